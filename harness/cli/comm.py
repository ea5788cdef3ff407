"""`harness comm`: its arguments, `command_comm` (the collective microbenchmark, harness.commbench, launched here or
across an emulated cluster) and the refusal of more CPU ranks than this machine's cores time fairly.

    python -m harness comm --world-size 2 --device cpu --min-bytes 1K --max-bytes 64K
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from pathlib import Path

from harness.cli.arguments import _bytes, _csv, add_device_argument, add_emulation_arguments, add_timeout_argument
from harness.emulate.network import EmulatedNetwork
from harness.emulate.session import check_emulation
from harness.machine import Machine
from harness.outputs import check_results_file
from harness.spec import DeviceKind, SpecError

# `comm` on CPU refuses more ranks a core than this without --oversubscribe: 64 ranks on this 2-core machine ran on for
# 19 minutes after their parent was killed, timing nothing but the cores' sharing. 4 leaves the emulated clusters'
# layouts (8 ranks on 8 namespace nodes of 2 cores) and a 2-rank check on one core.
COMM_RANKS_PER_CORE = 4


def add_parser(commands: argparse._SubParsersAction) -> None:
    comm = commands.add_parser("comm", help="collective microbenchmark: time, algbw, busbw per size")
    comm.set_defaults(handler=command_comm)
    comm.add_argument("--world-size", type=int, default=2)
    add_device_argument(comm)
    comm.add_argument("--collectives", type=_csv, help="default: all_reduce, all_gather, reduce_scatter, "
                      "broadcast, all_to_all")
    comm.add_argument("--min-bytes", type=_bytes, default=1024, help="smallest size (default 1K)")
    comm.add_argument("--max-bytes", type=_bytes, default=16 << 20, help="largest size (default 16M)")
    comm.add_argument("--warmup", type=int, default=5)
    comm.add_argument("--iters", type=int, default=20)
    comm.add_argument("--out", type=Path, help="results JSONL (default: results/comm-<time>.jsonl)")
    add_timeout_argument(comm, default=600.0, help="seconds before the benchmark's ranks are killed")
    add_emulation_arguments(comm, link="across the nodes of an emulated cluster (root), links shaped to RATE (e.g. "
                            "100mbit), the ranks spread evenly over the nodes")
    comm.add_argument("--group-size", type=int, default=0, help="split the ranks into groups of this many, each "
                      "running the collectives among its members at the same time as the others (default: the world)")
    comm.add_argument("--group-layout", default="contiguous", help="with --group-size: contiguous (consecutive "
                      "ranks: inside a node) or strided (ranks world-size / group-size apart: across nodes)")
    comm.add_argument("--oversubscribe", action="store_true", help=f"on CPU, run more than {COMM_RANKS_PER_CORE} "
                      "ranks a core (refused otherwise: their timings measure the cores' sharing)")


def command_comm(args: argparse.Namespace) -> int:
    from harness import commbench

    collectives = args.collectives or commbench.COLLECTIVES
    unknown = [c for c in collectives if c not in commbench.COLLECTIVES]
    if unknown:
        raise SpecError(f"unknown collective {unknown[0]!r}; known: {', '.join(commbench.COLLECTIVES)}")
    if args.world_size < 2:
        raise SpecError(f"--world-size must be >= 2 for a collective benchmark, got {args.world_size}")
    if args.warmup < 0 or args.iters < 1:
        raise SpecError(f"--warmup must be >= 0 and --iters >= 1, got {args.warmup} and {args.iters}")
    try:
        commbench.sizes_between(args.min_bytes, args.max_bytes)
        if args.group_size:
            commbench.groups_of(args.world_size, args.group_size, args.group_layout)
    except ValueError as error:
        raise SpecError(str(error)) from None
    machine = Machine.detect(args.device)
    device = machine.device
    check_comm_ranks(args.world_size, machine, oversubscribe=args.oversubscribe)
    emulated = EmulatedNetwork.planned(args.emulate_link, args.emulate_nodes) if args.emulate_link else None
    if emulated is not None:
        check_emulation(emulated, ())
    out = args.out or Path("results") / f"comm-{datetime.now():%Y%m%d-%H%M%S}.jsonl"
    check_results_file(out, "--out" if args.out else "results file")
    print(f"parbench: collective benchmark at world size {args.world_size} on {device.value} -> {out}",
          file=sys.stderr)
    try:
        if emulated is None:
            rows = commbench.run(args.world_size, device.value, collectives, args.min_bytes, args.max_bytes,
                                 args.warmup, args.iters, out, args.timeout, group_size=args.group_size,
                                 group_layout=args.group_layout)
        else:
            from harness.emulate.network import emulated_network

            print(f"parbench: on {emulated.describe()}", file=sys.stderr)
            with emulated_network(emulated):
                rows = commbench.run(args.world_size, device.value, collectives, args.min_bytes, args.max_bytes,
                                     args.warmup, args.iters, out, args.timeout, emulated=emulated,
                                     group_size=args.group_size, group_layout=args.group_layout)
    except commbench.BenchmarkFailed as error:
        print(f"parbench: error: {error}", file=sys.stderr)
        return 1
    print(commbench.format_table(rows))
    print(f"\nrow appended to {out}")
    return 0


def check_comm_ranks(world_size: int, machine: Machine, *, oversubscribe: bool) -> None:
    """On CPU, where every rank of `comm` runs on this machine's cores (an emulated cluster's nodes too): a warning
    where the ranks outnumber them, as `run` warns, and one line refusing more than COMM_RANKS_PER_CORE a core
    unless `oversubscribe`, before anything starts."""
    if machine.device is not DeviceKind.CPU:
        return
    cores = machine.devices_per_node
    if world_size > COMM_RANKS_PER_CORE * cores and not oversubscribe:
        share = f"{world_size / cores:.2f}".rstrip("0").rstrip(".")      # 9 on 2 cores: 4.5, not a rounded 4
        share = share if float(share) * cores == world_size else f"about {share}"
        raise SpecError(f"--world-size {world_size} puts {share} ranks on each of this machine's "
                        f"{cores} cores, over {COMM_RANKS_PER_CORE}: their timings would measure the cores' sharing; "
                        "--oversubscribe runs it anyway")
    if world_size > cores:
        print(f"parbench: warning: {world_size} ranks on this machine's {cores} cores: the collectives' times measure "
              "the cores' sharing, not the link", file=sys.stderr)
