"""Count the collectives a strategy really issues: bytes and calls per collective type per step per rank.

The counter replaces the collective functions of `torch.distributed` (what DDP's Python comm hooks, FSDP2,
DeepSpeed and our own code call) and Horovod's all-reduce entry points with wrappers that note the buffer
size and pass the call through unchanged. It is installed in each rank before the strategy starts, because
DeepSpeed keeps references to the torch functions it finds at initialisation. Calls made inside another
counted call (torch's `all_gather_into_tensor` forwards to `all_gather_single`) are counted once.

Bytes are the buffer size in nccl-tests' sense ("size" in its algbw = size / time): the reduced tensor for
all_reduce, the gathered output for all_gather, the scattered input for reduce_scatter, the tensor for
broadcast, reduce, send and recv, the input for all_to_all. Reading sizes never synchronises a device.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import defaultdict
from typing import Any, Callable, Iterator

import torch

# torch.distributed function -> (collective type, which argument holds the buffer that defines its size)
TORCH_COLLECTIVES: dict[str, tuple[str, Callable[..., Any]]] = {
    "all_reduce": ("all_reduce", lambda *a, **k: k.get("tensor", a[0] if a else None)),
    "all_reduce_coalesced": ("all_reduce", lambda *a, **k: k.get("tensors", a[0] if a else None)),
    "all_gather": ("all_gather", lambda *a, **k: k.get("tensor_list", a[0] if a else None)),
    "all_gather_into_tensor": ("all_gather", lambda *a, **k: k.get("output_tensor", a[0] if a else None)),
    "all_gather_single": ("all_gather", lambda *a, **k: k.get("output_tensor", a[0] if a else None)),
    "_all_gather_base": ("all_gather", lambda *a, **k: k.get("output_tensor", a[0] if a else None)),
    "all_gather_coalesced": ("all_gather", lambda *a, **k: k.get("output_tensor_lists", a[0] if a else None)),
    "reduce_scatter": ("reduce_scatter", lambda *a, **k: k.get("input_list", a[1] if len(a) > 1 else None)),
    "reduce_scatter_tensor": ("reduce_scatter", lambda *a, **k: k.get("input", a[1] if len(a) > 1 else None)),
    "reduce_scatter_single": ("reduce_scatter", lambda *a, **k: k.get("input", a[1] if len(a) > 1 else None)),
    "_reduce_scatter_base": ("reduce_scatter", lambda *a, **k: k.get("input", a[1] if len(a) > 1 else None)),
    "broadcast": ("broadcast", lambda *a, **k: k.get("tensor", a[0] if a else None)),
    "reduce": ("reduce", lambda *a, **k: k.get("tensor", a[0] if a else None)),
    "all_to_all_single": ("all_to_all", lambda *a, **k: k.get("input", a[1] if len(a) > 1 else None)),
    "all_to_all": ("all_to_all", lambda *a, **k: k.get("input_tensor_list", a[1] if len(a) > 1 else None)),
    "send": ("send", lambda *a, **k: k.get("tensor", a[0] if a else None)),
    "isend": ("send", lambda *a, **k: k.get("tensor", a[0] if a else None)),
    "recv": ("recv", lambda *a, **k: k.get("tensor", a[0] if a else None)),
    "irecv": ("recv", lambda *a, **k: k.get("tensor", a[0] if a else None)),
}

# Horovod's entry points as its optimizer imports them (module, function): each all-reduces its tensor(s).
HOROVOD_ALLREDUCES = (("horovod.torch.optimizer", "allreduce_async_"),
                      ("horovod.torch.optimizer", "grouped_allreduce_async_"),
                      ("horovod.torch.mpi_ops", "allreduce_async_"),
                      ("horovod.torch.mpi_ops", "grouped_allreduce_async_"),
                      ("horovod.torch.mpi_ops", "allreduce_"),
                      ("horovod.torch.mpi_ops", "allreduce"))


def buffer_bytes(value: Any) -> int:
    """Bytes of a tensor, or of every tensor in a (nested) list of them."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(buffer_bytes(item) for item in value)
    return 0


class CollectiveCounter:
    """Collective calls and bytes, counted only while `counting(record=True)` is open."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.steps = 0
        self._recording = False
        self._local = threading.local()
        self._installed: list[tuple[Any, str, Any]] = []

    # ---- installation -----------------------------------------------------------------------------

    def install_torch(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name, (kind, buffer_of) in TORCH_COLLECTIVES.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            wrapped = self._wrap(original, kind, buffer_of)
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    self._patch(module, name, wrapped)

    def install_horovod(self) -> None:
        import importlib

        for module_name, name in HOROVOD_ALLREDUCES:
            module = importlib.import_module(module_name)
            original = getattr(module, name, None)
            if original is not None:
                self._patch(module, name, self._wrap(original, "all_reduce",
                                                     lambda *a, **k: k.get("tensor", k.get("tensors",
                                                                                           a[0] if a else None))))

    def uninstall(self) -> None:
        for module, name, original in reversed(self._installed):
            setattr(module, name, original)
        self._installed.clear()

    def _patch(self, module: Any, name: str, replacement: Any) -> None:
        self._installed.append((module, name, getattr(module, name)))
        setattr(module, name, replacement)

    def _wrap(self, original: Callable, kind: str, buffer_of: Callable[..., Any]) -> Callable:
        counter = self

        @functools.wraps(original)
        def counted(*args, **kwargs):
            depth = getattr(counter._local, "depth", 0)
            if counter._recording and depth == 0:
                counter.calls[kind] += 1
                counter.bytes[kind] += buffer_bytes(buffer_of(*args, **kwargs))
            counter._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                counter._local.depth = depth

        return counted

    # ---- use --------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def counting(self, record: bool = True) -> Iterator[None]:
        """Count the collectives issued in the body (one training step) when `record`."""
        self._recording = record
        try:
            yield
        finally:
            self._recording = False
            if record:
                self.steps += 1

    def per_step(self) -> dict[str, dict[str, float]]:
        """{collective: {"bytes": mean bytes per step, "calls": mean calls per step}} over counted steps."""
        if not self.steps:
            return {}
        return {kind: {"bytes": self.bytes[kind] / self.steps, "calls": self.calls[kind] / self.steps}
                for kind in sorted(self.calls)}
