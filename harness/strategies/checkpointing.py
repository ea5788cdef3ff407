"""Activation checkpointing of whole blocks: the option every strategy takes, and the wrapping they share.

    activation_checkpointing=none      keep every activation (the default)
    activation_checkpointing=blocks    recompute every block's activations in backward (full recomputation)
    activation_checkpointing=every:K   recompute the first block of every K (blocks 0, K, 2K, ...), keep the rest

`every:K` is torchtitan's per-layer selective checkpointing (torchtitan/models/llama3/infra/parallelize.py:
a block is wrapped where its index modulo `selective_ac_option` is 0). A checkpointed block keeps only its
input for backward and runs its forward again there (Korthikanti et al. 2022, "full recomputation").

Always torch's non-reentrant checkpoint (`checkpoint_wrapper(CheckpointImpl.NO_REENTRANT)`), named explicitly:
torch 2.13 still defaults `use_reentrant` to True and only warns, while torch.utils.checkpoint's documentation
recommends False; measured here, it keeps every strategy's losses those of the plain loop, ZeRO-3 included, where
DeepSpeed's own `non_reentrant_checkpoint` crashes (deepspeedai/DeepSpeed#4595). Each strategy wraps where
its library wants the wrapper: before DDP, Horovod, ZeRO and FSDP2 see the model; after tensor parallelism
has split the blocks and before FSDP2 shards them (torchtitan's order: TP, then checkpointing, then
`fully_shard`). The wrapper adds `_checkpoint_wrapped_module` to parameter names, which
`harness.strategies.base.unwrapped_parameter_names` removes.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from torch import nn

from harness.spec import OptionValue, SpecError
from harness.strategies.base import Option, is_block

OPTION_NAME = "activation_checkpointing"
NONE, BLOCKS, EVERY = "none", "blocks", "every:"


def checkpoint_interval(value: OptionValue) -> int:
    """Blocks per checkpointed block: 0 for none, 1 for blocks, K for every:K. SpecError, one line, otherwise."""
    if value in (NONE, None):      # None: rows whose `=none` the command line read as None (before Option.given)
        return 0
    if value == BLOCKS:
        return 1
    if isinstance(value, str) and value.startswith(EVERY):
        count = value[len(EVERY):]
        if count.isdigit() and int(count) >= 1:
            return int(count)
    raise SpecError(f"option {OPTION_NAME}={value!r} is not one of: none, blocks, every:K (K a whole number >= 1)")


ACTIVATION_CHECKPOINTING = Option(NONE, "recompute blocks' activations in backward: none, blocks (every block) "
                                  "or every:K (one block in K)", parse=checkpoint_interval)


def setting(interval: int) -> str:
    """The option's value for an interval, as rows record it."""
    return NONE if not interval else BLOCKS if interval == 1 else f"{EVERY}{interval}"


def interval_of(options: Mapping[str, OptionValue]) -> int:
    """`checkpoint_interval` of a cell's resolved options (0 where its strategy has no such option)."""
    return checkpoint_interval(options.get(OPTION_NAME, NONE))


def checkpointed_blocks(layers: Sequence[nn.Module], interval: int) -> list[nn.Module]:
    """`layers` with the first block of every `interval` blocks wrapped in torch's non-reentrant checkpoint
    (none where `interval` is 0). A new list: the modules inside, and so the parameters, are the same objects."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    if not interval:
        return list(layers)
    wrapped, blocks = [], 0
    for layer in layers:
        if is_block(layer):
            if blocks % interval == 0:
                layer = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            blocks += 1
        wrapped.append(layer)
    return wrapped


def count_checkpointed(layers: Sequence[nn.Module], interval: int) -> int:
    """How many of `layers`' blocks `checkpointed_blocks` wraps."""
    blocks = sum(1 for layer in layers if is_block(layer))
    return -(-blocks // interval) if interval else 0
