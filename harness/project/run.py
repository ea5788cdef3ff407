"""`python -m harness project`: projections from measured rows or from a description, printed as tables and
appended as projected rows.

    python -m harness project results/reference/ci-cpu/smoke.jsonl --comm results/reference/ci-cpu/comm-ws2.jsonl \\
        --cluster dgx-h100-ib
    python -m harness project --params 1.5B --compute-ms 120 --grad-bytes 2 --cluster dgx-h100-ib
    python -m harness project --params 1.5B --compute-ms 120 --cluster dgx-h100-ib --storage-GBps 100 \\
        --mtbf-hours 50000
    python -m harness project --params 7B --shape 4096,4096,32,32 --cluster dgx-h100-ib --world-sizes 8,64 \\
        --strategies tp,fsdp2-tp[tp=8],pipeline[stages=4]

`project_rows` and `project_description` are the plain functions (tests call them); `projection_from_arguments`
turns the command line's arguments into one of them. Bad input is a one-line SpecError, raised before
anything is computed or written.
"""

from __future__ import annotations

import argparse
import json
import re
from functools import partial
from pathlib import Path
from typing import Any, Mapping, Sequence

from harness.derive.identity import describe_differences, network_of, network_tag
from harness.project.cluster import load_cluster
from harness.project.collectives import ClusterModel, CommModel
from harness.derive.rows import spec
from harness.project.facts import REGISTRY_FACTS
from harness.project.fit import Calibration, load_calibration
from harness.project.goodput import CheckpointTarget
from harness.project.projection import (DEFAULT_WORLD_SIZES, Projected, Scaling, StrategyFacts, bases_from_rows,
                                        check_world_sizes, default_model, description_basis, format_table, project,
                                        projected_record, with_checkpoint_costs)
from harness.record import append_line
from harness.spec import SpecError


# What `--params` projects when no --strategies is given: every data-parallel strategy.
DESCRIBED_STRATEGIES = ("ddp", "horovod", "zero1", "zero2", "zero3", "fsdp2")
# A description's flags (argument names) and their defaults; with measured ROWS each is refused, since the
# rows give what it describes (f is measured; gradient bytes, batch and recipe are the row's).
DESCRIPTION_DEFAULTS = {"grad_bytes": 4.0, "batch_per_device": 1, "recipe": "autocast", "exposed_fraction": 1.0}
DESCRIPTION_FLAGS = {"--grad-bytes": "grad_bytes", "--batch-per-device": "batch_per_device",
                     "--global-batch": "global_batch", "--recipe": "recipe", "--exposed-fraction": "exposed_fraction",
                     "--shape": "shape", "--mfu": "mfu", "--model": "model"}
# The caveat a projection of CPU rows onto a GPU cluster opens with: the step's compute and the overlap the rows
# measured are a CPU's, so what carries over is the machinery (schedule, pricing), not the times.
CPU_ROWS_CAVEAT = ("caveat: these rows ran on CPUs. CPU rows prove the machinery (the schedule, its pricing on the "
                   "target); their compute and overlap are a CPU's, so the projected times below are not a GPU's. "
                   "Measure on one GPU (its world size 1 cell gives the per-GPU compute) to project a GPU cluster.")


def parse_scalings(names: Sequence[str]) -> tuple[Scaling, ...]:
    allowed = [s.value for s in Scaling]
    for name in names:
        if name not in allowed:
            raise SpecError(f"scaling {name!r} is not one of: {', '.join(allowed)}")
    if not names:
        raise SpecError(f"--scaling needs one of: {', '.join(allowed)}")
    return tuple(Scaling(name) for name in names)


def parse_algorithms(pairs: Sequence[str]) -> dict[str, str]:
    chosen = {}
    for pair in pairs:
        collective, sep, algorithm = pair.partition("=")
        if not sep or not collective or not algorithm:
            raise SpecError(f"--algorithm {pair!r} must be COLLECTIVE=ALGORITHM, e.g. all_reduce=hierarchical")
        chosen[collective.strip()] = algorithm.strip()
    return chosen


def describe_choice(model: ClusterModel) -> str:
    """How a cluster model picks each call's algorithm, in words."""
    forced = ", ".join(f"{c}={a}" for c, a in model.algorithms.items())
    return (f"library {model.library}: each call by its least modelled time among the library's algorithms"
            + (f", except {forced} (forced)" if forced else ""))


def check_one_network(rows: Sequence[Mapping], comm_records: Sequence[Mapping]) -> None:
    """The --comm rows price the measured rows' communication, for the overlap f each basis carries: they
    must be of the network the rows ran on, and that network one (harness.derive.identity), or f would set one
    link's measured time against another's priced time. SpecError in one line otherwise."""
    networks = {json.dumps(network_of(row), sort_keys=True): network_of(row) for row in rows}
    calibrated = {json.dumps(network_of(record), sort_keys=True): network_of(record) for record in comm_records}
    if len(networks) > 1:
        tags = ", ".join(network_tag({"network": network}) or "real hosts" for network in networks.values())
        raise SpecError(f"ROWS were measured on {len(networks)} networks ({tags}) and --comm calibrates one for "
                        "their overlap: project the rows of one network at a time")
    if calibrated and set(calibrated) != set(networks):
        [ours], [theirs] = networks.values(), list(calibrated.values())[:1]
        raise SpecError("the --comm rows are not of the network ROWS ran on ("
                        + describe_differences({"network": ours}, {"network": theirs}).replace(" here,", " in ROWS,")
                        .replace(" there", " in --comm") + "): calibrate the rows' own network")


# A strategy as --strategies names it: `name`, or `name[key=value,...]` (as the table labels a basis).
STRATEGY_FORM = re.compile(r"([\w-]+)(?:\[(.*)\])?")


def parse_strategy(text: str) -> tuple[str, dict[str, Any]]:
    """`name` or `name[key=value,...]` (e.g. `ps[servers=8]`) -> (name, options), each value read as `--option`
    reads one. Whether the strategy takes those options is the registry's to say when it is first asked (a
    one-line SpecError naming the option and what is allowed)."""
    match = STRATEGY_FORM.fullmatch(text.strip())
    if match is None:
        raise SpecError(f"--strategies {text!r}: expected NAME or NAME[KEY=VALUE,...], e.g. ps[servers=8]")
    name, inside = match.groups()
    options = {}
    for pair in inside.split(",") if inside is not None else ():
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise SpecError(f"--strategies {text!r}: options are KEY=VALUE separated by commas, e.g. ps[servers=8]")
        options[key.strip()] = _option_value(raw.strip())
    return name, options


def _option_value(raw: str) -> Any:
    """A strategy option's value from its text: true/false, none/null, a whole number, a number, else the word."""
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def project_rows(rows: Sequence[Mapping], model: CommModel, world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
                 scalings: Sequence[Scaling] = (Scaling.WEAK, Scaling.STRONG), measuring_host: Calibration | None = None,
                 facts: StrategyFacts = REGISTRY_FACTS, strategies: Sequence[str] | None = None,
                 checkpointing: CheckpointTarget | None = None) -> tuple[list[Projected], list[str]]:
    """Every projectable strategy cell of `rows` (of `strategies` only, where given) at `world_sizes`, each point
    with its checkpoint time and goodput on `checkpointing` where given; and a note per cell or point left out."""
    check_world_sizes(world_sizes, model)
    if strategies is not None:
        # The plain loop's rows stay: they give the compute of a strategy measured above one rank only.
        rows = rows_of_strategies(rows, strategies) + [row for row in rows if spec(row).get("strategy") == "plain"]
    bases, skipped = bases_from_rows(rows, facts, measuring_host)
    if not bases:
        raise SpecError("no measured row to project from: " + ("; ".join(skipped) or "no ok cell rows in the files"))
    points: list[Projected] = []
    for basis in bases:
        found, left_out = project(basis, world_sizes, model, facts, scalings)
        points += found
        skipped += left_out
    return (with_checkpoint_costs(points, checkpointing, facts) if checkpointing else points), skipped


def rows_of_strategies(rows: Sequence[Mapping], strategies: Sequence[str]) -> list[Mapping]:
    """The rows of `strategies` (`name`, or `name[key=value,...]`: its rows with those options); one no row ran is a
    one-line error naming the ones the rows hold."""
    held = sorted({str(spec(row).get("strategy")) for row in rows})
    wanted = {text: parse_strategy(text) for text in strategies}
    kept = {text: [row for row in rows if _runs(row, *chosen)] for text, chosen in wanted.items()}
    missing = [text for text, found in kept.items() if not found]
    if not strategies or missing:
        raise SpecError(f"--strategies {','.join(missing or strategies) or '(none)'}: no row of it to project; "
                        f"the rows hold: {', '.join(held) or 'none'}")
    chosen = {id(row) for found in kept.values() for row in found}
    return [row for row in rows if id(row) in chosen]


def _runs(row: Mapping, strategy: str, options: Mapping[str, Any]) -> bool:
    """Whether `row` ran `strategy` with (at least) `options`."""
    s = spec(row)
    given = s.get("options") or {}
    return s.get("strategy") == strategy and all(given.get(key) == value for key, value in options.items())


def project_description(strategies: Sequence[str], model: CommModel, world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
                        scalings: Sequence[Scaling] = (Scaling.WEAK, Scaling.STRONG),
                        facts: StrategyFacts = REGISTRY_FACTS, checkpointing: CheckpointTarget | None = None,
                        mfu: float | None = None, defaulted: bool = False,
                        **description) -> tuple[list[Projected], list[str]]:
    """Each strategy of a model described by `description` (harness.project.projection.description_basis): `name`,
    or `name[key=value,...]` with options of its own (`parse_strategy`), e.g. ps[servers=8]; each point with its
    checkpoint time and goodput on `checkpointing` where given.

    A strategy that cannot run the description's recipe (`Strategy.recipe_refusal`, as `harness memory` refuses
    it) is a one-line error, or, where the strategies were `defaulted`, left out with its reason. A hybrid
    (harness.project.plan.HYBRID: tensor parallelism, the pipeline) is priced by `harness plan`'s schedule of its
    layout, which needs the shape; its degree must lay the model out at every world size (`degree_refusal`).
    Without `compute_s` (None), compute is the model's FLOPs a device runs a step over the cluster's GPU's peak
    x `mfu` (`flops_compute`)."""
    from harness.project.layouts import HYBRID, RECIPE_MATH, degree_refusal, described_schedule_at
    from harness.project.model import decoder_of

    check_world_sizes(world_sizes, model)
    if not strategies:
        raise SpecError("no strategies to project")
    recipe, shape = description.get("recipe", "autocast"), description.get("shape")
    compute_s, compute_source = description.pop("compute_s", None), "given"
    if compute_s is None:
        compute_s, compute_source = flops_compute(model, description.get("parameters"), shape,
                                                  description.get("per_device_batch", 1), recipe, mfu)
    elif mfu is not None:
        raise SpecError("--mfu is the compute MFU of compute from FLOPs: it has no meaning with --compute-ms")
    gpus_per_node = model.cluster.gpus_per_node if isinstance(model, ClusterModel) else None
    chosen, skipped = [], []
    for text in strategies:
        name, options = parse_strategy(text)
        refusal = recipe_refusal_of(facts, name, recipe)
        if refusal and defaulted:
            skipped.append(f"{text}: {refusal}")
            continue
        if refusal:
            raise SpecError(f"--strategies {text}: {refusal}")
        if name in HYBRID:
            if shape is None:
                raise SpecError(f"--strategies {text}: a hybrid's tensor-parallel all-reduces and pipeline sends "
                                "follow from the model's shape: give --shape SEQ,HIDDEN,HEADS,LAYERS")
            if recipe not in RECIPE_MATH:
                raise SpecError(f"--strategies {text}: a hybrid's traffic is described under recipe "
                                f"{', '.join(RECIPE_MATH)} only (harness plan's schedule), not {recipe}")
            why = degree_refusal(name, options, decoder_of(description["parameters"], shape), world_sizes,
                                 gpus_per_node, facts)
            if why:
                raise SpecError(f"--strategies {text}: {why}")
        chosen.append((name, options))
    if not chosen:
        raise SpecError(f"no strategy to project runs recipe {recipe}: " + "; ".join(skipped))
    points: list[Projected] = []
    for name, options in chosen:
        own_compute, own_source = compute_s, compute_source
        if compute_source != "given" and options.get("activation_checkpointing", "none") != "none":
            from harness.project.layouts import RECOMPUTE_FACTOR

            own_compute, own_source = compute_s * RECOMPUTE_FACTOR, f"{compute_source}, x {RECOMPUTE_FACTOR:.4g} " \
                                                                     "recomputed (activation checkpointing)"
        # A hybrid's schedule at each size is the plan's for its layout (one traffic model for both commands).
        layout_schedule = (partial(described_schedule_at, strategy=name, options=options,
                                   model=decoder_of(description["parameters"], shape), recipe=recipe,
                                   micro_batch=description.get("per_device_batch", 1), facts=facts)
                           if name in HYBRID else None)
        basis = description_basis(strategy=name, options=options, layout_schedule=layout_schedule,
                                  compute_s=own_compute, compute_source=own_source, **description)
        found, left_out = project(basis, world_sizes, model, facts, scalings)
        points += found
        skipped += left_out
    return (with_checkpoint_costs(points, checkpointing, facts) if checkpointing else points), skipped


def recipe_refusal_of(facts: StrategyFacts, strategy: str, recipe: str) -> str | None:
    """Why the strategy cannot run `recipe` (RegistryFacts.recipe_refusal), or None; None where the facts do not
    say (a test's own StrategyFacts)."""
    ask = getattr(facts, "recipe_refusal", None)
    return ask(strategy, recipe) if ask is not None else None


def flops_compute(model: CommModel, parameters: int | None, shape: Mapping[str, Any] | None, per_device_batch: int,
                  recipe: str, mfu: float | None) -> tuple[float, str]:
    """(seconds, where they come from) of one device's compute a step from FLOPs, as `harness plan` computes it:
    `per_device_batch` samples of the shape's tokens x PaLM's 6N + 12 L H Q T FLOPs a token (Chowdhery et al. 2022,
    appendix B; N without the input embedding, harness.project.model) over the cluster's GPU's datasheet peak in
    the recipe's math x the compute MFU: `mfu` where given, else the one fitted on published GPU runs for the GPU and
    the model's size (harness.project.mfu_model). A one-line SpecError where the cluster names no GPU or no shape
    is given."""
    from harness.project.layouts import RECIPE_MATH, peak_flops
    from harness.project.mfu_model import mfu_model
    from harness.project.model import decoder_of

    cluster = model.cluster if isinstance(model, ClusterModel) else None
    if shape is None or cluster is None or not cluster.gpu:
        raise SpecError("a description needs --compute-ms MS, or --shape (or --model) with a --cluster that names "
                        "its gpu (compute from FLOPs at the fitted compute MFU)")
    if mfu is not None and (isinstance(mfu, bool) or not isinstance(mfu, (int, float)) or not 0 < mfu <= 1):
        raise SpecError(f"--mfu must be a fraction of the peak in (0, 1], got {mfu!r}")
    decoder = decoder_of(parameters, shape)
    peak = peak_flops(cluster, recipe)
    if mfu is None:
        fitted = mfu_model()
        mfu = fitted.compute_mfu(cluster.gpu, decoder.parameters, False)
        given = fitted.describe(cluster.gpu, decoder.parameters, False)
    else:
        given = f"compute MFU {mfu:.0%} (--mfu)"
    tokens = per_device_batch * decoder.seq_len
    seconds = tokens * decoder.flops_per_token / (peak * mfu)
    source = (f"FLOPs: {tokens:,} tokens x {decoder.flops_per_token / 1e9:.4g} GFLOP a token (PaLM: 6N + 12 L H Q T) "
              f"/ ({peak / 1e12:.4g} TFLOP/s {RECIPE_MATH[recipe]} datasheet peak of the {cluster.gpu} x {given})")
    return seconds, source


def checkpointing_from_arguments(args: argparse.Namespace) -> CheckpointTarget | None:
    """--storage-GBps, --mtbf-hours, --restart-s as a CheckpointTarget (one-line SpecError where bad), or None
    where none is given: the projection is then printed and recorded as without them."""
    storage, mtbf, restart = args.storage_GBps, args.mtbf_hours, args.restart_s
    if storage is None:
        given = [flag for flag, value in (("--mtbf-hours", mtbf), ("--restart-s", restart)) if value is not None]
        if given:
            raise SpecError(f"{given[0]} needs --storage-GBps: the goodput follows from a checkpoint's save time, "
                            "its bytes over the storage's write bandwidth")
        return None
    return CheckpointTarget(storage_GBps=storage, mtbf_hours_per_gpu=mtbf,
                            restart_s=0.0 if restart is None else restart)


def validation_from_arguments(args: argparse.Namespace) -> str:
    """`--validate`: measured ROWS and their --comm rows, and nothing that chooses a target."""
    if not args.rows or not args.comm:
        raise SpecError("--validate needs measured ROWS and the --comm rows of the same settings")
    extra = [flag for flag, given in (("--cluster", args.cluster), ("--params", args.params is not None),
                                      ("--out", args.out), ("--world-sizes", args.world_sizes),
                                      ("--strategies", args.strategies is not None), ("--library", args.library),
                                      ("--algorithm", args.algorithm),
                                      ("--storage-GBps", args.storage_GBps is not None),
                                      ("--mtbf-hours", args.mtbf_hours is not None),
                                      ("--restart-s", args.restart_s is not None)) if given]
    if extra:
        raise SpecError(f"--validate predicts the measured cells on their own settings: {', '.join(extra)} "
                        "has no meaning with it")
    from harness.derive.rows import load_rows
    from harness.project.validate import Design, format_validation, validate
    from harness.record import COMMBENCH_KIND, read_rows

    designs = [design.value for design in Design]
    if args.design not in designs:
        raise SpecError(f"--design {args.design!r} is not one of: {', '.join(designs)}")
    comm = read_rows([Path(p) for p in args.comm], kind=COMMBENCH_KIND)
    return format_validation(validate(load_rows(args.rows), comm, design=Design(args.design),
                                      max_source_world_size=args.largest_source))


def projection_from_arguments(args: argparse.Namespace) -> str:
    """Check the command line, project, append the rows to --out; returns the text to print."""
    if args.validate:
        return validation_from_arguments(args)
    changed = [flag for flag, given in (("--design", args.design != "interpolate"),
                                        ("--largest-source", args.largest_source != 2)) if given]
    if changed:
        raise SpecError(f"{changed[0]} chooses how --validate predicts measured cells: give --validate with it")
    if args.model is not None:
        if args.shape is not None:
            raise SpecError("give --model PRESET or --shape, not both (--model's shape is the preset's)")
        from harness.project.model import preset

        chosen_model = preset(args.model).with_stated_parameters(args.params)
        args.params, args.shape = chosen_model.parameters, chosen_model.shape_fields()
    described = args.params is not None or args.compute_ms is not None
    if described and args.rows:
        raise SpecError("give measured ROWS or a description (--params, --compute-ms), not both")
    if not described and not args.rows:
        raise SpecError("give measured ROWS, or a description: --params N --compute-ms MS (or --params N --shape "
                        "with a --cluster that names its gpu)")
    if described and args.params is None:
        raise SpecError("a description needs --params")
    if described and args.shape is not None and args.model is None:
        from harness.project.model import decoder_of

        # The shape as the activations read it (a swiglu shape is Llama's block: its family and widths).
        args.shape = decoder_of(args.params, args.shape).shape_fields()
    describing = [flag for flag, value in DESCRIPTION_FLAGS.items() if getattr(args, value) is not None]
    if args.rows and describing:
        raise SpecError(f"{', '.join(describing)} describes a model (--params); with measured ROWS the rows give it")
    world_sizes = tuple(args.world_sizes or DEFAULT_WORLD_SIZES)
    scalings = parse_scalings(args.scaling)
    checkpointing = checkpointing_from_arguments(args)
    calibration = load_calibration(args.comm) if args.comm else None
    cluster = load_cluster(args.cluster, args.set) if args.cluster else None
    if cluster is None and args.set:
        raise SpecError("--set changes a cluster: give --cluster PRESET|FILE.toml")
    model = default_model(cluster, calibration, parse_algorithms(args.algorithm), args.library)
    if described:
        given = {key: getattr(args, key) for key in DESCRIPTION_DEFAULTS if getattr(args, key) is not None}
        chosen = {**DESCRIPTION_DEFAULTS, **given}
        points, skipped = project_description(
            DESCRIBED_STRATEGIES if args.strategies is None else args.strategies, model, world_sizes, scalings,
            mfu=args.mfu, defaulted=args.strategies is None, parameters=args.params,
            compute_s=None if args.compute_ms is None else args.compute_ms / 1e3,
            gradient_element_bytes=chosen["grad_bytes"],
            per_device_batch=chosen["batch_per_device"],
            global_batch=args.global_batch or chosen["batch_per_device"] * max(world_sizes), recipe=chosen["recipe"],
            exposed_fraction=chosen["exposed_fraction"], shape=args.shape, checkpointing=checkpointing)
    else:
        from harness.derive.rows import load_rows
        from harness.record import COMMBENCH_KIND, read_rows

        rows = load_rows(args.rows)
        on_cpu = any(spec(row).get("device") == "cpu" for row in rows)
        if calibration is not None:
            check_one_network(rows, read_rows([Path(p) for p in args.comm], kind=COMMBENCH_KIND))
        points, skipped = project_rows(rows, model, world_sizes, scalings, measuring_host=calibration,
                                       strategies=args.strategies, checkpointing=checkpointing)
    comm_sources = [str(Path(p)) for p in args.comm]
    if args.out:
        for point in points:
            append_line(args.out, projected_record(point, model, comm_sources))
    target = (f"cluster {cluster.name}, {describe_choice(model)}" if cluster is not None else
              f"the calibrated {calibration.backend}/{calibration.device} host's network, one level")
    lines = [f"parbench: projection onto {target} (predictions, not measurements)"]
    if not described and on_cpu and cluster is not None:
        lines.append(CPU_ROWS_CAVEAT)
    if described and args.compute_ms is None:
        lines.append(f"compute, not measured: {points[0].basis.compute_source}" if points else
                     "compute, not measured: from FLOPs at the compute MFU fitted on published runs")
    lines.append(format_table(points))
    lines += [f"left out: {note}" for note in skipped]
    if args.out:
        lines.append(f"\n{len(points)} projected rows (kind projection) appended to {args.out}")
    return "\n".join(lines)
