"""The compute-only baseline steps exactly the elements a rank's optimizer updates in the real step."""

import pytest
import torch
from torch import nn

from harness.rank.compute_only import Piece, ShardStep, shard_pieces
from harness.strategies.base import ComputeOnlyPlan, Sharding

# Three parameters: 4x3 = 12, 5 and 2x2 = 4 elements, 21 in all.
SHAPES = [(4, 3), (5,), (2, 2)]


def test_flat_sharding_cuts_all_parameters_concatenated_into_contiguous_chunks():
    # ceil(21 / 2) = 11: rank 0 gets elements 0-10 (all 12 of the first parameter but its last), rank 1 the
    # remaining 10: the first parameter's last element, the 5 of the second, the 4 of the third.
    assert shard_pieces(SHAPES, Sharding.FLAT, 0, 2) == [Piece(0, 0, 11)]
    assert shard_pieces(SHAPES, Sharding.FLAT, 1, 2) == [Piece(0, 11, 12), Piece(1, 0, 5), Piece(2, 0, 4)]


def test_per_parameter_sharding_cuts_each_parameter_on_its_own():
    # ceil(12/2) = 6, ceil(5/2) = 3, ceil(4/2) = 2.
    assert shard_pieces(SHAPES, Sharding.PER_PARAMETER, 0, 2) == [Piece(0, 0, 6), Piece(1, 0, 3), Piece(2, 0, 2)]
    assert shard_pieces(SHAPES, Sharding.PER_PARAMETER, 1, 2) == [Piece(0, 6, 12), Piece(1, 3, 5), Piece(2, 2, 4)]


def test_dim0_rows_follow_torch_chunk_and_leave_late_ranks_empty():
    # 3 ranks: 4 rows -> chunks of 2 rows (6 elements): ranks 0, 1 and none for rank 2; 5 rows of 1 -> 2, 2, 1;
    # 2 rows -> 1, 1, none.
    assert shard_pieces(SHAPES, Sharding.DIM0_ROWS, 0, 3) == [Piece(0, 0, 6), Piece(1, 0, 2), Piece(2, 0, 2)]
    assert shard_pieces(SHAPES, Sharding.DIM0_ROWS, 1, 3) == [Piece(0, 6, 12), Piece(1, 2, 4), Piece(2, 2, 4)]
    assert shard_pieces(SHAPES, Sharding.DIM0_ROWS, 2, 3) == [Piece(1, 4, 5)]
    for rows in torch.chunk(torch.arange(5), 3):    # torch's own cut of 5 rows into 3: 2, 2, 1
        assert len(rows) in (2, 1)


@pytest.mark.parametrize("sharding", [Sharding.FLAT, Sharding.PER_PARAMETER, Sharding.DIM0_ROWS])
def test_every_element_belongs_to_exactly_one_rank(sharding):
    for ranks in (2, 3, 8):
        owned = [(piece.index, element) for rank in range(ranks)
                 for piece in shard_pieces(SHAPES, sharding, rank, ranks) for element in range(piece.start, piece.stop)]
        assert sorted(owned) == [(i, e) for i, n in enumerate((12, 5, 4)) for e in range(n)]


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)).to(dtype)   # 12 + 4 + 4 + 1 = 21 elements
    model(torch.ones(2, 3, dtype=dtype)).sum().backward()
    return model


@pytest.mark.parametrize("sharding, dtype", [(Sharding.FLAT, torch.float32), (Sharding.FLAT, torch.bfloat16),
                                             (Sharding.DIM0_ROWS, torch.float32),
                                             (Sharding.DIM0_ROWS, torch.bfloat16)])
def test_a_shard_step_changes_this_ranks_elements_and_no_other(sharding, dtype):
    model = _model(dtype)
    before = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    step = ShardStep(model, ComputeOnlyPlan(sharding=sharding, weights_dtype=dtype), rank=1, ranks=2,
                     device=torch.device("cpu"))
    step.step()
    after = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    changed = set(torch.nonzero(before != after).flatten().tolist())
    offsets = [0, 12, 16, 20]
    mine = {offsets[piece.index] + e for piece in step.pieces for e in range(piece.start, piece.stop)}
    assert step.elements == len(mine)
    # Flat: rank 1 of 2 owns elements 11..20 (ceil(21/2) = 11). Rows: weight rows 2-3 (elements 6..11), bias
    # 2..3 (14, 15), the 1-row weight and bias go to rank 0 only.
    assert mine == (set(range(11, 21)) if sharding is Sharding.FLAT else {6, 7, 8, 9, 10, 11, 14, 15})
    assert changed <= mine
    if dtype is torch.float32:
        assert changed == mine
    else:   # a 1e-3 update rounds away in bf16 where a weight is near 0.5 (8 bits of mantissa): most survive
        assert len(changed) > len(mine) // 2
    assert all(p.grad is None for p in model.parameters())
