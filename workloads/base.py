"""The contract every workload meets: an ordered list of layers, synthetic batches, a loss and its FLOPs.

A model is an ordered list of layers so that pipeline parallelism can cut it between any two of them;
every other strategy runs the same layers as one `nn.Sequential`. Weights shared between layers (GPT's
tied embedding and output head) are declared as `Tie`s so a pipeline can keep the copies in step.

What a plan needs of a model (parameter counts, which module holds which, each layer's output shape) it reads
without building one: `build_layers_on_meta` builds the layers on the meta device with their initialisation
skipped, and `layer_output_shapes` says each layer's output from the config.

    python -c "from workloads import WORKLOADS; print(WORKLOADS['resnet50'].layer_output_shapes()[:2])"
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

T = TypeVar("T")


def memory_format_name(memory_format: torch.memory_format) -> str:
    """torch's name of a memory format, as rows record it: "contiguous_format", "channels_last"."""
    return str(memory_format).removeprefix("torch.")


class Family(enum.StrEnum):
    RESNET = "resnet"
    GPT = "gpt"
    LLAMA = "llama"
    MOE = "moe"


# What initialisation calls to fill a tensor's values: torch.nn.init's functions (those torch lets a mode see) and the
# Tensor methods they and the modules' reset_parameters end in.
VALUE_FILLS = frozenset({
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
    "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_", "fill_", "zero_"})


class _ValuesSkippedOnMeta(TorchFunctionMode):
    """Returns a meta tensor as it is from a call that would fill its values (`VALUE_FILLS`). A meta tensor has no
    values, but torch still runs the fill's checks there, through its Python reference kernels: ResNet-50's Kaiming
    init took seconds of a dry run, the first such call seconds more to import torch._dynamo."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in VALUE_FILLS:
            filled = args[0] if args else kwargs.get("tensor")      # torch.nn.init passes its tensor by name
            if isinstance(filled, torch.Tensor) and filled.is_meta:
                return filled
        return func(*args, **kwargs)


def build_on_meta(build: Callable[[], T]) -> T:
    """`build()` on the meta device, its initialisation skipped: modules with every parameter's shape, dtype and
    sharing, and no storage or values."""
    with torch.device("meta"), _ValuesSkippedOnMeta():
        return build()


@dataclass(frozen=True)
class Tie:
    """Layer `user` reuses a weight owned by layer `owner` (attribute path `weight_attr` on the owner)."""

    key: str
    owner: int
    user: int
    weight_attr: str
    # How the user layer computes its output from the owner module, for pipelines that hold a copy of
    # the owner rather than the user layer itself.
    user_forward: Callable[[nn.Module, torch.Tensor], torch.Tensor]


class Workload(abc.ABC):
    """A model family member plus its data; instances live in `workloads.WORKLOADS`."""

    name: str
    family: Family
    # From the paper or reference implementation. A workload may differ from it by design (GPT-2's padded
    # vocabulary rows); a row records both this and the model's own count (`parameters`).
    published_params: int | None = None

    @abc.abstractmethod
    def build_layers(self) -> list[nn.Module]:
        """Fresh layers, initialised from torch's global RNG (the caller seeds it)."""

    @property
    @abc.abstractmethod
    def layer_count(self) -> int:
        """len(build_layers()), known without building them (pipelines validate stage counts with it)."""

    def ties(self) -> tuple[Tie, ...]:
        return ()

    def build_model(self) -> nn.Sequential:
        return nn.Sequential(*self.build_layers())

    def build_layers_on_meta(self) -> list[nn.Module]:
        """The layers' shapes without their memory or initialisation (`build_on_meta`): what a plan counts."""
        return build_on_meta(self.build_layers)

    def layer_output_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Each layer's output for one sample, its batch dimension left out, in layer order: what a pipeline sends
        where it is cut (harness.strategies.pipeline_traffic). Default: one sample's forward on the meta device
        (shapes, no values), which a family overrides with the shapes its config gives, as the families here do."""
        x, _ = self.batch(0, 0, torch.arange(1, device="meta"), torch.device("meta"))
        shapes = []
        with torch.no_grad():
            for layer in self.build_layers_on_meta():
                x = layer(x)
                shapes.append(tuple(x.shape[1:]))
        return tuple(shapes)

    @abc.abstractmethod
    def batch(self, seed: int, step: int, indices: torch.Tensor,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) for the given global sample indices of a step, made on `device`."""

    def input_memory_format(self, device_type: str) -> torch.memory_format:
        """How `batch` lays its inputs out in memory on a device of this type ("cpu", "cuda"): row-major unless a
        workload says otherwise. Only the inputs: the parameters stay as built, which every wrapper can flatten."""
        return torch.contiguous_format

    def precision_refusal(self, precision: str) -> str | None:
        """Why this workload cannot train in `precision` ("fp32", "bf16", "fp16"), or None: every precision by
        default."""
        return None

    def scale_auxiliary_losses(self, layers: list[nn.Module], factor: float) -> None:
        """Tell the layers the factor a trainer multiplies each micro-batch's loss by (1 / its micro-batches), for
        a loss term they send to the gradients themselves (workloads.moe's load-balancing loss). None by default."""

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy; outputs are logits (N, classes) or (N, T, vocab)."""
        return nn.functional.cross_entropy(outputs.flatten(0, -2).float(), targets.flatten())

    @property
    @abc.abstractmethod
    def train_flops_per_sample(self) -> float:
        """Analytic matmul FLOPs of one sample's forward and backward pass (see each family's formula)."""

    @property
    def tokens_per_sample(self) -> int | None:
        """Tokens in one sample for language models; None for images."""
        return None

    def describe(self) -> dict[str, object]:
        """What a row records about the workload besides its name."""
        return {"family": self.family.value, "train_flops_per_sample": self.train_flops_per_sample,
                "tokens_per_sample": self.tokens_per_sample, "published_parameters": self.published_params}


def count_parameters(model: nn.Module) -> int:
    """Distinct trainable parameters; a tied weight counts once (as in the published figures)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
