"""The bare loop: the plain loop with nothing of parbench's in or between its timed steps, a bound on the harness's cost.

    python -m harness run --matrix full --strategy plain,bare --world-sizes 1

The same workload, initial weights, data, micro-batches, precision and optimizer as `plain` (its trainer, whose
step is a user's loop: forward and backward under autocast, the loss scaler in fp16, AdamW), run by
`harness.rank.bare_loop` instead of the measuring worker: no collective counter, no probe, no census, no barrier and
no clock around a step. The timed steps' batches are made first, then one clock around all of them, closed by one
device synchronisation. The row holds that loop's time and its steps (`loop_time_s`, `loop_steps`), the losses of
every step (parity holds them to the plain loop's), its peak memory over those steps and the facts any row holds;
`harness.derive.harness_overhead` sets the plain loop's mean step against it. Its peak memory holds every timed
step's inputs at once (made before the clock: 3.1 GB of ResNet-50's 20 steps of 256 images), which the plain loop's
does not: the two peaks do not compare.
"""

from __future__ import annotations

from harness.derive.harness_overhead import BARE_STRATEGY
from harness.spec import RunSpec
from harness.strategies.plain import Plain
from harness.strategies.state_checkpoint import OPTION_NAME as CHECKPOINT_NAME


class Bare(Plain):
    name = BARE_STRATEGY
    description = "the plain loop timed whole, with no probe, counter or per-step clock: the harness's cost"
    comm_interception = "none: one process, no communication, nothing instrumented"
    checkpoint_method = ""
    # The plain loop's techniques, which change the step it is the yardstick of; not its state checkpoint, which the
    # measuring worker saves and loads.
    options = {name: option for name, option in Plain.options.items() if name != CHECKPOINT_NAME}
    # The worker runs `harness.rank.bare_loop` for it rather than its measured steps.
    times_whole_loop = True

    def instrument(self, counter) -> None:
        """Nothing: the collective counter's wrappers are part of what the bare loop leaves out."""

    def compute_only_unavailable(self, spec: RunSpec) -> str:
        return "the bare loop times its steps as a whole and nothing else"
