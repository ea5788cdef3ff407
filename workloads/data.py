"""Synthetic batches that are a pure function of (seed, step, global sample index).

Every strategy and world size draws the samples of the global batch it owns from the same function, so a
rank that owns samples 8..15 of step 3 sees exactly what a single process sees for those samples. The
values come from an integer hash evaluated elementwise with torch ops (no generator state), so the same
call gives the same bits on every rank, and a batch is produced in a few vectorised kernels on the device
itself. The data carry learnable structure (a class-dependent pattern in the images, arithmetic
progressions in the token streams) so that losses fall within a few steps and a wrong gradient shows in
the loss parity check.

    python -c "import torch; from workloads.data import token_batch; print(token_batch(0, 0, torch.arange(2), 8, 50))"
"""

from __future__ import annotations

import math

import torch

_MASK32 = 0xFFFFFFFF
# Constants of the "hash32" integer mixer; small enough that x * K stays inside int64 for x < 2**32.
_MIX = 0x45D9F3B
_SALT_LABEL = 0x2545F491
_SALT_STRIDE = 0x3C6EF372
_SALT_NOISE = 0x1B873593


def mix32(x):
    """Integer hash of values in [0, 2**32); works on Python ints and on int64 tensors alike."""
    x = x ^ (x >> 16)
    x = (x * _MIX) & _MASK32
    x = x ^ (x >> 16)
    x = (x * _MIX) & _MASK32
    return x ^ (x >> 16)


def sample_keys(seed: int, step: int, indices: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per global sample index; the only source of randomness in a batch."""
    base = mix32(mix32(seed & _MASK32) ^ (step & _MASK32))
    return mix32(indices.to(torch.int64) ^ base)


def _uniform(keys: torch.Tensor, numel: int, salt: int = 0) -> torch.Tensor:
    """Uniform [0, 1) floats, shape (len(keys), numel), a pure function of the keys."""
    positions = mix32(torch.arange(numel, device=keys.device, dtype=torch.int64) ^ salt)
    bits = mix32(keys[:, None] ^ positions[None, :])
    return bits.to(torch.float32) * (1.0 / 2**32)


def image_batch(seed: int, step: int, indices: torch.Tensor, channels: int, size: int,
                num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (N, C, H, W) float32 and labels (N,) int64 for the given global sample indices.

    Each image is unit-variance noise plus a class-dependent sinusoid across its width, so a CNN can
    learn the labels.
    """
    keys = sample_keys(seed, step, indices)
    labels = mix32(keys ^ _SALT_LABEL) % num_classes
    noise = (_uniform(keys, channels * size * size) - 0.5) * math.sqrt(12.0)
    noise = noise.view(-1, channels, size, size)
    width = torch.arange(size, device=keys.device, dtype=torch.float32) / size
    frequency = (1 + labels % 7).to(torch.float32)[:, None, None, None]
    phase = ((labels // 7) % 16).to(torch.float32)[:, None, None, None] * (2 * math.pi / 16)
    channel = torch.arange(channels, device=keys.device, dtype=torch.float32)[None, :, None, None]
    pattern = torch.sin(2 * math.pi * frequency * width[None, None, None, :] + phase + channel)
    return noise * 0.5 + pattern, labels


def token_batch(seed: int, step: int, indices: torch.Tensor, seq_len: int,
                vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (N, T) and next-token targets (N, T) for the given global sample indices.

    Each stream is an arithmetic progression modulo the vocabulary with 10% of tokens replaced by noise,
    so a transformer can learn to predict the next token from the previous two.
    """
    keys = sample_keys(seed, step, indices)
    start = keys % vocab_size
    stride = 1 + mix32(keys ^ _SALT_STRIDE) % 7
    position = torch.arange(seq_len + 1, device=keys.device, dtype=torch.int64)
    stream = (start[:, None] + stride[:, None] * position[None, :]) % vocab_size
    replace = _uniform(keys, seq_len + 1, _SALT_NOISE) < 0.1
    noise = mix32(keys[:, None] ^ mix32(position[None, :] ^ _SALT_LABEL)) % vocab_size
    stream = torch.where(replace, noise, stream)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def rank_sample_indices(*, replica: int, micro_batch_index: int, micro_batches: int,
                        micro_batch: int) -> torch.Tensor:
    """Global sample indices of one micro-batch of one data-parallel replica.

    Replica-major: replica r's k-th micro-batch holds samples ((r * K + k) * m ... + m). One replica with
    K micro-batches therefore cuts the global batch into the same micro-batches as K replicas with one
    each, which keeps per-micro-batch statistics (BatchNorm) identical across world sizes.
    """
    first = (replica * micro_batches + micro_batch_index) * micro_batch
    return torch.arange(first, first + micro_batch, dtype=torch.int64)
