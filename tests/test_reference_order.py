"""The GPU reference set's launch order, and what a lent GPU's budget keeps of it (harness.launch_order.value_first,
harness.matrix.reference, scripts/gpu-reference.sh).

The budget is replayed at the launch times the last GPU run measured (one H200 at a3663fd,
results/reference/h200/a3663fd/rows.jsonl, `wall_time_s`), as harness.runner's Budget spends it: a launch starts only
with BUDGET_FLOOR_S left and is killed at what is left. Cells that run did not launch get an estimate, written out
below with its reasoning, and the test says which figures are estimates.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.launch_order import round_robin, value_first
from harness.matrix import Selection, build_matrix, launch_order
from harness.machine import Machine
from harness.runner import BUDGET_FLOOR_S
from harness.spec import DeviceKind

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu-reference.sh"

# Measured at a3663fd (wall_time_s of each ok row, seconds).
MEASURED_S = {
    ("gpt2-small", "plain", "bf16", ""): 15.625, ("gpt2-small", "ddp", "bf16", ""): 19.83,
    ("gpt2-small", "fsdp2", "bf16", ""): 20.231, ("gpt2-small", "zero1", "bf16", ""): 31.248,
    ("gpt2-small", "zero2", "bf16", ""): 29.034, ("gpt2-small", "zero3", "bf16", ""): 38.254,
    ("gpt2-small", "plain", "fp16", ""): 15.434, ("gpt2-small", "ddp", "fp16", ""): 25.839,
    ("gpt2-small", "zero2", "fp16", ""): 30.241, ("gpt2-small", "zero3", "fp16", ""): 35.644,
    ("gpt2-small", "fsdp2", "bf16", "offload_policy"): 39.644, ("gpt2-small", "horovod", "bf16", ""): 18.825,
    ("resnet50", "plain", "bf16", ""): 12.224, ("resnet50", "ddp", "bf16", ""): 18.626,
    ("resnet50", "fsdp2", "bf16", ""): 19.024, ("resnet50", "zero2", "bf16", ""): 28.834,
}
# Estimates, for cells a3663fd did not launch:
# - the bare loop: the plain loop's launch (the same model and steps, less the harness's own work);
# - compiled GPT-2 small: the launch uncompiled plus inductor's compile of the block, COLD_COMPILE_S on the first
#   launch (gpt-tiny's block took 14.1 s cold on a 2-core CPU, docs/methodology.md; a GPU's Triton code generation is
#   slower, so about three times that is assumed), WARM_COMPILE_S on the second, from the cache the first filled;
# - Llama 3.2 1B, LLAMA_LAUNCH_S: GPT-2 small's plain launch was 15.6 s, of which 25 steps x 72.9 ms are 1.8 s; a
#   Llama step at 4 x 2048 tokens is 4.3 times GPT-2 small's FLOPs (8.22 GFLOP a token against 0.96, 8,192 tokens
#   against 16,384), 7.8 s for 25 steps, plus 10 s to initialise ten times the parameters: about 32 s, taken as 35;
# - any other strategy: the slowest measured launch of its workload and precision (ZeRO-3's 38.3 s on GPT-2 small).
COLD_COMPILE_S, WARM_COMPILE_S, LLAMA_LAUNCH_S = 40.0, 5.0, 35.0
# Installing DeepSpeed from the carried sdist and describing the machine, before the first cell (an estimate).
SETUP_S = 30.0
# Each `harness run`'s own start before its budget's clock starts (imports, the environment, the doctor's line):
# 5.8 s for a whole run that launched nothing here on 2 CPU cores, so 10 s is allowed.
HARNESS_START_S = 10.0


def script_constant(name: str) -> int:
    return int(re.search(rf"^{name}=(\d+)$", SCRIPT.read_text(), re.MULTILINE).group(1))


def launch_seconds(spec, repeat: int) -> tuple[float, bool]:
    """(seconds, measured) of one launch of `spec` on the H200."""
    strategy = "plain" if spec.strategy == "bare" else spec.strategy
    options = spec.options_dict
    offload = ",".join(sorted(k for k in options if k.startswith("offload")))
    key = (spec.workload, strategy, spec.precision.value, offload)
    if spec.workload.startswith("llama"):
        return LLAMA_LAUNCH_S, False
    if options.get("compile"):
        base, _ = launch_seconds(spec.replace(options={k: v for k, v in options.items() if k != "compile"}), 0)
        return base + (COLD_COMPILE_S if repeat == 0 else WARM_COMPILE_S), False
    if key in MEASURED_S:       # a3663fd's cells were one rank at one micro-batch a step: others are estimates
        return MEASURED_S[key], (spec.strategy != "bare" and spec.world_size == 1
                                 and spec.global_batch == spec.micro_batch)
    same = [s for (w, _, p, _), s in MEASURED_S.items() if w == spec.workload and p == spec.precision.value]
    return max(same), False


def replay(launches, budget_s: float) -> tuple[list, list, float]:
    """(kept, cut, seconds spent): the launches that end within `budget_s` as harness.runner.Budget spends it (a launch
    starts only with BUDGET_FLOOR_S left, and is killed at what is left), the rest, and the time it all took."""
    left, kept, cut = budget_s, [], []
    for spec, repeat in launches:
        seconds, _ = launch_seconds(spec, repeat)
        if left >= BUDGET_FLOOR_S and seconds <= left:
            kept.append((spec, repeat))
            left -= seconds
        else:
            cut.append((spec, repeat))
            if left >= BUDGET_FLOOR_S:      # started, then killed at what was left: the budget is spent
                left = 0.0
    return kept, cut, budget_s - left


def reference_launches(strategies: tuple[str, ...]):
    specs = build_matrix("reference", Machine(DeviceKind.CUDA, 1), Selection(strategies=strategies))
    return launch_order("reference")(specs)


def name(launch) -> str:
    spec, repeat = launch
    return f"{spec.label} r{repeat}"


def key(spec) -> tuple:
    """A parity key as far as this set's cells differ: workload, precision, compiled or not, global batch."""
    return spec.workload, spec.precision, bool(spec.options_dict.get("compile")), spec.global_batch


def keys(launches, world_size: int | None = None) -> set:
    return {key(s) for s, _ in launches if world_size is None or s.world_size == world_size}


HOROVOD = ("horovod",)


def not_horovod() -> tuple[str, ...]:
    return tuple(re.search(r"^NOT_HOROVOD=(\S+)$", SCRIPT.read_text(), re.MULTILINE).group(1).split(","))


def test_the_reference_set_launches_every_keys_two_plain_launches_first_then_the_strategies_in_value_order():
    launches = reference_launches(not_horovod())
    plains = len(keys([(s, r) for s, r in launches if s.strategy != "plain"], world_size=1)) * 2
    first = launches[:plains]
    assert all(spec.strategy == "plain" for spec, _ in first)
    assert [repeat for _, repeat in first] == [0, 1] * (plains // 2)       # each key's two launches back to back
    assert [spec.workload for spec, _ in first[::2]] == ["gpt2-small", "gpt2-small", "gpt2-small", "llama3.2-1b",
                                                         "resnet50"]
    then = [(spec.workload, spec.strategy, spec.precision.value) for spec, _ in launches[plains:plains + 6]]
    assert then == [("gpt2-small", s, "bf16") for s in ("ddp", "fsdp2", "zero1", "zero2", "zero3", "bare")]
    # The bare loop alternates with its plain loop's launches past parity's two.
    overhead = [name(launch) for launch in launches[plains + 5:plains + 11]]
    assert [label.split("/")[1] + label[-3:] for label in overhead] == [
        "bare r0", "plain r2", "bare r1", "plain r3", "bare r2", "bare r3"]
    # fp16, compile, Llama, ResNet, offload, two ranks: the groups after, in that order.
    groups = []
    for spec, _ in launches[plains + 11:]:
        group = ("fp16" if spec.precision.value == "fp16" else "compile" if spec.options_dict.get("compile")
                 else "llama" if spec.workload.startswith("llama") else "resnet" if spec.workload == "resnet50"
                 else "offload" if any(k.startswith("offload") for k in spec.options_dict)
                 else f"gb{spec.global_batch}")
        if not groups or groups[-1] != group:
            groups.append(group)
    # Two ranks last, their own key's plain launches (twice the batch) just before them.
    assert groups == ["fp16", "compile", "llama", "resnet", "offload", "gb32"]
    assert [(s.strategy, s.world_size, r) for s, r in launches[-6:]] == [
        ("plain", 1, 0), ("plain", 1, 1), ("ddp", 2, 0), ("fsdp2", 2, 0), ("zero2", 2, 0), ("zero3", 2, 0)]
    assert sorted(map(name, launches)) == sorted(map(name, round_robin([s for s, r in launches if r == 0])))


def test_at_a3663fds_launch_times_a_540_s_budget_keeps_both_plain_launches_of_every_key_and_every_strategys_first_cell():
    budget, horovod_reserve, report_reserve = (script_constant(n) for n in
                                               ("BUDGET_S", "RESERVE_HOROVOD_S", "RESERVE_REPORT_S"))
    assert budget == 540
    # The script's first run: every strategy but Horovod, within what is left less both reserves.
    first = reference_launches(not_horovod())
    kept, cut, spent = replay(first, budget - SETUP_S - horovod_reserve - report_reserve)
    # Then Horovod's, within what is left less the report's reserve: the first run's start before its budget's clock
    # came off the command's time (the reserves absorb it, and the second run's start).
    left = budget - SETUP_S - HARNESS_START_S - spent
    assert left > report_reserve + 30        # the script's own condition for launching Horovod's cells at all
    kept_horovod, _, _ = replay(reference_launches(HOROVOD), left - report_reserve)
    kept += kept_horovod

    plain_kept = {(*key(s), r) for s, r in kept if s.strategy == "plain"}
    # Both plain launches of every key of the one-GPU cells, and of every key any kept cell is held against.
    cells = [launch for launch in first if launch[0].strategy not in ("plain", "bare")]
    for needed in keys(cells, world_size=1) | keys([launch for launch in kept if launch in cells]):
        assert {(*needed, 0), (*needed, 1)} <= plain_kept, f"a plain launch of {needed} is cut"
    strategies = {s.strategy for s, _ in first} | set(HOROVOD)
    assert strategies == {"plain", "bare", "ddp", "fsdp2", "zero1", "zero2", "zero3", "horovod"}
    assert strategies <= {s.strategy for s, _ in kept}
    # The budget cuts the tail, never a launch before one it keeps.
    assert first[:len(kept) - len(kept_horovod)] == kept[:len(kept) - len(kept_horovod)]
    measured = [launch for launch in kept if launch_seconds(*launch)[1]]
    print(f"kept {len(kept)} launches ({len(measured)} at measured times), cut {len(cut)}: first cut {name(cut[0])}")


def test_the_order_is_a_permutation_and_every_other_matrix_keeps_going_repeat_by_repeat():
    specs = build_matrix("reference", Machine(DeviceKind.CUDA, 1))
    ordered = value_first(specs)
    assert sorted(map(name, ordered)) == sorted(f"{s.label} r{r}" for s in specs for r in range(s.repeats))
    assert launch_order("full") is round_robin and launch_order("smoke") is round_robin


@pytest.mark.parametrize("device", [DeviceKind.CPU, DeviceKind.CUDA])
def test_the_reference_set_runs_the_llama_and_two_ranks_and_enough_bare_and_plain_launches_for_an_overhead_interval(
        device):
    specs = build_matrix("reference", Machine(device, 1))
    by = {}
    for s in specs:     # the first of each (the plain loop at twice the batch, for two ranks, comes later)
        by.setdefault((s.workload, s.strategy, s.world_size, s.precision.value, bool(s.options_dict.get("compile"))), s)
    gpt, llama = ("gpt2-small", "llama3.2-1b") if device is DeviceKind.CUDA else ("gpt-tiny", "llama-tiny")
    assert {s for (w, s, *_ ) in by if w == llama} == {"plain", "ddp", "fsdp2", "zero3"}
    assert {s for (w, s, ws, p, c) in by if w == gpt and c} == {"plain", "ddp", "fsdp2"}
    assert {s for (w, s, ws, *_ ) in by if ws == 2} == {"ddp", "fsdp2", "zero2", "zero3"}
    # harness.derive.harness_overhead gives no interval under 4 launches a side.
    assert by[(gpt, "bare", 1, "bf16", False)].repeats >= 4 and by[(gpt, "plain", 1, "bf16", False)].repeats >= 4


@pytest.mark.launch
def test_harness_run_launches_the_reference_set_in_value_order(tmp_path, capsys):
    # Through the command: with a budget under the floor nothing launches, and every launch is recorded `skipped` in
    # the order the runner walked them, which must be value_first's (no DeepSpeed cells: no host build either).
    from harness.cli import main
    from harness.record import read_results

    out = tmp_path / "rows.jsonl"
    chosen = ("plain", "bare", "ddp", "fsdp2")
    assert main(["run", "--matrix", "reference", "--device", "cpu", "--strategy", ",".join(chosen),
                 "--budget", str(int(BUDGET_FLOOR_S) - 1), "--allow-failed-cells", "--out", str(out)]) == 0
    rows = read_results([out])
    specs = build_matrix("reference", Machine(DeviceKind.CPU, 2), Selection(strategies=chosen))
    assert [(row.spec.label, row.repeat) for row in rows] == [(spec.label, repeat) for spec, repeat in value_first(specs)]
    assert rows[0].spec.strategy == "plain" and rows[-1].spec.world_size == 2
    assert len(rows) > 20 and all(row.message.startswith("not launched: ") for row in rows)
