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
what a recipe really reduces in, fp32 or bf16), per size of the group the call ran among (what turns
a size into wire bytes, harness.derive.comm), and calls and bytes per group by name (`label_group`: a
device mesh's dimensions, "tp" and "dp"; the default group is "world"), so that tensor parallelism's
activation reductions and data parallelism's gradient reductions are told apart.

DTensor (tensor parallelism) does not call those functions: it issues `torch.ops._c10d_functional.*`
directly. `install_functional` adds a TorchDispatchMode that sees them (as
`torch.distributed.tensor.debug.CommDebugMode` does: it declines DTensor arguments, so DTensor's own
dispatch runs and the plain-tensor collectives it issues come back to the mode). A Python dispatch mode
costs time on every operator, so it is entered only in the step `counting(sample_functional=True)` names
(the worker's last warm-up step; a tensor-parallel step issues the same collectives every step), never in
a timed one; its counts are means over the steps it sampled.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections import defaultdict
from typing import Any, Callable, Iterator

import torch
import torch.utils._python_dispatch

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

# torch.ops._c10d_functional operator -> (collective type, index of the argument defining its size). The
# collective's group is its `group_name` argument, always the last. wait_tensor and the send/recv of
# batch_p2p_ops move no data of their own here (pipelines send through torch.distributed, counted above).
FUNCTIONAL_COLLECTIVES: dict[str, tuple[str, int]] = {
    "all_reduce": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce", 0),
    "all_gather_into_tensor": ("all_gather", -1),          # the output: input bytes x group size
    "all_gather_into_tensor_coalesced": ("all_gather", -1),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "all_to_all_single": ("all_to_all", 0),
    "broadcast": ("broadcast", 0),
}
WORLD = "world"                  # the label of the default process group
_GROUP_LABELS: dict[str, str] = {}   # c10d group name -> label (label_group)


def label_group(group: Any, label: str) -> None:
    """Name a process group in the counts (a strategy names its device mesh's dimensions: "tp", "dp")."""
    _GROUP_LABELS[group.group_name] = label


def group_label(group_name: str, size: int) -> str:
    """The label counts carry for the group named `group_name` (c10d's name) of `size` ranks."""
    import torch.distributed as dist

    if group_name in _GROUP_LABELS:
        return _GROUP_LABELS[group_name]
    default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    if default is not None and group_name == default.group_name:
        return WORLD
    return f"group {group_name} of {size}"


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


def torch_group(original: Callable) -> Callable[..., tuple[int, str]]:
    """A function of a torch collective's arguments giving the size and label of the group it runs among."""
    import torch.distributed as dist

    try:
        names = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        names = []
    position = names.index("group") if "group" in names else None

    def group_of(*args, **kwargs) -> tuple[int, str]:
        group = kwargs.get("group")
        if group is None and position is not None and len(args) > position:
            group = args[position]
        size = dist.get_world_size(group)
        resolved = group if group is not None else dist.distributed_c10d._get_default_group()
        return size, group_label(resolved.group_name, size)

    return group_of


class CollectiveCounter:
    """Collective calls and bytes, counted only while `counting(record=True)` is open."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes_by_dtype: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.element_bytes: dict[str, int] = {}                  # dtype name -> bytes per element
        self.bytes_by_group_size: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.bytes_by_group: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.calls_by_group: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.group_ranks: dict[str, dict[str, int]] = defaultdict(dict)    # kind -> group label -> its ranks
        self.steps = 0
        # The functional collectives' own tally (install_functional), over the steps it sampled.
        self.functional: CollectiveCounter | None = None
        self._recording = False
        self._local = threading.local()
        self._installed: list[tuple[Any, str, Any]] = []

    def forget(self) -> None:
        """Drop every tally so far: the steps an elastic job restored to an earlier commit runs again, at its new size
        (harness.rank.horovod_elastic)."""
        installed, functional = self._installed, self.functional
        self.__init__()
        self._installed, self.functional = installed, functional
        if functional is not None:
            functional.forget()

    # ---- installation -----------------------------------------------------------------------------

    def install_torch(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name, (kind, buffer_of) in TORCH_COLLECTIVES.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            wrapped = self._wrap(original, kind, buffer_of, torch_group(original))
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
                                                     lambda *a, **k: (hvd.size(), WORLD)))

        # Horovod's alltoall (horovod-ep's dispatch): its autograd function's forward calls this, backward included.
        mpi_ops = importlib.import_module("horovod.torch.mpi_ops")
        self._patch(mpi_ops, "alltoall_async", self._wrap(mpi_ops.alltoall_async, "all_to_all",
                                                          lambda *a, **k: k.get("tensor", a[0] if a else None),
                                                          lambda *a, **k: (hvd.size(), WORLD)))

    def install_functional(self) -> None:
        """Also count `torch.ops._c10d_functional` collectives (DTensor's), in the steps `counting` samples."""
        self.functional = CollectiveCounter()

    def uninstall(self) -> None:
        for module, name, original in reversed(self._installed):
            setattr(module, name, original)
        self._installed.clear()

    def _patch(self, module: Any, name: str, replacement: Any) -> None:
        self._installed.append((module, name, getattr(module, name)))
        setattr(module, name, replacement)

    def _wrap(self, original: Callable, kind: str, buffer_of: Callable[..., Any],
              group_of: Callable[..., tuple[int, str]]) -> Callable:
        counter = self

        @functools.wraps(original)
        def counted(*args, **kwargs):
            depth = getattr(counter._local, "depth", 0)
            if counter._recording and depth == 0:
                counter._record(kind, buffer_tensors(buffer_of(*args, **kwargs)), *group_of(*args, **kwargs))
            counter._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                counter._local.depth = depth

        return counted

    def _record(self, kind: str, tensors: list[torch.Tensor], group_size: int, group: str = WORLD,
                scale: int = 1) -> None:
        """One call of `kind` over `tensors` (each counted `scale` times: a functional all-gather's input)."""
        self.calls[kind] += 1
        self.calls_by_group[kind][group] += 1
        self.group_ranks[kind][group] = group_size
        for tensor in tensors:
            size = tensor.numel() * tensor.element_size() * scale
            name = dtype_name(tensor.dtype)
            self.bytes[kind] += size
            self.bytes_by_dtype[kind][name] += size
            self.element_bytes[name] = tensor.element_size()
            self.bytes_by_group_size[kind][group_size] += size
            self.bytes_by_group[kind][group] += size

    # ---- use --------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def counting(self, record: bool = True, sample_functional: bool = False) -> Iterator[None]:
        """Count the collectives issued in the body (one training step) when `record`; with
        `sample_functional` (and `install_functional`), count its functional collectives too (an untimed step:
        the dispatch mode slows every operator)."""
        self._recording = record
        sampling = contextlib.nullcontext()
        if sample_functional and self.functional is not None:
            sampling = FunctionalCollectiveMode(self.functional)
        try:
            with sampling:
                yield
        finally:
            self._recording = False
            if record:
                self.steps += 1
            if sample_functional and self.functional is not None:
                self.functional.steps += 1

    def per_step(self) -> dict[str, dict[str, Any]]:
        """Means per counted step, per collective type:
        {"bytes": nccl-tests size, "calls": calls,
         "dtypes": {dtype name: {"bytes": size in that dtype, "element_bytes": its bytes per element}},
         "bytes_by_group_size": {ranks in the group (as text, a JSON key): size among that many ranks},
         "by_group": {group label: {"calls": calls, "bytes": size}}, "group_ranks": {group label: its ranks}}"""
        means = self._means()
        if self.functional is not None and self.functional.steps:
            for kind, figures in self.functional._means().items():
                means[kind] = _merged(means[kind], figures) if kind in means else figures
        return {kind: means[kind] for kind in sorted(means)}

    def _means(self) -> dict[str, dict[str, Any]]:
        if not self.steps:
            return {}
        steps = self.steps
        return {kind: {"bytes": self.bytes[kind] / steps, "calls": self.calls[kind] / steps,
                       "dtypes": {name: {"bytes": size / steps, "element_bytes": self.element_bytes[name]}
                                  for name, size in sorted(self.bytes_by_dtype[kind].items())},
                       "bytes_by_group_size": {str(group): size / steps
                                               for group, size in sorted(self.bytes_by_group_size[kind].items())},
                       "by_group": {group: {"calls": self.calls_by_group[kind][group] / steps,
                                            "bytes": self.bytes_by_group[kind][group] / steps}
                                    for group in sorted(self.calls_by_group[kind])},
                       "group_ranks": dict(sorted(self.group_ranks[kind].items()))}
                for kind in self.calls}


def _merged(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two per-step means of one collective type added: numbers add, nested figures add key by key."""
    merged = dict(a)
    for key, value in b.items():
        if key not in merged:
            merged[key] = value
        elif key == "group_ranks":          # a group's size, not a count: the same group has the same size
            merged[key] = {**merged[key], **value}
        elif isinstance(value, dict):
            merged[key] = _merged(merged[key], value)
        elif key == "element_bytes":
            merged[key] = value
        else:
            merged[key] = merged[key] + value
    return merged


class FunctionalCollectiveMode(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts `torch.ops._c10d_functional` collectives into `counter` while entered."""

    def __init__(self, counter: CollectiveCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        from torch.distributed.tensor import DTensor

        if any(issubclass(kind, DTensor) for kind in types):
            return NotImplemented        # DTensor decomposes it; its plain-tensor collectives come back here
        packet = getattr(func, "overloadpacket", None)
        if packet is not None and getattr(packet, "_qualified_op_name", "").startswith("_c10d_functional::"):
            name = packet._qualified_op_name.split("::", 1)[1]
            if name in FUNCTIONAL_COLLECTIVES:
                self._record(name, args)
        return func(*args, **kwargs)

    def _record(self, name: str, args: tuple) -> None:
        import torch.distributed as dist

        kind, position = FUNCTIONAL_COLLECTIVES[name]
        group_name = args[-1]
        size = dist.distributed_c10d._resolve_process_group(group_name).size()
        # An all-gather's size is its output: the input from every rank of the group.
        self.counter._record(kind, buffer_tensors(args[0]), size, group_label(group_name, size),
                             scale=size if position == -1 else 1)
