"""Parallelisation strategies, one module each, in one literal registry.

    python -m harness list
    PARBENCH_EXTRA_STRATEGIES=my_strategies.py:STRATEGIES python -m harness run --strategy plain,mine

A strategy kept outside this package (a user's own, or a test's toy) joins the registry by name: the
variable names a Python file and a dict {name: Strategy} in it. It is read when this registry is
imported, in the harness and in every rank it launches (they inherit the variable, and rows record it),
so the strategy runs through matrix, launch, worker and report like a built-in one. Nothing scans folders.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Mapping

from harness.launch.launcher import LAUNCHERS
from harness.strategies.autotp import AutoTP
from harness.strategies.bare import Bare
from harness.strategies.cp import ContextParallel
from harness.spec import Layout, OptionValue, RunSpec, SpecError
from harness.strategies.base import Option, PrecisionRecipe, RankContext, Strategy, Trainer
from harness.strategies.compiling import compiles
from harness.strategies.dataparallel import DataParallel
from harness.strategies.ddp import DDP
from harness.strategies.deepspeed_moe import DeepSpeedMoE
from harness.strategies.ep import ExpertParallel
from harness.strategies.fsdp2 import FSDP2
from harness.strategies.fsdp2_tp import FSDP2TensorParallel
from harness.strategies.horovod import Horovod
from harness.strategies.horovod_ep import HorovodExpertParallel
from harness.strategies.parameter_server import ParameterServer
from harness.strategies.parameter_server_async import AsyncParameterServer
from harness.strategies.pipeline import Pipeline
from harness.strategies.plain import Plain
from harness.strategies.tp import TensorParallel
from harness.strategies.ulysses import Ulysses
from harness.strategies.state_checkpoint import (OPTION_NAME as CHECKPOINT_OPTION, check_plan, plan_of, saving_spec,
                                              shrunk_spec)
from harness.strategies.zero import ZeRO
from harness.rank.checkpoint import METHODS
from workloads import get_workload

STRATEGIES: dict[str, Strategy] = {
    "plain": Plain(),
    "bare": Bare(),
    "dataparallel": DataParallel(),
    "ddp": DDP(),
    "horovod": Horovod(),
    "zero1": ZeRO(stage=1),
    "zero2": ZeRO(stage=2),
    "zero3": ZeRO(stage=3),
    "fsdp2": FSDP2(),
    "pipeline": Pipeline(),
    "tp": TensorParallel(),
    "fsdp2-tp": FSDP2TensorParallel(),
    "autotp": AutoTP(),
    "ps": ParameterServer(),
    "ps-async": AsyncParameterServer(),
    "ep": ExpertParallel(),
    "horovod-ep": HorovodExpertParallel(),
    "deepspeed-moe": DeepSpeedMoE(),
    "ulysses": Ulysses(),
    "cp": ContextParallel(),
}


EXTRA_STRATEGIES_ENV = "PARBENCH_EXTRA_STRATEGIES"


def check_launcher(name: str, strategy: Strategy) -> None:
    """A strategy's launcher must be a key of the launcher registry (harness.launch.launcher.LAUNCHERS)."""
    if getattr(strategy, "launcher", None) not in LAUNCHERS:
        raise SpecError(f"strategy {name!r} names launcher {getattr(strategy, 'launcher', None)!r}; "
                        f"known launchers: {', '.join(LAUNCHERS)}")


def register(extra: Mapping[str, Strategy]) -> None:
    """Add strategies to the registry; a name already taken is an error, never a silent replacement."""
    for name, strategy in extra.items():
        if name in STRATEGIES and STRATEGIES[name] is not strategy:
            raise SpecError(f"strategy {name!r} is already registered; choose another name")
        if not isinstance(strategy, Strategy):
            raise SpecError(f"{EXTRA_STRATEGIES_ENV}: {name!r} is not a harness Strategy")
        check_launcher(name, strategy)
        STRATEGIES[name] = strategy


def _register_from_environment() -> None:
    """Read `FILE.py:DICT[,FILE.py:DICT]` from PARBENCH_EXTRA_STRATEGIES."""
    for entry in filter(None, os.environ.get(EXTRA_STRATEGIES_ENV, "").split(",")):
        path, _, attribute = entry.rpartition(":")
        if not path or not Path(path).is_file():
            raise SpecError(f"{EXTRA_STRATEGIES_ENV}={entry!r}: expected FILE.py:DICT naming an existing file")
        module_spec = importlib.util.spec_from_file_location(f"parbench_extra_{Path(path).stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module     # before it runs: its dataclasses look themselves up there
        module_spec.loader.exec_module(module)
        register(getattr(module, attribute))


def get_strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise SpecError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}") from None


# A compiled cell's warm-up: the first step compiles, the second absorbs the recompile a hook added in the first
# (the parity probe, the census) may cause (harness.strategies.compiling). With fewer, a timed step times the
# compiler: `--warmup-steps 0` on gpt-tiny timed a first step of 6,023 ms beside a median of 61.4.
COMPILE_WARMUP_STEPS = 2


def checked(spec: RunSpec) -> RunSpec:
    """`spec`, once what needs the registries holds (harness.spec checks the fields alone): its workload and
    strategy exist, the strategy takes its options and its rules (`Strategy.validate`), and the global batch
    splits into the strategy's data-parallel replicas and micro-batches. SpecError, one line, otherwise."""
    refusal = get_workload(spec.workload).precision_refusal(spec.precision.value)
    if refusal:
        raise SpecError(refusal)
    strategy = get_strategy(spec.strategy)
    strategy.check_options(spec.options_dict)
    if compiles(spec.options_dict) and spec.warmup_steps < COMPILE_WARMUP_STEPS:
        raise SpecError(f"compile=true needs --warmup-steps of at least {COMPILE_WARMUP_STEPS} (got {spec.warmup_steps}):"
                        f" the first step compiles and the next may recompile, and a timed step that compiles times "
                        f"the compiler")
    strategy.validate(spec)
    plan = plan_of(spec) if CHECKPOINT_OPTION in strategy.options else None
    if plan is not None:
        check_plan(spec, plan, reshards=METHODS[strategy.checkpoint_method].reshards, method=strategy.checkpoint_method)
        if plan.from_world_size is not None:
            checked(saving_spec(spec, plan))      # the launch that saves must be a valid cell of its own
        if plan.leave_step is not None:
            checked(shrunk_spec(spec))            # and so must the cell the ranks left go on with
    layout = strategy.layout(spec)
    denominator = layout.data_parallel * spec.micro_batch
    if spec.global_batch % denominator:
        raise SpecError(f"global_batch {spec.global_batch} must be divisible by data-parallel size x micro_batch "
                        f"= {layout.data_parallel} x {spec.micro_batch} = {denominator}")
    return spec


def layout_of(spec: RunSpec) -> Layout:
    """How the cell's strategy splits its global batch."""
    return get_strategy(spec.strategy).layout(spec)


def resolved_options(spec: RunSpec) -> dict[str, OptionValue]:
    """The cell's strategy options, its defaults included."""
    return get_strategy(spec.strategy).resolved(spec)


for _name, _strategy in STRATEGIES.items():    # the built-ins are held to the check extras get
    check_launcher(_name, _strategy)
_register_from_environment()

__all__ = ["EXTRA_STRATEGIES_ENV", "STRATEGIES", "Option", "PrecisionRecipe", "RankContext", "Strategy",
           "Trainer", "checked", "get_strategy", "layout_of", "register", "resolved_options"]
