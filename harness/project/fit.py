"""Latency and bandwidth per collective fitted to `harness comm` rows, in the model's own form, with the
residuals kept.

    python -m harness comm --world-size 2 --device cpu --max-bytes 1M --out comm.jsonl
    python -c "from harness.project.fit import load_calibration; print(load_calibration(['comm.jsonl']).describe())"

Each row of a `harness comm` run (kind "commbench") gives the mean time of one collective of one size at
the run's world size p. The fit is the one-link model of harness.project.collectives,

    time = fixed + steps(p) alpha + bytes_factor(p) n beta,

so that alpha (seconds per step) and beta (seconds per byte of one link) are the link's, not the
collective's, and carry over to other world sizes with that algorithm's step count and bytes factor.
It is least squares on ratios, not seconds: sizes span four decades or more, and a plain fit in seconds
would let the largest sizes decide alone, leaving the latency to their noise. The loss of a row is
(predicted - measured)^2 / (predicted x measured), so a row 25% slower than the fit weighs as much as one
20% faster (_fit_coefficients says why not plain relative error). Alpha, beta and fixed are kept >= 0.

What one world size can and cannot tell. At one p, steps(p) and bytes_factor(p) are constants, so the fit
is the straight line time = a + b n: b / bytes_factor(p) is beta, and a / steps(p) is alpha, which then
also holds any fixed cost per collective (a kernel or a Python call, a rendezvous) as if it were paid per
step; extrapolating to more ranks multiplies that cost by the step count and overstates latency. With
rows from two world sizes or more the fixed term is fitted apart from alpha. Neither tells whether the
library really ran the algorithm assumed (gloo and NCCL choose by size and count): at p = 2 the ring, the
tree and the chain differ only in their bytes factor, so beta is only as right as the algorithm named.
Rows from a CPU gloo run calibrate a "CPU cluster" of one level: every pair of ranks joined by the
fitted link, which is what ranks sharing one host's loopback are.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from harness.project.cluster import Link
from harness.project.collectives import (DEFAULT_ALGORITHMS, ONE_LINK_FORMS, Algorithm, check_applies,
                                         resolve_algorithm)
from harness.spec import SpecError


@dataclass(frozen=True, slots=True)
class Point:
    """One measured collective: `seconds` for one call of `size_bytes` among `world_size` ranks."""

    collective: str
    world_size: int
    size_bytes: float
    seconds: float
    source: str = ""                # file:line of the comm row it came from


@dataclass(frozen=True, slots=True)
class Residual:
    world_size: int
    size_bytes: float
    measured_s: float
    predicted_s: float

    @property
    def relative(self) -> float:
        """measured / predicted - 1: +0.1 means the collective took 10% longer than the fit says."""
        return self.measured_s / self.predicted_s - 1.0 if self.predicted_s > 0 else math.inf


@dataclass(frozen=True, slots=True)
class LinkFit:
    """alpha, beta and the fixed cost of one collective under one algorithm, and how the rows sat
    around the fit."""

    collective: str
    algorithm: Algorithm
    latency_s: float                 # alpha: seconds per step
    seconds_per_byte: float          # beta: seconds per byte through one link
    fixed_s: float                   # seconds per collective; 0 unless fitted from two world sizes or more
    world_sizes: tuple[int, ...]
    residuals: tuple[Residual, ...]

    def seconds(self, size_bytes: float, ranks: int) -> float:
        """The fitted model's time for one collective of `size_bytes` among `ranks` ranks on this link."""
        if ranks == 1:
            return 0.0
        check_applies(self.algorithm, ranks)
        form = ONE_LINK_FORMS[(self.collective, self.algorithm)]
        return (self.fixed_s + form.steps(ranks) * self.latency_s
                + form.bytes_factor(ranks) * size_bytes * self.seconds_per_byte)

    @property
    def link(self) -> Link:
        """The fitted link, to build a cluster from (its fixed cost per collective is not part of it)."""
        if self.seconds_per_byte <= 0:
            raise SpecError(f"the {self.collective} fit has no bandwidth term (beta = 0): its rows did not grow "
                            "with size; measure larger sizes (--max-bytes)")
        return Link(latency_s=self.latency_s, bandwidth_bytes_per_s=1.0 / self.seconds_per_byte)

    @property
    def relative_residuals(self) -> tuple[float, ...]:
        return tuple(r.relative for r in self.residuals)

    @property
    def rms_relative_residual(self) -> float:
        values = self.relative_residuals
        return math.sqrt(sum(v * v for v in values) / len(values))


def fit_link(points: Sequence[Point], collective: str, algorithm: str | None = None) -> LinkFit:
    """alpha, beta (and the fixed cost, given two world sizes or more) of `collective` from `points`, in
    the one-link form of `algorithm` (DEFAULT_ALGORITHMS[collective] when None)."""
    chosen = resolve_algorithm(collective, algorithm, ONE_LINK_FORMS)
    form = ONE_LINK_FORMS[(collective, chosen)]
    rows = [point for point in points if point.collective == collective]
    for point in rows:
        if point.world_size < 2:
            raise SpecError(f"{point.source or collective}: world size {point.world_size} moves nothing; "
                            "calibration rows need world size >= 2")
        check_applies(chosen, point.world_size)
        if not (math.isfinite(point.seconds) and point.seconds > 0):
            raise SpecError(f"{point.source or collective}: time must be a finite number of seconds > 0, "
                            f"got {point.seconds!r}")
    if len({point.size_bytes for point in rows}) < 2:
        raise SpecError(f"fitting {collective} needs rows at two sizes or more to separate latency from "
                        f"bandwidth; got {len(rows)} row(s)")
    world_sizes = tuple(sorted({point.world_size for point in rows}))
    steps = np.array([form.steps(point.world_size) for point in rows], dtype=float)
    moved = np.array([form.bytes_factor(point.world_size) * point.size_bytes for point in rows], dtype=float)
    measured = np.array([point.seconds for point in rows], dtype=float)
    columns = {"latency_s": steps, "seconds_per_byte": moved}
    if len(set(steps)) > 1:                   # only then is a fixed cost per collective apart from alpha
        columns["fixed_s"] = np.ones_like(steps)
    coefficients = _fit_coefficients(columns, measured)
    fitted = LinkFit(collective=collective, algorithm=chosen, latency_s=coefficients.get("latency_s", 0.0),
                     seconds_per_byte=coefficients.get("seconds_per_byte", 0.0),
                     fixed_s=coefficients.get("fixed_s", 0.0), world_sizes=world_sizes, residuals=())
    residuals = tuple(Residual(p.world_size, p.size_bytes, p.seconds, fitted.seconds(p.size_bytes, p.world_size))
                      for p in rows)
    return dataclasses.replace(fitted, residuals=residuals)


def _fit_coefficients(columns: Mapping[str, np.ndarray], measured: np.ndarray) -> dict[str, float]:
    """Coefficients >= 0 of time = sum(coefficient x column) minimising sum((p - t)^2 / (t p)), p the
    predicted and t the measured time: a row k times slower than the fit costs (k - 1)^2 / k, exactly as
    much as one k times faster, and for small deviations that is (log k)^2. Least squares on plain
    relative error, ((p - t) / t)^2, would be biased low: a row 3x slower counts at most 1, one 3x faster 4.

    Solved by reweighting (iteratively reweighted least squares): the gradient of the loss is
    sum((p - t)(p + t) / (t p^2) dp), so least squares with weights (p' + t) / (t p'^2) from the previous
    fit p' has the loss's minimum as its fixed point. It starts from the plain relative fit (p' = t)."""
    coefficients = _nonnegative_least_squares(columns, measured, 1.0 / measured)
    for _ in range(200):
        predicted = sum(value * columns[name] for name, value in coefficients.items())
        if not np.all(predicted > 0):
            break
        weights = np.sqrt((predicted + measured) / (measured * predicted ** 2))
        refitted = _nonnegative_least_squares(columns, measured, weights)
        settled = all(math.isclose(refitted.get(name, 0.0), coefficients.get(name, 0.0), rel_tol=1e-12, abs_tol=0.0)
                      for name in columns)
        coefficients = refitted
        if settled:
            break
    return coefficients


def _nonnegative_least_squares(columns: Mapping[str, np.ndarray], measured: np.ndarray,
                               weights: np.ndarray) -> dict[str, float]:
    """Coefficients >= 0 minimising sum((weight x (X c - t))^2): the least-squares solution of each subset
    of the columns, the best of those whose coefficients are all >= 0 (with at most three columns, trying
    every subset is the exact non-negative least squares)."""
    names = list(columns)
    target = measured * weights
    best: tuple[float, dict[str, float]] = (float(np.sum(target ** 2)), {})   # every coefficient 0
    for count in range(1, len(names) + 1):
        for subset in itertools.combinations(names, count):
            design = np.column_stack([columns[name] * weights for name in subset])
            solution, *_ = np.linalg.lstsq(design, target, rcond=None)
            if np.any(solution < 0):
                continue
            loss = float(np.sum((design @ solution - target) ** 2))
            if loss < best[0]:
                best = (loss, dict(zip(subset, map(float, solution))))
    return best[1]


# ---- from `harness comm` rows -----------------------------------------------------------------------------


def calibration_points(records: Iterable[Mapping[str, Any]]) -> list[Point]:
    """Every measured collective of `harness comm` records (rows of kind "commbench", as
    harness.record.read_rows returns them): one point per collective and size."""
    points = []
    for record in records:
        source = record.get("_source", "")
        # Concurrent groups (`harness comm --group-size`) time each collective among a group's members.
        world_size = int(record.get("group_size") or record["world_size"])
        for row in record["rows"]:
            points.append(Point(collective=row["collective"], world_size=world_size,
                                size_bytes=float(row["size_bytes"]), seconds=float(row["time_s"]), source=source))
    return points


@dataclass(frozen=True, slots=True)
class Calibration:
    """Fitted links per collective: a one-level cluster where every pair of ranks is joined by the link
    each collective measured (a CPU gloo run on one host, or any single-level network)."""

    fits: Mapping[str, LinkFit] = field(default_factory=dict)
    backend: str = ""
    device: str = ""
    not_modelled: tuple[str, ...] = ()    # collectives the rows measured that the model has no form for

    def collective_seconds(self, collective: str, size_bytes: float, ranks: int) -> float:
        if collective == "recv":            # carried by the peer's send (harness.project.collectives)
            return 0.0
        if collective == "send" and "send" not in self.fits:
            # `harness comm` times no send; a broadcast between 2 ranks is one (a chain of one hop).
            return self.fit("broadcast").seconds(size_bytes, 2)
        return self.fit(collective).seconds(size_bytes, ranks)

    def algorithm(self, collective: str, size_bytes: float, ranks: int) -> str:
        """The algorithm the collective's fit assumed, at any size and rank count."""
        if collective in ("send", "recv") and collective not in self.fits:
            return "chain"
        return self.fit(collective).algorithm.value

    def link(self, collective: str) -> Link:
        return self.fit(collective).link

    def fit(self, collective: str) -> LinkFit:
        if collective not in self.fits:
            raise SpecError(f"no calibration rows for {collective}; calibrated: {', '.join(self.fits) or 'none'}")
        return self.fits[collective]

    def describe(self) -> str:
        """One line per collective: alpha, bandwidth, fixed cost, rows and spread of the residuals."""
        lines = [f"{'collective':<15} {'algorithm':<9} {'alpha us':>9} {'GB/s':>8} {'fixed us':>9} "
                 f"{'rows':>5} {'world sizes':>11} {'rms rel. resid.':>15}"]
        for name, fit in self.fits.items():
            bandwidth = 1e-9 / fit.seconds_per_byte if fit.seconds_per_byte > 0 else math.inf
            sizes = ",".join(str(w) for w in fit.world_sizes)
            lines.append(f"{name:<15} {fit.algorithm.value:<9} {fit.latency_s * 1e6:>9.1f} {bandwidth:>8.3f} "
                         f"{fit.fixed_s * 1e6:>9.1f} {len(fit.residuals):>5} {sizes:>11} "
                         f"{fit.rms_relative_residual:>15.1%}")
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class ServerLinkCalibration:
    """A dedicated parameter server's sends and recvs on a calibrated one-level link (Algorithm.STAR): every
    message, a recv as much as a send, priced as the calibration prices one send (the send's fit, else a 2-rank
    broadcast): a server receives in one phase and sends in a later one, so no send carries a recv."""

    calibration: Calibration

    def collective_seconds(self, collective: str, size_bytes: float, ranks: int) -> float:
        if collective not in ("send", "recv"):
            raise SpecError(f"a parameter server's links carry send and recv only, got {collective!r}")
        return self.calibration.collective_seconds("send", size_bytes, 2)

    def algorithm(self, collective: str, size_bytes: float, ranks: int) -> str:
        return Algorithm.STAR.value


@dataclass(frozen=True, slots=True)
class NodesCalibration:
    """Two calibrations and the ranks each node holds: `within_node` (ranks on one host: `harness comm` there)
    and `across_nodes` (one rank per node: `harness comm` across them). A group whose members all lie on one
    node is priced on the first, any other on the second; for the emulated cluster, whose ranks of one node
    talk over its loopback and across nodes over the shaped link (docs/clusters.md).

    Ranks are placed node by node (ranks 0 .. r-1 on node 0), so a group of g members `stride` ranks apart
    spans g x stride consecutive ranks and lies on one node when that is at most r (groups of a mesh tile the
    ranks, so r is a multiple of it there). A send crosses a node boundary somewhere once the ranks fill more
    than a node, and the step waits for the slowest boundary. Without a group (`for_group(ranks, 1)` of a
    collective among every rank) the rule is the same: all ranks on one node, or across."""

    within_node: Calibration
    across_nodes: Calibration
    ranks_per_node: int
    # Where the ranks outnumber the machine's cores, what a collective costs depends on what every other rank
    # is doing (waiting its turn on a core): calibrations measured under the cell's own layout, by (world size,
    # the group's ranks, their stride) (`harness comm --world-size N --group-size G --group-layout ...`), price
    # a group of that layout in a step of that world size ahead of the two levels above.
    layouts: Mapping[tuple[int, int, int], Calibration] = field(default_factory=dict)

    def for_group(self, collective: str, ranks: int, stride: int, world_size: int) -> Calibration:
        """The calibration that prices `collective` among `ranks` members `stride` apart in a step of
        `world_size` ranks."""
        # A send is a 2-rank broadcast of the group its two ends would form (`stride` apart).
        members = 2 if collective in ("send", "recv") else ranks
        measured = self.layouts.get((world_size, members, max(1, stride) if members < world_size else 1))
        if measured is not None:
            return measured
        if collective in ("send", "recv"):
            return self.within_node if world_size <= self.ranks_per_node else self.across_nodes
        if ranks * max(1, stride) <= self.ranks_per_node:
            return self.within_node
        if collective == "all_to_all" and stride <= 1 and self.ranks_per_node > 1:
            return SharedLinkAllToAll(self.within_node, self.across_nodes, self.ranks_per_node)
        return self.across_nodes

    def collective_seconds(self, collective: str, size_bytes: float, ranks: int) -> float:
        # Without a stride or world size: a collective among `ranks` neighbours.
        return self.for_group(collective, ranks, 1, ranks).collective_seconds(collective, size_bytes, ranks)

    def algorithm(self, collective: str, size_bytes: float, ranks: int) -> str:
        return self.for_group(collective, ranks, 1, ranks).algorithm(collective, size_bytes, ranks)


@dataclass(frozen=True, slots=True)
class SharedLinkAllToAll:
    """An all-to-all among ranks packed g to a node, each node's link shared by its g ranks (the emulated cluster's:
    ranks of a node on its loopback, every node on one shaped link). Pairwise (harness.project.collectives
    `_pairwise_all_to_all`): a rank's buffer of n bytes sends n / p to each peer, g - 1 of them on its node and
    p - g across, where its node's g ranks send at once, g (p - g) n / p bytes through the link. Priced as the
    within-node all-to-all of the g ranks' share (n g / p among g) and the one across nodes that puts those bytes
    through a link: the 2-rank all-to-all (one rank a node) of 2 g (p - g) n / p, which sends half of it across.
    The one-level form would put (p - 1) / p n through the link whatever g is: at 4 ranks on 2 nodes 3/4 n where
    the link carries n."""

    within_node: Calibration
    across_nodes: Calibration
    ranks_per_node: int

    def collective_seconds(self, collective: str, size_bytes: float, ranks: int) -> float:
        g = self.ranks_per_node
        return (self.within_node.collective_seconds(collective, size_bytes * g / ranks, g)
                + self.across_nodes.collective_seconds(collective, 2 * g * (ranks - g) * size_bytes / ranks, 2))

    def algorithm(self, collective: str, size_bytes: float, ranks: int) -> str:
        return self.across_nodes.algorithm(collective, size_bytes, 2)


def fit_calibration(records: Iterable[Mapping[str, Any]], algorithms: Mapping[str, str] | None = None) -> Calibration:
    """A Calibration from `harness comm` records: every collective they measured, each fitted in the
    one-link form of its algorithm (DEFAULT_ALGORITHMS, with `algorithms` replacing some)."""
    records = list(records)
    if not records:
        raise SpecError("no `harness comm` rows to calibrate from (kind \"commbench\")")
    points = calibration_points(records)
    chosen = {**DEFAULT_ALGORITHMS, **(algorithms or {})}
    measured = {point.collective for point in points}
    collectives = [c for c in DEFAULT_ALGORITHMS if c in measured]
    backends = sorted({str(record.get("backend", "")) for record in records})
    devices = sorted({str(record.get("device", "")) for record in records})
    if len(backends) > 1 or len(devices) > 1:
        raise SpecError(f"calibration rows mix backends {backends} or devices {devices}; calibrate one link at a time")
    links = sorted({str(((record.get("environment") or {}).get("emulated_network") or {}).get("link_rate_bits_per_s"))
                    for record in records})
    if len(links) > 1:
        raise SpecError(f"calibration rows mix emulated link rates (bits/s: {', '.join(links)}); calibrate one "
                        "link at a time (`project --validate` groups them by rate itself)")
    return Calibration(fits={c: fit_link(points, c, chosen[c]) for c in collectives},
                       backend=backends[0], device=devices[0],
                       not_modelled=tuple(sorted(measured - set(DEFAULT_ALGORITHMS))))


def load_calibration(paths: Iterable[Path | str], algorithms: Mapping[str, str] | None = None) -> Calibration:
    """fit_calibration over the `harness comm` rows of results files (other rows are skipped)."""
    from harness.record import COMMBENCH_KIND, read_rows

    return fit_calibration(read_rows([Path(p) for p in paths], kind=COMMBENCH_KIND), algorithms)
