"""`python -m harness project`: projections from measured rows or from a description, printed as tables and
appended as projected rows.

    python -m harness project results/reference/ci-cpu/smoke.jsonl --comm results/reference/ci-cpu/comm-ws2.jsonl \\
        --cluster dgx-h100-ib
    python -m harness project --params 1.5B --compute-ms 120 --grad-bytes 2 --cluster dgx-h100-ib

`project_rows` and `project_description` are the plain functions (tests call them); `projection_from_arguments`
turns the command line's arguments into one of them. Bad input is a one-line SpecError, raised before
anything is computed or written.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Mapping, Sequence

from harness.derive.identity import describe_differences, network_of, network_tag
from harness.project.cluster import load_cluster
from harness.project.collectives import CommModel
from harness.project.facts import REGISTRY_FACTS
from harness.project.fit import Calibration, load_calibration
from harness.project.projection import (DEFAULT_WORLD_SIZES, Projected, Scaling, StrategyFacts, bases_from_rows,
                                        check_world_sizes, default_model, description_basis, format_table, project,
                                        projected_record)
from harness.record import append_line
from harness.spec import SpecError


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


def project_rows(rows: Sequence[Mapping], model: CommModel, world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
                 scalings: Sequence[Scaling] = (Scaling.WEAK, Scaling.STRONG), measuring_host: Calibration | None = None,
                 facts: StrategyFacts = REGISTRY_FACTS) -> tuple[list[Projected], list[str]]:
    """Every projectable strategy cell of `rows` at `world_sizes`; and a note per cell or point left out."""
    check_world_sizes(world_sizes, model)
    bases, skipped = bases_from_rows(rows, facts, measuring_host)
    if not bases:
        raise SpecError("no measured row to project from: " + ("; ".join(skipped) or "no ok cell rows in the files"))
    points: list[Projected] = []
    for basis in bases:
        found, left_out = project(basis, world_sizes, model, facts, scalings)
        points += found
        skipped += left_out
    return points, skipped


def project_description(strategies: Sequence[str], model: CommModel, world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
                        scalings: Sequence[Scaling] = (Scaling.WEAK, Scaling.STRONG),
                        facts: StrategyFacts = REGISTRY_FACTS, **description) -> tuple[list[Projected], list[str]]:
    """Each strategy of a model described by `description` (harness.project.projection.description_basis)."""
    check_world_sizes(world_sizes, model)
    if not strategies:
        raise SpecError("no strategies to project")
    points: list[Projected] = []
    skipped: list[str] = []
    for strategy in strategies:
        basis = description_basis(strategy=strategy, **description)
        found, left_out = project(basis, world_sizes, model, facts, scalings)
        points += found
        skipped += left_out
    return points, skipped


def validation_from_arguments(args: argparse.Namespace) -> str:
    """`--validate`: measured ROWS and their --comm rows, and nothing that chooses a target."""
    if not args.rows or not args.comm:
        raise SpecError("--validate needs measured ROWS and the --comm rows of the same settings")
    extra = [flag for flag, given in (("--cluster", args.cluster), ("--params", args.params is not None),
                                      ("--out", args.out), ("--world-sizes", args.world_sizes)) if given]
    if extra:
        raise SpecError(f"--validate predicts the measured cells on their own settings: {', '.join(extra)} "
                        "has no meaning with it")
    from harness.derive.rows import load_rows
    from harness.project.validate import format_validation, validate
    from harness.record import COMMBENCH_KIND, read_rows

    comm = read_rows([Path(p) for p in args.comm], kind=COMMBENCH_KIND)
    return format_validation(validate(load_rows(args.rows), comm))


def projection_from_arguments(args: argparse.Namespace) -> str:
    """Check the command line, project, append the rows to --out; returns the text to print."""
    if args.validate:
        return validation_from_arguments(args)
    described = args.params is not None or args.compute_ms is not None
    if described and args.rows:
        raise SpecError("give measured ROWS or a description (--params, --compute-ms), not both")
    if not described and not args.rows:
        raise SpecError("give measured ROWS, or a description: --params N --compute-ms MS")
    if described and (args.params is None or args.compute_ms is None):
        raise SpecError("a description needs both --params and --compute-ms")
    world_sizes = tuple(args.world_sizes or DEFAULT_WORLD_SIZES)
    scalings = parse_scalings(args.scaling)
    calibration = load_calibration(args.comm) if args.comm else None
    cluster = load_cluster(args.cluster, args.set) if args.cluster else None
    if cluster is None and args.set:
        raise SpecError("--set changes a cluster: give --cluster PRESET|FILE.toml")
    model = default_model(cluster, calibration, parse_algorithms(args.algorithm))
    if described:
        points, skipped = project_description(
            args.strategies, model, world_sizes, scalings, parameters=args.params, compute_s=args.compute_ms / 1e3,
            gradient_element_bytes=args.grad_bytes, per_device_batch=args.batch_per_device,
            global_batch=args.global_batch or args.batch_per_device * max(world_sizes), recipe=args.recipe,
            exposed_fraction=args.exposed_fraction)
    else:
        from harness.derive.rows import load_rows
        from harness.record import COMMBENCH_KIND, read_rows

        rows = load_rows(args.rows)
        if calibration is not None:
            check_one_network(rows, read_rows([Path(p) for p in args.comm], kind=COMMBENCH_KIND))
        points, skipped = project_rows(rows, model, world_sizes, scalings, measuring_host=calibration)
    comm_sources = [str(Path(p)) for p in args.comm]
    if args.out:
        for point in points:
            append_line(args.out, projected_record(point, model, comm_sources))
    target = (f"cluster {cluster.name}" if cluster is not None else
              f"the calibrated {calibration.backend}/{calibration.device} host's network, one level")
    lines = [f"parbench: projection onto {target} (predictions, not measurements)", format_table(points)]
    lines += [f"left out: {note}" for note in skipped]
    if args.out:
        lines.append(f"\n{len(points)} projected rows (kind projection) appended to {args.out}")
    return "\n".join(lines)
