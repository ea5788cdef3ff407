"""Horovod Elastic in a rank: the worker's steps run inside `hvd.elastic.run`, with the model and optimizer in a
`hvd.elastic.TorchState` committed before step K, as Horovod's elastic recipe has them (docs: "Elastic Horovod").

    horovodrun -np 2 --min-np 1 --max-np 2 --host-discovery-script '...' --gloo python -m harness.rank.worker ...

When a rank dies, the others' next collective raises HorovodInternalError; `hvd.elastic.run` restores the state of
the last commit (in memory: nothing is read from disk), shuts Horovod down and initialises it again with the hosts
horovodrun still has (it blacklists the failed rank's host), broadcasts rank 0's state, and calls the steps again from
the committed step, at the smaller world size. The global batch is kept: each rank takes more micro-batches
(`shrunk_spec`), so the learning rate stays as it was. What the worker recorded of the steps it runs again is
forgotten (`on_reset`), so the row holds each step once, as the job finally ran it.
"""

from __future__ import annotations

import os
from typing import Any, Callable

ELASTIC_ENV = "HOROVOD_ELASTIC"
RESET_PAUSE_S = 2.0       # horovodrun sets it in every rank of an elastic launch


def is_elastic() -> bool:
    return os.environ.get(ELASTIC_ENV) == "1"


class ElasticSteps:
    """The worker's steps under `hvd.elastic.run`; `steps(begin)` runs steps begin.. and returns what the worker would
    return early (a launch that stops after its save) or None; `on_reset(step)` rolls the worker's records back to the
    committed step once Horovod is initialised again."""

    def __init__(self, trainer: Any, steps: Callable[[int], Any], on_reset: Callable[[int], None]) -> None:
        import horovod.torch as hvd

        self.hvd = hvd
        self.steps, self.on_reset = steps, on_reset
        self.state = _TrainingState(hvd, trainer.model, trainer.optimizer, step=0)
        self.state.register_reset_callbacks([lambda: self.on_reset(self.state.step)])
        self.resets = 0

    def commit(self, step: int) -> None:
        """The state before `step` runs is the one a failure goes back to."""
        self.state.step = step
        self.state.commit()

    def run(self, begin: int) -> Any:
        self.state.step = begin

        from horovod.common.elastic import run_fn

        def train(state):
            return self.steps(state.step)

        return run_fn(train, self._reset)(self.state)

    def _reset(self) -> None:
        """Horovod's own reset (shutdown, then init), with the background thread given time to go first."""
        import time

        self.hvd.shutdown()
        time.sleep(RESET_PAUSE_S)
        self.hvd.init()


def _training_state_class(hvd: Any) -> type:
    """`hvd.elastic.TorchState`'s save, restore and sync of a model and its optimizer, with the sync in the order
    parbench's Horovod checkpoint loads them (harness.rank.checkpoint.HorovodRankZero): TorchState broadcasts the
    parameters and then the optimizer's state, and `broadcast_optimizer_state` makes an empty AdamW's state by stepping
    it on zero gradients, which moves every weight by its decoupled weight decay and counts a step. Where rank 0's
    optimizer has no state yet (the start of the job) there is nothing to broadcast; where it has (after a reset), its
    state goes first and the parameters over it."""
    import copy

    from horovod.common.elastic import ObjectState

    class TrainingState(ObjectState):
        def __init__(self, model: Any, optimizer: Any, **kwargs: Any) -> None:
            self._model, self._optimizer = model, optimizer
            self._saved_training = self._snapshot()
            super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **kwargs)

        def _snapshot(self) -> tuple[dict, dict]:
            return copy.deepcopy(self._model.state_dict()), copy.deepcopy(self._optimizer.state_dict())

        def save(self) -> None:
            self._saved_training = self._snapshot()
            super().save()

        def restore(self) -> None:
            model_state, optimizer_state = self._saved_training
            self._model.load_state_dict(model_state)
            self._optimizer.load_state_dict(optimizer_state)
            super().restore()

        def sync(self) -> None:
            if hvd.broadcast_object(bool(self._optimizer.state), root_rank=0, name="parbench.optimizer_has_state"):
                hvd.broadcast_optimizer_state(self._optimizer, root_rank=0)
            hvd.broadcast_parameters(self._model.state_dict(), root_rank=0)
            super().sync()

    return TrainingState


def _TrainingState(hvd: Any, model: Any, optimizer: Any, **kwargs: Any) -> Any:
    return _training_state_class(hvd)(model, optimizer, **kwargs)
