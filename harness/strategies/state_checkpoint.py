"""The `checkpoint` option: save the training state at step K in the strategy's own library's way, start again in
new processes from that save, and hold the resumed steps against the run that was never interrupted.

    checkpoint=none              no checkpoint (the default)
    checkpoint=at:K              save after K steps; a second launch resumes from the save and trains to the end
    checkpoint=at:K:from=W       the save is made by a launch at W ranks and resumed at the cell's world size
                                 (resharded on load: DCP's strategies and Horovod's rank-0 file)
    checkpoint=at:K:kill=S       one launch saves at K, a rank is killed at step S > K, and the launcher's own
                                 restart (torchrun --max-restarts 1) resumes the group from the save
    checkpoint=at:K:leave=S      elastic shrink: the last node leaves at step S (its launcher's agent and ranks
                                 killed), and torchrun --nnodes=N-1:N goes on without it, the ranks left resuming
                                 from the save at the smaller world size (resharded; the global batch kept)

Every such cell is several launches (harness.launch.checkpointed): an uninterrupted one at the cell's world size,
which saves at K where no other launch does and reads the norms of step K (the parity probe's, in a warm-up step),
and the launch under test. harness.derive.resume holds the second's steps K.. against the first's. Each strategy
names the library call that saves it (`Strategy.checkpoint_method`: harness.rank.checkpoint); a strategy without one
takes no `checkpoint` option.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from harness.spec import OptionValue, Precision, RunSpec, SpecError
from harness.strategies.option import Option

OPTION_NAME = "checkpoint"
NONE = "none"
FORMS = "none, at:K, at:K:from=W, at:K:kill=S or at:K:leave=S (K, W and S whole numbers)"
_FORM = re.compile(r"at:(?P<at>\d+)(?::(?P<key>from|kill|leave)=(?P<value>\d+))?")


@dataclass(frozen=True)
class CheckpointPlan:
    """What a cell's `checkpoint` option asks for."""

    at: int                          # the state after this many steps is saved, and step `at` is the first resumed
    from_world_size: int | None = None   # the save is made at this world size (resharded on load)
    kill_step: int | None = None     # a rank is killed at the start of this step, and its launcher restarts
    leave_step: int | None = None    # the last node leaves at the start of this step, and the others go on

    @property
    def value(self) -> str:
        """The option's value, as rows record it."""
        tail = (f":from={self.from_world_size}" if self.from_world_size is not None
                else f":kill={self.kill_step}" if self.kill_step is not None
                else f":leave={self.leave_step}" if self.leave_step is not None else "")
        return f"at:{self.at}{tail}"

    @property
    def failure_step(self) -> int | None:
        """The step a rank or a node is lost at, if any."""
        return self.kill_step if self.kill_step is not None else self.leave_step

    def killed_rank(self, world_size: int) -> int:
        """The rank the kill fault ends: the last, so that rank 0, which writes the row, is restarted too."""
        return world_size - 1


def checkpoint_plan(value: OptionValue) -> CheckpointPlan | None:
    """The plan of an option value, None for none; SpecError, one line, for anything else."""
    if value in (NONE, None):
        return None
    found = _FORM.fullmatch(value) if isinstance(value, str) else None
    if found is None:
        raise SpecError(f"option {OPTION_NAME}={value!r} is not one of: {FORMS}")
    at, key, other = int(found["at"]), found["key"], found["value"]
    return CheckpointPlan(at=at, from_world_size=int(other) if key == "from" else None,
                          kill_step=int(other) if key == "kill" else None,
                          leave_step=int(other) if key == "leave" else None)


CHECKPOINT = Option(NONE, "save the training state at step K in the strategy's library's way and resume from it in "
                    f"new processes, held against an uninterrupted run: {FORMS}", parse=checkpoint_plan)


def plan_of(spec: RunSpec) -> CheckpointPlan | None:
    """The cell's checkpoint plan (None where it has none, or its strategy takes no such option)."""
    return checkpoint_plan(dict(spec.options).get(OPTION_NAME, NONE))


def check_plan(spec: RunSpec, plan: CheckpointPlan, *, reshards: bool, method: str) -> None:
    """The rules every strategy's `checkpoint` cells follow; SpecError, one line, naming what is allowed."""
    steps = spec.warmup_steps + spec.timed_steps
    if not 1 <= plan.at < spec.warmup_steps:
        raise SpecError(f"option {OPTION_NAME}={plan.value}: K must be a warm-up step after the first, "
                        f"1 <= K < warmup_steps = {spec.warmup_steps}, so that the probe of step K stays out of "
                        "the timed steps and the resumed launch times every one of them")
    if spec.precision is Precision.FP16:
        raise SpecError(f"option {OPTION_NAME}: fp16 cells are not checkpointed here (the loss scaler's state is not "
                        "saved); use fp32 or bf16")
    if plan.failure_step is not None and not plan.at < plan.failure_step < steps:
        raise SpecError(f"option {OPTION_NAME}={plan.value}: the step S a rank or node is lost at must come after the "
                        f"save and within the run, {plan.at} < S < {steps}")
    if plan.leave_step is not None:
        if spec.nnodes < 2:
            raise SpecError(f"option {OPTION_NAME}={plan.value}: a node can leave only a cell of 2 or more nodes "
                            f"(nnodes {spec.nnodes}; on one machine, --emulate-link and --emulate-nodes)")
        if not (reshards and method == "dcp"):
            raise SpecError(f"option {OPTION_NAME}={plan.value}: elastic shrink is torchrun's with a save that reshards "
                            f"(DCP: ddp, fsdp2); strategy {spec.strategy} saves with {method}")
    if plan.from_world_size is not None:
        if not reshards:
            raise SpecError(f"option {OPTION_NAME}={plan.value}: strategy {spec.strategy} saves with {method}, which "
                            "this harness loads only at the world size that saved it (docs/reliability.md); "
                            "resharded resume is DCP's (ddp, fsdp2, tp, fsdp2-tp) and Horovod's whole-state file's")
        if plan.from_world_size == spec.world_size or plan.from_world_size < 1:
            raise SpecError(f"option {OPTION_NAME}={plan.value}: from=W must name another world size than the "
                            f"cell's {spec.world_size}")
        if plan.from_world_size % spec.nnodes:
            raise SpecError(f"option {OPTION_NAME}={plan.value}: from=W must spread over the cell's {spec.nnodes} "
                            "nodes evenly")


def saving_spec(spec: RunSpec, plan: CheckpointPlan) -> RunSpec:
    """The cell as the launch that saves at another world size runs it (no checkpoint option of its own)."""
    options = {name: value for name, value in spec.options if name != OPTION_NAME}
    return spec.replace(world_size=plan.from_world_size, options=options)


def shrunk_spec(spec: RunSpec) -> RunSpec:
    """The cell once its last node has left (`leave=S`): a node's ranks fewer, on one node fewer, the global batch
    kept (each rank takes more micro-batches), as the ranks left run it after torchrun's new rendezvous; the option
    left out, as in `saving_spec`, since no node leaves that cell."""
    options = {name: value for name, value in spec.options if name != OPTION_NAME}
    return spec.replace(world_size=spec.world_size - spec.ranks_per_node, nnodes=spec.nnodes - 1, options=options)
