"""`harness memory`: its arguments and `command_memory`, the table of each strategy's predicted bytes per rank (the
figures are harness.derive.memory's and harness.project.rank_memory's).

    python -m harness memory --params 7B --dp 8 --option tp=8
"""

from __future__ import annotations

import argparse
import importlib.util

from harness.cli.arguments import _count, add_model_arguments, add_strategy_options
from harness.spec import SpecError


def add_parser(commands: argparse._SubParsersAction) -> None:
    memory = commands.add_parser(
        "memory", help="predicted memory per rank for every strategy: model states, and with a model's shape every "
                       "other term",
        description="Model states (weights, gradients, optimizer state) per rank of every strategy, for a model "
                    "(--params, or --model PRESET / --shape for every term) on --dp data-parallel replicas, each a "
                    "group of tp ranks (fsdp2-tp, autotp: --option tp=N) or of pipeline stages (pipeline: --option "
                    "stages=N); GPUs = dp x tp x stages, and tp alone is one group of tp ranks. Each strategy's own "
                    "plan over the parameters one of its ranks holds: with a shape, the embeddings, norms and an "
                    "untied head whole on every tp rank; with --params alone every parameter split tp ways. With a "
                    "shape, also the activations, the logits and loss, the strategy's buckets, gathered parameters "
                    "and accumulated gradients and the allowance, at --micro-batch samples and --micro-batches a "
                    "step, as `harness plan` counts them. A strategy that cannot run --recipe shows '-', and every "
                    "'-' has its reason printed under the table.")
    memory.set_defaults(handler=command_memory)
    add_model_arguments(memory)
    memory.add_argument("--micro-batch", type=int, default=1, help="with a shape: samples a forward (default 1)")
    memory.add_argument("--micro-batches", type=int, default=1, help="with a shape: micro-batches a replica runs a "
                        "step (default 1; above 1 FSDP2 keeps unsharded gradients between them)")
    memory.add_argument("--dp", type=int, required=True, help="data-parallel replicas, each one rank, a group of "
                        "tp ranks or a pipeline of stages")
    memory.add_argument("--recipe", default="autocast", help="precision recipe: fp32, autocast, deepspeed-bf16, "
                        "deepspeed-fp16, fsdp-mp-policy; a strategy that cannot run it shows '-'")
    add_strategy_options(memory, help="an option of the strategies that take it, e.g. tp=8 (fsdp2-tp, autotp, and "
                         "tp's own degree), stages=4 (pipeline), offload_optimizer=cpu (ZeRO), offload_policy=cpu "
                         "(FSDP2): offloaded states are counted on the host, not the device")
    memory.add_argument("--largest-layer", type=_count, help="the most parameters one module holds itself "
                        "(DeepSpeed's largest_layer_params, for its ZeRO-3 estimate; default: params / 20)")
    memory.add_argument("--gpus-per-node", type=int, help="for DeepSpeed's estimator: the --dp GPUs lie on "
                        "dp / gpus-per-node nodes (default: --dp, one node)")
    memory.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's estimator")


# The strategies that split a sample's sequence over ranks (harness.strategies.sequence_parallel).
SEQUENCE_SPLITTING = ("ulysses", "cp")


def sequence_split_refusal(name: str, degree: int, ranks: int, model) -> str | None:
    """Why `name` cannot split the described model's sequence over `degree` of `ranks` GPUs, or None: the rules its
    strategy enforces on a workload (`SequenceGroups.sequence_refusal`, `Ulysses.layout_refusal`)."""
    option = "sp" if name == "ulysses" else "cp"
    if model is None:
        return "a sequence split needs the model's shape and sequence: --model or --shape (and --seq-len)"
    if degree < 2 or ranks % degree:
        return f"{option}={degree} must be 2 or more and divide the {ranks} GPUs"
    pieces = degree if name == "ulysses" else 2 * degree
    if model.seq_len % pieces:
        return f"the sequence of {model.seq_len} tokens does not split into {pieces} pieces ({option}={degree})"
    if name == "ulysses" and (model.heads % degree or model.kv_heads_count % degree):
        return (f"Ulysses gives each of sp={degree} ranks whole heads: the {model.heads} heads and "
                f"{model.kv_heads_count} key/value heads must both divide by it")
    return None


def command_memory(args: argparse.Namespace) -> int:
    """Each strategy's model states per rank (`model_state_plan` over the parameters one of its ranks holds, as its
    `model_split` lays out --dp replicas), DeepSpeed's estimate beside ZeRO-2/3's, with a model's shape every other
    term `harness plan` counts (harness.project.rank_memory), and under the table the reason for every figure left
    "-"."""
    from harness.derive.memory import plan_bytes
    from harness.project.facts import REGISTRY_FACTS
    from harness.project.model import described
    from harness.project.rank_memory import ALLOWANCE_TEXT, layout_memory
    from harness.strategies import STRATEGIES, PrecisionRecipe

    recipes = [recipe.value for recipe in PrecisionRecipe]
    if args.recipe not in recipes:
        raise SpecError(f"recipe {args.recipe!r} is not one of: {', '.join(recipes)}")
    if args.dp < 1:
        raise SpecError(f"--dp must be >= 1, got {args.dp}")
    if args.micro_batch < 1 or args.micro_batches < 1:
        raise SpecError(f"--micro-batch and --micro-batches must be >= 1, got {args.micro_batch} and "
                        f"{args.micro_batches}")
    model = None
    if args.model is not None or args.shape is not None:
        model = described(args.model, args.params, args.shape, args.seq_len)
    elif args.params is None:
        raise SpecError("describe the model: --params N (model states alone), or --model PRESET or --shape "
                        "(every term)")
    elif args.seq_len is not None:
        raise SpecError("--seq-len changes a preset's or a shape's sequence: give --model or --shape with it")
    parameters = model.parameters if model is not None else args.params
    gpus_per_node = args.dp if args.gpus_per_node is None else args.gpus_per_node
    if gpus_per_node < 1 or args.dp % gpus_per_node:
        raise SpecError(f"--dp {args.dp} must be a whole number of nodes of --gpus-per-node {gpus_per_node} "
                        f"(DeepSpeed's estimate is for nodes x GPUs per node = --dp GPUs)")
    nodes = args.dp // gpus_per_node
    given = dict(args.option)
    unknown = sorted(set(given) - {name for strategy in STRATEGIES.values() for name in strategy.options})
    if unknown:
        raise SpecError(f"no strategy has option(s) {', '.join(unknown)}")
    # The recipe is --recipe's alone: an option choosing another beside it would print one recipe's figures under
    # the other's name.
    recipe_options = sorted(set(given) & {"precision_recipe", "mixed_precision"})
    if recipe_options:
        raise SpecError(f"memory takes the precision recipe from --recipe, not option(s) {', '.join(recipe_options)}")
    # tp's degree is its world size, no option of its own: the one --option tp gives fsdp2-tp and autotp, else
    # their option's default, so that every tensor-parallel row splits alike.
    tp_option = next(strategy.options["tp"] for strategy in STRATEGIES.values() if "tp" in strategy.options)
    tensor_parallel = tp_option.given(given["tp"]) if "tp" in given else tp_option.default
    tp_option.check("tp", "tp", tensor_parallel)
    use_deepspeed = not args.no_deepspeed and importlib.util.find_spec("deepspeed") is not None
    recipe = PrecisionRecipe(args.recipe)
    gib = float(1 << 30)
    largest_layer = args.largest_layer or parameters // 20

    rows, refused, no_estimate, splits = [], {}, [], {}
    for name, strategy in STRATEGIES.items():
        if name in ("plain", "bare", "dataparallel"):
            continue
        taken = {key: strategy.options[key].given(value) for key, value in given.items() if key in strategy.options}
        strategy.check_options(taken)
        options = strategy.resolve_options(taken)
        split = splits[name] = strategy.model_split(args.dp, tensor_parallel, options)
        layout = f"{split.data_parallel}x{split.tensor_parallel}x{split.pipeline_stages}"
        shown_options = f"  [{', '.join(f'{k}={v}' for k, v in taken.items())}]" if taken else ""
        refusal = strategy.recipe_refusal(recipe)
        experts_over = strategy.expert_parallel_degree(split.ranks, options)
        if refusal is None and model is not None:
            from harness.project.layouts import shape_refusal

            refusal = shape_refusal(split, model, None) or None
        if refusal is None and experts_over:
            if model is None or not model.is_moe:
                refusal = ("expert parallelism shards an MoE model's experts: describe one (--model mixtral-8x7b, "
                           "or --shape ...,experts=N,top_k=K)")
            elif split.ranks % experts_over:
                refusal = f"ep={experts_over} must divide the world size {split.ranks} (--dp and the replicas' ranks)"
            elif model.experts % experts_over:
                refusal = f"the {model.experts} experts do not divide over {experts_over} expert-parallel ranks"
        split_over = strategy.sequence_split_degree(split.ranks, options)
        if refusal is None and name in SEQUENCE_SPLITTING:
            refusal = sequence_split_refusal(name, split_over, split.ranks, model)
        if refusal:
            refused[name] = refusal
            rows.append(f"{name:<13} {layout:>12} {'-':>11} {'-':>12} {'-':>10} {'-':>10} {'-':>10} {'-':>9} "
                        f"{'-':>19}" + (f" {'-':>11} {'-':>8} {'-':>8} {'-':>10}" if model else "") + shown_options)
            continue
        plan = strategy.model_state_plan(split.data_parallel, recipe, options)
        vocabulary_split = bool(options.get("loss_parallel"))
        held = (model.held_by_rank(split.tensor_parallel, split.pipeline_stages, vocabulary_split,
                                   max(1, experts_over)) if model is not None else split.evenly_held(parameters))
        states = plan_bytes(plan, held)
        if experts_over and model is not None:
            # The rank's experts under the plan over the ranks holding the same ones (harness.project.rank_memory).
            experts = model.routed_expert_parameters / experts_over / split.pipeline_stages
            over = strategy.model_state_plan(max(1, split.data_parallel // experts_over), recipe, options)
            dense, own = plan_bytes(plan, held - experts), plan_bytes(over, experts)
            states = {name: dense[name] + own[name] for name in dense}
        per_parameter = "+".join(f"{getattr(plan, c).bytes_per_parameter:g}" for c in ("weights", "gradients",
                                                                                        "optimizer"))
        # DeepSpeed divides the sharded states by num_nodes x num_gpus_per_node: all --dp GPUs, so the estimate is
        # for the same cluster as the columns beside it.
        estimate = (strategy.deepspeed_estimate_bytes(parameters, largest_layer, gpus_per_node, nodes, options)
                    if use_deepspeed else None)
        if estimate is None:
            no_estimate.append(name)
        shown = f"{estimate / gib:>19.3f}" if estimate is not None else f"{'-':>19}"
        row = (f"{name:<13} {layout:>12} {per_parameter:>11} {states['weights'] / gib:>12.3f} "
               f"{states['gradients'] / gib:>10.3f} {states['optimizer'] / gib:>10.3f} "
               f"{states['total'] / gib:>10.3f} {states['host'] / gib:>9.3f} {shown}")
        if model is not None:
            terms = layout_memory(model=model, strategy=name, options=taken, split=split, recipe=recipe.value,
                                  micro_batch=args.micro_batch, micro_batches=args.micro_batches,
                                  checkpointed=options.get("activation_checkpointing", "none") not in ("none", None),
                                  facts=REGISTRY_FACTS, vocabulary_split=vocabulary_split,
                                  expert_parallel=max(1, experts_over), context_parallel=split_over,
                                  ulysses=name == "ulysses")
            row += (f" {terms.activations / gib:>11.3f} {terms.logits / gib:>8.3f} {terms.working_total / gib:>8.3f} "
                    f"{terms.total / gib:>10.3f}")
        rows.append(row + shown_options)

    described_as = model.describe() if model is not None else f"{parameters:,} parameters"
    print(f"memory per rank, {described_as}, recipe {args.recipe}: each strategy's own bytes per parameter and "
          f"sharding (Rajbhandari et al. 2020, sec. 5.1)")
    print(f"layout dp x tp x pp: --dp {args.dp} data-parallel replicas, each a group of tp x pp ranks (GPUs = "
          f"dp x tp x pp); a rank holds 1/(tp x pp) of the parameters, and its strategy's plan shards their "
          f"states over the dp replicas or not")
    print(f"{'strategy':<13} {'dp x tp x pp':>12} {'bytes w+g+o':>11} {'weights GiB':>12} {'grads GiB':>10} "
          f"{'optim GiB':>10} {'states GiB':>10} {'host GiB':>9} {'DeepSpeed est. GiB':>19}"
          + (f" {'activations':>11} {'logits':>8} {'working':>8} {'GPU total':>10}" if model else ""))
    for row in rows:
        print(row)
    for degree in sorted({split.tensor_parallel for split in splits.values()} - {1}):
        names = [name for name, split in splits.items() if split.tensor_parallel == degree]
        default = "" if "tp" in given else " (the tp option's default; --option tp=N sets it)"
        if model is not None:
            print(f"tp={degree}{default}, {', '.join(names)}: each block's split layers divided {degree} ways, its "
                  f"norms and row-parallel biases, the embeddings and the head whole on every tp rank "
                  f"({model.held_by_rank(degree):,.0f} a rank before any data-parallel sharding; tp with "
                  "loss_parallel=true splits the vocabulary matrices too)")
        else:
            print(f"tp={degree}{default}, {', '.join(names)}: every parameter counted as split {degree} ways "
                  f"({parameters / degree:,.0f} a rank before any data-parallel sharding); a model's embeddings, "
                  f"layer norms and row-parallel biases stay whole on every tp rank and would add (1 - 1/{degree}) x "
                  f"their parameters x the bytes a parameter: --model or --shape counts them")
    for name, split in splits.items():
        if split.data_parallel != args.dp:
            print(f"{name}: one group of {split.ranks} ranks whatever --dp says: it has no data-parallel replicas")
    for stages in sorted({split.pipeline_stages for split in splits.values()} - {1}):
        names = [name for name, split in splits.items() if split.pipeline_stages == stages]
        default = "" if "stages" in given else " (the stages option's default; --option stages=N sets it)"
        print(f"stages={stages}{default}, {', '.join(names)}: the layers cut into {stages} stages, each counted as "
              f"holding 1/{stages} of the parameters; a stage that holds a tied weight's copy holds more")
    if model is not None:
        print("ulysses, cp: a sample's sequence split over sp / cp ranks of the --dp (every one by default: --option "
              "sp=N, cp=N), each rank's activations and logits at its seq / N tokens, the states sharded over all")
        print(f"activations, logits: at micro-batch {args.micro_batch} of {model.seq_len} tokens, "
              f"{args.micro_batches} micro-batch(es) a step (harness.derive.activations: the family's block and the "
              f"workloads' loss); working: the strategy's buckets, gathered parameters and accumulated gradients; "
              f"GPU total: every term on the busiest GPU, the allowance included ({ALLOWANCE_TEXT}), as "
              "`harness plan` counts it")
    if use_deepspeed:
        print(f"DeepSpeed est.: its estimate_zero{{2,3}}_model_states_mem_needs, with the offload options given, for "
              f"{args.dp} GPUs ({nodes} node(s) x {gpus_per_node} GPUs), largest layer {largest_layer:,} parameters")
        if recipe not in (PrecisionRecipe.DEEPSPEED_BF16, PrecisionRecipe.DEEPSPEED_FP16):
            # DeepSpeed's functions know one recipe: 16-bit weights and gradients with fp32 master weights and
            # Adam moments (2 + 2 + 12 bytes a parameter). Beside another recipe's columns they differ by the
            # recipe, not by the sharding.
            print(f"  it counts 16-bit weights and gradients with fp32 master copies and moments (2 + 2 + 12 bytes "
                  f"a parameter), not recipe {args.recipe}'s: compare it with --recipe deepspeed-bf16")
    if refused or no_estimate:
        print("'-', why:")
    for name, refusal in refused.items():
        print(f"  {name}: {refusal}")
    if no_estimate:
        why = ("--no-deepspeed" if args.no_deepspeed else "deepspeed is not installed here" if not use_deepspeed
               else "DeepSpeed's estimator has functions for ZeRO-2 and ZeRO-3 of a whole model alone")
        print(f"  DeepSpeed est. of {', '.join(no_estimate)}: {why}")
    return 0
