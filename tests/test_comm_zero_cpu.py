"""A real 2-rank ZeRO-2 cell (gpt-tiny, bf16 under DeepSpeed's torch_autocast section, gloo on CPU): the dtypes
its gradient reductions really use, and a compute-only baseline that steps this rank's half of the state.

The cell is tests/conftest.py's bf16 ZeRO-2 cell at world size 2 (global batch 16, micro-batch 4, the
matrix's options), launched once for the session: nothing here depends on timing.
"""

import pytest

from harness.spec import Precision, Status

pytestmark = [pytest.mark.launch, pytest.mark.matrix]   # every test here reads cells launched for real

# gpt-tiny (workloads/gpt.py): vocab 512, 64 tokens, 4 blocks of width 64, head tied to the token embedding.
V, T, LAYERS, D = 512, 64, 4, 64
LINEAR = LAYERS * ((D * 3 * D + 3 * D) + (D * D + D) + (D * 4 * D + 4 * D) + (4 * D * D + D))   # 198,912
OTHER = V * D + T * D + LAYERS * 2 * (2 * D) + 2 * D          # embeddings and LayerNorms: 38,016
K = 2                                                          # 16 samples / 2 ranks / micro-batch 4


@pytest.fixture(scope="module")
def cell(bf16_rows):
    result = bf16_rows["zero2", 2]
    assert result.status is Status.OK, result.message
    spec = result.spec
    assert (spec.workload, spec.precision, spec.global_batch, spec.micro_batch, spec.options) == (
        "gpt-tiny", Precision.BF16, 16, 4, ())      # K = 2 micro-batches per rank, DeepSpeed's default recipe
    return result


@pytest.fixture(scope="module")
def row(cell):
    return cell.measurements


def test_zero2_under_torch_autocast_reduces_linear_gradients_in_bf16_and_the_rest_in_fp32(row):
    # DeepSpeed 0.19.8: runtime/torch_autocast.py init_autocast_params gives every parameter of an exact
    # nn.Linear comm_dtype bf16; runtime/zero/stage_1_and_2.py reduces each gradient in its comm dtype
    # (one bucket per dtype), after every micro-batch. On gloo the reduction is an all-reduce of the bucket.
    assert row["parameters"] == LINEAR + OTHER
    for counted in row["comm_per_step_by_rank"]:
        dtypes = counted["all_reduce"]["dtypes"]
        assert set(dtypes) == {"bfloat16", "float32"}
        assert dtypes["bfloat16"] == {"bytes": K * 2 * LINEAR, "element_bytes": 2}
        assert dtypes["float32"]["element_bytes"] == 4
        # Plus one fp32 scalar per step: DeepSpeed all-reduces the gradient norm.
        assert dtypes["float32"]["bytes"] == K * 4 * OTHER + 4
        assert counted["all_gather"]["dtypes"] == {"float32": {"bytes": 4 * (LINEAR + OTHER), "element_bytes": 4}}
        assert counted["all_reduce"]["bytes_by_group_size"] == {"2": counted["all_reduce"]["bytes"]}


def test_zero2_expects_the_bytes_its_recipe_reduces(row):
    assert row["comm_expected_per_step"]["collectives"] == [
        {"collective": "reduce_scatter", "size_bytes": 2 * LINEAR + 4 * OTHER, "calls": K, "ranks": 2,
         "group": "world", "stride": 1},
        {"collective": "all_gather", "size_bytes": 4 * (LINEAR + OTHER), "calls": 1, "ranks": 2, "group": "world",
         "stride": 1}]


def test_zero2_compute_only_baseline_steps_half_the_optimizer_state(cell, row):
    # Each rank's optimizer updates a contiguous half of the 236,928 parameters: 118,464 each (DeepSpeed's
    # alignment padding would move the boundary by a few elements at most).
    assert row["compute_only_kind"] == "same work"
    assert row["compute_only_optimizer_elements_by_rank"] == [(LINEAR + OTHER) // 2] * 2
    timed = cell.spec.timed_steps
    assert [len(times) for times in row["compute_only_step_time_s_by_rank"]] == [timed, timed]
    assert [len(flags) for flags in row["compute_only_host_stalled_by_rank"]] == [timed, timed]
