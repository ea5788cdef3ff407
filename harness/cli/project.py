"""`harness project`: its arguments and `command_project`, which hands them to harness.project.run (projections of
step time, throughput, scaling and memory at world sizes not measured, from rows or from a description).

    python -m harness project --params 1.5B --compute-ms 120 --cluster dgx-h100-ib --strategies ddp,zero3
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.cli.arguments import (CLUSTER_PRESETS, _count, _csv, _int_csv, _shape, _strategies,
                                   add_cluster_arguments)
from harness.outputs import check_results_file


def add_parser(commands: argparse._SubParsersAction) -> None:
    project = commands.add_parser("project", help="predict step time, throughput, scaling efficiency and "
                                  "memory per rank at world sizes not measured (harness.project.projection)")
    project.set_defaults(handler=command_project)
    project.add_argument("rows", type=Path, nargs="*", help="results JSONL files with measured cell rows")
    project.add_argument("--comm", type=Path, nargs="+", default=[], help="`harness comm` rows of the host the rows "
                         "ran on: the measured overlap is judged against them; with no --cluster they are the target")
    add_cluster_arguments(project, cluster=f"target: a preset ({CLUSTER_PRESETS}) or a FILE.toml",
                          overrides="override a cluster key, e.g. inter_node_bandwidth_GBps=100 (repeatable)")
    project.add_argument("--algorithm", action="append", default=[], metavar="COLLECTIVE=ALGORITHM",
                         help="force one, e.g. all_reduce=hierarchical (default: each call by the least modelled "
                         "time among the library's algorithms; repeatable)")
    project.add_argument("--library", help="with --cluster: the collective library that runs there, nccl (default), "
                         "gloo or mpi: it decides which algorithms a call can get")
    project.add_argument("--world-sizes", type=_int_csv, help="default: 8,16,...,1024")
    project.add_argument("--scaling", type=_csv, default=("weak", "strong"), help="weak, strong or both (default)")
    project.add_argument("--out", type=Path, help="append the projected rows (kind projection) to this JSONL")
    project.add_argument("--validate", action="store_true", help="predict every measured multi-rank cell of ROWS "
                         "from its setting's world-size-1 cells and --comm rows, without it, and print the errors")
    project.add_argument("--design", default="interpolate", help="with --validate: which cells predict which: "
                         "interpolate (the nearest other world size; default), larger (cells above "
                         "--largest-source ranks from the largest at or below it), across-settings (each cell from "
                         "the same world size at another link rate)")
    project.add_argument("--largest-source", type=int, default=2, help="with --validate --design larger: the "
                         "largest world size a prediction may start from (default 2)")
    project.add_argument("--params", type=_count, help="a description instead of rows: parameters, e.g. 1.5B")
    project.add_argument("--model", help="a description from a preset (its parameters and shape): every transformer "
                         "workload and public shapes (llama3-70b, gpt3-175b, ...)")
    project.add_argument("--compute-ms", type=float, help="with --params: compute time of one step on one device "
                         "(default, with --shape and a --cluster naming its gpu: FLOPs / (peak x --mfu), as plan)")
    project.add_argument("--mfu", type=float, help="with --params --shape and no --compute-ms: fraction of the GPU's "
                         "peak its compute runs at (default 0.4, an assumption)")
    project.add_argument("--grad-bytes", type=float, help="with --params: bytes per gradient element "
                         "as reduced (and per parameter as gathered; default 4)")
    project.add_argument("--strategies", type=_strategies, help="strategies to project, each NAME or "
                         "NAME[KEY=VALUE,...] with options of its own (e.g. ddp,ps,ps[servers=8]): with --params, the "
                         "described model under each (default: every data-parallel one); with ROWS, only their cells "
                         "(with those options; default: all)")
    project.add_argument("--batch-per-device", type=int, help="with --params: samples per device per step "
                         "(default 1)")
    project.add_argument("--global-batch", type=int, help="with --params: strong scaling's global batch (default: "
                         "batch per device x the largest world size)")
    project.add_argument("--recipe", help="with --params: precision recipe for memory (default autocast)")
    project.add_argument("--shape", type=_shape, help="with --params: a transformer's SEQ,HIDDEN,HEADS,LAYERS[,...] "
                         "(as plan takes it), for the activations a rank holds (every block whole and checkpointed) "
                         "beside its model states")
    project.add_argument("--exposed-fraction", type=float, help="with --params: f, exposed time over "
                         "priced communication, >= 0 (default 1: no overlap; above 1: collectives cost more in the "
                         "step than priced)")
    project.add_argument("--storage-GBps", type=float, help="the target's aggregate storage write bandwidth, GB/s "
                         "(1e9 B/s): adds each point's checkpoint bytes and save time (harness.project.goodput)")
    project.add_argument("--mtbf-hours", type=float, help="with --storage-GBps: one GPU's mean time between "
                         "failures, hours (the job's is this / N): adds the Young/Daly checkpoint interval and goodput")
    project.add_argument("--restart-s", type=float, help="with --mtbf-hours: seconds from a failure until training "
                         "runs again (default 0)")


def command_project(args: argparse.Namespace) -> int:
    from harness.project.run import projection_from_arguments

    if args.out is not None:
        check_results_file(args.out, "--out")
    print(projection_from_arguments(args))
    return 0
