"""`python -m harness plan`: every layout of a described model on a described cluster, what fits, ranked by the
projected step.

Every expected figure is worked by hand from its source: model states from bytes per parameter (Rajbhandari et al.
2020, sec. 3.1 and 5.1: 16 bytes a parameter for DDP under autocast, 4 + 4 + 8, the paper's 2 + 2 + 12 in another
split), activations from the workloads' block (harness/derive/activations.py's docstring: s b h (2 x 4 + 2 e_c +
12 e_c / t) + 16 s b + 4 a s b / t, and 2 x 12 h^2 / t of autocast's bf16 weight copies), compute from PaLM's
6N + 12 L h s FLOPs a token over the datasheet peak x the MFU, communication from the ring's alpha-beta formula
with the dgx-h100-ib preset's numbers written out.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from pathlib import Path

import pytest

from harness.cli import main
from harness.project.cluster import load_cluster, preset
from harness.project.confidence import CONFIDENCE
from harness.project.plan import Settings, Transformer, format_plan, plan
from one_line import assert_one_line_error   # tests/one_line.py

ROOT = Path(__file__).resolve().parent.parent
GIB = 2 ** 30

# The Done-means command's model: 7B, 4096 tokens, hidden 4096, 32 heads, 32 layers; 8 DGX H100 nodes.
P, S, H, A, L = 7_000_000_000, 4096, 4096, 32, 32
NODES, GPUS = 8, 64
SAMPLES = 1024                  # the default 4M-token batch: 4,194,304 / 4096
PEAK = 989.4e12                 # H100 SXM5 bf16 dense (NVIDIA H100 whitepaper)
MFU = 0.4                       # the plan's default assumption
# dgx-h100-ib: NVLink 450 GB/s a GPU one way, 3.4 us a step; InfiniBand 400 GB/s a node one way, 14 us a step.
B_INTRA, ALPHA_INTRA, B_INTER, ALPHA_INTER = 450e9, 3.4e-6, 400e9, 14e-6

MODEL = Transformer(parameters=P, seq_len=S, hidden=H, heads=A, layers=L)
SETTINGS = Settings(global_batch=SAMPLES, tokens=1e9)


@pytest.fixture(scope="module")
def planned():
    return {p.layout.label: p for p in plan(MODEL, preset("dgx-h100-ib"), NODES, SETTINGS)}


def block_bytes(micro_batch: int, tp: int = 1) -> float:
    """One block's saved bytes under autocast (e_n = 4, e_c = 2), by the formula in the module docstring."""
    s, b, h, a = S, micro_batch, H, A
    return s * b * h * (2 * 4 + 2 * 2 + 12 * 2 / tp) + 16 * s * b + 4 * a * s * b / tp + 2 * 12 * h * h / tp


def palm_step_seconds() -> float:
    """A GPU's share of the step's FLOPs over the peak x MFU: 1024 x 4096 tokens x (6N + 12 L h s) / 64 GPUs."""
    flops_per_token = 6 * P + 12 * L * H * S
    return SAMPLES * S * flops_per_token / GPUS / (PEAK * MFU)


def test_ddp_does_not_fit_and_says_by_how_much_worked_by_hand(planned):
    # 16 bytes a parameter whole on every rank, and 32 blocks' activations at one sample a micro-batch.
    need = P * (4 + 4 + 8) + L * block_bytes(1)
    text = format_plan(list(planned.values()), MODEL, preset("dgx-h100-ib"), NODES, SETTINGS)
    row = next(line for line in text.splitlines() if line.split()[1:4] == ["ddp", "dp=64", "no"])
    assert f"does not fit (needs {need / GIB:.1f} GiB of 80)" in row           # 134.3 GiB
    assert planned["ddp dp=64"].micro_batch == 1 and not planned["ddp dp=64"].fits


def test_sharded_and_two_dimensional_layouts_fit(planned):
    assert planned["zero3 dp=64"].fits and planned["fsdp2 dp=64"].fits
    assert any(p.fits for label, p in planned.items() if label.startswith("fsdp2-tp tp=8"))
    ranked = [p.step_s for p in planned.values() if p.fits]
    assert ranked == sorted(ranked)


def test_zero3_memory_and_step_worked_by_hand(planned):
    row = planned["zero3 dp=64"]
    # Micro-batch: the largest power of two dividing the replica's 16 samples that fits in 90% of 80 GiB: at 4,
    # 4 x 18 GiB of activations + 12 GiB of weight copies is over it; at 2 it fits.
    assert (row.micro_batch, row.micro_batches) == (2, 8)
    assert row.states_bytes == pytest.approx(P * (4 + 4 + 12) / GPUS)          # ZeRO-3: all of it over 64 ranks
    assert row.activation_bytes == pytest.approx(L * block_bytes(2))
    # Traffic: under autocast DeepSpeed reduces and (stage 3) gathers linear layers' parameters in bf16, 2 bytes;
    # 2 all-gathers a micro-batch and one reduce-scatter, each of 14 GB among 64 ranks on 8 nodes, NCCL's ring:
    # (p - 1 - (m - 1)) alpha_intra + (m - 1) alpha_inter + (p - 1) / p n / min(B_intra, B_inter).
    n, p, m = 2 * P, 64, 8
    ring = (p - 1 - (m - 1)) * ALPHA_INTRA + (m - 1) * ALPHA_INTER + (p - 1) / p * n / min(B_INTRA, B_INTER)
    comm = (2 * 8 + 8) * ring
    assert row.comm_s == pytest.approx(comm)
    assert row.step_s == pytest.approx(palm_step_seconds() + comm)              # every byte exposed (f = 1)
    assert row.tokens_per_s_per_gpu == pytest.approx(SAMPLES * S / row.step_s / GPUS)
    assert row.gpu_hours == pytest.approx(1e9 / row.tokens_per_s_per_gpu / 3600)


def test_fsdp2_tp_divides_states_and_split_activations_by_tp(planned):
    row = planned["fsdp2-tp tp=8 x dp=8"]
    # A rank holds 1/8 of the parameters, FSDP2 shards their 16 bytes over the 8 replicas.
    assert row.states_bytes == pytest.approx(P / 8 * 16 / 8)
    assert row.activation_bytes == pytest.approx(L * block_bytes(row.micro_batch, tp=8))


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
    # nodes over the rank's fp32 slice, 2 gathers a micro-batch and one reduce-scatter.
    slice_bytes = 4 * P / 8
    ring = 7 * ALPHA_INTER + 7 / 8 * slice_bytes / (B_INTER / 8)
    assert row.comm_s == pytest.approx(tp + (2 * k + 1) * ring)


def test_the_pipeline_pays_its_bubble(planned):
    row = planned["pipeline pp=4 x dp=16"]
    k = row.micro_batches
    assert row.compute_s == pytest.approx(palm_step_seconds() * (k + 4 - 1) / k)
    # Each stage holds its 8 blocks for min(stages, micro-batches) = 4 micro-batches in flight (1F1B).
    assert row.activation_bytes == pytest.approx(8 * 4 * block_bytes(row.micro_batch))


def test_checkpointing_recomputes_the_forward_and_keeps_block_inputs(planned):
    row = planned["zero3 dp=64 ckpt"]
    assert row.compute_s == pytest.approx(palm_step_seconds() * 4 / 3)
    b = row.micro_batch
    assert row.activation_bytes == pytest.approx(L * 4 * S * b * H + block_bytes(b))


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


def test_the_command_prints_the_table_then_the_fastest_layouts_dry_run(capsys):
    assert main(["plan", "--params", "7B", "--shape", "4096,4096,32,32", "--cluster", "dgx-h100-ib", "--nodes", "8",
                 "--tokens", "1e9"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("parbench plan: 7,000,000,000 parameters")
    assert "projected, not measured" in out and "assumed MFU of 40%" in out
    first = next(line for line in out.splitlines() if line.strip().startswith("1  "))
    command = next(line for line in out.splitlines() if line.startswith("python -m harness run "))
    strategy = first.split()[1]
    assert f"--strategy {strategy} " in command and "--world-sizes 64 " in command and command.endswith("--dry-run")
    assert "parbench dry run: 1 cells" in out and "8 node(s) x 8 rank(s)" in out


@pytest.mark.parametrize("args, words", [
    (["--cluster", "dgx-h9000"], ["unknown cluster preset 'dgx-h9000'", "dgx-h100-ib"]),
    (["--shape", "4096,4096,32,16"], ["the shape holds", "of --params", "allowed"]),
    (["--shape", "4096,4096,30,32"], ["heads dividing the hidden size"]),
    (["--recipe", "deepspeed-bf16"], ["autocast, fp32 only"]),
    (["--mfu", "1.5"], ["--mfu"]),
    (["--global-batch-tokens", "1000"], ["not a whole number of 4096-token samples"]),
    (["--set", "gpu=NVIDIA B9000"], ["gpu 'NVIDIA B9000'", "NVIDIA H100 80GB HBM3"]),
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


def test_a_cluster_without_its_gpu_cannot_be_planned():
    bare = load_cluster(None, overrides={"gpus_per_node": 8, "intra_node_bandwidth_GBps": 450,
                                         "intra_node_latency_us": 3.4, "inter_node_bandwidth_GBps": 400,
                                         "inter_node_latency_us": 14})
    assert_one_line_error(lambda: plan(MODEL, bare, 2, SETTINGS), ["names no gpu", "--peak-tflops"])
    named = dataclasses.replace(bare, gpu="NVIDIA H100 80GB HBM3")
    assert_one_line_error(lambda: plan(MODEL, named, 2, SETTINGS), ["gives no gpu_memory_GiB", "--set"])
