"""The collective counter sees what a strategy issues, once per call, and passes results through."""

import torch
import torch.distributed as dist

from harness.comm_counter import CollectiveCounter


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
        assert counter.per_step() == {"all_reduce": {"bytes": 4080.0, "calls": 2.0},
                                      "all_gather": {"bytes": 1024.0, "calls": 1.0}}
    finally:
        counter.uninstall()
        dist.destroy_process_group()
    assert dist.all_reduce is original
