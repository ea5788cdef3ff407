"""`python -m harness plan`: every layout of a described model on a described cluster, every byte it needs, what
fits, ranked by the projected step, the ones within the error grouped.

Every expected figure is worked by hand from its source: model states from bytes per parameter (Rajbhandari et al.
2020, sec. 5.1), activations from the measured block formulas (harness/derive/activations.py's docstring, written out
term by term here), the logits and the loss as the workloads compute them (the same docstring: 4 T V of fp32
log-probabilities and e_c T V of logits held, 8 T V transient), FSDP2's unsharded fp32 gradients under accumulation
(4 bytes a parameter), compute from PaLM's 6N + 12 L H Q T FLOPs a token over the datasheet peak x the compute MFU,
communication from the ring's alpha-beta formula with the dgx-h100-ib preset's numbers written out.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from pathlib import Path

import pytest

from harness.cli import main
from harness.cli.arguments import _count
from harness.derive.activations import llama_block_activations
from harness.project.cluster import load_cluster, preset
from harness.project.confidence import CONFIDENCE
from harness.project.mfu_model import validation
from harness.project.model import Decoder, preset as model_preset
from harness.project.plan import Settings, equivalent, format_plan, plan
from one_line import assert_one_line_error   # tests/one_line.py

ROOT = Path(__file__).resolve().parent.parent
GIB = 2 ** 30
ALLOWANCE = 2.5 * GIB                   # harness.project.rank_memory.ALLOWANCE_GIB, stated
H100_80 = 80 * GIB                      # dgx-h100-ib's gpu_memory_GiB

# Issue 21's model: 7B, 4096 tokens, hidden 4096, 32 heads, 32 layers, now with a 32,000-token vocabulary; 8 DGX H100.
P, S, H, A, L, V = 7_000_000_000, 4096, 4096, 32, 32, 32_000
NODES, GPUS = 8, 64
SAMPLES = 1024                  # the default 4M-token batch: 4,194,304 / 4096
PEAK = 989.4e12                 # H100 SXM5 bf16 dense (NVIDIA H100 whitepaper)
# dgx-h100-ib: NVLink 450 GB/s a GPU one way, 3.4 us a step; InfiniBand 400 GB/s a node one way, 14 us a step.
B_INTRA, ALPHA_INTRA, B_INTER, ALPHA_INTER = 450e9, 3.4e-6, 400e9, 14e-6

MODEL = Decoder(seq_len=S, hidden=H, heads=A, layers=L, vocab=V, stated_parameters=P)
SETTINGS = Settings(global_batch=SAMPLES, tokens=1e9)


@pytest.fixture(scope="module")
def planned():
    return {p.layout.label: p for p in plan(MODEL, preset("dgx-h100-ib"), NODES, SETTINGS)}


# ---- Llama 3 8B on one node of 8 x 80 GB at sequence 8192, worked by hand ------------------------------------------

LLAMA = model_preset("llama3-8b")
T = 8192                                # one sample of 8192 tokens a micro-batch
LLAMA_V = 128_256
LLAMA_P = 8_030_261_248


def llama_block_by_hand() -> int:
    """One Llama 3 8B block at b = 1, s = 8192 on CUDA (fused RMSNorm) with bf16 weights (the MixedPrecisionPolicy):
    whole: 2 norms' bf16 inputs (2 + 2) and wqkv's and w_gate_up's inputs (2 + 2) a value of T x h; split over t = 1:
    wqkv's whole output (h + 2 h_kv), the rotated q (h) and k (h_kv), the attention output (h): 3 h + 3 h_kv, and
    gate|up (2 i), silu (i), the product (i): 4 i, 2 bytes each; statistics: 2 RMSNorms' fp32 rms (8 B a token) and
    the log-sum-exp (4 B a head and token); rotary cos and sin, 2 x s x head_dim x 2 bytes; no weight copies."""
    h, kv, i = 4096, 1024, 14_336
    whole = T * h * (2 + 2 + 2 + 2)
    split = T * (3 * h + 3 * kv + 4 * i) * 2
    statistics_ = 8 * T + 4 * 32 * T
    rotary = 2 * T * 128 * 2
    return whole + split + statistics_ + rotary


def test_the_llama_block_by_hand_is_the_formulas():
    assert llama_block_by_hand() == 1_464_926_208
    assert llama_block_activations(seq_len=T, micro_batch=1, hidden=4096, heads=32, kv_heads=8, intermediate=14_336,
                                   compute_bytes=2, fused_norm=True, bf16_weights=True).total == llama_block_by_hand()


def fsdp2_by_hand() -> dict[str, int]:
    """fsdp2 dp=8 under the MixedPrecisionPolicy, 64 micro-batches of 1 (512 samples a step over 8 replicas)."""
    h, v = 4096, LLAMA_V
    unit = h * (h + 2 * 1024) + h * h + 3 * h * 14_336 + 2 * h     # one block's parameters
    outside = 2 * v * h + h                                         # embedding, untied head, final RMSNorm
    return {
        "states": LLAMA_P * (4 + 4 + 8) // 8,                       # fp32 shards, all three over 8 ranks
        "activations": 32 * llama_block_by_hand(),
        "logits": T * v * (2 + 4 + 8),                              # bf16 logits + fp32 log-probs, 8 T V transient
        "accumulated": 4 * LLAMA_P,                                 # every unsharded fp32 gradient, sync off
        "gathered": (outside + 2 * unit) * 2,                       # the root and two blocks, in bf16
        "allowance": int(ALLOWANCE),
    }


def fsdp2_row(facts=None):
    settings = Settings(global_batch=512, tokens=1e9, micro_batch=1)
    found = {p.layout.label: p for p in plan(LLAMA, preset("dgx-h100-ib"), 1, settings)}
    return found["fsdp2 dp=8"]


def test_llama3_8b_fsdp2_needs_every_term_worked_by_hand():
    row = fsdp2_row()
    hand = fsdp2_by_hand()
    terms = row.memory.terms()
    assert row.layout.recipe == "fsdp-mp-policy" and (row.micro_batch, row.micro_batches) == (1, 64)
    assert terms["model states"] == hand["states"]
    assert terms["activations"] == hand["activations"]
    assert terms["logits and loss"] == hand["logits"]
    assert terms["accumulated gradients"] == hand["accumulated"]
    assert terms["gathered"] == hand["gathered"]
    assert terms["allowance"] == hand["allowance"]
    assert row.need_bytes == sum(hand.values())           # 107.5 GiB: it does not fit in 80
    assert not row.fits and round(sum(hand.values()) / GIB, 1) == 107.5


@pytest.mark.parametrize("planted", ["logits", "accumulation", "gpt block"])
def test_a_planted_omission_of_each_term_fails_the_hand_check(monkeypatch, planted):
    import harness.project.rank_memory as rank_memory
    import harness.strategies.fsdp2 as fsdp2

    if planted == "logits":
        monkeypatch.setattr(rank_memory, "logits_bytes", lambda *a, **k: 0.0)
    elif planted == "accumulation":
        original = fsdp2.fully_shard_working_memory
        monkeypatch.setattr(fsdp2.FSDP2, "working_memory_bytes", lambda self, rank, recipe, options: {
            k: v for k, v in original(rank, 2, options).items() if k != "accumulated gradients"})
    else:       # the Llama shape priced as GPT's block (what a Llama planned as GPT-2 got)
        monkeypatch.setattr(rank_memory, "block_bytes", lambda model, **k: rank_memory.formulas.block_activations(
            seq_len=model.seq_len, micro_batch=k["micro_batch"], hidden=model.hidden, heads=model.heads,
            compute_bytes=2, bf16_weights=True, fused_norm=True).total)
    assert fsdp2_row().need_bytes != sum(fsdp2_by_hand().values())


def test_plan_by_model_and_by_shape_print_the_same_table(capsys):
    base = ["--cluster", "dgx-h100-ib", "--nodes", "1", "--tokens", "1e9"]

    def table(argv):
        assert main(["plan", *argv, *base]) == 0
        lines = capsys.readouterr().out.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("rank "))
        return lines[start:lines.index("", start)]

    by_model = table(["--model", "llama3-8b"])
    by_shape = table(["--shape", "8192,4096,32,32,128256,kv_heads=8,ffn=14336,mlp=swiglu,tied=false"])
    assert by_model == by_shape and len(by_model) > 20


# ---- the 7B plan of issue 21 -----------------------------------------------------------------------------------------


def test_no_layout_marked_fitting_counts_more_than_the_gpu(planned):
    fitting = [p for p in planned.values() if p.fits]
    assert fitting and all(p.need_bytes <= H100_80 for p in fitting)
    # DDP keeps 16 bytes a parameter whole: with the logits and the loss of 4096 x 32,000 at (2 + 4 + 8) bytes it
    # needs more than before they were counted.
    ddp = planned["ddp dp=64"]
    logits = S * V * (2 + 4 + 8)
    assert not ddp.fits and ddp.memory.logits == logits and ddp.need_bytes > 16 * P + logits


def test_zero2_checkpointed_counts_its_logits(planned):
    # Issue 60's example: 16 x 4096 = 65,536 tokens x 32,000 logits, 11.7 GiB held (bf16 logits and fp32
    # log-probabilities) and 15.6 GiB transient (8 T V): 27.3 GiB the old plan never counted.
    row = planned["zero2 dp=64 ckpt"]
    assert row.micro_batch == 16 and row.memory.logits == 16 * S * V * (2 + 4 + 8)
    assert round(row.memory.logits / GIB, 1) == 27.3 and row.need_bytes <= H100_80


def test_zero3_memory_and_step_worked_by_hand(planned):
    row = planned["zero3 dp=64"]
    fitted = validation()
    assert row.layout.recipe == "deepspeed-bf16"            # DeepSpeed's bf16 section, its users' recipe
    # States: 2-byte weights and gradients and K = 12 bytes of master weights and moments, all over 64 ranks; the
    # final LayerNorm and every block's LayerNorms and row-parallel biases are counted like the rest at tp = 1.
    assert row.memory.states == pytest.approx(P * (2 + 2 + 12) / GPUS)
    b = row.micro_batch
    # GPT block (gelu MLP of 4h), bf16 weights on CUDA: norm inputs 2 + 2, column-parallel inputs 2 + 2, the 12
    # split values at 2 bytes, fp32 norm statistics (16 B a token, CUDA's kernel) and the log-sum-exp (4 B a head).
    block = S * b * H * (2 + 2 + 2 + 2 + 12 * 2) + 16 * S * b + 4 * A * S * b
    assert row.memory.activations == pytest.approx(L * block)
    # Traffic: bf16 gathers and reduce-scatters of the 7B, 2 all-gathers a micro-batch and one reduce-scatter a
    # micro-batch, among 64 ranks on 8 nodes, NCCL's ring:
    # (p - 1 - (m - 1)) alpha_intra + (m - 1) alpha_inter + (p - 1) / p n / min(B_intra, B_inter).
    k = row.micro_batches
    n, p, m = 2 * P, 64, 8
    ring = (p - 1 - (m - 1)) * ALPHA_INTRA + (m - 1) * ALPHA_INTER + (p - 1) / p * n / min(B_INTRA, B_INTER)
    assert row.comm_s == pytest.approx((2 * k + k) * ring)
    # Compute at the fitted compute MFU of a 7B model on an H100: 1 / (a_H100 + b log10 7).
    mfu = 1 / (fitted.model.per_gpu["H100"] + fitted.model.size * 0.845098040014)
    flops_per_token = 6 * (P - 0) + 12 * L * H * S           # tied head: no lookup to leave out
    assert row.compute_s == pytest.approx(SAMPLES * S * flops_per_token / GPUS / (PEAK * mfu))
    # The fitted share of the data-parallel collectives is exposed.
    assert row.step_s == pytest.approx(row.compute_s + fitted.model.exposed_data_parallel * row.comm_s)
    assert row.tokens_per_s_per_gpu == pytest.approx(SAMPLES * S / row.step_s / GPUS)
    assert row.gpu_hours == pytest.approx(1e9 / row.tokens_per_s_per_gpu / 3600)


def test_fsdp2_tp_communication_worked_by_hand(planned):
    row = planned["fsdp2-tp tp=8 x dp=8 ckpt"]
    b, k = row.micro_batch, row.micro_batches

    def all_reduce_in_a_node(n: float) -> float:
        # NCCL's ring or tree among the 8 GPUs of one node, whichever is faster (its tuner's choice).
        ring = 2 * 7 * ALPHA_INTRA + 2 * 7 / 8 * n / B_INTRA
        tree = 2 * 7 * ALPHA_INTRA + 2 * n / B_INTRA
        return min(ring, tree)

    # Megatron's all-reduces of b x s x h values, 2 a block forward (bf16 under autocast) and 2 backward (fp32),
    # every micro-batch; recomputation runs the forward's again.
    values = b * S * H
    tp = 2 * L * k * 2 * all_reduce_in_a_node(2 * values) + 2 * L * k * all_reduce_in_a_node(4 * values)
    # FSDP2 among the 8 replicas of a tp rank, one a node, each with 1/8 of its node's NICs: rings of 7 steps across
    # nodes over the rank's fp32 slice, 2 gathers a micro-batch and one reduce-scatter. The slice: the blocks' split
    # layers / 8, their norms and row-parallel biases and the tied embedding and final norm whole.
    held = MODEL.held_by_rank(8)
    ring = 7 * ALPHA_INTER + 7 / 8 * 4 * held / (B_INTER / 8)
    assert row.comm_s == pytest.approx(tp + (2 * k + 1) * ring)


def test_the_pipeline_pays_its_bubble(planned):
    row = planned["pipeline pp=4 x dp=16"]
    k = row.micro_batches
    fitted = validation()
    mfu = 1 / (fitted.model.per_gpu["H100"] + fitted.model.size * 0.845098040014)
    step = SAMPLES * S * (6 * P + 12 * L * H * S) / GPUS / (PEAK * mfu)
    assert row.compute_s == pytest.approx(step * (k + 4 - 1) / k)


def test_the_top_layouts_that_tie_are_grouped_and_the_simplest_followed(planned, capsys):
    group = equivalent(list(planned.values()))
    fastest = min((p for p in planned.values() if p.fits), key=lambda p: p.step_s)
    assert fastest in group and len(group) > 1
    # Equivalent: each range overlaps the fastest's.
    assert all(p.step_low_s <= fastest.step_high_s for p in group)
    outside = [p for p in planned.values() if p.fits and p not in group]
    assert all(p.step_low_s > fastest.step_high_s for p in outside)
    # The simplest first: no model parallelism before any, checkpointing after none.
    assert group[0].layout.split.tensor_parallel == group[0].layout.split.pipeline_stages == 1
    assert main(["plan", "--params", "7B", "--shape", "4096,4096,32,32,32000", "--cluster", "dgx-h100-ib",
                 "--nodes", "8", "--tokens", "1e9", "--set", "inter_node_bandwidth_GBps=100"]) == 0
    out = capsys.readouterr().out
    assert f"equivalent within the error ({len(group)}" in out or "equivalent within the error (" in out
    command = next(line for line in out.splitlines() if line.startswith("python -m harness run "))
    # The dry run follows the user's cluster and overrides.
    assert "--cluster dgx-h100-ib --set inter_node_bandwidth_GBps=100" in command
    assert "cluster dgx-h100-ib (--cluster" in out


def test_compute_and_communication_confidence_are_printed_apart(capsys):
    assert main(["plan", "--params", "7B", "--shape", "4096,4096,32,32,32000", "--cluster", "dgx-h100-ib",
                 "--nodes", "8", "--tokens", "1e9"]) == 0
    out = capsys.readouterr().out
    fitted = validation()
    assert f"compute, the MFU model's error on published runs it was not fitted on ({fitted.confidence_text()})" \
        in out
    assert "communication confidence" in out and "median 2.5%, max 8% (14)" in out
    # Every row shows its memory terms.
    assert "memory: " in out and "logits and loss" in out


def test_confidence_is_each_strategys_error_over_the_committed_validation_tables():
    text = (ROOT / "docs" / "clusters.md").read_text()

    def cells(marker: str) -> dict[str, list[int]]:
        block = text.split(f"<!-- {marker}:")[1].split(f"<!-- /{marker} -->")[0]
        rows = [line for line in block.splitlines() if line.startswith("|")]
        names = [c.strip() for c in rows[0].strip("|").split("|")]
        found: dict[str, list[int]] = {}
        for line in rows[2:]:
            for name, cell in zip(names[1:], [c.strip() for c in line.strip("|").split("|")][1:]):
                if name in CONFIDENCE:
                    found.setdefault(name, []).extend(abs(int(x)) for x in re.findall(r"[+-]\d+(?=%)", cell))
        return found

    data_parallel = {name: a + b for (name, a), b in zip(cells("validation-table").items(),
                                                        cells("extrapolation-table").values())}
    for name, errors in {**data_parallel, **cells("hybrid-layouts-validation-table")}.items():
        figure = CONFIDENCE[name]
        assert (figure.median_abs_error_pct, figure.max_abs_error_pct, figure.cells) == (
            statistics.median(errors), max(errors), len(errors)), name
        assert figure.validated == (name in data_parallel)


def test_the_command_prints_the_table_then_the_followed_layouts_dry_run(capsys):
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100-ib", "--nodes", "1", "--tokens", "1e9"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("parbench plan: llama3-8b: 8,030,261,248 parameters")
    assert "projected, not measured" in out and "fitted on" in out
    command = next(line for line in out.splitlines() if line.startswith("python -m harness run "))
    # The hybrid matrix runs the Llamas on GPUs: the dry run lays out the planned model itself.
    assert "--workload llama3-8b " in command and command.endswith("--dry-run")
    assert "parbench dry run: 1 cells" in out


@pytest.mark.parametrize("args, words", [
    (["--cluster", "dgx-h9000"], ["unknown cluster preset 'dgx-h9000'", "dgx-h100-ib"]),
    (["--shape", "4096,4096,32,16"], ["the shape holds", "of --params", "allowed"]),
    (["--shape", "4096,4096,30,32"], ["heads dividing the hidden size"]),
    (["--recipe", "deepspeed-bf16"], ["users, autocast, fp32"]),
    (["--mfu", "1.5"], ["--mfu"]),
    (["--mfu", "nan"], ["--mfu"]),
    (["--peak-tflops", "inf"], ["--peak-tflops must be a finite number > 0"]),
    (["--global-batch-tokens", "1000"], ["not a whole number of 4096-token samples"]),
    (["--set", "gpu=NVIDIA B9000"], ["gpu 'NVIDIA B9000'", "NVIDIA H100 80GB HBM3"]),
    (["--tokens", "inf"], ["--tokens", "positive whole number"]),
    (["--tokens", "nan"], ["--tokens", "positive whole number"]),
    (["--tokens", "1e999"], ["--tokens", "at most"]),
    (["--params", "7.0000000001B"], ["--params", "not whole"]),
    (["--model", "llama3-8b"], ["not both"]),
])
def test_bad_input_is_one_line_before_anything_is_printed(capsys, args, words):
    given = {"--params": "7B", "--shape": "4096,4096,32,32", "--cluster": "dgx-h100-ib", "--nodes": "8",
             "--tokens": "1e9"}
    extra = []
    for key, value in zip(args[::2], args[1::2]):
        if key in given:
            given[key] = value
        else:
            extra += [key, value]
    assert main(["plan", *[x for pair in given.items() for x in pair], *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    message = captured.err.strip()
    assert message.count("\n") == 0 and message.startswith("parbench: error:")
    for word in words:
        assert word in message, message


def test_counts_are_read_exactly():
    # Decimal arithmetic: 8.03B is 8,030,000,000, where a float product gives 8,029,999,999.
    assert _count("8.03B") == 8_030_000_000 and _count("1.5B") == 1_500_000_000 and _count("1e9") == 10**9
    assert _count("124.4M") == 124_400_000 and _count("4096") == 4096


def test_a_cluster_without_its_gpu_cannot_be_planned():
    bare = load_cluster(None, overrides={"gpus_per_node": 8, "intra_node_bandwidth_GBps": 450,
                                         "intra_node_latency_us": 3.4, "inter_node_bandwidth_GBps": 400,
                                         "inter_node_latency_us": 14})
    assert_one_line_error(lambda: plan(MODEL, bare, 2, SETTINGS), ["names no gpu", "--peak-tflops"])
    named = dataclasses.replace(bare, gpu="NVIDIA H100 80GB HBM3")
    assert_one_line_error(lambda: plan(MODEL, named, 2, SETTINGS), ["gives no gpu_memory_GiB", "--set"])
    # A GPU no published run measured needs --mfu.
    l4 = dataclasses.replace(named, gpu="NVIDIA L4", gpu_memory_GiB=24.0)
    assert_one_line_error(lambda: plan(MODEL, l4, 2, SETTINGS), ["no published run measured the NVIDIA L4",
                                                                 "--mfu"])
    assert plan(MODEL, l4, 2, dataclasses.replace(SETTINGS, mfu=0.3))


def test_format_plan_names_the_recipe_of_each_layout(planned):
    text = format_plan(list(planned.values()), MODEL, preset("dgx-h100-ib"), NODES, SETTINGS)
    fsdp2 = next(line for line in text.splitlines() if line.split()[1:3] == ["fsdp2", "dp=64"])
    assert "fsdp-mp-policy" in fsdp2
