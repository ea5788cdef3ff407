"""An expert-parallel row's all-to-alls carried to another world size by the projection (harness.project.projection
`schedule_at`): each dispatch and combine is a call per block and micro-batch of one micro-batch's routed rows, so
under a fixed micro-batch its calls follow the micro-batches a rank runs and its size stays. Worked by hand on moe-tiny's
`ep` at 2 ranks (global batch 32, micro-batch 4: 4 micro-batches a rank; 4 blocks x 4 exchanges = 64 calls a step)."""

import pytest

from harness.project.facts import REGISTRY_FACTS
from harness.project.projection import Basis, Scheduled, description_basis, schedule_at
from harness.spec import SpecError

DENSE_BYTES = 465_152            # moe-tiny's 116,288 dense fp32 gradients: DDP's one all-reduce a step
ALL_TO_ALL_CALL = 152_104.0      # a call's mean bytes as a row counted it


def ep_basis(strategy: str = "ep", options: dict | None = None) -> Basis:
    schedule = (Scheduled(collective="all_reduce", size_bytes=DENSE_BYTES, calls=1.0),
                Scheduled(collective="all_to_all", size_bytes=ALL_TO_ALL_CALL, calls=64.0))
    return Basis(workload="moe-tiny", strategy=strategy, options=options or {}, precision="fp32", recipe="fp32",
                 parameters=263_744, kept_whole=0, tokens_per_sample=64.0, per_device_batch=16.0, global_batch=32,
                 micro_batch=4, compute_s=0.1, world_size=2, micro_batches=4, schedule=schedule,
                 gradient_bytes=DENSE_BYTES, gathered_bytes=DENSE_BYTES, exposed_fraction=1.0, overlap_source="given")


def test_the_all_to_alls_follow_the_micro_batches_and_keep_their_size():
    # At 4 ranks each runs 2 micro-batches: 32 calls of the same size; DDP's all-reduce stays one call of the dense
    # gradients (ep's expected traffic: the same at every world size).
    scheduled, notes = schedule_at(ep_basis(), 4, 2, REGISTRY_FACTS)
    found = {s.collective: (s.size_bytes, s.calls, s.group) for s in scheduled}
    assert found == {"all_reduce": (DENSE_BYTES, 1.0, None), "all_to_all": (ALL_TO_ALL_CALL, 32.0, None)}
    assert any("micro-batches a rank runs" in note for note in notes)
    # At 8 ranks, 1 micro-batch each: 16 calls.
    scheduled, _ = schedule_at(ep_basis(), 8, 1, REGISTRY_FACTS)
    assert {s.collective: s.calls for s in scheduled}["all_to_all"] == 16.0


def test_a_strategy_that_shards_no_experts_keeps_a_counted_all_to_all_as_it_was():
    # DDP expects no all-to-all: one counted on it is kept per step, said so, not scaled as experts' would be.
    scheduled, notes = schedule_at(ep_basis("ddp"), 4, 2, REGISTRY_FACTS)
    assert {s.collective: s.calls for s in scheduled}["all_to_all"] == 64.0
    assert any("not in ddp's expected traffic" in note for note in notes)


def test_an_expert_strategy_described_by_a_parameter_count_alone_is_refused_in_one_line():
    for strategy in ("ep", "horovod-ep", "deepspeed-moe"):
        with pytest.raises(SpecError, match=f"{strategy} shards an MoE model's experts"):
            description_basis(strategy=strategy, parameters=10**9, compute_s=1.0)


class Recorded:
    """A calibration that records what it is asked to price and prices it at its size."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, float, int]] = []

    def collective_seconds(self, collective: str, size_bytes: float, ranks: int) -> float:
        self.asked.append((collective, size_bytes, ranks))
        return size_bytes

    def algorithm(self, collective: str, size_bytes: float, ranks: int) -> str:
        return "pairwise"


def test_an_all_to_all_across_emulated_nodes_puts_its_ranks_crossing_bytes_through_one_link():
    # 4 ranks on 2 nodes, a buffer of n = 1,000 bytes: each rank sends 250 to each peer, one on its node and two
    # across; its node's 2 ranks send 2 x 500 = 1,000 bytes through the link. Priced as the 2 ranks' own exchange of
    # their share (n g / p = 500 among 2) and as the 2-rank all-to-all that sends 1,000 across (2,000: half of a
    # 2-rank buffer crosses).
    from harness.project.fit import NodesCalibration, SharedLinkAllToAll

    within, across = Recorded(), Recorded()
    nodes = NodesCalibration(within_node=within, across_nodes=across, ranks_per_node=2)
    shared = nodes.for_group("all_to_all", 4, 1, 4)
    assert isinstance(shared, SharedLinkAllToAll)
    assert shared.collective_seconds("all_to_all", 1_000.0, 4) == 500.0 + 2_000.0
    assert within.asked == [("all_to_all", 500.0, 2)] and across.asked == [("all_to_all", 2_000.0, 2)]
    # A rank a node (2 ranks on 2 nodes): the link's own 2-rank form; 2 ranks of one node: the loopback's.
    assert NodesCalibration(within_node=within, across_nodes=across, ranks_per_node=1).for_group(
        "all_to_all", 2, 1, 2) is across
    assert nodes.for_group("all_to_all", 2, 1, 4) is within
    # Other collectives keep the one-level form across nodes.
    assert nodes.for_group("all_reduce", 4, 1, 4) is across


def test_a_grouped_expert_row_carries_its_counted_all_to_alls_beside_its_expected_traffic():
    # deepspeed-moe at 4 ranks names its groups (the experts' replicas, the capacity's all-reduce), so its schedule
    # at another size is its expected traffic there, which no all-to-all is in: the counted ones are carried, among
    # the expert group it forms at that size (every rank: 2), their calls with the micro-batches (2 -> 4 a rank).
    from harness.project.projection import grouped_schedule_at

    basis = ep_basis("deepspeed-moe")
    basis = Basis(**{**basis.__dict__, "world_size": 4, "micro_batches": 2, "grouped": True, "schedule": (
        Scheduled(collective="all_to_all", size_bytes=ALL_TO_ALL_CALL, calls=32.0, group=4, label="group 5 of 4"),)})
    schedule, data_parallel, micro_batches, _ = grouped_schedule_at(basis, 2, 32, REGISTRY_FACTS)
    assert (data_parallel, micro_batches) == (2, 4)
    carried = [s for s in schedule if s.collective == "all_to_all"]
    assert [(s.size_bytes, s.calls, s.group) for s in carried] == [(ALL_TO_ALL_CALL, 64.0, 2)]
    # Beside it, ZeRO-2's expected traffic of the dense part among both ranks: a reduce-scatter every micro-batch.
    assert any(s.collective == "reduce_scatter" and s.calls == 4.0 and s.group == 2 for s in schedule)
