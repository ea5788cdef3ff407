"""The published GPU runs `harness plan` is fitted on and checked against (harness.project.published_runs,
harness.project.mfu_model, docs/published-runs.md): each source's figure read as its source states it, worked by
hand; the held-out rule; the fit solved another way; one run's prediction worked by hand; the doc held to the file."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from harness.project.mfu_model import HELD_OUT_EVERY, RunFeatures, held_out, markdown_tables, validation
from harness.project.published_runs import RUNS_FILE, model_mfu, published_runs

ROOT = Path(__file__).resolve().parent.parent
RUNS = {run.id: run for run in published_runs()}


def test_the_file_holds_three_sources_a100_and_h100_from_1b_to_176b():
    runs = published_runs()
    assert len(runs) >= 10 and len({run.source for run in runs}) >= 3
    gpus = {run.cluster.gpu for run in runs}
    assert {"NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"} <= gpus
    sizes = [run.model.parameters for run in runs]
    assert min(sizes) < 2e9 and max(sizes) > 175e9
    assert not [run.id for run in runs if run.check()]          # every split multiplies to its GPUs, every batch


def test_megatrons_tflops_become_tokens_by_its_own_formula():
    # model_table.png's 1.7B row: 24 layers, hidden 2048, 408.8 TFLOP/s a GPU; vocabulary 131,072, sequence 4096.
    # num_floating_point_operations a token: 12 L h^2 (1 + 1 + s / h + 4 + V / (2 L h))
    #   = 12 x 24 x 2048^2 x (2 + 2 + 4 + 131072 / 98304) = 1,207,959,552 x 9.3333 = 11,274,289,152.
    flops = 12 * 24 * 2048**2 * (2 + 4096 / 2048 + 4 + 131_072 / (2 * 24 * 2048))
    assert flops == pytest.approx(11_274_289_152)
    run = RUNS["megatron-h100-gpt1.7b-g48"]
    assert run.tokens_per_s_per_gpu == pytest.approx(408.8e12 / flops)        # 36,259 tokens/s a GPU
    # Its published MFU, 41% of 989.4 TFLOP/s, is the TFLOP/s' own: 408.8 / 989.4 = 41.3%.
    assert round(408.8 / 989.4 * 100) == 41


def test_bloom_and_mosaicml_figures_as_published():
    bloom = RUNS["bigscience-a100-bloom176b-g384"]
    assert bloom.tokens_per_s_per_gpu == pytest.approx(19.561 * 2048 / 384, abs=0.01)      # 104.33
    assert bloom.model.parameters == 176_247_271_424
    # MPT-7B at 2048 tokens (its table's NumParams): 32 GeLU blocks of 12 h^2 + 13 h, the 50,368-row tied embedding,
    # 2048 learned positions and the final LayerNorm at h = 4096.
    h = 4096
    mpt7b = RUNS["mosaicml-h100-mpt7b-s2048-g8"]
    assert mpt7b.model.shape_parameters == 32 * (12 * h * h + 13 * h) + 50_368 * h + 2048 * h + 2 * h \
        == 6_658_859_008
    assert mpt7b.tokens_per_s_per_gpu == 10_643
    # Our MFU of it: (6 (N - the position table) + 12 L h s) x tokens/s over the peak; MosaicML's table says 46.44%
    # counting every parameter.
    flops = 6 * (6_658_859_008 - 2048 * h) + 12 * 32 * h * 2048
    assert model_mfu(mpt7b) == pytest.approx(10_643 * flops / 989.4e12)
    assert abs(model_mfu(mpt7b) - 0.4644) < 0.005


def test_every_third_run_of_each_source_is_held_out_and_never_fitted_on():
    runs = published_runs()
    flags = held_out(runs)
    for source in {run.source for run in runs}:
        ours = [flag for run, flag in zip(runs, flags) if run.source == source]
        assert ours == [(i + 1) % HELD_OUT_EVERY == 0 for i in range(len(ours))]
    fitted_on = set(validation().model.fitted_on)
    assert fitted_on == {run.id for run, flag in zip(runs, flags) if not flag}


def test_the_fit_solved_by_normal_equations_gives_the_same_coefficients():
    # f lies inside its bounds [0, 1]: the bounded least squares is the unbounded one, which numpy solves alike.
    fitted = validation()
    kinds = ("A100", "H100")
    rows = [(f, h) for f, h in zip(fitted.features, fitted.held) if not h]
    matrix = np.array([f.row(kinds) for f, _ in rows]) / np.array([[f.run.step_s] for f, _ in rows])
    target = np.array([1 - f.other_s / f.run.step_s for f, _ in rows])
    solution, *_ = np.linalg.lstsq(matrix, target, rcond=None)
    model = fitted.model
    assert 0 < model.exposed_data_parallel < 1
    assert np.allclose(solution, [model.per_gpu["A100"], model.per_gpu["H100"], model.size, model.recompute,
                                  model.exposed_data_parallel], rtol=1e-6)


def test_one_runs_prediction_worked_by_hand():
    # MPT-7B on 8 H100 at 2048 tokens, 6 samples a GPU, no recomputation, FSDP under the MixedPrecisionPolicy.
    run = RUNS["mosaicml-h100-mpt7b-s2048-g8"]
    model = validation().model
    h, n = 4096, 6_658_859_008
    tokens = 48 * 2048 / 8                                  # a GPU's tokens a step: 12,288
    flops_per_token = 6 * (n - 2048 * h) + 12 * 32 * h * 2048
    compute_at_peak = tokens * flops_per_token / 989.4e12
    # In one node of 8 (NVLink 450 GB/s, 3.4 us a step): 2 all-gathers of the bf16 weights and one reduce-scatter of
    # fp32 gradients, each a ring of 7 steps moving 7/8 of its buffer.
    ring = lambda size: 7 * 3.4e-6 + 7 / 8 * size / 450e9                                    # noqa: E731
    comm = 2 * ring(2 * n) + ring(4 * n)
    features = RunFeatures.of(run)
    assert features.compute_s == pytest.approx(compute_at_peak) and features.data_parallel_s == pytest.approx(comm)
    step = compute_at_peak * (model.per_gpu["H100"] + model.size * math.log10(n / 1e9)) \
        + model.exposed_data_parallel * comm
    assert features.predicted_step_s(model) == pytest.approx(step)
    assert features.ratio(model) == pytest.approx(tokens / 10_643 / step)


def test_the_doc_holds_the_tables_computed_from_the_file():
    text = (ROOT / "docs" / "published-runs.md").read_text()
    block = text.split("<!-- published-runs: python -m harness.project.mfu_model -->\n")[1].split(
        "\n<!-- /published-runs -->")[0]
    assert block == markdown_tables()
    assert str(RUNS_FILE.relative_to(ROOT)) in text


def test_no_published_run_is_marked_does_not_fit():
    for run in published_runs():
        assert run.fits(), (run.id, run.memory().describe())


def test_the_bounded_fit_where_its_bound_binds_is_scipys_bounded_least_squares():
    # The published runs' f lies inside [0, 1] (above); where it would not, the fit keeps it at the nearer bound and
    # solves the rest again, as scipy's bounded least squares finds by iterating.
    from scipy.optimize import lsq_linear

    from harness.project.mfu_model import last_bounded_least_squares

    rng = np.random.default_rng(0)
    matrix = rng.normal(size=(40, 4))
    for true_f in (1.7, -0.6, 0.4):
        target = matrix @ np.array([0.5, -1.0, 2.0, true_f]) + rng.normal(scale=0.05, size=40)
        ours = last_bounded_least_squares(matrix, target, 0.0, 1.0)
        scipy = lsq_linear(matrix, target, bounds=([-np.inf] * 3 + [0.0], [np.inf] * 3 + [1.0]), tol=1e-14).x
        assert ours[-1] == min(max(ours[-1], 0.0), 1.0)
        assert np.allclose(ours, scipy, rtol=1e-9, atol=1e-12), (true_f, ours, scipy)
