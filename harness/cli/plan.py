"""`harness plan`: its arguments, `command_plan` (every layout of a described model on a described cluster,
harness.project.plan) and the `harness run --dry-run` of the layout it follows, which it then runs.

    python -m harness plan --model llama3-8b --cluster dgx-h100-ib --nodes 1 --tokens 1e9
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any, Sequence

from harness.cli.run import add_parser as add_run_parser, command_run
from harness.cli.arguments import CLUSTER_PRESETS, _count, add_cluster_arguments, add_model_arguments, parser_of
from harness.spec import DeviceKind, SpecError


def add_parser(commands: argparse._SubParsersAction) -> None:
    planner = commands.add_parser(
        "plan", help="every layout of a described model on a described cluster: what fits, ranked by projected step",
        description="Every layout (DDP, Horovod, ZeRO-1/2/3, FSDP2, tp, fsdp2-tp, autotp, the pipeline; activation "
                    "checkpointing off and on) of a decoder (--model PRESET, or --shape with or without --params) on "
                    "--nodes nodes of --cluster: every byte a GPU needs by term, whether it fits, the projected step "
                    "with its range (compute at the MFU fitted on published GPU runs, communication on the "
                    "cluster's links), throughput, MFU, GPU-hours for --tokens; the layouts equivalent within the "
                    "error grouped, and the simplest one's `run --dry-run` on that cluster. Projected, not measured "
                    "(docs/projection.md, \"Planning a layout\"; docs/published-runs.md).")
    planner.set_defaults(handler=command_plan)
    add_model_arguments(planner)
    add_cluster_arguments(planner, required=True, cluster=f"a preset ({CLUSTER_PRESETS}) or a cluster TOML file "
                          "naming its gpu and gpu_memory_GiB", overrides="override a cluster key, e.g. "
                          "gpu_memory_GiB=40")
    planner.add_argument("--nodes", type=int, required=True, help="nodes of the cluster to plan for")
    planner.add_argument("--tokens", type=_count, required=True, help="tokens to train, for the GPU-hours, e.g. 1e9")
    batch = planner.add_mutually_exclusive_group()
    batch.add_argument("--global-batch-tokens", type=_count, help="tokens a step (default 4M = 2^22: 1024 samples "
                       "of 4096)")
    batch.add_argument("--global-batch", type=int, help="samples a step, instead of --global-batch-tokens")
    planner.add_argument("--micro-batch", type=int, help="samples a forward (default: the largest power of two "
                         "that fits)")
    planner.add_argument("--mfu", type=float, help="the compute MFU, a fraction of the peak (default: fitted on "
                         "published GPU runs for the cluster's GPU, the model's size and recomputation)")
    planner.add_argument("--recipe", help="precision recipe of every layout: users (default: each strategy's own, "
                         "FSDP2's MixedPrecisionPolicy, DeepSpeed's bf16 section, autocast elsewhere), autocast, "
                         "fp32")
    planner.add_argument("--peak-tflops", type=float, help="one GPU's peak TFLOP/s, instead of its datasheet's")


def command_plan(args: argparse.Namespace) -> int:
    """The plan's table, then the `run --dry-run` of the simplest layout among those equivalent within the error, on
    the cluster and overrides given (harness.project.plan)."""
    from harness.project.cluster import load_cluster
    from harness.project.model import described
    from harness.project.plan import (DEFAULT_GLOBAL_BATCH_TOKENS, DEFAULT_RECIPE, Settings, equivalent, format_plan,
                                      plan)

    model = described(args.model, args.params, args.shape, args.seq_len)
    samples = args.global_batch
    if samples is None:
        tokens = args.global_batch_tokens or DEFAULT_GLOBAL_BATCH_TOKENS
        if tokens % model.seq_len:
            raise SpecError(f"--global-batch-tokens {tokens:,} is not a whole number of {model.seq_len}-token samples")
        samples = tokens // model.seq_len
    settings = Settings(global_batch=samples, tokens=float(args.tokens), recipe=args.recipe or DEFAULT_RECIPE,
                        mfu=args.mfu, micro_batch=args.micro_batch,
                        peak_flops=None if args.peak_tflops is None else args.peak_tflops * 1e12)
    cluster = load_cluster(args.cluster, args.set)
    planned = plan(model, cluster, args.nodes, settings)
    print(format_plan(planned, model, cluster, args.nodes, settings))
    group = equivalent(planned)
    if not group:
        print("\nno layout fits: nothing to run")
        return 0
    chosen = group[0]
    if model.is_moe:
        # The hybrid matrix's GPU transformers are dense: an expert layout would be skipped on them, and the moe
        # matrix's one GPU MoE workload (moe-tiny, 4 experts) checks a dispatch, not a model of this size.
        print(f"\nfollowed: {chosen.layout.label}, micro-batch {chosen.micro_batch}, the simplest of the {len(group)} "
              "equivalent within the error. No dry run follows: parbench's GPU MoE cells are moe-tiny's "
              "(python -m harness run --matrix moe --device cuda), which check the dispatch, not this model's step")
        return 0
    if chosen.layout.context_parallel > 1:
        # The hybrid matrix's GPU transformers run whole samples: a sequence split runs on the long-context matrix's.
        print(f"\nfollowed: {chosen.layout.label}, micro-batch {chosen.micro_batch}, the simplest of the {len(group)} "
              "equivalent within the error. No dry run follows: parbench's sequence-split cells are the long-context "
              "matrix's (python -m harness run --matrix long-context --device cuda), which check parity and traffic, "
              "not this model's step")
        return 0
    argv, workload = plan_run_arguments(chosen, model, cluster.gpus_per_node, args.nodes, args.cluster, args.set)
    what = (f"{workload} itself" if workload == model.name else
            f"{workload}, the largest of the hybrid matrix's GPU transformers this layout takes (it has none of this "
            f"shape): it checks the launch on the cluster, not this model's step")
    print(f"\nfollowed: {chosen.layout.label}, micro-batch {chosen.micro_batch}, the simplest of the "
          f"{len(group)} equivalent within the error. The run below lays it out on {what}. Its placement uses "
          f"placeholder hosts; give --hostfile (or --slurm, --placement k8s) to run it:")
    print("python -m harness " + " ".join(shlex.quote(part) for part in argv))
    # `run`'s parser alone reads it: harness.cli.build_parser, which imports this module, would close an import
    # circle (tests/test_layering.py).
    return command_run(parser_of(add_run_parser).parse_args(argv))


def plan_run_arguments(chosen: Any, model: Any, gpus_per_node: int, nodes: int, cluster: str,
                       overrides: Sequence[str]) -> tuple[list[str], str]:
    """(`harness run` arguments of the chosen layout as a dry run on `cluster` with `overrides`, the workload it
    runs): the model itself where the hybrid matrix runs it on GPUs, else that matrix's GPU transformer with the
    most parameters whose heads the layout's tensor-parallel degree divides and whose layers its stages do not
    outnumber."""
    from harness.matrix import HYBRID_PLANS
    from workloads import get_workload

    layout = chosen.layout
    split = layout.split

    def takes(name: str) -> bool:
        config = get_workload(name).config
        return config.n_head % split.tensor_parallel == 0 and split.pipeline_stages <= config.n_layer

    if model.name in HYBRID_PLANS[DeviceKind.CUDA]:
        workload = model.name
    else:
        candidates = [name for name in HYBRID_PLANS[DeviceKind.CUDA] if takes(name)]
        if not candidates:
            raise SpecError(f"no GPU transformer of parbench's takes {layout.label}")
        workload = max(candidates, key=lambda name: get_workload(name).published_params or 0)
    argv = ["run", "--matrix", "hybrid", "--workload", workload, "--strategy", layout.strategy,
            "--world-sizes", str(split.ranks), "--global-batch", str(chosen.micro_batch * chosen.micro_batches
                                                                      * split.data_parallel),
            "--micro-batch", str(chosen.micro_batch), "--precision", "fp32" if layout.recipe == "fp32" else "bf16",
            "--device", "cuda", "--gpus-per-node", str(gpus_per_node), "--nnodes", str(nodes), "--cluster", cluster]
    for pair in overrides:
        argv += ["--set", pair]
    for key, value in layout.options:
        if key != "activation_checkpointing" or value != "none":
            argv += ["--option", f"{key}={value}"]
    return argv + ["--dry-run"], workload
