"""torch.compile of whole blocks: the option the strategies that can compile take, and the wrapping they share.

    compile=false    eager (the default)
    compile=true     each block compiled with torch.compile (inductor: C++ on CPU, Triton on GPUs)

Per block, as torchtitan compiles (torchtitan/models/llama3/infra/parallelize.py, `apply_compile`: every
transformer block `torch.compile`d on its own, after tensor parallelism and activation checkpointing and
before `fully_shard`): the blocks are where the time is, one graph serves them all (they run the same code,
and torch 2.13 treats a module's parameters as the graph's inputs), and the hooks of the wrapper around them
(DDP's reducer, FSDP2's gathers, Horovod's) stay outside the graph, where each library expects them. The
embedding and the head run eager. DeepSpeed's ZeRO engine is the exception: it compiles the module it was given
through its own `engine.compile()` (harness.strategies.zero).

Compilation happens in the first warm-up step, and a recompile later in the warm-up (a hook the parity probe or
the census adds) is absorbed there too; the worker records the compile seconds and counts any frame compiled
inside the timed steps (`CompileCounter`), so a step that recompiled is reported, never averaged in unseen.
The compiled module is `torch._dynamo.eval_frame.OptimizedModule`, whose `_orig_mod.` in parameter names
`harness.strategies.base.unwrapped_parameter_names` removes, and which `is_block` sees through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from torch import nn

from harness.spec import OptionValue
from harness.strategies.base import Option, is_block

OPTION_NAME = "compile"

COMPILE = Option(False, "torch.compile each block (inductor), as torchtitan does", choices=(False, True))


def compiles(options: Mapping[str, OptionValue]) -> bool:
    """Whether a cell's resolved options compile (False where its strategy has no such option)."""
    return bool(options.get(OPTION_NAME, False))


def compiled_blocks(layers: Sequence[nn.Module], compile_them: bool) -> list[nn.Module]:
    """`layers` with every block replaced by its `torch.compile`d module (none where not `compile_them`). A new
    list; the parameters are the same objects, so an optimizer or wrapper built afterwards sees them."""
    import torch

    if not compile_them:
        return list(layers)
    return [torch.compile(layer) if is_block(layer) else layer for layer in layers]


@dataclass(frozen=True)
class CompileReading:
    """What torch.compile had done by one point of a rank's run: seconds spent compiling (dynamo's own account,
    tracing and inductor's code generation, forward and backward), frames compiled, graph breaks."""

    seconds: float
    frames: int
    graph_breaks: int
    # Graphs inductor took from its on-disk cache (TORCHINDUCTOR_CACHE_DIR) rather than generating: a warm cache
    # cuts a compile's seconds by a factor of ten, so the row says which it had.
    cache_hits: int

    @classmethod
    def now(cls) -> "CompileReading":
        from torch._dynamo.utils import calculate_time_spent, counters

        return cls(seconds=float(calculate_time_spent().get("total_wall_time", 0.0)),
                   frames=int(counters["frames"]["ok"]),
                   graph_breaks=int(sum(counters["graph_break"].values())),
                   cache_hits=int(counters["inductor"]["fxgraph_cache_hit"]))


def blocks_as_run(layers: Sequence[nn.Module], options: Mapping[str, OptionValue]) -> list[nn.Module]:
    """`layers` as a cell's resolved `options` run its blocks: checkpointed (harness.strategies.checkpointing), then
    compiled, in torchtitan's order (a compiled graph holds the checkpoint's recomputation)."""
    from harness.strategies.checkpointing import checkpointed_blocks, interval_of

    return compiled_blocks(checkpointed_blocks(layers, interval_of(options)), compiles(options))


def compile_figures(compiled: bool, readings_by_rank: list[dict[str, dict[str, float]]]) -> dict[str, object]:
    """A row's compile figures from each rank's `CompileReading`s (as dicts) at its first timed step's start
    ("timed_start") and after its last ("timed_end"): the seconds compiling and the frames compiled before the timed
    steps (the warm-up absorbs them), the frames compiled inside them (a recompile there is in some step's time, so
    it is counted and reported, never averaged in unseen) and graph breaks; `compiled: false` where not compiled."""
    if not compiled:
        return {"compiled": False}
    if any("timed_start" not in reading for reading in readings_by_rank):   # a launch that stopped before them
        return {"compiled": True, "compile_unmeasured_because": "no timed step ran"}
    return {"compiled": True,
            "compile_seconds_by_rank": [reading["timed_start"]["seconds"] for reading in readings_by_rank],
            "compiled_frames_by_rank": [reading["timed_start"]["frames"] for reading in readings_by_rank],
            "recompiles_in_timed_steps_by_rank": [reading["timed_end"]["frames"] - reading["timed_start"]["frames"]
                                                  for reading in readings_by_rank],
            "graph_breaks_by_rank": [reading["timed_end"]["graph_breaks"] for reading in readings_by_rank],
            "compile_cache_hits_by_rank": [reading["timed_start"]["cache_hits"] for reading in readings_by_rank]}
