"""llama-tiny's cells of the ci matrix on real ranks (tests/conftest.py `llama_tiny_fp32`): the plain loop, FSDP2 and
tp at 2 ranks in fp32, each matching the plain loop, and FSDP2's traffic held to a schedule worked out by hand."""

from __future__ import annotations

import pytest

from harness.derive.comm import comm_columns
from harness.derive.parity import Verdict, judge
from harness.spec import Status

# llama-tiny (workloads/llama.py), written out: vocabulary 512 rows (500 tokens padded to 64), h = 64, 4 blocks of
# two RMSNorm weights (2h), wqkv (h x (4 + 2 + 2) x 16: 4 query heads and 2 key/value heads of 16), wo (h x h),
# w_gate_up (h x 2 x 192) and w_down (192 x h); the embedding, the final norm (h) and the untied head (512 x h).
H, VOCABULARY, INTERMEDIATE = 64, 512, 192
BLOCK = 2 * H + H * (4 + 2 + 2) * 16 + H * H + H * 2 * INTERMEDIATE + INTERMEDIATE * H
PARAMETERS = VOCABULARY * H + 4 * BLOCK + H + VOCABULARY * H
assert PARAMETERS == 262_720


@pytest.mark.launch
def test_llama_tinys_cells_match_the_plain_loop(llama_tiny_fp32):
    assert set(llama_tiny_fp32) == {"plain", "fsdp2", "tp"}
    for name, row in llama_tiny_fp32.items():
        assert row.status is Status.OK, (name, row.message)
        assert row.measurements["parameters"] == PARAMETERS
    verdicts = dict(zip(llama_tiny_fp32, judge([row.to_dict() for row in llama_tiny_fp32.values()])))
    assert verdicts["plain"].verdict is Verdict.REFERENCE
    for name in ("fsdp2", "tp"):
        assert verdicts[name].verdict is Verdict.MATCH, (name, verdicts[name].note)


@pytest.mark.launch
def test_fsdp2_on_llama_tiny_gathers_and_reduces_what_its_units_hold(llama_tiny_fp32):
    # 5 units (4 blocks and the root), 2 micro-batches a step (8 samples a rank in micro-batches of 4): every unit
    # all-gathered for each micro-batch's forward and again for its backward, and its gradients reduce-scattered
    # once a step; nccl-tests sizes are the whole fp32 buffer, 4 bytes a parameter.
    m = llama_tiny_fp32["fsdp2"].measurements
    for counted in m["comm_per_step_by_rank"]:
        assert (counted["all_gather"]["calls"], counted["all_gather"]["bytes"]) == (5 * 2 * 2, 2 * 2 * 4 * PARAMETERS)
        assert (counted["reduce_scatter"]["calls"], counted["reduce_scatter"]["bytes"]) == (5, 4 * PARAMETERS)
    assert comm_columns(m)["comm_wire_over_expected"] == pytest.approx(1.0)
    # tp's counted traffic is what its layout says a step issues (tests/test_llama_tp.py works the layout by hand).
    assert comm_columns(llama_tiny_fp32["tp"].measurements)["comm_wire_over_expected"] == pytest.approx(1.0)
