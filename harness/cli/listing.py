"""`harness list`: the matrices, workloads and strategies the registries hold, one line each (`command_list`).
Named listing, not list: harness.cli imports each command's module by name, and `list` would shadow the builtin.

    python -m harness list
"""

from __future__ import annotations

import argparse

from harness.matrix import MATRICES


def add_parser(commands: argparse._SubParsersAction) -> None:
    listing = commands.add_parser("list", help="matrices, workloads and strategies")
    listing.set_defaults(handler=command_list)


def command_list(args: argparse.Namespace) -> int:
    from harness.strategies import STRATEGIES
    from workloads import WORKLOADS

    print("matrices:")
    for name, function in MATRICES.items():
        print(f"  {name:<14} {(function.__doc__ or '').strip().splitlines()[0]}")
    print("workloads:")
    for name, workload in WORKLOADS.items():
        print(f"  {name:<14} {workload.family.value:<7} {workload.layer_count:>3} layers  "
              f"{workload.train_flops_per_sample:.3g} train FLOPs/sample")
    print("strategies:")
    for name, strategy in STRATEGIES.items():
        options = ", ".join(f"{k}={v.default}" for k, v in strategy.options.items())
        print(f"  {name:<14} {strategy.launcher:<11} {strategy.description}"
              + (f"  [options: {options}]" if options else ""))
    return 0
