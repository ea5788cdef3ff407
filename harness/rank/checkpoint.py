"""Saving and loading a rank's training state the way each library documents it, and which rank wrote which file.

- `dcp` (DDP, FSDP2, tensor parallelism, FSDP2 x TP): PyTorch Distributed Checkpoint with the
  `torch.distributed.checkpoint.state_dict` helpers (`get_state_dict` / `set_state_dict`), every rank writing
  `__{rank}_{n}.distcp` and rank 0 the `.metadata` (torch/distributed/checkpoint/filesystem.py). Replicated
  tensors are written once: DCP's default planner spreads them over the ranks (`dedup_save_plans`). It loads at
  any world size, resharding each tensor to the loading ranks' layout.
- `deepspeed` (ZeRO-1/2/3, pipeline): `engine.save_checkpoint` / `engine.load_checkpoint` under one tag; every
  data-parallel rank writes its optimizer partition `zero_pp_rank_{dp}_mp_rank_{mp}_optim_states.pt` (ZeRO-3 its
  `..._model_states.pt` too), data-parallel rank 0 the module's `mp_rank_{mp}_model_states.pt` (the pipeline:
  `layer_{i}-model_states.pt` per stage).
- `horovod rank 0`: Horovod's recipe (examples/pytorch/pytorch_imagenet_resnet50.py): rank 0 `torch.save`s the
  model and optimizer state; on load rank 0 reads it and `broadcast_optimizer_state` / `broadcast_parameters`
  hand it to the others, at whatever world size loads it.
- `torch.save`: the single-process loops (plain, DataParallel).

A planted bug (harness.rank.faults, `checkpoint-without-optimizer`) leaves the optimizer's state out of the save and
the load, as a checkpoint that forgets AdamW's moments and step count would: the resumed run must then differ.
"""

from __future__ import annotations

import abc
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:      # the strategies' registry imports this module
    from harness.strategies.base import Trainer

TORCH_SAVE_FILE = "state.pt"
DEEPSPEED_TAG = "parbench"


class CheckpointMethod(abc.ABC):
    """One library's save and load of a trainer's model and optimizer state in `directory`."""

    name: ClassVar[str]
    reshards: ClassVar[bool] = False       # loads at another world size than the one that saved

    @abc.abstractmethod
    def save(self, trainer: Trainer, directory: Path, *, optimizer: bool = True) -> None:
        """Write this rank's part of the state (every rank calls it)."""

    def async_save(self, trainer: Trainer, directory: Path) -> Any:
        """Start a save the training loop does not wait for and return what finishes it (`.result()`), or None where
        the library has none."""
        return None

    @abc.abstractmethod
    def load(self, trainer: Trainer, directory: Path, *, optimizer: bool = True) -> None:
        """Read this rank's part of the state back into `trainer` (every rank calls it)."""

    def payload(self, directory: Path) -> dict[str, int]:
        """{file relative to `directory`: the bytes of tensor data it holds}, without the format's own bytes: each
        file torch.save wrote, read back (memory-mapped) for its distinct storages."""
        found = {}
        for path in sorted(directory.rglob("*.pt")):
            found[path.relative_to(directory).as_posix()] = _storage_bytes(
                torch.load(path, map_location="cpu", mmap=True, weights_only=False))
        return found

    def writer_of(self, relative: str) -> int | None:
        """The rank that wrote the file at `relative` (a path inside the checkpoint's folder) where its name says
        so; None where only `torch.save`'s record (`SavedFiles`) knows."""
        return None


class DistributedCheckpoint(CheckpointMethod):
    name = "dcp"
    reshards = True
    _RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp$")

    def save(self, trainer, directory, *, optimizer=True):
        import torch.distributed.checkpoint as dcp

        dcp.save(_dcp_state(trainer, optimizer), checkpoint_id=str(directory))

    def async_save(self, trainer, directory):
        import torch.distributed.checkpoint as dcp

        # A process group of its own: the save's collectives run in DCP's thread while the training loop issues its
        # own on the default group (torch's async checkpointing recipe).
        group = torch.distributed.new_group(backend="gloo")
        return dcp.async_save(_dcp_state(trainer, True), checkpoint_id=str(directory), process_group=group)

    def load(self, trainer, directory, *, optimizer=True):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = _dcp_state(trainer, optimizer)      # the loading ranks' own layout: DCP reshards into it
        dcp.load(state, checkpoint_id=str(directory))
        set_state_dict(trainer.model, trainer.optimizer if optimizer else [], model_state_dict=state["model"],
                       optim_state_dict=state.get("optimizer", {}))

    def payload(self, directory):
        return {**super().payload(directory), **_dcp_payload(directory)}

    def writer_of(self, relative):
        found = self._RANK_FILE.search(relative)
        return int(found[1]) if found else 0 if relative == ".metadata" else None


def _dcp_payload(directory: Path) -> dict[str, int]:
    """{file: tensor bytes} from DCP's .metadata: each written piece's elements x its dtype's size, in its file."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(directory)).read_metadata()
    found: dict[str, int] = {}
    for index, stored in metadata.storage_data.items():
        item = metadata.state_dict_metadata[index.fqn]
        if not isinstance(item, TensorStorageMetadata):
            continue            # a pickled value (a param group's settings)
        chunk = next(c for c in item.chunks if index.offset is None or tuple(c.offsets) == tuple(index.offset))
        elements = 1
        for size in chunk.sizes:
            elements *= size
        found[stored.relative_path] = found.get(stored.relative_path, 0) + elements * item.properties.dtype.itemsize
    return found


def _storage_bytes(value: Any) -> int:
    """The bytes of the distinct tensor storages anywhere in `value` (dicts, lists, tuples, tensors)."""
    seen: dict[int, int] = {}

    def walk(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, dict):
            for member in item.values():
                walk(member)
        elif isinstance(item, (list, tuple)):
            for member in item:
                walk(member)

    walk(value)
    return sum(seen.values())


def _dcp_state(trainer: Trainer, optimizer: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if not optimizer:
        return {"model": get_model_state_dict(trainer.model)}
    model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


class DeepSpeedCheckpoint(CheckpointMethod):
    name = "deepspeed"

    def save(self, trainer, directory, *, optimizer=True):
        # DeepSpeed always saves its optimizer partitions; a load without them is how a checkpoint that forgot
        # them behaves (`load`).
        trainer.engine.save_checkpoint(str(directory), tag=DEEPSPEED_TAG)

    def load(self, trainer, directory, *, optimizer=True):
        path, _ = trainer.engine.load_checkpoint(str(directory), tag=DEEPSPEED_TAG, load_optimizer_states=optimizer,
                                                 load_lr_scheduler_states=optimizer)
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint tagged {DEEPSPEED_TAG!r} in {directory}")


class HorovodRankZero(CheckpointMethod):
    name = "horovod rank 0"
    reshards = True     # the whole state in one file, which rank 0 reads and broadcasts to however many ranks load it

    def save(self, trainer, directory, *, optimizer=True):
        if trainer.context.rank == 0:
            torch.save(_whole_state(trainer, optimizer), directory / TORCH_SAVE_FILE)

    def load(self, trainer, directory, *, optimizer=True):
        hvd = trainer.hvd
        if trainer.context.rank == 0:
            _load_whole_state(trainer, torch.load(directory / TORCH_SAVE_FILE, weights_only=True), optimizer)
        # The optimizer's state first: on a rank whose optimizer has none yet, `broadcast_optimizer_state` makes it
        # with a step on zero gradients, which AdamW's weight decay turns into a change of every weight. Horovod's
        # examples broadcast the parameters first, which leaves those ranks' weights one decay off rank 0's
        # (docs/reliability.md); the parameters broadcast after it overwrite that step.
        if optimizer:
            hvd.broadcast_optimizer_state(trainer.optimizer, root_rank=0)
        hvd.broadcast_parameters(trainer.model.state_dict(), root_rank=0)



class TorchSave(CheckpointMethod):
    name = "torch.save"

    def save(self, trainer, directory, *, optimizer=True):
        torch.save(_whole_state(trainer, optimizer), directory / TORCH_SAVE_FILE)

    def load(self, trainer, directory, *, optimizer=True):
        _load_whole_state(trainer, torch.load(directory / TORCH_SAVE_FILE, weights_only=True), optimizer)



def _whole_state(trainer: Trainer, optimizer: bool) -> dict[str, Any]:
    state = {"model": trainer.model.state_dict()}
    if optimizer:
        state["optimizer"] = trainer.optimizer.state_dict()
    return state


def _load_whole_state(trainer: Trainer, state: dict[str, Any], optimizer: bool) -> None:
    trainer.model.load_state_dict(state["model"])
    if optimizer:
        trainer.optimizer.load_state_dict(state["optimizer"])


METHODS: dict[str, type[CheckpointMethod]] = {method.name: method for method in
                                               (DistributedCheckpoint, DeepSpeedCheckpoint, HorovodRankZero, TorchSave)}


def checkpoint_method(name: str) -> CheckpointMethod:
    return METHODS[name]()


class SavedFiles:
    """The files this rank's `torch.save` calls wrote while in the `with` block: DeepSpeed's checkpoint engine,
    Horovod's rank 0 and the single-process loops all write through it, so a file is counted on the rank that
    wrote it, whatever the library names it."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def __enter__(self) -> "SavedFiles":
        self._save = torch.save

        def recorded(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(f, (str, Path)):
                self.paths.append(str(Path(f).resolve()))
            return self._save(obj, f, *args, **kwargs)

        torch.save = recorded
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.save = self._save


def files_by_rank(method: CheckpointMethod, directory: Path, saved_by_rank: list[list[str]]) -> dict[str, list[int]]:
    """The bytes, files and tensor bytes (`CheckpointMethod.payload`: the state itself, without the formats' own bytes)
    of the checkpoint in `directory` by the rank that wrote each: the rank whose `torch.save` wrote it (`saved_by_rank`,
    each rank's `SavedFiles`), else the rank its name says (`writer_of`), else rank 0, where the coordinator of every
    library here writes what is left (DeepSpeed's `latest` tag file and its zero_to_fp32.py, DCP's .metadata)."""
    world_size = len(saved_by_rank)
    owner = {path: rank for rank, paths in enumerate(saved_by_rank) for path in paths}
    payload = method.payload(directory)
    written = [0] * world_size
    files = [0] * world_size
    data = [0] * world_size
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        relative = path.relative_to(directory).as_posix()
        writer = owner.get(str(path.resolve()), method.writer_of(relative))
        writer = writer if writer is not None and 0 <= writer < world_size else 0
        written[writer] += path.stat().st_size
        files[writer] += 1
        data[writer] += payload.get(relative, 0)
    return {"bytes_by_rank": written, "files_by_rank": files, "tensor_bytes_by_rank": data}
