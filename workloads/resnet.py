"""ResNets (He et al. 2015, "Deep Residual Learning for Image Recognition"), built as a list of layers.

ImageNet members (resnet18, resnet50) follow torchvision's layout (stride in the 3x3 convolution of a
bottleneck, "v1.5"), so their parameter counts equal the published ones (11,689,512 and 25,557,032).
The CIFAR member is the paper's section 4.2 network: 6n+2 layers on 32x32 inputs with parameter-free
(option A) shortcuts; n=3 gives ResNet-20 with 269,722 parameters, small enough for 2 CPU cores.

Training FLOPs per sample (see `training_flops_per_sample`): 2 FLOPs per multiply-accumulate of every
convolution and linear layer in the forward pass, computed from the layer shapes (`layer_plan`), times 3 for forward
plus backward (the backward pass computes gradients for inputs and weights, twice the forward's work;
Kaplan et al. 2020 sec. 2.1). Normalisation, activations and pooling are not counted, as for MFU.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn
from torch.nn import functional as F

from workloads.base import Family, Workload
from workloads.data import image_batch


def _conv_init(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions; the shortcut is a 1x1 projection (ImageNet) or zero padding (CIFAR option A)."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int, shortcut: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.pad_channels = 0
        self.stride = stride
        self.downsample: nn.Module | None = None
        if stride != 1 or in_planes != planes:
            if shortcut == "pad":
                self.pad_channels = planes - in_planes
            else:
                self.downsample = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False),
                                                nn.BatchNorm2d(planes))

    def _shortcut(self, x: torch.Tensor) -> torch.Tensor:
        if self.downsample is not None:
            return self.downsample(x)
        if self.stride != 1 or self.pad_channels:
            x = x[:, :, ::self.stride, ::self.stride]
            half = self.pad_channels // 2
            return F.pad(x, (0, 0, 0, 0, half, self.pad_channels - half))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self._shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand by 4; projection shortcut when shapes change."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int, shortcut: str = "project") -> None:
        super().__init__()
        del shortcut  # bottlenecks always project (the paper's option B)
        out_planes = planes * self.expansion
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_planes, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_planes != out_planes:
            self.downsample = nn.Sequential(nn.Conv2d(in_planes, out_planes, 1, stride, bias=False),
                                            nn.BatchNorm2d(out_planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(out + shortcut)


class Stem(nn.Module):
    def __init__(self, out_planes: int, imagenet: bool) -> None:
        super().__init__()
        if imagenet:  # 7x7/2 convolution then 3x3/2 max-pool: 224 -> 56
            self.conv = nn.Conv2d(3, out_planes, 7, 2, 3, bias=False)
            self.pool: nn.Module = nn.MaxPool2d(3, 2, 1)
        else:         # one 3x3 convolution, no pooling: 32 -> 32
            self.conv = nn.Conv2d(3, out_planes, 3, 1, 1, bias=False)
            self.pool = nn.Identity()
        self.bn = nn.BatchNorm2d(out_planes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(F.relu(self.bn(self.conv(x))))


class Head(nn.Module):
    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


@dataclass(frozen=True, kw_only=True)
class ResNetConfig:
    block: str                  # "basic" or "bottleneck"
    blocks_per_stage: tuple[int, ...]
    widths: tuple[int, ...]     # planes of each stage (before bottleneck expansion)
    image_size: int             # square inputs, pixels
    num_classes: int
    imagenet_stem: bool


class ResNetWorkload(Workload):
    family = Family.RESNET

    def __init__(self, name: str, config: ResNetConfig, published_params: int | None) -> None:
        self.name = name
        self.config = config
        self.published_params = published_params

    def build_layers(self) -> list[nn.Module]:
        c = self.config
        block_type = {"basic": BasicBlock, "bottleneck": Bottleneck}[c.block]
        shortcut = "project" if c.imagenet_stem else "pad"
        layers: list[nn.Module] = [Stem(c.widths[0], c.imagenet_stem)]
        in_planes = c.widths[0]
        for stage, (count, planes) in enumerate(zip(c.blocks_per_stage, c.widths)):
            for index in range(count):
                stride = 2 if stage > 0 and index == 0 else 1
                layers.append(block_type(in_planes, planes, stride, shortcut))
                in_planes = planes * block_type.expansion
        layers.append(Head(in_planes, c.num_classes))
        for layer in layers:
            _conv_init(layer)
        return layers

    @property
    def layer_count(self) -> int:
        return 1 + sum(self.config.blocks_per_stage) + 1   # stem, residual blocks, head

    def input_memory_format(self, device_type: str) -> torch.memory_format:
        """channels_last (NHWC) on CUDA: cuDNN's bf16 and fp16 convolutions run in NHWC, and an NCHW input made
        ResNet-50 in bf16 on an H200 run at half speed (106.2 ms a step against 55.0 with the input alone in
        channels_last, ../shared/gpu-h200 at a3663fd). The input alone: channels_last parameters broke FSDP2's
        and DeepSpeed's flattening there. Row-major on CPU, where the figures are not speed figures."""
        return torch.channels_last if device_type == "cuda" else torch.contiguous_format

    def batch(self, seed, step, indices, device):
        c = self.config
        images, labels = image_batch(seed, step, indices.to(device), 3, c.image_size, c.num_classes)
        return images.contiguous(memory_format=self.input_memory_format(torch.device(device).type)), labels

    @cached_property
    def layer_plan(self) -> tuple[tuple[tuple[int, ...], int], ...]:
        """Each layer's (output for one sample, forward multiply-accumulates), from the config as `build_layers`
        lays it out: a convolution's or pooling's output side is floor((side + 2 padding - kernel) / stride) + 1,
        its MACs `conv2d_macs`, the head's in_features x classes."""
        c = self.config
        side, width = c.image_size, c.widths[0]
        if c.imagenet_stem:     # 7x7/2 convolution, then 3x3/2 max-pool
            conv = output_side(side, 7, 2, 3)
            macs, side = conv2d_macs(3, width, (7, 7), (conv, conv)), output_side(conv, 3, 2, 1)
        else:                   # one 3x3 convolution
            side = output_side(side, 3, 1, 1)
            macs = conv2d_macs(3, width, (3, 3), (side, side))
        plan = [((width, side, side), macs)]
        in_planes = width
        for stage, (count, planes) in enumerate(zip(c.blocks_per_stage, c.widths)):
            for index in range(count):
                stride = 2 if stage > 0 and index == 0 else 1
                out = output_side(side, 3, stride, 1)           # the stride is in a block's 3x3 convolution
                if c.block == "basic":
                    out_planes = planes
                    macs = conv2d_macs(in_planes, planes, (3, 3), (out, out)) + conv2d_macs(planes, planes, (3, 3),
                                                                                             (out, out))
                    projected = c.imagenet_stem and (stride != 1 or in_planes != planes)   # CIFAR pads instead
                else:
                    out_planes = planes * Bottleneck.expansion
                    macs = (conv2d_macs(in_planes, planes, (1, 1), (side, side))
                            + conv2d_macs(planes, planes, (3, 3), (out, out))
                            + conv2d_macs(planes, out_planes, (1, 1), (out, out)))
                    projected = stride != 1 or in_planes != out_planes
                if projected:           # the 1x1 shortcut convolution, with the block's stride
                    shortcut = output_side(side, 1, stride, 0)
                    macs += conv2d_macs(in_planes, out_planes, (1, 1), (shortcut, shortcut))
                plan.append(((out_planes, out, out), macs))
                side, in_planes = out, out_planes
        plan.append(((c.num_classes,), in_planes * c.num_classes))
        return tuple(plan)

    def layer_output_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(shape for shape, _ in self.layer_plan)

    @property
    def forward_macs_per_sample(self) -> int:
        return sum(macs for _, macs in self.layer_plan)

    @property
    def train_flops_per_sample(self) -> float:
        return training_flops_per_sample(self.forward_macs_per_sample)


def training_flops_per_sample(forward_macs: int) -> float:
    """2 FLOPs per multiply-accumulate, x3 for forward + backward (Kaplan et al. 2020, sec. 2.1)."""
    return 3 * 2 * float(forward_macs)


def output_side(side: int, kernel: int, stride: int, padding: int) -> int:
    """The output's side of a square convolution or pooling window over a square input (torch.nn.Conv2d's formula,
    dilation 1)."""
    return (side + 2 * padding - kernel) // stride + 1


def conv2d_macs(in_channels: int, out_channels: int, kernel: tuple[int, int], out_hw: tuple[int, int],
                groups: int = 1) -> int:
    """Multiply-accumulates of one convolution for one sample: Cout x Hout x Wout x (Cin/groups) x kh x kw."""
    return out_channels * out_hw[0] * out_hw[1] * (in_channels // groups) * kernel[0] * kernel[1]


def forward_macs(model: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Multiply-accumulates of convolutions and linear layers in one forward pass of one sample."""
    total = 0

    def count(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        nonlocal total
        if isinstance(module, nn.Conv2d):
            total += conv2d_macs(module.in_channels, module.out_channels, module.kernel_size,
                                 tuple(output.shape[-2:]), module.groups)
        elif isinstance(module, nn.Linear):
            total += output.numel() // output.shape[-1] * module.in_features * module.out_features

    handles = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    try:
        model(torch.zeros(input_shape, device=next(model.parameters()).device))
    finally:
        for handle in handles:
            handle.remove()
    return total


RESNET_CONFIGS = {
    "resnet20-cifar": (ResNetConfig(block="basic", blocks_per_stage=(3, 3, 3), widths=(16, 32, 64),
                                    image_size=32, num_classes=10, imagenet_stem=False), 269_722),
    "resnet18": (ResNetConfig(block="basic", blocks_per_stage=(2, 2, 2, 2), widths=(64, 128, 256, 512),
                              image_size=224, num_classes=1000, imagenet_stem=True), 11_689_512),
    "resnet50": (ResNetConfig(block="bottleneck", blocks_per_stage=(3, 4, 6, 3), widths=(64, 128, 256, 512),
                              image_size=224, num_classes=1000, imagenet_stem=True), 25_557_032),
}
