"""`harness project --params` for the hybrids (tp, fsdp2-tp, the pipeline), priced by `harness plan`'s schedule of
their layout (harness.project.layouts.described_schedule_at); compute from FLOPs at the compute MFU fitted on
published runs where --compute-ms is left out; a recipe a strategy cannot run refused as `harness memory` refuses it.

The hand-worked row: `tp` over one 8-GPU node of dgx-h100-ib (NVLink 450 GB/s a GPU one way, 3.4 us a step), a 7B
model of shape 4096,4096,32,32, one sample a device, weak scaling: one replica of 8 ranks running 8 samples as 8
micro-batches of 1.
"""

from __future__ import annotations

import pytest

from harness.cli import main
from harness.project.cluster import preset
from harness.project.collectives import ClusterModel
from harness.project.mfu_model import mfu_model
from harness.project.model import Decoder
from harness.project.plan import Settings, plan
from harness.project.projection import Scaling
from harness.project.run import project_description
from one_line import assert_one_line_error   # tests/one_line.py

GIB = 2 ** 30
P, S, H, A, L = 7_000_000_000, 4096, 4096, 32, 32
SHAPE = {"seq_len": S, "n_embd": H, "n_head": A, "n_layer": L}
PEAK = 989.4e12                         # H100 SXM5 bf16 dense (NVIDIA H100 whitepaper)
B_INTRA, ALPHA_INTRA = 450e9, 3.4e-6    # dgx-h100-ib's NVLink: bytes/s a GPU one way, seconds a ring step
MODEL = ClusterModel(preset("dgx-h100-ib"))


def described(strategies, world_sizes, **extra):
    description = dict(parameters=P, compute_s=0.5, per_device_batch=1, recipe="autocast", shape=SHAPE)
    return project_description(strategies, MODEL, world_sizes, (Scaling.WEAK,), **(description | extra))


def test_tp_over_one_node_worked_by_hand():
    [row], skipped = described(["tp"], [8])
    assert not skipped
    # Megatron (Shoeybi et al. 2019, sec. 3): each block's forward all-reduces its two row-parallel outputs, its
    # backward the input gradients of its two column-parallel layers: 2 + 2 all-reduces of b x s x h values a block,
    # for every micro-batch. Under autocast the forward's are in bf16 (2 bytes), the backward's in fp32 (4 bytes).
    values, k = 1 * S * H, 8                # b = 1 sample a micro-batch, 8 micro-batches a step
    calls = 2 * L * k                       # 512 of each
    t = 8

    def ring_all_reduce(n: float) -> float:
        # The alpha-beta ring among the t GPUs of one node (NCCL's ring: reduce-scatter then all-gather, 2(t-1)
        # steps of n/t bytes): 2(t-1) alpha + 2(t-1)/t x n / B_intra.
        return 2 * (t - 1) * ALPHA_INTRA + 2 * (t - 1) / t * n / B_INTRA

    comm = calls * ring_all_reduce(2 * values) + calls * ring_all_reduce(4 * values)
    assert comm == pytest.approx(0.2492, abs=1e-4)      # 91.2 ms forward + 158.0 ms backward
    assert row.comm_s == pytest.approx(comm, rel=1e-9)
    assert [item.collective for item in row.schedule] == ["all_reduce", "all_reduce"]
    assert row.algorithms == ("ring", "ring")      # NCCL picks the ring over the tree at these sizes
    # One replica: no data-parallel traffic. Every byte exposed (f = 1): step = compute + comm.
    assert row.step_s == pytest.approx(0.5 + comm, rel=1e-9)
    # Model states: torch AdamW's 4 + 4 + 8 bytes over what a rank holds: each block's split layers / 8, its two
    # LayerNorms and two row-parallel biases (6 h) whole; the final LayerNorm (2 h) whole. The stated 7B less the
    # final norm is the blocks', each in the shape's proportions (12 h^2 + 13 h a block).
    per_block = (P - 2 * H) / L
    whole = per_block * 6 * H / (12 * H * H + 13 * H)
    held = L * ((per_block - whole) / 8 + whole) + 2 * H
    assert row.model_state_bytes_per_rank == pytest.approx(held * 16, rel=1e-9)


@pytest.mark.parametrize("text, label, gpus", [
    ("tp", "tp tp=8 x dp=1", 8),
    ("fsdp2-tp[tp=8]", "fsdp2-tp tp=8 x dp=8", 64),
    ("pipeline[stages=4]", "pipeline pp=4 x dp=16", 64),
])
def test_project_and_plan_price_a_hybrid_alike(text, label, gpus):
    # plan at one sample a micro-batch and one a GPU a step, under autocast as the projection takes it: the same
    # layout, micro-batches, collectives and compute from FLOPs.
    model = Decoder(seq_len=S, hidden=H, heads=A, layers=L, stated_parameters=P)
    settings = Settings(global_batch=gpus, tokens=1e9, micro_batch=1, recipe="autocast")
    planned = {p.layout.label: p for p in plan(model, preset("dgx-h100-ib"), gpus // 8, settings)}[label]
    assert planned.fits
    [row], _ = described([text], [gpus], compute_s=None)
    assert row.comm_s == pytest.approx(planned.comm_s, rel=1e-12)
    assert row.compute_s == pytest.approx(planned.compute_s, rel=1e-12)
    assert row.model_state_bytes_per_rank == pytest.approx(planned.memory.states, rel=1e-9)   # a count, rounded
    # The projection exposes every byte (f = 1 unless --exposed-fraction); the plan the fitted share of the
    # data-parallel collectives: one step where there are none.
    if label.endswith("dp=1"):
        assert row.step_s == pytest.approx(planned.step_s, rel=1e-12)
    # Compute from FLOPs, by hand: PaLM's 6N + 12 L h s a token (N the stated 7B, a tied head and no vocabulary),
    # a GPU's 4096 tokens, over the peak x the fitted compute MFU of a 7B model on an H100 (x the pipeline's bubble
    # (K + S - 1) / K at K = 4 micro-batches a replica through 4 stages).
    fitted = mfu_model()
    mfu = 1 / (fitted.per_gpu["H100"] + fitted.size * 0.845098040014 + 0)       # log10(7) = 0.845098...
    bubble = (4 + 4 - 1) / 4 if text.startswith("pipeline") else 1.0
    assert row.compute_s == pytest.approx(S * (6 * P + 12 * L * H * S) / (PEAK * mfu) * bubble, rel=1e-9)


def test_the_command_projects_the_hybrids_and_says_compute_is_from_flops(capsys):
    assert main(["project", "--params", "7B", "--shape", "4096,4096,32,32", "--cluster", "dgx-h100-ib",
                 "--world-sizes", "8,64", "--strategies", "tp,fsdp2-tp[tp=8],pipeline[stages=4]",
                 "--scaling", "weak"]) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert lines[1].startswith("compute, not measured: FLOPs: 4,096 tokens x ")
    assert "x compute MFU 47.8%: fitted on" in lines[1] and "7B parameters" in lines[1]
    for label in ("described/tp/autocast", "described/fsdp2-tp[tp=8]/autocast", "described/pipeline[stages=4]/"):
        assert label in printed
    # tp's degree is the world size: 64 does not divide the 32 heads, so that size is left out with its reason.
    assert "left out: described/tp/autocast weak at 64: tensor parallelism of 64 must divide the 32 heads" in printed


@pytest.mark.parametrize("strategies, extra, words", [
    (["tp"], {"shape": None}, ["--strategies tp", "--shape SEQ,HIDDEN,HEADS,LAYERS"]),
    (["fsdp2-tp[tp=3]"], {}, ["fsdp2-tp[tp=3]", "allowed tp for 32 heads, nodes of 8 GPUs", ": 1, 2, 4, 8"]),
    (["fsdp2-tp[tp=16]"], {}, ["replica of 16 ranks does not divide 8 GPUs", "allowed tp", ": 1, 2, 4, 8"]),
    (["pipeline[stages=3]"], {}, ["pipeline[stages=3]", "allowed stages for 32 blocks", ": 1, 2, 4, 8"]),
    (["pipeline"], {"recipe": "fp8"}, ["recipe 'fp8' is not one of: fp32, autocast"]),
    (["ddp", "zero1"], {"recipe": "deepspeed-bf16"},
     ["--strategies ddp", "recipe deepspeed-bf16 is DeepSpeed's", "ddp runs fp32 and autocast"]),
    (["ddp"], {"compute_s": None, "shape": None}, ["needs --compute-ms MS, or --shape"]),
    (["ddp"], {"mfu": 0.5}, ["--mfu", "no meaning with --compute-ms"]),
])
def test_bad_input_is_one_line_before_anything_is_projected(strategies, extra, words):
    assert_one_line_error(lambda: described(strategies, [8, 64], **extra), words)


def test_defaulted_strategies_that_cannot_run_the_recipe_are_left_out_with_the_reason(capsys):
    assert main(["project", "--params", "1B", "--compute-ms", "100", "--cluster", "dgx-h100-ib", "--world-sizes",
                 "8", "--scaling", "weak", "--recipe", "deepspeed-bf16"]) == 0
    printed = capsys.readouterr().out
    for strategy in ("zero1", "zero2", "zero3"):
        assert f"described/{strategy}/deepspeed-bf16" in printed
    for strategy, runs in (("ddp", "fp32 and autocast"), ("horovod", "fp32 and autocast"),
                           ("fsdp2", "fp32, autocast and fsdp-mp-policy")):
        assert f"described/{strategy}/" not in printed
        assert (f"left out: {strategy}: recipe deepspeed-bf16 is DeepSpeed's (its bf16 section); {strategy} runs "
                f"{runs}") in printed


def test_a_preset_describes_the_model_as_its_shape_and_count_do(capsys):
    args = ["--cluster", "dgx-h100-ib", "--world-sizes", "8", "--strategies", "fsdp2-tp[tp=2]", "--scaling", "weak"]
    assert main(["project", "--model", "llama3-8b", *args]) == 0
    by_model = capsys.readouterr().out
    assert main(["project", "--params", "8030261248", "--shape",
                 "8192,4096,32,32,128256,kv_heads=8,ffn=14336,mlp=swiglu,tied=false", *args]) == 0
    assert capsys.readouterr().out == by_model
    assert_one_line_error(lambda: main_raising(["project", "--model", "llama3-8b", "--shape", "1,64,4,2", *args]),
                          ["not both"])


def main_raising(argv):
    from harness.cli import build_parser
    from harness.project.run import projection_from_arguments

    return projection_from_arguments(build_parser().parse_args(argv))
