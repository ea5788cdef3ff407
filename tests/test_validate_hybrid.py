"""The projection's validation of hybrid cells on the emulated cluster (harness.project.validate): a group
inside an emulated node priced on the host's loopback calibration, one across nodes on the link's, and the
plain loop's world-size-1 step as compute where the strategy has no cell of one rank. Worked out by hand."""

from __future__ import annotations

import copy

import pytest

from harness.project.fit import NodesCalibration, fit_calibration
from harness.project.validate import validate
from harness.record import COMMBENCH_KIND
from test_project_hybrid import ACTIVATION, BLOCK, ROOT, _fsdp2_tp_row, _plain_row

RATE = 80e6
LINK = (1e-3, 1e-7)          # across nodes: 1 ms a step, 10 MB/s
LOOPBACK = (1e-4, 1e-9)      # inside a node: 0.1 ms a step, 1 GB/s
PLAIN_STEP = 0.8             # the plain loop's step at the global batch 32 on one rank


def _ring_2(collective, n, alpha, beta):
    """A ring among 2 ranks: all-reduce 2 steps, 1 byte per byte through a link; all-gather and
    reduce-scatter 1 step, 1/2 byte per byte of the whole buffer (nccl-tests sizes)."""
    return 2 * alpha + n * beta if collective == "all_reduce" else alpha + n / 2 * beta


def _comm(alpha, beta, rate=None):
    rows = [{"collective": c, "size_bytes": n, "time_s": _ring_2(c, n, alpha, beta)}
            for c in ("all_reduce", "all_gather", "reduce_scatter") for n in (1e3, 1e4, 1e5, 1e6)]
    record = {"kind": COMMBENCH_KIND, "world_size": 2, "backend": "gloo", "device": "cpu", "rows": rows}
    if rate is not None:
        record["environment"] = {"emulated_network": {"link_rate_bits_per_s": rate}}
    return record


def _emulated(row, world_size, step, nodes=2):
    row = copy.deepcopy(row)
    row["spec"]["nnodes"] = nodes
    row["spec"]["world_size"] = world_size
    row["run_id"] = f"{row['spec']['strategy']}-{world_size}"
    row["environment"] = {"emulated_network": {"link_rate_bits_per_s": RATE, "shared_machine_cores": 2}}
    row["measurements"]["threads_per_rank"] = 1
    row["measurements"]["step_time_s"] = [step] * len(row["measurements"]["step_time_s"])
    return row


def _fsdp2_tp_at_2(step):
    """fsdp2-tp at 2 ranks (dp 1 x tp 2), one rank on each node: tensor parallelism's traffic alone, 128
    all-reduces of an activation (16 a micro-batch, as at 4 ranks, over the 8 micro-batches of 4 samples in
    the global batch of 32 that one replica runs)."""
    row = _emulated(_fsdp2_tp_row(), 2, step)
    tp = {"all_reduce": {"bytes": 128 * ACTIVATION, "calls": 128, "bytes_by_group_size": {"2": 128 * ACTIVATION},
                         "by_group": {"tp": {"calls": 128, "bytes": 128 * ACTIVATION}}, "group_ranks": {"tp": 2}}}
    m = row["measurements"]
    m.update(comm_per_step_by_rank=[tp] * 2, data_parallel=1, micro_batches_per_step=8,
             comm_expected_per_step={"collectives": [
                 {"collective": "all_reduce", "size_bytes": ACTIVATION, "calls": 128, "ranks": 2, "group": "tp",
                  "stride": 1}], "not_modelled_because": ""})
    m["parameters_held_by_rank"] = m["parameters_held_by_rank"][:2]
    return row


def _rows(step_2=1.2, step_4=0.7):
    return [_emulated(_plain_row(PLAIN_STEP), 1, PLAIN_STEP, nodes=1), _fsdp2_tp_at_2(step_2),
            _emulated(_fsdp2_tp_row(), 4, step_4)]


def test_tp_inside_an_emulated_node_is_priced_on_the_loopback_and_dp_across_on_the_link_by_hand():
    result = validate(_rows(), [_comm(*LINK, RATE), _comm(*LOOPBACK)])
    [at_4] = [c for c in result.cells if c.world_size == 4]
    alpha, beta = LINK
    # The source, 2 ranks on 2 nodes: compute is the plain loop's step for a rank's 16 of the 32 samples,
    # 0.4 s (2 ranks x 1 thread on 2 cores: no sharing); tp's 128 all-reduces cross the link:
    # 128 x (2 alpha + 65,536 beta) = 128 x 8.5536 ms = 1.0948608 s. f = (1.2 - 0.4) / 1.0948608.
    comm_2 = 128 * (2 * alpha + ACTIVATION * beta)
    assert comm_2 == pytest.approx(1.0948608)
    f = (1.2 - 0.4) / comm_2
    assert at_4.exposed_fraction == pytest.approx(f)
    # The held-out cell, 2 nodes x 2 ranks: tp (ranks 0-1, 2-3) inside a node on the loopback,
    # 64 x (2 x 0.1 ms + 65,536 x 1 ns) = 16.994304 ms; dp (ranks 0-2, 1-3) across on the link, all-gathers
    # 32 x (1 ms + 100,736 / 2 x 100 ns) + 8 x (1 ms + 147,968 / 2 x 100 ns) = 260.3648 ms and
    # reduce-scatters 4 x 6.0368 ms + 8.3984 ms = 32.5456 ms.
    tp_4 = 64 * (2 * LOOPBACK[0] + ACTIVATION * LOOPBACK[1])
    dp_4 = (32 * (alpha + BLOCK / 2 * beta) + 8 * (alpha + ROOT / 2 * beta)
            + 4 * (alpha + BLOCK / 2 * beta) + (alpha + ROOT / 2 * beta))
    assert (tp_4, dp_4) == (pytest.approx(0.016994304), pytest.approx(0.2603648 + 0.0325456))
    # Compute at 4: the plain step for 8 samples, 0.2 s, stretched x 2 by 4 ranks on 2 cores: 0.4 s.
    assert at_4.compute_s == pytest.approx(0.4)
    comm_4 = tp_4 + dp_4
    assert at_4.predicted_s == pytest.approx(0.4 + max(f * comm_4, comm_4 - 2 / 3 * 0.4))
    assert at_4.predicted_s == pytest.approx(0.6264, abs=1e-4)
    # Planted: priced on the link alone (the one-level model), tp's all-reduces would cost 64 x 8.5536 ms.
    one_level = 0.4 + f * (64 * (2 * alpha + ACTIVATION * beta) + dp_4)
    assert abs(one_level - at_4.predicted_s) > 0.3


def test_without_the_hosts_own_comm_rows_every_group_is_priced_on_the_link():
    result = validate(_rows(), [_comm(*LINK, RATE)])
    [at_4] = [c for c in result.cells if c.world_size == 4]
    alpha, beta = LINK
    comm_2 = 128 * (2 * alpha + ACTIVATION * beta)
    comm_4 = 64 * (2 * alpha + ACTIVATION * beta) + 36 * (alpha + BLOCK / 2 * beta) + 9 * (alpha + ROOT / 2 * beta)
    assert at_4.predicted_s == pytest.approx(0.4 + max(0.8 / comm_2 * comm_4, comm_4 - 2 / 3 * 0.4))


def test_a_group_lies_on_one_node_when_its_members_span_no_more_than_a_nodes_ranks():
    loopback, link = fit_calibration([_comm(*LOOPBACK)]), fit_calibration([_comm(*LINK, RATE)])
    two_a_node = NodesCalibration(within_node=loopback, across_nodes=link, ranks_per_node=2)
    assert two_a_node.for_group("all_reduce", 2, 1, 4) is loopback       # tp: ranks 0 and 1
    assert two_a_node.for_group("all_gather", 2, 2, 4) is link           # dp: ranks 0 and 2
    assert two_a_node.for_group("all_reduce", 4, 1, 4) is link           # every rank
    assert two_a_node.for_group("send", 2, 2, 4) is link                 # a stage on each node
    assert two_a_node.for_group("send", 2, 1, 2) is loopback             # both stages on one node
    one_a_node = NodesCalibration(within_node=loopback, across_nodes=link, ranks_per_node=1)
    assert one_a_node.for_group("all_reduce", 2, 1, 2) is link


def _shown(text, marker):
    start = text.index(f"<!-- {marker}")
    start = text.index("\n", start) + 1
    return text[start:text.index(f"<!-- /{marker} -->")].strip()


def test_the_first_hybrid_table_in_the_docs_is_its_committed_rows_validated():
    # The first emulated run of the hybrids (scripts/validate-hybrid-projection.sh at 100, 200 and 1000 Mbit/s, before
    # the layouts' rows and the degree-1 cells): the docs show what its committed rows give, on two levels (the
    # host's loopback rows are in comm.jsonl), and the one-level variant and the diagnostics they quote.
    from pathlib import Path
    from statistics import median

    from harness.derive.rows import load_rows
    from harness.project.validate import markdown_table
    from harness.record import read_rows

    root = Path(__file__).parent.parent
    reference = root / "results" / "reference" / "emulated-hybrid"
    rows = load_rows([reference / "cells.jsonl"])
    comm = read_rows([reference / "comm.jsonl"], kind=COMMBENCH_KIND)
    result = validate(rows, comm)
    assert len(result.cells) == 24 and not result.left_out
    assert {cell.launches for cell in result.cells} == {3}
    assert {c.strategy for c in result.cells} == {"tp", "fsdp2-tp", "autotp", "pipeline"}
    assert _shown((root / "docs" / "clusters.md").read_text(), "hybrid-validation-table") == markdown_table(result)
    assert result.baseline_median_abs_error < result.median_abs_error and not result.passes
    clusters = " ".join((root / "docs" / "clusters.md").read_text().split())     # lines joined
    assert (f"the median |error| is {result.median_abs_error:.1%} and the p90 {result.p90_abs_error:.1%}" in clusters)
    assert f"({result.baseline_median_abs_error:.1%}, {result.baseline_p90_abs_error:.1%})" in clusters
    one_level = validate(rows, [r for r in comm if (r.get("environment") or {}).get("emulated_network")])
    assert f"median {one_level.median_abs_error:.1%} and p90 {one_level.p90_abs_error:.1%}" in clusters
    assert set(one_level.taus.values()) == {1.0}

    def step_ms(strategy, world_size, rate):
        launches = [row for row in rows if row["spec"]["strategy"] == strategy
                    and row["spec"]["world_size"] == world_size
                    and row["environment"]["emulated_network"]["link_rate_bits_per_s"] == rate * 1e6]
        assert len(launches) == 3
        return median(median(row["measurements"]["step_time_s"]) for row in launches) * 1e3

    quoted = [f"{step_ms('fsdp2-tp', 4, rate):.1f}" for rate in (100, 200, 1000)]
    assert f"fsdp2-tp at 4 ranks took {quoted[0]}, {quoted[1]} and {quoted[2]} ms" in clusters
    assert f"took {step_ms('tp', 1, 100):.1f} ms for the 8 samples the plain loop ran in {step_ms('plain', 1, 100):.1f}" \
        in clusters


SHARED_PAIR = (5e-3, 1e-9)   # a pair inside a node while the other node's pair runs on the same 2 cores: 5 ms a step


def _time_sliced_comm(alpha, beta, group_size, stride, world_size=4):
    """`harness comm --world-size 4 --group-size 2` on the emulated cluster: 4 ranks on 2 cores, so the record is
    priced only for its own layout."""
    record = _comm(alpha, beta, RATE)
    record.update(world_size=world_size, group_size=group_size, group_stride=stride, threads_per_rank=1)
    record["environment"]["emulated_network"]["shared_machine_cores"] = 2
    return record


def test_a_layout_measured_on_shared_cores_prices_its_own_groups_ahead_of_the_two_levels():
    loopback, link = fit_calibration([_comm(*LOOPBACK)]), fit_calibration([_comm(*LINK, RATE)])
    inside, across, everyone = (fit_calibration([_comm(*LOOPBACK)]) for _ in range(3))
    nodes = NodesCalibration(within_node=loopback, across_nodes=link, ranks_per_node=2,
                             layouts={(4, 2, 1): inside, (4, 2, 2): across, (4, 4, 1): everyone})
    assert nodes.for_group("all_reduce", 2, 1, 4) is inside        # tp: ranks 0-1 and 2-3 at once
    assert nodes.for_group("all_gather", 2, 2, 4) is across        # dp: ranks 0-2 and 1-3 at once
    assert nodes.for_group("all_reduce", 4, 1, 4) is everyone
    assert nodes.for_group("send", 2, 2, 4) is across              # a stage on each node, its replicas beside
    assert nodes.for_group("all_reduce", 2, 1, 2) is loopback      # at 2 ranks (one node): no layout measured there


def test_time_sliced_comm_rows_price_their_layout_in_a_cell_and_stay_out_of_the_links_fit_by_hand():
    from harness.project.validate import calibrations_by_network, layouts_by_network, network_key

    comm = [_comm(*LINK, RATE), _comm(*LOOPBACK), _time_sliced_comm(*SHARED_PAIR, 2, 1)]
    [link] = [c for key, c in calibrations_by_network(comm).items() if key != network_key({})]
    # The link's fit holds its own 2-rank rows alone: an all-reduce of 1 MB, 2 alpha + n beta = 102 ms.
    assert link.collective_seconds("all_reduce", 1e6, 2) == pytest.approx(2 * LINK[0] + 1e6 * LINK[1])
    [layouts] = layouts_by_network(comm).values()
    assert list(layouts) == [(4, 2, 1)]
    result = validate(_rows(), comm)
    [at_4] = [c for c in result.cells if c.world_size == 4]
    alpha, beta = LINK
    f = (1.2 - 0.4) / (128 * (2 * alpha + ACTIVATION * beta))
    # tp's pairs at 4 ranks on the shared cores' rows: 64 x (2 x 5 ms + 65,536 x 1 ns) = 644.194304 ms; dp across
    # on the link as before (292.9104 ms).
    tp_4 = 64 * (2 * SHARED_PAIR[0] + ACTIVATION * SHARED_PAIR[1])
    assert tp_4 == pytest.approx(0.644194304)
    comm_4 = tp_4 + 0.2603648 + 0.0325456
    assert at_4.predicted_s == pytest.approx(0.4 + max(f * comm_4, comm_4 - 2 / 3 * 0.4))
    # Planted: the same rows fitted into the link's calibration instead would leave tp on the loopback (0.6264 s).
    assert at_4.predicted_s - 0.6264 > 0.4


def test_a_layout_that_needs_several_ranks_takes_its_compute_from_its_own_cell_of_one_rank():
    # fsdp2-tp[tp=1] on one rank (DTensor's and FSDP2's machinery, no communication): 1.6 s for the 32 samples,
    # twice the plain loop's 0.8 s. The source at 2 ranks runs 16 samples a rank: compute 0.8 s, not 0.4.
    own = _emulated(_fsdp2_tp_row(), 1, 1.6, nodes=1)
    own["spec"]["options"] = {"tp": 1}
    own["measurements"].update(data_parallel=1, comm_per_step_by_rank=[{}], parameters_held_by_rank=[236_928],
                               comm_expected_per_step={"collectives": [], "not_modelled_because": ""})
    result = validate([*_rows(), own], [_comm(*LINK, RATE), _comm(*LOOPBACK)])
    [at_4] = [c for c in result.cells if c.world_size == 4]
    # At 4 ranks: 8 samples a rank, 0.4 s, stretched x 2 by 4 ranks on 2 cores.
    assert at_4.compute_s == pytest.approx(0.8)
    alpha, beta = LINK
    assert at_4.exposed_fraction == pytest.approx((1.2 - 0.8) / (128 * (2 * alpha + ACTIVATION * beta)))


def test_only_a_cell_of_the_same_options_at_degree_one_stands_in_for_a_layouts_compute():
    from harness.project.projection import at_degree_one

    assert at_degree_one({"tp": 1}, {"tp": 2}) and at_degree_one({"stages": 1}, {"stages": 4})
    assert at_degree_one({"tp": 1, "activation_checkpointing": "blocks"}, {"tp": 2, "activation_checkpointing": "blocks"})
    # Other work on the rank: no activation checkpointing for a cell with it, or a missing option.
    assert not at_degree_one({"tp": 1, "activation_checkpointing": "none"}, {"tp": 2, "activation_checkpointing": "blocks"})
    assert not at_degree_one({}, {"tp": 2}) and not at_degree_one({"tp": 2}, {"tp": 4})


def test_the_hybrid_table_in_the_docs_and_the_readme_are_the_committed_run_from_a_clean_commit_validated():
    # The run with the layouts' comm rows and each layout's cell of one rank (docs/clusters.md): every launch ok and
    # clean, the table and the figures the docs and the README quote, the baseline beaten, the bars not met.
    from pathlib import Path

    from harness.derive.rows import load_rows
    from harness.project.validate import markdown_table, time_sliced
    from harness.record import read_rows

    root = Path(__file__).parent.parent
    reference = root / "results" / "reference" / "emulated-hybrid-layouts"
    rows = load_rows([reference / "cells.jsonl"])
    comm = read_rows([reference / "comm.jsonl"], kind=COMMBENCH_KIND)
    assert len(rows) == 117 and {r["status"] for r in rows} == {"ok"}
    assert {r["environment"]["git_dirty"] for r in rows} == {False}
    result = validate(rows, comm)
    assert len(result.cells) == 24 and not result.left_out and {c.launches for c in result.cells} == {3}
    assert _shown((root / "docs" / "clusters.md").read_text(), "hybrid-layouts-validation-table") == markdown_table(result)
    assert result.median_abs_error < result.baseline_median_abs_error
    assert result.p90_abs_error < result.baseline_p90_abs_error and not result.passes
    figures = (f"median |error| {result.median_abs_error:.1%}, p90 {result.p90_abs_error:.1%}, better than copying the "
               f"source cell's step ({result.baseline_median_abs_error:.1%}, {result.baseline_p90_abs_error:.1%})")
    assert figures in " ".join((root / "README.md").read_text().split())
    clusters = " ".join((root / "docs" / "clusters.md").read_text().split())
    assert (f"the median |error| is {result.median_abs_error:.1%} and the p90 {result.p90_abs_error:.1%}, tau "
            f"{min(result.taus.values()):.2f} to {max(result.taus.values()):.2f}") in clusters
    # The ablations the docs quote: each rule taken away on these rows.
    without_layouts = validate(rows, [c for c in comm if not time_sliced(c)])
    without_one_rank = validate([r for r in rows if not (r["spec"]["world_size"] == 1 and r["spec"]["strategy"]
                                                         in ("fsdp2-tp", "autotp", "pipeline"))], comm)
    assert (f"without the layouts' rows, median {without_layouts.median_abs_error:.1%} and p90 "
            f"{without_layouts.p90_abs_error:.1%}; without the degree-1 cells, {without_one_rank.median_abs_error:.1%} "
            f"and {without_one_rank.p90_abs_error:.1%}") in clusters


def test_the_8_rank_layout_rows_make_the_extrapolation_worse_as_the_docs_say():
    # docs/clusters.md, "Extrapolation from a frozen commit": the layouts' rule given 8-rank rows of the emulated
    # cluster, beside the 2-rank rows the extrapolation was validated on.
    from pathlib import Path

    from harness.derive.rows import load_rows
    from harness.project.validate import Design
    from harness.record import read_rows

    root = Path(__file__).parent.parent
    reference = root / "results" / "reference" / "extrapolation"
    rows = load_rows([reference / "cells.jsonl"])
    comm = read_rows([reference / "comm.jsonl"], kind=COMMBENCH_KIND)
    eight = read_rows([reference / "comm-ws8-diagnostic.jsonl"], kind=COMMBENCH_KIND)
    assert {(r["world_size"], r["group_size"]) for r in eight} == {(8, 8)}
    frozen, priced = (validate(rows, c, design=Design.LARGER) for c in (comm, [*comm, *eight]))
    assert priced.median_abs_error > frozen.median_abs_error and priced.p90_abs_error > frozen.p90_abs_error
    clusters = " ".join((root / "docs" / "clusters.md").read_text().split())
    assert (f"miss by a median of {priced.median_abs_error:.1%} and a p90 of {priced.p90_abs_error:.1%} (against "
            f"{frozen.median_abs_error:.1%}, {frozen.p90_abs_error:.1%})") in clusters

    def error(cells, strategy, rate):
        [cell] = [c for c in cells if c.strategy == strategy and c.setting == f"{rate} Mbit/s"]
        return f"{cell.error:+.1%}"

    for strategy in ("fsdp2", "zero3", "horovod"):
        assert f"from {error(frozen.cells, strategy, 400)} to {error(priced.cells, strategy, 400)}" in clusters
