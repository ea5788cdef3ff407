"""The collective counter sees what a strategy issues, once per call, and passes results through."""

import torch
import torch.distributed as dist

from harness.rank.comm_counter import CollectiveCounter


def test_counts_bytes_and_calls_per_step_in_a_real_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    original = dist.all_reduce
    counter = CollectiveCounter()
    counter.install_torch()
    assert dist.all_reduce is not original
    try:
        tensor = torch.ones(1000)
        dist.all_reduce(tensor)                                 # outside a counted step: ignored
        for _ in range(2):
            with counter.counting(record=True):
                dist.all_reduce(tensor)
                dist.all_reduce(torch.ones(10, dtype=torch.float64))
                gathered = torch.empty(256)
                dist.all_gather_into_tensor(gathered, torch.full((256,), 3.0))   # forwards internally: one call
        with counter.counting(record=False):
            dist.broadcast(tensor, src=0)
        assert torch.equal(gathered, torch.full((256,), 3.0))
        # Per step: 1000 fp32 (4000 B) + 10 fp64 (80 B) all-reduced, 256 fp32 gathered, in a 1-rank group.
        assert counter.per_step() == {
            "all_reduce": {"bytes": 4080.0, "calls": 2.0,
                           "dtypes": {"float32": {"bytes": 4000.0, "element_bytes": 4},
                                      "float64": {"bytes": 80.0, "element_bytes": 8}},
                           "bytes_by_group_size": {"1": 4080.0}},
            "all_gather": {"bytes": 1024.0, "calls": 1.0,
                           "dtypes": {"float32": {"bytes": 1024.0, "element_bytes": 4}},
                           "bytes_by_group_size": {"1": 1024.0}}}
    finally:
        counter.uninstall()
        dist.destroy_process_group()
    assert dist.all_reduce is original
