"""The parity probe's instrument: a tensor's norm read the same wherever the tensor lives.

FSDP2's offload_policy keeps gradients on the host, every other strategy on the GPU; on an H200 its first-step
gradient of GPT-2's tied embedding read 0.7% off every other (tests below: the host's float32 reduction, not
FSDP2's arithmetic). The reference here is numpy's float64 pairwise sum, not the code under test.
"""

from __future__ import annotations

import numpy as np
import torch

from harness.strategies.base import NORM_CHUNK_ELEMENTS, squared_norm


def _embedding_like_gradient(elements: int) -> torch.Tensor:
    """Spread as a tied embedding's first gradient is: many tiny values (the head's share of rows no token used)
    and a few rows a hundred times larger (the rows the batch's tokens looked up)."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(elements, generator=generator) * 1e-5
    values[: elements // 100] *= 100
    return values


def _float64_reference(tensor: torch.Tensor) -> float:
    return float(np.sqrt(np.sum(tensor.numpy().astype(np.float64) ** 2)))


def test_a_large_host_tensors_norm_is_exact_in_float64():
    gradient = _embedding_like_gradient(10_000_000)
    expected = _float64_reference(gradient)
    assert abs(float(squared_norm(gradient).sqrt()) / expected - 1) < 1e-12


def test_torch_float32_norm_on_the_host_is_what_read_fsdp2_offload_off():
    # The defect the probe had: the same tensor's float32 norm on the host is off by far more than parity's bf16
    # tolerance by tensor (2e-5). If torch ever sums it exactly, this stops failing and the docs can say so.
    gradient = _embedding_like_gradient(10_000_000)
    expected = _float64_reference(gradient)
    assert abs(float(torch.linalg.vector_norm(gradient, dtype=torch.float32)) / expected - 1) > 1e-4


def test_squared_norm_crosses_chunks_and_takes_any_layout():
    # More elements than a chunk, in a non-contiguous (transposed) view: every element counted once, 3 x 3 each.
    n = NORM_CHUNK_ELEMENTS + 3
    tensor = torch.full((n, 1), 3.0).expand(-1, 2).t()
    assert float(squared_norm(tensor)) == 2 * n * 9
    assert float(squared_norm(torch.empty(0))) == 0.0
