"""The saved-for-backward census: how many bytes of activations a rank's forward passes keep for backward.

Every tensor autograd saves passes through `torch.autograd.graph.saved_tensors_hooks`' pack hook. The census
counts each storage once (views of one tensor share it) while any tensor saved on it is alive, and records
the peak of that sum over one step: the activation memory of the step, on every device alike (the allocator's
peak on a GPU also holds the model states, buffers and the allocator's slack). Parameters, and views of them,
are not activations and are left out, and so are the step's inputs and targets, which the caller holds for
the whole step (an embedding saves its token ids; every micro-batch's are made before the step starts).
Under torch.autocast the bf16 copies of the weights are counted, as they are held until backward all the same
(harness.derive.activations calls them `weight_copies`).

A tensor stops counting when autograd lets go of it: the census holds it only through a weak reference whose
finaliser takes its bytes off. With activation checkpointing a checkpointed block saves only its input
through these hooks; its recomputation in backward saves under the checkpoint's own hooks, which these do not
see (measured on gpt-tiny: no tensor reaches them during backward), and is freed within that block's backward.

Run in one warm-up step (harness.rank.worker): a Python call per saved tensor would slow a timed step.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterable, Iterator

import torch
from torch import nn


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds), else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _is_parameter(tensor: torch.Tensor) -> bool:
    """A parameter or a view of one (a linear layer saves its weight's transpose)."""
    return isinstance(tensor, nn.Parameter) or isinstance(getattr(tensor, "_base", None), nn.Parameter)


class SavedActivationCensus:
    """The peak bytes of saved-for-backward storages alive at once during the steps it counted (see the module
    docstring); `parameter_storages` are left out (the storages of the model's own parameters)."""

    def __init__(self, model: nn.Module) -> None:
        self.parameter_storages = {_local(p.detach()).untyped_storage().data_ptr() for p in model.parameters()}
        self.live: dict[int, list[int]] = {}     # storage address -> [bytes, tensors saved on it still alive]
        self.current = 0
        self.peak: int | None = None
        self.tensors = 0                          # tensors counted (parameters left out)
        self.data_storages: set[int] = set()

    @contextlib.contextmanager
    def counting(self, active: bool, data: Iterable[torch.Tensor] = ()) -> Iterator[None]:
        """Count the tensors saved inside this block where `active`, leaving out the storages of `data` (the step's
        inputs and targets, held by the caller for the whole step whatever autograd saves)."""
        if not active:
            yield
            return
        self.peak = self.peak or 0
        excluded = {_local(t).untyped_storage().data_ptr() for t in data}
        self.data_storages = excluded
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda packed: packed):
                yield
        finally:
            self.data_storages = set()

    def _pack(self, tensor: torch.Tensor) -> Any:
        if _is_parameter(tensor):
            return tensor
        storage = _local(tensor.detach()).untyped_storage()
        address = storage.data_ptr()
        if address in self.parameter_storages or address in self.data_storages or storage.nbytes() == 0:
            return tensor
        entry = self.live.get(address)
        if entry is None:
            entry = self.live[address] = [storage.nbytes(), 0]
            self.current += entry[0]
            self.peak = max(self.peak or 0, self.current)
        entry[1] += 1
        self.tensors += 1
        weakref.finalize(tensor, self._release, address)
        return tensor

    def _release(self, address: int) -> None:
        entry = self.live.get(address)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[address]
