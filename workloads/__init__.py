"""Workloads: models, synthetic data and analytic FLOPs, in one literal registry.

    python -m harness list
"""

from __future__ import annotations

from workloads.base import Family, Tie, Workload, count_parameters
from workloads.gpt import GPT_CONFIGS, GPTWorkload
from workloads.llama import LLAMA_CONFIGS, LlamaWorkload
from workloads.moe import MOE_CONFIGS, MoEWorkload
from workloads.resnet import RESNET_CONFIGS, ResNetWorkload

WORKLOADS: dict[str, Workload] = {
    "resnet20-cifar": ResNetWorkload("resnet20-cifar", *RESNET_CONFIGS["resnet20-cifar"]),
    "resnet18": ResNetWorkload("resnet18", *RESNET_CONFIGS["resnet18"]),
    "resnet50": ResNetWorkload("resnet50", *RESNET_CONFIGS["resnet50"]),
    "gpt-tiny": GPTWorkload("gpt-tiny", *GPT_CONFIGS["gpt-tiny"]),
    "gpt-tiny-long": GPTWorkload("gpt-tiny-long", *GPT_CONFIGS["gpt-tiny-long"]),
    "gpt2-small": GPTWorkload("gpt2-small", *GPT_CONFIGS["gpt2-small"]),
    "gpt2-medium": GPTWorkload("gpt2-medium", *GPT_CONFIGS["gpt2-medium"]),
    "gpt2-large": GPTWorkload("gpt2-large", *GPT_CONFIGS["gpt2-large"]),
    "gpt2-xl": GPTWorkload("gpt2-xl", *GPT_CONFIGS["gpt2-xl"]),
    "llama-tiny": LlamaWorkload("llama-tiny", *LLAMA_CONFIGS["llama-tiny"]),
    "llama-tiny-long": LlamaWorkload("llama-tiny-long", *LLAMA_CONFIGS["llama-tiny-long"]),
    "llama3.2-1b": LlamaWorkload("llama3.2-1b", *LLAMA_CONFIGS["llama3.2-1b"]),
    "llama3-8b": LlamaWorkload("llama3-8b", *LLAMA_CONFIGS["llama3-8b"]),
    "moe-tiny": MoEWorkload("moe-tiny", *MOE_CONFIGS["moe-tiny"]),
    "mixtral-8x7b": MoEWorkload("mixtral-8x7b", *MOE_CONFIGS["mixtral-8x7b"]),
}


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        from harness.spec import SpecError

        raise SpecError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None


__all__ = ["WORKLOADS", "Family", "Tie", "Workload", "count_parameters", "get_workload"]
