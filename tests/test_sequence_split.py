"""A sequence split over ranks, without a launch: which tokens a rank holds and the causal work they give it, the
planted mask's leak, the Ulysses and ring exchanges a step should issue (worked by hand from the shapes), the layouts
and refusals, the activations a Ulysses rank saves, and the long-context matrix."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from harness.derive.activations import block_bytes, predicted_activation_bytes
from harness.machine import Machine
from harness.matrix import Selection, build_matrix
from harness.spec import DeviceKind, Precision, RunSpec
from harness.strategies import STRATEGIES, checked
from harness.strategies.sequence_parallel import (causal_work_by_rank, plant_causal_leak, shard_boundaries,
                                                  token_indices)
from workloads import get_workload
from workloads.attention import CausalAttention, attention_cores, leaking_causal_mask

ULYSSES, CP = STRATEGIES["ulysses"], STRATEGIES["cp"]


def spec(strategy: str, workload: str = "gpt-tiny-long", world_size: int = 2, precision=Precision.FP32, **options):
    return RunSpec(workload=workload, strategy=strategy, world_size=world_size, global_batch=8, micro_batch=2,
                   precision=precision, warmup_steps=2, timed_steps=3, device=DeviceKind.CPU, options=options)


def test_a_rank_holds_a_contiguous_slice_or_the_ring_s_head_and_tail_chunks():
    assert token_indices(8, 2, 1, load_balanced=False).tolist() == [4, 5, 6, 7]
    # 2 x 2 chunks of 2: rank 0 the first and the last, rank 1 the two middle ones.
    assert token_indices(8, 2, 0, load_balanced=True).tolist() == [0, 1, 6, 7]
    assert token_indices(8, 2, 1, load_balanced=True).tolist() == [2, 3, 4, 5]
    assert shard_boundaries(8, 2, load_balanced=False) == (4,)
    assert shard_boundaries(16, 2, load_balanced=True) == (4, 8, 12)


def test_the_head_tail_chunks_even_out_the_causal_work():
    # A query at place p sees p + 1 keys. Contiguous halves of 8: 1+2+3+4 = 10 and 5+6+7+8 = 26; head and tail:
    # 1+2+7+8 = 18 and 3+4+5+6 = 18.
    assert causal_work_by_rank(8, 2, load_balanced=False) == [10, 26]
    assert causal_work_by_rank(8, 2, load_balanced=True) == [18, 18]


def test_the_planted_leak_lets_one_future_key_through_at_each_boundary():
    mask = leaking_causal_mask(4, (2,), torch.device("cpu"))
    assert mask.tolist() == [[True, False, False, False], [True, True, True, False],
                             [True, True, True, False], [True, True, True, True]]
    q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
    core = CausalAttention()
    honest = core(q, k, v)
    expected = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
    torch.testing.assert_close(honest, expected, rtol=0, atol=0)
    core.leak_at = (2,)
    leaked = core(q, k, v)
    # Query 1 (the last before the boundary) changed; every other query is the honest one.
    changed = (leaked - honest).abs().amax(dim=(0, 2, 3))
    assert changed[1] > 0 and changed[[0, 2, 3]].abs().max() == 0


def test_the_leak_is_refused_where_it_would_plant_nothing():
    layers = get_workload("gpt-tiny-long").build_layers()
    with pytest.raises(ValueError, match="ulysses"):
        plant_causal_leak(layers, spec("cp"), CP)                  # the ring keeps its own mask
    with pytest.raises(ValueError, match="ulysses"):
        plant_causal_leak(layers, spec("plain", world_size=1), STRATEGIES["plain"])
    plant_causal_leak(layers, spec("ulysses", world_size=4), ULYSSES)
    assert {core.leak_at for core in attention_cores(torch.nn.Sequential(*layers))} == {(64, 128, 192)}


def test_a_replica_is_a_group_of_ranks_sharing_its_samples():
    four = spec("ulysses", world_size=4, sp=2)
    layout = ULYSSES.layout(four)
    assert (layout.data_parallel, layout.per_replica_batch, layout.micro_batches) == (2, 4, 2)
    assert [ULYSSES.replica(four, type("C", (), {"rank": r})()) for r in range(4)] == [0, 0, 1, 1]
    assert ULYSSES.state_sharding_ranks(four) == 4              # ZeRO over all of them
    assert ULYSSES.layout(spec("ulysses", world_size=4)).micro_batches == 4


def test_cells_a_sequence_cannot_split_over_are_refused_in_one_line():
    assert "2 key/value heads must both divide" in ULYSSES.layout_refusal(spec("ulysses", "llama-tiny-long", 4))
    assert ULYSSES.layout_refusal(spec("ulysses", "llama-tiny-long", 2)) is None
    assert "resnet" in ULYSSES.layout_refusal(spec("ulysses", "resnet20-cifar", 2))
    assert ">= 2 ranks" in CP.layout_refusal(spec("cp", world_size=1))
    # gpt-tiny's 64 tokens: 2 x 4 ring chunks of 8; gpt-tiny-long's 256 not 2 x 256 chunks.
    assert CP.layout_refusal(spec("cp", "gpt-tiny", 4)) is None
    assert "sequence of 256 tokens does not split into 2 x cp=256 chunks" in CP.layout_refusal(
        spec("cp", "gpt-tiny-long", 256))
    assert "CUDA attention kernels alone" in CP.skip_reason(spec("cp"))
    with pytest.raises(Exception, match="sp=3 must divide the world size 4"):
        checked(spec("ulysses", world_size=4, sp=3))


def test_ulysses_expects_eight_all_to_alls_a_block_and_micro_batch_worked_by_hand():
    layers = get_workload("llama-tiny-long").build_layers()
    traffic = ULYSSES.expected_traffic(spec("ulysses", "llama-tiny-long", 2, Precision.BF16), layers)
    exchanges = sorted((c.size_bytes, c.calls, c.ranks, c.group) for c in traffic.collectives
                       if c.collective == "all_to_all")
    # b 2 x s/P 128 tokens x 16 values x 2 bytes (bf16): q and the output 4 heads, k and v 2; 4 blocks x 4
    # micro-batches x (forward + backward) x 2 tensors of each size.
    assert exchanges == [(2 * 128 * 2 * 16 * 2, 64, 2, "sp"), (2 * 128 * 4 * 16 * 2, 64, 2, "sp")]
    # ZeRO-2 among all the ranks, beside them.
    zero = {(c.collective, c.ranks) for c in traffic.collectives if c.collective != "all_to_all"}
    assert zero == {("reduce_scatter", 2), ("all_gather", 2)}


def test_the_ring_expects_its_key_value_passes_worked_by_hand():
    layers = get_workload("gpt-tiny-long").build_layers()

    def ring(method):
        traffic = CP.expected_traffic(spec("cp", world_size=4, precision=Precision.BF16, rotate_method=method), layers)
        return sorted((c.collective, c.size_bytes, c.calls) for c in traffic.collectives if c.group == "cp")

    block = 2 * 2 * 64 * 4 * 16 * 2            # keys and values of b 2 x s/P 64 tokens x 4 heads x 16, bf16: 32,768
    gradients = 2 * block                      # accumulated in fp32
    blocks = 4 * 4                             # 4 blocks x 4 micro-batches
    assert ring("allgather") == [("all_gather", 4 * block, 2 * blocks), ("all_to_all", gradients, 4 * blocks)]
    assert ring("alltoall") == [("all_to_all", block, 2 * 3 * blocks), ("all_to_all", gradients, 4 * blocks)]


def test_a_ulysses_rows_predicted_blocks_are_at_its_tokens_with_the_output_s_exchange():
    shape = {"family": "gpt", "seq_len": 256, "n_layer": 4, "n_embd": 64, "n_head": 4}
    row = {"workload_description": shape, "precision_recipe": "fp32",
           "strategy_config": {"sequence_split": 2, "sequence_attention": "ulysses"}}
    spec_ = {"workload": "gpt-tiny-long", "strategy": "ulysses", "micro_batch": 2, "precision": "fp32"}
    # 256 tokens a rank: 17 values of 4 bytes a token and feature (GPT's 16 and the output's exchange), 16 B of norm
    # statistics and 16 B of log-sum-exp a token.
    block = 256 * 64 * 17 * 4 + 16 * 256 + 16 * 256
    assert block == 1_122_304
    assert predicted_activation_bytes(spec_, row) == 4 * block
    # The ring at the same split saves the block at its tokens, nothing added.
    ring = {**row, "strategy_config": {"sequence_split": 2, "sequence_attention": "ring"}}
    assert predicted_activation_bytes({**spec_, "strategy": "cp"}, ring) == 4 * (block - 256 * 64 * 4)
    # Llama's under Ulysses: v no longer keeps wqkv's whole output alive (one h_kv fewer than its plain block).
    plain = block_bytes(seq_len=128, micro_batch=2, hidden=64, heads=4, kv_heads=2, intermediate=192)
    split = block_bytes(seq_len=256, micro_batch=2, hidden=64, heads=4, kv_heads=2, intermediate=192, cp=2,
                        ulysses=True)
    assert plain.total - split.total == 256 * 32 * 4


def test_the_long_context_matrix_runs_ulysses_and_cp_beside_whole_samples():
    cells = build_matrix("long-context", Machine(device=DeviceKind.CPU, devices_per_node=2), Selection())
    labels = {spec_.label for spec_ in cells}
    for workload in ("gpt-tiny-long", "llama-tiny-long"):
        for precision in ("fp32", "bf16"):
            assert f"{workload}/plain/ws1/gb8/mb2/{precision}/cpu" in labels
            for strategy in ("ddp", "fsdp2", "ulysses", "cp"):
                assert f"{workload}/{strategy}/ws4/gb8/mb2/{precision}/cpu" in labels
            assert f"{workload}/ulysses[sp=2]/ws4/gb8/mb2/{precision}/cpu" in labels
            assert f"{workload}/cp[cp=2]/ws4/gb8/mb2/{precision}/cpu" in labels
    assert {spec_.strategy for spec_ in cells} == {"plain", "ddp", "fsdp2", "ulysses", "cp"}


def test_the_ab_tier_names_the_ring_as_skipped_on_its_cpu_and_times_ulysses():
    from harness.ab import refused_cells

    refused = refused_cells(["cp", "ulysses"])
    assert set(refused) == {"cp"} and refused["cp"].startswith("torch's context parallelism handles the CUDA")


def test_a_rows_attention_figures_and_the_report_lines_worked_by_hand():
    import pandas as pd

    from harness.derive.sequence import sequence_columns
    from harness.report.sequence import sequence_lines

    # Two ranks: 8,388,608 and 8,388,608 B of all-to-alls in `sp`, beside a ZeRO all-gather in another group, against
    # 64 expected calls of 131,072 B.
    counted = {"all_to_all": {"bytes": 8_388_608.0, "by_group": {"sp": {"bytes": 8_388_608.0, "calls": 128.0}}},
               "all_gather": {"bytes": 996_864.0, "by_group": {"group 2 of 2": {"bytes": 996_864.0}}}}
    m = {"strategy_config": {"sequence_split": 2, "sequence_attention": "ulysses"},
         "comm_per_step_by_rank": [counted, counted],
         "comm_expected_per_step": {"collectives": [
             {"collective": "all_to_all", "size_bytes": 131_072, "calls": 64, "ranks": 2, "group": "sp"},
             {"collective": "all_gather", "size_bytes": 996_864, "calls": 1, "ranks": 2, "group": "world"}]},
         "strategy_figures_by_rank": [{"sequence_parallel": {"causal_work_by_rank": [65_792, 65_792]}}] * 2}
    columns = sequence_columns(m)
    assert columns == {"sequence_split": 2, "sequence_attention": "ulysses", "causal_balance": 1.0,
                       "attention_bytes_per_step": 8_388_608.0, "attention_expected_bytes_per_step": 8_388_608.0,
                       "attention_counted_over_expected": 1.0}
    assert sequence_columns({"strategy_config": {}}) == {}
    off = {**columns, "attention_bytes_per_step": 4_194_304.0, "attention_counted_over_expected": 0.5}
    cells = pd.DataFrame([
        {"label": "gpt-tiny-long/plain/ws1/gb8/mb2/fp32/cpu", "workload": "gpt-tiny-long", "precision": "fp32",
         "world_size": 1, "status": "ok", "saved_activation_bytes": 9_771_012.0, "sequence_split": None},
        {"label": "gpt-tiny-long/ulysses/ws2/gb8/mb2/fp32/cpu", "workload": "gpt-tiny-long", "precision": "fp32",
         "world_size": 2, "status": "ok", "saved_activation_bytes": 5_147_652.0, **columns},
        {"label": "gpt-tiny-long/ulysses[sp=2]/ws4/gb8/mb2/fp32/cpu", "workload": "gpt-tiny-long",
         "precision": "fp32", "world_size": 4, "status": "ok", "saved_activation_bytes": 5_147_652.0, **off}])
    lines = sequence_lines(cells)
    assert lines[0].endswith("Ulysses' all-to-alls 8 MiB a step on its busiest rank, as its strategy expects.")
    assert "EXPECTED 8 MiB (counted / expected 0.5 on its furthest rank)" in lines[1]
    assert lines[2] == ("gpt-tiny-long fp32: saved for backward a rank, by the tokens of a sample it holds: 256 tokens "
                        "9.32 MiB (plain ws1); 128 tokens 4.91 MiB (ulysses ws2, ulysses[sp=2] ws4).")
