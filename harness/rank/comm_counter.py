"""Count the collectives a strategy really issues: bytes and calls per collective type per step per rank.

The counter replaces the collective functions of `torch.distributed` (what DDP's Python comm hooks, FSDP2,
DeepSpeed and our own code call) and Horovod's all-reduce entry points with wrappers that note the buffer
size and pass the call through unchanged. It is installed in each rank before the strategy starts, because
DeepSpeed keeps references to the torch functions it finds at initialisation. Calls made inside another
counted call (torch's `all_gather_into_tensor` forwards to `all_gather_single`) are counted once.

Bytes are the buffer size in nccl-tests' sense ("size" in its algbw = size / time): the reduced tensor for
all_reduce, the gathered output for all_gather, the scattered input for reduce_scatter, the tensor for
broadcast, reduce, send and recv, the input for all_to_all. Reading sizes never synchronises a device.
Beside each type's bytes and calls the counter keeps its bytes per dtype (with the dtype's element size:
what a recipe really reduces in, fp32 or bf16) and per size of the group the call ran among (what turns
a size into wire bytes, harness.derive.comm).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
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
    return sum(tensor.numel() * tensor.element_size() for tensor in buffer_tensors(value))


def buffer_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a tensor or (nested) list of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in buffer_tensors(item)]
    return []


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_group_size(original: Callable) -> Callable[..., int]:
    """A function of a torch collective's arguments giving the size of the group it runs among."""
    import torch.distributed as dist

    try:
        names = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        names = []
    position = names.index("group") if "group" in names else None

    def group_size(*args, **kwargs) -> int:
        group = kwargs.get("group")
        if group is None and position is not None and len(args) > position:
            group = args[position]
        return dist.get_world_size(group)

    return group_size


class CollectiveCounter:
    """Collective calls and bytes, counted only while `counting(record=True)` is open."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes_by_dtype: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.element_bytes: dict[str, int] = {}                  # dtype name -> bytes per element
        self.bytes_by_group_size: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
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
            wrapped = self._wrap(original, kind, buffer_of, torch_group_size(original))
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    self._patch(module, name, wrapped)

    def install_horovod(self) -> None:
        import importlib

        import horovod.torch as hvd

        for module_name, name in HOROVOD_ALLREDUCES:
            module = importlib.import_module(module_name)
            original = getattr(module, name, None)
            if original is not None:
                # Our Horovod strategy reduces over the global process set only.
                self._patch(module, name, self._wrap(original, "all_reduce",
                                                     lambda *a, **k: k.get("tensor", k.get("tensors",
                                                                                           a[0] if a else None)),
                                                     lambda *a, **k: hvd.size()))

    def uninstall(self) -> None:
        for module, name, original in reversed(self._installed):
            setattr(module, name, original)
        self._installed.clear()

    def _patch(self, module: Any, name: str, replacement: Any) -> None:
        self._installed.append((module, name, getattr(module, name)))
        setattr(module, name, replacement)

    def _wrap(self, original: Callable, kind: str, buffer_of: Callable[..., Any],
              group_size_of: Callable[..., int]) -> Callable:
        counter = self

        @functools.wraps(original)
        def counted(*args, **kwargs):
            depth = getattr(counter._local, "depth", 0)
            if counter._recording and depth == 0:
                counter._record(kind, buffer_tensors(buffer_of(*args, **kwargs)), group_size_of(*args, **kwargs))
            counter._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                counter._local.depth = depth

        return counted

    def _record(self, kind: str, tensors: list[torch.Tensor], group_size: int) -> None:
        self.calls[kind] += 1
        for tensor in tensors:
            size = tensor.numel() * tensor.element_size()
            name = dtype_name(tensor.dtype)
            self.bytes[kind] += size
            self.bytes_by_dtype[kind][name] += size
            self.element_bytes[name] = tensor.element_size()
            self.bytes_by_group_size[kind][group_size] += size

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

    def per_step(self) -> dict[str, dict[str, Any]]:
        """Means per counted step, per collective type:
        {"bytes": nccl-tests size, "calls": calls,
         "dtypes": {dtype name: {"bytes": size in that dtype, "element_bytes": its bytes per element}},
         "bytes_by_group_size": {ranks in the group (as text, a JSON key): size among that many ranks}}"""
        if not self.steps:
            return {}
        steps = self.steps
        return {kind: {"bytes": self.bytes[kind] / steps, "calls": self.calls[kind] / steps,
                       "dtypes": {name: {"bytes": size / steps, "element_bytes": self.element_bytes[name]}
                                  for name, size in sorted(self.bytes_by_dtype[kind].items())},
                       "bytes_by_group_size": {str(group): size / steps
                                               for group, size in sorted(self.bytes_by_group_size[kind].items())}}
                for kind in sorted(self.calls)}
