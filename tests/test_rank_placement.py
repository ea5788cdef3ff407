"""Where each rank of a node goes on GPUs (harness.strategies.base.place_rank), with the device count faked: the path
every multi-GPU launch takes first and no GPU session here has run at two ranks (issue 61). One GPU per local rank
over NCCL while the GPUs suffice; ranks that outnumber them share them round-robin over gloo, marked shared (memory
and correctness, never speed: NCCL refuses two ranks on one GPU)."""

import pytest
import torch

from harness.spec import DeviceKind
from harness.strategies.base import place_rank


@pytest.fixture
def gpus(monkeypatch):
    """Fake `count` visible GPUs; returns the devices set_device was called with."""
    chosen = []

    def fake(count):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: chosen.append(device))
        return chosen

    return fake


def test_eight_local_ranks_on_eight_gpus_get_one_each_over_nccl(gpus):
    chosen = gpus(8)
    placed = [place_rank(DeviceKind.CUDA, local_rank, 8) for local_rank in range(8)]
    assert [device for device, _, _ in placed] == [torch.device("cuda", i) for i in range(8)]
    assert {(backend, shared) for _, backend, shared in placed} == {("nccl", False)}
    assert chosen == [torch.device("cuda", i) for i in range(8)]       # each rank's current device is its own


def test_a_node_of_fewer_ranks_than_gpus_still_gives_each_its_own(gpus):
    gpus(8)
    assert place_rank(DeviceKind.CUDA, 3, 4) == (torch.device("cuda", 3), "nccl", False)


def test_ranks_outnumbering_the_gpus_share_them_round_robin_over_gloo(gpus):
    gpus(1)       # one lent GPU, two ranks: the reference set's oversubscribed cells
    assert [place_rank(DeviceKind.CUDA, r, 2) for r in range(2)] == [(torch.device("cuda", 0), "gloo", True)] * 2
    gpus(8)
    placed = [place_rank(DeviceKind.CUDA, r, 16) for r in range(16)]
    assert [device.index for device, _, _ in placed] == [r % 8 for r in range(16)]
    assert {(backend, shared) for _, backend, shared in placed} == {("gloo", True)}


def test_cpu_ranks_use_gloo_and_never_touch_cuda(gpus):
    chosen = gpus(8)
    assert place_rank(DeviceKind.CPU, 5, 8) == (torch.device("cpu"), "gloo", False) and chosen == []
