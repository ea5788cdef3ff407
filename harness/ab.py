"""Same-job A/B of timed figures: the base commit and this checkout measured in one job, their launches
interleaved, then judged by the regression gate (harness/derive/gate.py) on step time and peak memory.

    python -m harness ab                                  # base: HEAD's first parent, the previous main
    python -m harness ab --base origin/main               # base: the merge base of HEAD and origin/main
    python -m harness ab --a-a --repeat 20                # base = HEAD: the tier's false alarms here
    python -m harness ab --plant-new slow-step:factor=1.3:rank=all:step=0:strategy=ddp   # must fail

Why the same job: a baseline recorded in another hour carries that hour's load, and on a shared 2-core
machine other users move step times by more than a real regression would (docs/methodology.md, "The
regression gate": 13 of 56 ordered pairs of identical runs made beside another test run were false alarms).
Launches of both commits taken in turns share the machine's state, so a drift of its load moves both
sides alike; asv's `continuous` and the benchmark CI of pytorch and numpy measure the same way.

How:
- the base commit is checked out beside this one with `git worktree add --detach` in a temporary folder,
  and removed afterwards (on an error, SIGTERM or a signal during `git worktree add` too); checkouts that earlier
  runs left registered are removed first (`prune_stale_checkouts`);
- which strategies each side has: its registry's literal dict (harness.touched.registered_strategies, read from
  the commit without running it). Each side is sent only strategies it has: one new on this side is named "new:
  nothing to compare" and launched once on the new side alone (a failure there fails the tier); one the base has
  and this side lacks (removed or renamed) is named "gone"; one whose cell cannot be laid out on gpt-tiny
  (`refused_cells`: expert parallelism needs a model with experts) is named with the reason and not launched, its
  skipped rows judging nothing (the launch tier's tests run its own cells);
- the cells (`select_cells`), among the strategies both sides have: gpt-tiny at 2 ranks under DDP on every change
  (the step loop and the runner every strategy runs), and under each strategy the change touches (harness.touched:
  a file a cell of it runs differs from the base: its module, its launcher's, what they import, gpt-tiny's
  workload files; a registry's changed entries alone count for the strategies they build), each added while the
  cells fit the tier's budget (`AB_BUDGET_S`, 620 s, planned at `AB_ESTIMATE_MARGIN` times each strategy's
  measured seconds a launch, `LAUNCH_SECONDS`) at the launches the gate needs, the launches a side going down to the
  gate's least before a strategy is left out, the touched turned by the head commit. Where a strategy's own module
  or a family module it runs changed (harness.touched.must_time: `deepspeed_common.py` is ZeRO-1/2/3's, the
  pipeline's and AutoTP's), those come first, in the registry's order and never turned, at the gate's least
  launches, in a budget raised for them as far as `AB_MUST_TIME_BUDGET_S` (ZeRO-1/2/3 take 984 s of it), DDP beside
  them where it still fits; `.ci/run` leaves the tier that budget (`harness ab --print-budget`). The ones left out
  are named, never passed in silence;
- a launch is one `python -m harness run --matrix smoke --strategy ... --out SIDE.jsonl` with this interpreter (the same
  virtual environment), started in the side's checkout: python puts the working folder first on sys.path,
  so `harness` is that side's code, and so is every rank it starts (`-m harness.rank.worker` in the
  inherited folder). Every row's `environment.git_sha` is checked against its side's commit;
- base, new, base, new, ...: at least `MIN_LAUNCHES` a side, and as many as the gate needs to judge every
  metric of the family (harness.derive.gate.launches_needed_a_side: 2 cells x 3 metrics are a family of 6,
  which needs 5 a side; 4 cells, 12, which needs 5 too), while the wall time spent fits the budget: the next
  pair is not started where it would pass it (estimated from the longest pair so far), and a launch still
  running at the budget's end is stopped. Stopped so, the tier judges the pairs it has, or is skipped, "budget
  spent after N launches a side"; it prints its time against its budget;
- the gate judges step time (each launch's median unstalled step and its fastest) and peak RSS alone
  (`AB_METRICS`, a small family), the step times at `STEP_TIME_THRESHOLD` and `FASTEST_STEP_THRESHOLD`,
  set from this tier's own A/A and planted-slowdown measurements on the CI machine kind (below).

Outcomes: `pass`; `regression` (a metric of a cell regressed beyond its threshold: exit 1); `failed` (the
new side's launch failed, or a row ran other code than its side's: exit 1); `skipped`, with the reason
(no base to measure against: a shallow clone, a root commit; the base commit's launch failed; cells or
metrics the gate could not judge), never reported as a pass.
"""

from __future__ import annotations

import contextlib
import enum
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

from harness.compare import format_result
from harness.derive.gate import (DEFAULT_ALPHA, FASTEST_STEP_THRESHOLDS, GateResult, Judgement, Verdict,
                                 check_thresholds, gate, launches_needed_a_side)
from harness.derive.rows import label as row_label
from harness.launch.processes import stop_process_tree
from harness.launch.tether import tethered
from harness.rank.faults import FAULT_ENV, Fault
from harness.record import read_rows
from harness.spec import DeviceKind, SpecError, Status

AB_MATRIX = "smoke"
# Peak allocated is recorded on GPU rows alone: on CPU it is not a metric of the cell, and not in the family.
AB_METRICS = ("step_time_unstalled_median_s", "step_time_unstalled_fastest_s", "peak_rss_bytes_max",
              "peak_allocated_bytes_max")
# The rule needs 1 / C(2n, n) <= alpha / k; 3 a side is its least for one metric at alpha 0.05 (1/20).
MIN_LAUNCHES = 3
# Launches a side the tier takes: 8, not the 5 its family of 6 needs at least. The gate's exact Mann-Whitney
# test (harness/derive/gate.py) then calls a regression with up to 9 of the 64 (base, new) pairs within the
# threshold (p = 67/12870 = 0.0052 at 56 of 64 <= 0.05 / 6), so one base launch slowed as a whole by other
# load, above every new launch, spoils 8 pairs and still does not hide a real slowdown. At 5 a side one such
# launch hid a planted 30% DDP slowdown (2 of 4 runs here, the tier then judging "every new launch beyond
# every base launch"); at 7 it may spoil 5 pairs, not 7.
AB_LAUNCHES = 8
# The step-time threshold of the A/B tier, for each launch's median unstalled step (its fastest step's is the
# gate's FASTEST_STEP_THRESHOLDS, 5%). Both lie above what A/A runs of this tier (`python -m harness ab --a-a
# --repeat 20`, base = new = HEAD) showed on the 2-core VM and below what a planted 30% slowdown separates by
# (`--plant-new slow-step:factor=1.3:...`), measured 2026-11-25 with nothing else of ours running. A/A at 8 a
# side: 20 of 20 runs passed, every pair of sides overlapping, their closest approach -7.2% (median step),
# -4.6% (fastest step), -0.2% (peak RSS). At 5 a side: 20 of 20 passed even at thresholds of 0, closest
# approach -2.9% on either step reading. Planted at 8 a side: DDP 2 of 2 and the plain loop 1 of 1 failed
# the tier (fastest-step separations +23.7%, +12.2%, +18.0%).
STEP_TIME_THRESHOLD = 0.15
# 40 timed steps a cell instead of the smoke matrix's 10 (about 1.6 s more per cell on the 2-core VM): a
# launch's median then spans a couple of seconds, so a burst of another process's load moves fewer of its
# steps. In an A/A run at 40 the plain loop's launches made while the machine was otherwise idle agreed
# within 2.5% (38.8-39.8 ms).
LAUNCH_OPTIONS = ("--timed-steps", "40")
# How long a side's `harness run` gets, on a stop signal, to stop its own launch (its process groups' 10 s grace,
# then SIGKILL) before what is left of its tree is killed.
STOP_GRACE_S = 30.0
# The fastest-step threshold: the gate's for that metric (harness/derive/gate.py, FASTEST_STEP_THRESHOLDS),
# set from this tier's A/A and planted-slowdown runs (docs/methodology.md, "Same-job A/B of timed figures").
FASTEST_STEP_THRESHOLD = FASTEST_STEP_THRESHOLDS[DeviceKind.CPU]
BASE_DEFAULT = "HEAD^1"       # the previous main: HEAD's first parent (a merge's: the main it was merged into)


# ---- which cells: DDP on every change, and the strategies it touches, in a budget ----------------------------

AB_WORKLOAD = "gpt-tiny"
AB_WORLD_SIZE = 2
AB_ALWAYS = ("ddp",)
# The metrics a CPU cell brings to the gate's family (AB_METRICS less peak allocated, which CPU rows lack).
CPU_METRICS_A_CELL = 3
# Strategies whose cell does not run on this CPU tier.
AB_NOT_ON_CPU = {"dataparallel": "DataParallel replicates over CUDA devices only"}
# Seconds a launch takes: `harness run` starting and ending (HARNESS_START_S: 3-4 s between one side's last row and
# the other's first), then each cell's launch (its row's wall_time_s: launcher, ranks importing torch and their
# libraries, 2 warm-up and 40 timed steps of gpt-tiny at 2 ranks, the plain and bare loops at 1). The medians of a
# run of every strategy here and of a fresh-clone CI rehearsal's A/B tier (DDP and ZeRO-1/2/3, 4 launches each),
# 2026-11-29 on the 2-core VM with nothing else running; a pair of DDP and ZeRO-1/2/3 launches took 200 s there,
# 200.8 s by these figures. (The figures before, 2.3-2.9 times smaller, had the tier plan 5 launches a side of those
# four cells in 413 s: it ran out of budget after 2.)
HARNESS_START_S = 4.0
LAUNCH_SECONDS = {"plain": 9.4, "bare": 8.8, "ddp": 14.8, "horovod": 17.3, "zero1": 25.1, "zero2": 25.0,
                  "zero3": 31.5, "fsdp2": 20.9, "pipeline": 22.7, "tp": 32.3, "fsdp2-tp": 34.9, "autotp": 30.9,
                  "ps": 12.2, "ps-async": 14.9}
UNMEASURED_LAUNCH_S = 35.0      # a strategy registered since (another test's, a new one): as the slowest
# The tier's budget of launch time, both sides, for most changes: DDP's cell and the touched strategies' that fit.
# About 10 minutes: it holds DDP with any one other strategy at the 5 launches a side their family of 6 metrics needs,
# planned with its margin (the slowest, FSDP2+TP: 1.15 x 2 x 5 x (4.0 + 14.8 + 34.9) = 617.6 s), or DDP alone at 8
# (345.9 s); .ci/run's launch tier takes what the 30 minutes leave beside it.
AB_BUDGET_S = 620.0
# The most a change to a strategy's own code, or to its family's module, may take: its strategies are timed at the
# gate's least launches, and the tier's budget is raised as far as this to hold them (.ci/run asks for it before its
# launch tier, `harness ab --print-budget`, and that tier takes less). A change to deepspeed_common.py times ZeRO-1/2/3
# at 5 a side: 2 x 5 x (4.0 + 25.1 + 25.0 + 31.5) = 856 s, x 1.15 = 984 s; DDP beside them would take 1,155 s.
AB_MUST_TIME_BUDGET_S = 1000.0
# The tier plans at this multiple of its estimates: launches inside the tier ran over LAUNCH_SECONDS' medians (a
# fresh-clone .ci/run rehearsal on 2026-11-29: DDP 16.6 s against 14.8, the plain loop 11.5 against 9.4; a run of DDP
# and ZeRO-1 on 2026-11-29: 15.8 and 27.5 s against 14.8 and 25.1, `harness run`'s own start 4.6 s against 4.0), and a
# tier planned at the bare estimate stops a pair short of the launches the gate needs ("budget spent").
AB_ESTIMATE_MARGIN = 1.15


def one_launch_seconds(strategies: Sequence[str]) -> float:
    """Launch time of one launch of the cells of `strategies`: `harness run` starting, then each cell's launch."""
    return HARNESS_START_S + sum(LAUNCH_SECONDS.get(n, UNMEASURED_LAUNCH_S) for n in strategies)


def estimated_seconds(strategies: Sequence[str], launches: int) -> float:
    """Launch time of `launches` a side of the cells of `strategies`, both sides."""
    return 2 * launches * one_launch_seconds(strategies)


def least_launches(strategies: Sequence[str]) -> int:
    """The fewest launches a side at which the gate can judge every metric of these cells' family."""
    return max(MIN_LAUNCHES, launches_needed_a_side(DEFAULT_ALPHA / (CPU_METRICS_A_CELL * len(strategies))))


def planned_seconds(strategies: Sequence[str], launches: int) -> float:
    """What the tier plans for `launches` a side of these cells: the estimate with its margin (AB_ESTIMATE_MARGIN)."""
    return AB_ESTIMATE_MARGIN * estimated_seconds(strategies, launches)


def launches_a_side(strategies: Sequence[str], budget_s: float = AB_BUDGET_S, most: int = AB_LAUNCHES) -> int | None:
    """The launches a side the tier takes for these cells: as many as the budget holds at the planned seconds, up to
    `most`, and never fewer than the gate needs to judge every metric of their family; None where it holds fewer."""
    fits = [n for n in range(least_launches(strategies), most + 1) if planned_seconds(strategies, n) <= budget_s]
    return max(fits) if fits else None


@dataclass(frozen=True)
class CellChoice:
    """The strategies the tier times, why each, the launches a side, the strategies left out, why each, and those on
    one side's registry alone: new (launched once, on the new side) and gone (removed or renamed since the base)."""

    timed: tuple[str, ...]
    why: Mapping[str, str]              # strategy: "always" or the changed files it runs
    left_out: Mapping[str, str]         # strategy: the reason
    launches: int
    budget_s: float = AB_BUDGET_S       # the tier's budget for them: AB_BUDGET_S, or raised for a strategy's own code
    new: tuple[str, ...] = ()
    gone: tuple[str, ...] = ()

    def estimated_s(self) -> float:
        """The tier's launch time: its launches in turns, and the one launch of the new strategies."""
        return estimated_seconds(self.timed, self.launches) + (one_launch_seconds(self.new) if self.new else 0.0)

    def describe(self) -> str:
        timed = "; ".join(f"{name} ({self.why[name]})" for name in self.timed)
        line = (f"A/B cells: {AB_WORKLOAD} at {AB_WORLD_SIZE} ranks under {timed}; {self.launches} launches a side, "
                f"{self.estimated_s():.0f} s estimated, planned at {AB_ESTIMATE_MARGIN:g} times that within the tier's "
                f"{self.budget_s:.0f}-s budget")
        if self.left_out:
            line += "; not timed: " + "; ".join(f"{name} ({why})" for name, why in self.left_out.items())
        line += "".join(f"; new: {name} (nothing to compare: one launch on the new side alone, to prove it starts)"
                        for name in self.new)
        line += "".join(f"; gone: {name} (in the base's registry, not in this one's: removed or renamed, not timed)"
                        for name in self.gone)
        return line


def choose_cells(touched: Mapping[str, Sequence[str]], must_time: Mapping[str, Sequence[str]] | set[str], *,
                 rotation: int = 0, budget_s: float = AB_BUDGET_S,
                 most_s: float = AB_MUST_TIME_BUDGET_S) -> CellChoice:
    """The cells the tier times, and its budget.

    Where no strategy's own code changed: AB_ALWAYS (DDP: the step loop and the runner every strategy runs), then the
    touched strategies turned by `rotation` (the head commit's, so that over commits each gets its turn), each added
    where the cells with it fit `budget_s` at the launches the gate needs: the more cells, the fewer launches a side,
    down to the gate's least for their family (AB_LAUNCHES at most).

    Where some did (harness.touched.must_time: a strategy's own module, or a family module it runs): those strategies
    in the registry's order, never turned, so that a family's first members (deepspeed_common.py: ZeRO-1/2/3) are
    timed on every such change, each added while they fit `most_s` at the gate's least launches; then DDP where it
    still fits beside them (the step loop it stands for runs in their cells too); the tier's budget is what they need,
    `budget_s` at least. The other touched strategies follow in turn, in that budget. Whatever is left out is named."""
    why: dict[str, str] = {}
    left_out: dict[str, str] = {}
    candidates = [name for name in touched if name not in AB_ALWAYS]
    for name in candidates:
        if name in AB_NOT_ON_CPU:
            left_out[name] = AB_NOT_ON_CPU[name]
    candidates = [name for name in candidates if name not in AB_NOT_ON_CPU]

    def least_s(cells: Sequence[str]) -> float:
        return planned_seconds(cells, least_launches(cells))

    def because(name: str) -> str:
        files = touched[name]
        return (("its own code changed: " if name in must_time else "touched: ") + ", ".join(files[:2])
                + (f" and {len(files) - 2} more" if len(files) > 2 else ""))

    own: list[str] = []
    for name in (n for n in candidates if n in must_time):
        if least_s([*own, name]) <= most_s:
            own.append(name)
            why[name] = because(name)
        else:
            left_out[name] = (f"its own code changed, but past the {most_s:.0f}-s budget the tier may take for a "
                              f"strategy's own code, with the cells before it; `harness ab --strategy {name}` times it")
    if own and least_s([*AB_ALWAYS, *own]) > most_s:
        timed = own
        for name in AB_ALWAYS:
            left_out[name] = (f"past the {most_s:.0f}-s budget beside {', '.join(own)}, whose own code changed; the "
                              f"step loop and runner it stands for run in their cells")
    else:
        timed = [*AB_ALWAYS, *own]
        why.update({name: "always" for name in AB_ALWAYS})
    budget = max(budget_s, least_s(timed)) if own else budget_s
    for name in _turned([n for n in candidates if n not in must_time], rotation):
        if launches_a_side([*timed, name], budget) is not None:
            timed.append(name)
            why[name] = because(name)
        else:
            left_out[name] = f"touched, but past the tier's {budget:.0f}-s budget with the cells above"
    launches = launches_a_side(timed, budget)
    if launches is None:
        raise SpecError(f"the A/B budget of {budget:.0f} s does not hold {', '.join(timed)} at the launches the gate "
                        f"needs")
    return CellChoice(tuple(timed), why, left_out, launches, budget)


def _turned(names: list[str], rotation: int) -> list[str]:
    """`names` begun at `rotation` mod their count: over commits, each comes first in its turn."""
    turn = rotation % len(names) if names else 0
    return names[turn:] + names[:turn]


def registries(repo: Path, base_commit: str, head: str) -> tuple[list[str], list[str]]:
    """The strategies the base commit and this checkout register (harness.touched.registered_strategies)."""
    from harness.touched import registered_strategies

    if base_commit == head:     # an A/A run: both sides run this commit, whose registry this process has imported
        from harness.strategies import STRATEGIES
        return list(STRATEGIES), list(STRATEGIES)
    base, this = registered_strategies(repo, base_commit), registered_strategies(repo)
    if base is None or this is None:
        side = "base commit" if base is None else "checkout"
        raise Unavailable(f"the {side}'s harness/strategies/__init__.py holds no literal STRATEGIES dict to read")
    return base, this


def select_cells(repo: Path, base_commit: str, head: str, budget_s: float = AB_BUDGET_S,
                 most_s: float = AB_MUST_TIME_BUDGET_S, cap_s: float | None = None) -> CellChoice:
    """The tier's cells for the change from `base_commit` to this checkout (harness.touched), among the strategies
    both register: each side is sent only strategies it has. A strategy new on this side is named new and launched
    once here; one the base has and this checkout lacks is named gone. The new one's launch comes out of the budget.
    `cap_s` holds both budgets to at most that (.ci/run's: what its 30 minutes leave the tier); Unavailable where it
    holds not even DDP's cell at the gate's least launches."""
    from harness.strategies import STRATEGIES
    from harness.touched import must_time, touched_strategies

    base_names, head_names = registries(repo, base_commit, head)
    refused = refused_cells(head_names)
    new = tuple(name for name in head_names if name not in base_names and name not in refused)
    gone = tuple(name for name in base_names if name not in head_names)
    both = {name: STRATEGIES[name] for name in head_names if name in base_names and name in STRATEGIES}
    touched = touched_strategies(repo, base_commit, both, workload=AB_WORKLOAD)
    not_here = {name: (f"{'new; ' if name not in base_names else ''}its cell skips {AB_WORKLOAD} "
                       f"({refused[name]}): nothing to time here; the launch tier's tests run its own cells")
                for name in head_names if name in refused and (name in touched or name not in base_names)}
    touched = {name: files for name, files in touched.items() if name not in refused}
    proving = AB_ESTIMATE_MARGIN * one_launch_seconds(new) if new else 0.0
    if cap_s is not None:
        budget_s, most_s = min(budget_s, cap_s), min(most_s, cap_s)
        if launches_a_side(AB_ALWAYS, budget_s - proving) is None:
            raise Unavailable(f"the tier's budget, capped at {cap_s:.0f} s (what CI's 30 minutes leave it), holds no "
                              f"cell at the launches the gate needs")
    choice = choose_cells(touched, must_time(repo, touched, both), rotation=int(head[:8], 16),
                          budget_s=budget_s - proving, most_s=most_s - proving)
    return replace(choice, budget_s=choice.budget_s + proving, new=new, gone=gone,
                   left_out={**choice.left_out, **not_here})


def refused_cells(names: Sequence[str]) -> dict[str, str]:
    """{strategy: why} for the registered strategies among `names` that cannot run the tier's cell, the smoke
    matrix's on AB_WORKLOAD, on the tier's CPU (Strategy.skip_reason: expert parallelism on a model without experts,
    torch's ring attention on a CPU): timed there, each launch would end skipped, and a new one's proving launch would
    prove nothing."""
    from harness.matrix import Machine, Selection, build_matrix
    from harness.strategies import STRATEGIES

    machine = Machine(device=DeviceKind.CPU, devices_per_node=AB_WORLD_SIZE)
    refused = {}
    for name in (n for n in names if n in STRATEGIES):
        cells = build_matrix(AB_MATRIX, machine, Selection(workloads=(AB_WORKLOAD,), strategies=(name,)))
        reasons = [reason for cell in cells if (reason := STRATEGIES[name].skip_reason(cell, machine))]
        if reasons:
            refused[name] = reasons[0]
    return refused


def planned_budget(repo: Path, base_ref: str = BASE_DEFAULT, cap_s: float | None = None) -> float:
    """The seconds of launch time the tier's own choice of cells for this change is held to (`select_cells`), 0 where
    it would judge nothing (no base to measure against): what .ci/run leaves the tier (`harness ab --print-budget`)."""
    try:
        head = head_commit(repo)
        base_commit = resolve_base(repo, base_ref)
        if base_commit == head:
            return 0.0
        return select_cells(repo, base_commit, head, cap_s=cap_s).budget_s
    except Unavailable:
        return 0.0


class Outcome(enum.StrEnum):
    PASS = "pass"
    REGRESSION = "regression"
    FAILED = "failed"
    SKIPPED = "skipped"


EXIT_STATUS = {Outcome.PASS: 0, Outcome.REGRESSION: 1, Outcome.FAILED: 1, Outcome.SKIPPED: 0}


class Unavailable(Exception):
    """The tier cannot run here, for a reason that is not bad input: it is skipped, saying why."""


@dataclass(frozen=True)
class Side:
    name: str                      # "base" or "new", as the gate calls them
    checkout: Path                 # where its launches start: its code
    commit: str                    # the SHA its rows must record
    results: Path                  # one JSONL file, every launch appended
    env: Mapping[str, str] = field(default_factory=dict)    # added to its launches' environment


@dataclass(frozen=True)
class TierResult:
    outcome: Outcome
    reason: str                    # why, in one line
    launches: int                  # a side
    gate: GateResult | None        # None where nothing was judged

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS[self.outcome]


# ---- git: which commit is the base, and a checkout of it -------------------------------------------------


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)


def head_commit(repo: Path) -> str:
    found = _git(repo, "rev-parse", "--verify", "HEAD^{commit}")
    if found.returncode != 0:
        raise Unavailable(f"{repo} is not a git checkout with a commit: no HEAD to measure")
    return found.stdout.strip()


def resolve_base(repo: Path, ref: str = BASE_DEFAULT) -> str:
    """The base commit: the merge base of `ref` and HEAD (for HEAD's first parent, that parent). Unavailable
    where history does not hold it (a shallow clone, a root commit); SpecError for a ref that names nothing."""
    head = head_commit(repo)
    shallow = _git(repo, "rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    found = _git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    if found.returncode != 0:
        if shallow:
            raise Unavailable(f"shallow clone: {ref} is not in its history (clone with full history, or "
                              f"`git fetch --unshallow`)")
        if ref == BASE_DEFAULT and len(_git(repo, "rev-list", "--parents", "-n", "1", "HEAD").stdout.split()) == 1:
            raise Unavailable(f"HEAD {head[:12]} is a root commit: there is no previous main to measure against")
        raise SpecError(f"--base {ref!r} names no commit here")
    merge_base = _git(repo, "merge-base", found.stdout.strip(), head)
    if merge_base.returncode != 0:
        raise Unavailable(f"{ref} and HEAD share no history here" + (" (a shallow clone)" if shallow else ""))
    return merge_base.stdout.strip()


WORKTREE_PREFIX = "parbench-ab-base-"     # the base checkouts' folders, under the temporary folder
OWNER_FILE = "owner.pid"                  # in each such folder: the process that made it
# A base checkout this old whose owner no longer runs was left by a run that could not clean up (SIGKILL, a signal
# during `git worktree add`). Younger ones may be another run's in progress (two engineers' runs share one .git): the
# longest, an A/A measurement of 20 runs of 197-246 s each, takes 66-82 minutes here.
STALE_AFTER_S = 2 * 3600.0


@contextlib.contextmanager
def checkout_of(repo: Path, commit: str) -> Iterator[Path]:
    """A detached work tree of `commit` in a temporary folder, removed (and unregistered) on the way out. The
    clean-up is armed before `git worktree add` starts: a signal during it leaves a registered worktree, locked
    ("initializing"), that `git worktree prune` keeps, so it is removed with `--force --force`."""
    prune_stale_checkouts(repo)
    folder = Path(tempfile.mkdtemp(prefix=WORKTREE_PREFIX))
    tree = folder / "checkout"
    try:
        (folder / OWNER_FILE).write_text(str(os.getpid()))
        added = _git(repo, "worktree", "add", "--detach", str(tree), commit)
        if added.returncode != 0:
            why = (added.stderr.strip().splitlines() or ["git worktree add failed"])[-1]
            raise Unavailable(f"cannot check out {commit[:12]} beside this checkout: {why}")
        yield tree
    finally:
        _git(repo, "worktree", "remove", "--force", "--force", str(tree))
        shutil.rmtree(folder, ignore_errors=True)
        _git(repo, "worktree", "prune")


def prune_stale_checkouts(repo: Path) -> list[Path]:
    """Remove the base checkouts earlier runs left registered in `repo`: those under the temporary folder named
    WORKTREE_PREFIX... whose folder is gone, or older than STALE_AFTER_S with no running owner. Returns them."""
    _git(repo, "worktree", "prune")
    temporary = Path(tempfile.gettempdir()).resolve()
    removed = []
    for line in _git(repo, "worktree", "list", "--porcelain").stdout.splitlines():
        if not line.startswith("worktree "):
            continue
        tree = Path(line.removeprefix("worktree "))
        folder = tree.parent
        if not folder.name.startswith(WORKTREE_PREFIX) or folder.parent.resolve() != temporary:
            continue
        if folder.exists() and not _abandoned(folder):
            continue
        _git(repo, "worktree", "remove", "--force", "--force", str(tree))
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(tree)
    return removed


def _abandoned(folder: Path) -> bool:
    """Older than STALE_AFTER_S, and the process that made it (OWNER_FILE) runs no more."""
    if time.time() - folder.stat().st_mtime <= STALE_AFTER_S:
        return False
    try:
        os.kill(int((folder / OWNER_FILE).read_text()), 0)
    except PermissionError:            # running, as another user
        return False
    except (OSError, ValueError):      # no such process, or no owner recorded (the signal came before it was)
        return True
    return False


# ---- launches, taken in turns ----------------------------------------------------------------------------

Launch = Callable[[Side, int], None]     # one launch of a side (its index from 1), appending its rows


def matrix_launch(matrix: str = AB_MATRIX, logs: Path | None = None, options: Sequence[str] = LAUNCH_OPTIONS,
                  deadline: float | None = None) -> Launch:
    """A launch of `matrix` (with `harness run` OPTIONS) with this interpreter, started in the side's
    checkout; its output goes to a log beside the results (LOGS/base-1.log, ...), shown only where it failed.
    One still running at `deadline` (a time.monotonic() reading: the tier's budget) is stopped, BudgetSpent."""
    def launch(side: Side, index: int) -> None:
        env = {key: value for key, value in os.environ.items() if key != FAULT_ENV}
        env.update(side.env)
        log = (logs or side.results.parent) / f"{side.name}-{index}.log"
        with open(log, "w") as out:
            command = [sys.executable, "-m", "harness", "run", "--matrix", matrix, *options, "--out", str(side.results)]
            run = subprocess.Popen(tethered_in(side.checkout, command), cwd=side.checkout, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
            try:
                returncode = run.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stop_process_tree(run, STOP_GRACE_S)
                raise BudgetSpent(f"{side.name} launch {index} stopped at the tier's budget") from None
            except BaseException:      # a stop signal here (harness.launch.interrupt): its launch goes down with it
                stop_process_tree(run, STOP_GRACE_S)
                raise
        if returncode != 0:
            tail = " | ".join(log.read_text().strip().splitlines()[-3:])
            raise LaunchFailed(f"{side.name} launch {index} exited {returncode} (log {log}): {tail}")
    return launch


def tethered_in(checkout: Path, command: list[str]) -> list[str]:
    """`command`, run in `checkout`, bound to this process by the tether (harness.launch.tether), so that an `ab`
    killed by SIGKILL takes its running `harness run` with it, as that run takes its launches. `python -m` there
    imports the checkout's own tether, so a base from before it (no harness/launch/tether.py) runs `command` as it
    is."""
    return tethered(command) if (checkout / "harness" / "launch" / "tether.py").is_file() else command


class BudgetSpent(Exception):
    """A launch still running when the tier's budget ran out, stopped: its pair is not judged."""


class LaunchFailed(Exception):
    """A launch that produced no usable rows."""


def check_new_rows(side: Side, before: int, accept: Sequence[str] = ("ok",)) -> int:
    """The rows `side`'s launch appended ended with a status in `accept` and ran its commit's code; returns the new
    row count."""
    rows = read_rows([side.results]) if side.results.exists() else []
    added = rows[before:]
    if not added:
        raise LaunchFailed(f"{side.name} launch appended no row to {side.results}")
    for row in added:
        label = row_label(row)
        if row.get("status") not in accept:
            raise LaunchFailed(f"{side.name} launch: {label} ended {row.get('status')}: {row.get('message', '')[:200]}")
        sha = (row.get("environment") or {}).get("git_sha")
        if sha != side.commit:
            raise WrongCode(f"a {side.name} row ({label}) records git_sha {sha}, not the {side.name} commit "
                            f"{side.commit[:12]}: its launch ran other code")
    return len(rows)


class WrongCode(Exception):
    """A side's row ran another commit's code: the comparison would not be of the two commits."""


def run_tier(base: Side, new: Side, launch: Launch, *, min_launches: int = AB_LAUNCHES,
             thresholds: Mapping[str, float] | None = None, alpha: float = DEFAULT_ALPHA,
             metrics: Sequence[str] = AB_METRICS, progress: Callable[[str], None] = lambda line: None,
             budget_s: float | None = None, first_pair_s: float = 0.0,
             clock: Callable[[], float] = time.monotonic) -> TierResult:
    """Launch base, new, base, new, ... until each side has `min_launches` and the gate can judge every
    metric of the family, then judge. The family is known from the first pair's rows (its cells x metrics),
    so the launches it needs are too; a first pair with nothing comparable stops the tier there.

    With `budget_s`, a pair is started only where the wall time spent (on `clock`) and the pair's time fit it: the
    first pair's from `first_pair_s` (the estimate), each later one's as the longest pair measured so far. A launch
    that raises BudgetSpent (its deadline passed) ends the tier too, its pair not judged. Stopped so, the tier judges
    the pairs it has: a verdict where the gate can give one, else skipped, "budget spent after N launches a side"."""
    thresholds = {"step_time_unstalled_median_s": STEP_TIME_THRESHOLD,
                  "step_time_unstalled_fastest_s": FASTEST_STEP_THRESHOLD, **(thresholds or {})}
    rows = {side.name: 0 for side in (base, new)}
    judged = dict(rows)                 # the rows of the pairs that completed
    launches = 0
    result: GateResult | None = None
    began = clock()
    pairs_s: list[float] = []
    stopped = ""
    while True:
        if budget_s is not None:
            spent, next_s = clock() - began, max(pairs_s, default=first_pair_s)
            if spent + next_s > budget_s:
                stopped = (f"budget spent after {launches} launches a side ({spent:.0f} s of {budget_s:.0f} s, "
                           f"the next pair about {next_s:.0f} s)")
                break
        launches += 1
        pair_began = clock()
        try:
            for side in (base, new):
                launch(side, launches)
                rows[side.name] = check_new_rows(side, rows[side.name])
        except LaunchFailed as failed:
            outcome = Outcome.FAILED if side is new else Outcome.SKIPPED
            return TierResult(outcome, str(failed), launches, result)
        except WrongCode as wrong:
            return TierResult(Outcome.FAILED, str(wrong), launches, result)
        except BudgetSpent as spent_out:
            launches -= 1
            stopped = f"budget spent after {launches} launches a side ({spent_out})"
            break
        pairs_s.append(clock() - pair_began)
        judged = dict(rows)
        result = gate(read_rows([base.results]), read_rows([new.results]), thresholds, alpha, metrics)
        progress(f"  {launches} launch{'es' if launches > 1 else ''} a side done ({rows[base.name]} base rows, "
                 f"{rows[new.name]} new rows; the family of {result.family} needs {result.launches_needed_a_side})")
        if result.family == 0 or (launches >= min_launches and launches >= result.launches_needed_a_side):
            break
    if not stopped:
        return TierResult(*_verdict(result), launches, result)
    if launches == 0:
        return TierResult(Outcome.SKIPPED, stopped, 0, None)
    result = gate(read_rows([base.results])[:judged[base.name]], read_rows([new.results])[:judged[new.name]],
                  thresholds, alpha, metrics)
    outcome, reason = _verdict(result)
    if outcome is Outcome.SKIPPED:
        reason = f"{stopped}; the gate needs {result.launches_needed_a_side}: {reason}"
        return TierResult(outcome, reason, launches, result)
    return TierResult(outcome, f"{reason}; {stopped}", launches, result)


def _regressed(j: Judgement) -> str:
    """One regression in words: its separation where every new launch lies beyond every base launch, else the
    median of the new / base pairs with how many pairs lie beyond the threshold and the test's p."""
    if j.separation is not None and j.separation > j.threshold:
        return f"{j.label} {j.metric.name} {j.separation:+.1%} > {j.threshold:.0%}"
    return f"{j.label} {j.metric.name} {j.shift:+.1%} median of pairs ({j.reason}; threshold {j.threshold:.0%})"


def _verdict(result: GateResult) -> tuple[Outcome, str]:
    regressions = [j for j in result.judgements if j.verdict is Verdict.REGRESSION]
    if regressions:
        return Outcome.REGRESSION, "; ".join(_regressed(j) for j in regressions)
    unjudged = result.count(Verdict.NOT_JUDGED)
    if result.not_compared or unjudged or not result.judgements:
        return Outcome.SKIPPED, (f"nothing conclusive: {unjudged} metrics not judged, {len(result.not_compared)} "
                                 f"cells not compared (the table above says why)")
    return Outcome.PASS, (f"{len(result.judgements)} metrics judged, none beyond its threshold "
                          f"({result.count(Verdict.IMPROVEMENT)} improvements)")


SHORT_NAMES = {"step_time_unstalled_median_s": "step time", "step_time_unstalled_fastest_s": "fastest step",
               "peak_rss_bytes_max": "peak RSS", "peak_allocated_bytes_max": "peak allocated"}


def separations(result: GateResult | None) -> str:
    """Each judged metric's separation (harness.derive.gate.separation), in one line: what an A/A
    measurement collects, run after run."""
    if result is None:
        return "nothing judged"
    return ", ".join(f"{j.label} {SHORT_NAMES[j.metric.name]} "
                     f"{'overlap' if j.separation is None else format(j.separation, '+.1%')}"
                     for j in result.judgements)


# ---- the tier, once or N times -----------------------------------------------------------------------------


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def measure(repo: Path, out: Path, *, base_ref: str = BASE_DEFAULT, a_a: bool = False, repeat: int = 1,
            min_launches: int | None = None, thresholds: Mapping[str, float] | None = None,
            plant_new: str = "", matrix: str = AB_MATRIX, strategies: Sequence[str] | None = None,
            budget_cap_s: float | None = None,
            launch: Callable[..., Launch] = matrix_launch, say: Callable[[str], None] = print) -> list[TierResult]:
    """The tier `repeat` times, each into OUT/runK/{base,new}.jsonl, the base checkout made once. With
    `a_a` the base is HEAD itself: every regression is then a false alarm. `plant_new` is a PARBENCH_FAULT
    for the new side's launches alone (the base's never inherit one). The cells: `tier_plan`; a strategy new on
    this side is launched once, on this side alone, before the launches in turns (its failure fails the tier).
    The tier's own choice of cells keeps to its budget of wall time a run (`select_cells`; `run_tier`, and each
    launch's deadline)."""
    if repeat < 1 or (min_launches is not None and min_launches < MIN_LAUNCHES):
        raise SpecError(f"--repeat must be >= 1 and --launches >= {MIN_LAUNCHES}, got {repeat} and {min_launches}")
    try:
        check_thresholds(thresholds)
        if plant_new:
            Fault.parse(plant_new)
    except ValueError as error:
        raise SpecError(str(error)) from None
    if strategies:
        from harness.touched import registered_strategies

        known = registered_strategies(repo) or []      # this checkout's: the new side's
        if unknown := [name for name in strategies if name not in known]:
            raise SpecError(f"--strategy {','.join(unknown)}: not a strategy; known: {', '.join(known)}")
    if os.environ.get(FAULT_ENV):
        raise SpecError(f"{FAULT_ENV} is set: the A/B tier plants a fault on the new side only, with --plant-new")
    # Absolute: each side's launch starts in its own checkout, where a relative --out would put the base's rows
    # in the base's work tree, and the tier would find none ("base launch appended no row").
    out = out.resolve()
    if out.exists() and any(out.iterdir()):
        raise SpecError(f"--out {out} is not empty: the tier appends to fresh files only")
    tier_began = time.monotonic()
    head = head_commit(repo)
    base_commit = head if a_a else resolve_base(repo, base_ref)
    if base_commit == head and not a_a:
        raise Unavailable(f"the base {base_ref} is HEAD {head[:12]} itself: nothing changed to measure")
    dirty = bool(_git(repo, "status", "--porcelain", "--untracked-files=no").stdout.strip())
    plan = tier_plan(repo, base_commit, head, matrix, strategies, say, budget_cap_s)
    min_launches = min_launches or plan.launches
    say(f"A/B: base {base_commit[:12]}{' (HEAD: an A/A run)' if a_a else ''} vs new {head[:12]}"
        f"{' with uncommitted changes' if dirty else ''} (this checkout), the {matrix} matrix, launches in turns, "
        f"results under {out}" + (f"; new side planted: {FAULT_ENV}={plant_new}" if plant_new else ""))
    planted = {FAULT_ENV: plant_new} if plant_new else {}
    results = []
    with checkout_of(repo, base_commit) as base_tree:
        for k in range(1, repeat + 1):
            folder = out / f"run{k}" if repeat > 1 else out
            folder.mkdir(parents=True, exist_ok=True)
            load, started = _load(), time.monotonic()
            deadline = None if plan.budget_s is None else started + plan.budget_s
            if plan.new_only and k == 1:
                side = Side("new-only", repo, head, folder / "new-strategies.jsonl", planted)
                if failed := prove_new(side, launch(matrix, folder, plan.new_options, deadline=deadline)):
                    say(f"A/B run {k}/{repeat}: {Outcome.FAILED.value}: {failed}")
                    results.append(TierResult(Outcome.FAILED, failed, 0, None))
                    break
                say(f"A/B: new: {', '.join(plan.new_only)} ran on the new side alone "
                    f"({time.monotonic() - started:.0f} s; its rows in {side.results})")
            if plan.options is None:
                result = TierResult(Outcome.SKIPPED, "nothing to compare: every strategy named is new", 0, None)
            else:
                base = Side("base", base_tree, base_commit, folder / "base.jsonl")
                new = Side("new", repo, head, folder / "new.jsonl", planted)
                left = None if plan.budget_s is None else plan.budget_s - (time.monotonic() - started)
                result = run_tier(base, new, launch(matrix, folder, plan.options, deadline=deadline),
                                  min_launches=min_launches, thresholds=thresholds, progress=say, budget_s=left,
                                  first_pair_s=plan.first_pair_s)
            took = time.monotonic() - started
            if result.gate is not None and (repeat == 1 or result.outcome is not Outcome.PASS):
                say(format_result(result.gate, show_all=True))
            spent = f"{took:.0f} s" + ("" if plan.budget_s is None else f" of its {plan.budget_s:.0f}-s budget")
            say(f"A/B run {k}/{repeat}: {result.outcome.value}: {result.reason}; {result.launches} launches a side "
                f"in {spent}, load before {load}, after {_load()}; separations: {separations(result.gate)}")
            results.append(result)
    say(f"A/B tier: {time.monotonic() - tier_began:.0f} s in all, choosing cells and the base's checkout included"
        + ("" if plan.budget_s is None else f"; its launches' budget {plan.budget_s:.0f} s a run"))
    if repeat > 1:
        say(tally(results))
    return results


@dataclass(frozen=True)
class TierPlan:
    """What a run of the tier launches: `options` for both sides' launches in turns (None: nothing both have),
    `new_options` for the one launch of the strategies `new_only` on the new side, and the budget they keep to."""

    options: tuple[str, ...] | None
    new_only: tuple[str, ...]
    new_options: tuple[str, ...]
    launches: int                   # a side, where --launches does not say
    budget_s: float | None          # the tier's own choice of cells is held to its budget; cells named by hand not
    first_pair_s: float             # the first pair's estimated seconds, before any is measured


def tier_plan(repo: Path, base_commit: str, head: str, matrix: str, strategies: Sequence[str] | None,
              say: Callable[[str], None], budget_cap_s: float | None = None) -> TierPlan:
    """The cells: `strategies` where given, else on the smoke matrix DDP and what the change touches (`select_cells`,
    in its budget), else the matrix as it is; a strategy the base does not register goes to the new side alone."""
    if strategies:
        base_names, _ = registries(repo, base_commit, head)
        timed = tuple(name for name in strategies if name in base_names)
        new_only = tuple(name for name in strategies if name not in base_names)
        if new_only:
            say(f"A/B: new: {', '.join(new_only)} (not in the base's registry: nothing to compare; one launch on "
                f"the new side alone, to prove it starts)")
        return TierPlan(LAUNCH_OPTIONS + ("--strategy", ",".join(timed)) if timed else None, new_only,
                        LAUNCH_OPTIONS + ("--strategy", ",".join(new_only)), AB_LAUNCHES, None, 0.0)
    if matrix != AB_MATRIX:
        return TierPlan(LAUNCH_OPTIONS, (), (), AB_LAUNCHES, None, 0.0)
    choice = select_cells(repo, base_commit, head, cap_s=budget_cap_s)
    say(choice.describe())
    cells = LAUNCH_OPTIONS + ("--workload", AB_WORKLOAD, "--world-sizes", str(AB_WORLD_SIZE), "--strategy")
    return TierPlan(cells + (",".join(choice.timed),), choice.new, cells + (",".join(choice.new),), choice.launches,
                    choice.budget_s, 2 * one_launch_seconds(choice.timed))


def prove_new(side: Side, launch: Launch) -> str:
    """One launch, on the new side alone, of strategies the base does not register: the reason it failed, or "" where
    every row ended ok (or skipped, saying why: a cell this machine cannot run) and ran the new commit's code."""
    try:
        launch(side, 1)
        check_new_rows(side, 0, accept=(Status.OK, Status.SKIPPED))
    except (LaunchFailed, WrongCode, BudgetSpent) as failed:
        return f"a strategy new on this side did not run: {failed}"
    return ""


def tally(results: Sequence[TierResult]) -> str:
    """How many runs passed, and the largest separation each metric showed over them: the figure a
    step-time threshold must clear for A/A runs to pass."""
    counts = {outcome: sum(r.outcome is outcome for r in results) for outcome in Outcome}
    largest: dict[str, float] = {}
    closest: dict[str, float] = {}
    for result in results:
        for j in result.gate.judgements if result.gate else ():
            name = SHORT_NAMES[j.metric.name]
            if j.separation is not None:
                largest[name] = max(largest.get(name, 0.0), abs(j.separation))
            if j.base and j.new:
                closest[name] = max(closest.get(name, -math.inf), closest_approach(j.base, j.new))
    spread = ", ".join(f"{name} {value:.1%}" for name, value in largest.items()) or "every pair overlapped"
    nearest = ", ".join(f"{name} {value:+.1%}" for name, value in closest.items()) or "nothing judged"
    return (f"A/B over {len(results)} runs: {counts[Outcome.PASS]} passed, {counts[Outcome.REGRESSION]} regressions, "
            f"{counts[Outcome.FAILED]} failed, {counts[Outcome.SKIPPED]} skipped; largest |separation|: {spread}; "
            f"closest approach: {nearest}")


def closest_approach(base: Sequence[float], new: Sequence[float]) -> float:
    """How near two sets of launches came to separating, in the nearer direction: max(min(new) / max(base),
    min(base) / max(new)) - 1. Above 0 they separated by that much; below 0 they overlapped by that much, the
    margin an A/A measurement whose pairs all overlapped still has to show (a threshold of 0 would have
    passed it, but not by much where this is near 0)."""
    return max(min(new) / max(base), min(base) / max(new)) - 1.0
