"""Tensor parallelism of the GPT blocks (harness.strategies.tensor_parallel): the fused q|k|v rows reordered as
worked out by hand, and the bugs a tensor-parallel run can hide, each planted in a real run at TP 2, each
making parity mismatch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.strategies.tensor_parallel import per_head_qkv_order

ROOT = Path(__file__).resolve().parent.parent


def test_the_fused_qkv_rows_go_to_the_rank_of_their_head():
    # n_embd 4, 2 heads of 2 rows: q rows 0-3 (head 0: 0,1; head 1: 2,3), k rows 4-7, v rows 8-11. Rank 0
    # holds head 0's q, k and v rows; rank 1 head 1's.
    assert per_head_qkv_order(4, 2, 2).tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
    assert per_head_qkv_order(4, 2, 1).tolist() == list(range(12))        # one rank: the order is unchanged
    with pytest.raises(ValueError, match="heads"):
        per_head_qkv_order(6, 3, 2)


PLANTED_STRATEGIES = r'''
"""The tp strategy with one of the bugs a tensor-parallel run can hide (issue 36): its ranks fed different
batches, a row-parallel output left unreduced (each rank carries on with its own partial sum), or c_attn's fused
q|k|v rows split as they come (rank 0 gets all of q and half of k as "its heads"); and fsdp2-tp with its tp ranks
fed apart."""
import torch
import torch.distributed.tensor.parallel as tensor_parallel_api
from torch.distributed.tensor import Partial

from harness.strategies import tensor_parallel
from harness.strategies.fsdp2_tp import FSDP2TensorParallel
from harness.strategies.tp import TensorParallel


class FedApart(TensorParallel):
    name = "tp-fed-apart"

    def replica(self, spec, context):
        return context.rank


class UnreducedRowwise(tensor_parallel_api.RowwiseParallel):
    def __init__(self):
        super().__init__(output_layouts=Partial())


class Unreduced(TensorParallel):
    name = "tp-unreduced"

    def wrap(self, spec, context, workload, layers):
        tensor_parallel_api.RowwiseParallel = UnreducedRowwise     # what parallelize_blocks imports
        return super().wrap(spec, context, workload, layers)


class MisplacedHeads(TensorParallel):
    name = "tp-misplaced-heads"

    def wrap(self, spec, context, workload, layers):
        tensor_parallel.per_head_qkv_order = lambda n_embd, n_head, tp: torch.arange(3 * n_embd)
        return super().wrap(spec, context, workload, layers)


class FSDP2TPFedApart(FSDP2TensorParallel):
    name = "fsdp2-tp-fed-apart"

    def replica(self, spec, context):
        return context.rank


STRATEGIES = {"tp-fed-apart": FedApart(), "tp-unreduced": Unreduced(), "tp-misplaced-heads": MisplacedHeads(),
              "fsdp2-tp-fed-apart": FSDP2TPFedApart()}
'''


@pytest.mark.launch
@pytest.mark.matrix
def test_each_planted_tensor_parallel_bug_makes_parity_mismatch(tmp_path):
    # The honest tp and fsdp2-tp rows match the plain loop (tests/test_strategies_cpu.py, tests/test_hybrid.py).
    from harness.derive.parity import Verdict, judge

    (tmp_path / "planted.py").write_text(PLANTED_STRATEGIES)
    out = tmp_path / "rows.jsonl"
    done = subprocess.run([sys.executable, "-m", "harness", "run", "--matrix", "smoke", "--workload", "gpt-tiny",
                           "--strategy", "plain,tp-fed-apart,tp-unreduced,tp-misplaced-heads,fsdp2-tp-fed-apart",
                           "--world-sizes", "2",
                           "--warmup-steps", "1", "--timed-steps", "3", "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "PARBENCH_EXTRA_STRATEGIES": f"{tmp_path / 'planted.py'}:STRATEGIES"})
    assert done.returncode == 5, done.stderr[-3000:]      # EXIT_CHECK_FAILED: every planted row a mismatch
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    verdicts = {row["spec"]["strategy"]: judgement.verdict for row, judgement in zip(rows, judge(rows))}
    assert verdicts == {"plain": Verdict.REFERENCE, "tp-fed-apart": Verdict.MISMATCH,
                        "tp-unreduced": Verdict.MISMATCH, "tp-misplaced-heads": Verdict.MISMATCH,
                        "fsdp2-tp-fed-apart": Verdict.MISMATCH}, [row["message"] for row in rows]
