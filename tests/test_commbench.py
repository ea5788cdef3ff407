"""`harness comm` measures as nccl-tests does: buffers made once, before timing; the mean over ranks."""

import json
from statistics import fmean

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from harness.cli import main
from harness.commbench import (COLLECTIVES, MAX_RANK_ONLY, MEAN_OVER_RANKS, _operation, format_table, group_stride,
                               groups_of, rank_time_reduction, reduce_rank_times, with_bandwidth)


class FreshTensors(TorchDispatchMode):
    """Records every aten op that returns a tensor aliasing none of its inputs, i.e. a new allocation.
    (c10d's collectives write into the tensors they are given and are not counted.)"""

    def __init__(self):
        super().__init__()
        self.allocating_ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "aten" and any(r.alias_info is None and "Tensor" in str(r.type)
                                            for r in func._schema.returns):
            self.allocating_ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::FutureWarning")     # torch 2.13 renames *_into_tensor / *_tensor
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_each_collective_reuses_buffers_made_before_its_timed_calls(one_rank_group, collective):
    operation, size = _operation(collective, 4096, 1, torch.device("cpu"))
    assert size == 4096
    operation()                                               # warm-up, as before the timed loop
    with FreshTensors() as seen:
        for _ in range(3):
            operation()
    assert seen.allocating_ops == []


def test_rank_times_reduce_to_their_mean_with_the_slowest_rank_beside_it():
    # nccl-tests' default (-a 1) averages over ranks: (1 + 2 + 3 + 10) us / 4 = 4 us; the slowest is 10 us.
    reduced = reduce_rank_times([1e-6, 2e-6, 3e-6, 10e-6])
    assert reduced["time_s"] == pytest.approx(4e-6)
    assert reduced["time_max_rank_s"] == 10e-6
    assert reduced["time_by_rank_s"] == [1e-6, 2e-6, 3e-6, 10e-6]
    with pytest.raises(ValueError):
        reduce_rank_times([])


def test_bandwidth_comes_from_the_mean_time_and_the_slowest_ranks_busbw_sits_beside_it():
    # all_reduce of 2 GB on 4 ranks: mean 0.5 s -> algbw 4 GB/s, busbw 4 x 2(4-1)/4 = 6 GB/s;
    # slowest rank 1.0 s -> busbw 2 x 1.5 = 3 GB/s.
    row = {"collective": "all_reduce", "size_bytes": 2e9, "time_s": 0.5, "time_max_rank_s": 1.0}
    [measured] = with_bandwidth([row], 4)
    assert measured["algbw_bytes_per_s"] == pytest.approx(4e9)
    assert measured["busbw_bytes_per_s"] == pytest.approx(6e9)
    assert measured["busbw_max_rank_bytes_per_s"] == pytest.approx(3e9)
    assert rank_time_reduction([row]) == MEAN_OVER_RANKS


def test_rows_written_before_the_mean_still_read_and_are_labelled_slowest_rank_only():
    from harness.report.plots import plot_busbw

    old = {"collective": "broadcast", "size_bytes": 1024, "time_s": 1e-4}    # time_s was the slowest rank's
    [measured] = with_bandwidth([old], 2)
    assert measured["busbw_bytes_per_s"] == pytest.approx(1024 / 1e-4)         # broadcast factor 1
    assert "busbw_max_rank_bytes_per_s" not in measured
    assert rank_time_reduction([old]) == MAX_RANK_ONLY
    assert format_table([measured]).splitlines()[2].split()[3] == "-"          # no max-rank column value
    svg = plot_busbw([{"world_size": 2, "backend": "gloo", "rows": [old]}])
    assert "broadcast (gloo, 2 ranks, slowest rank only)" in svg


@pytest.mark.launch
def test_comm_run_at_two_ranks_records_every_ranks_time_their_mean_and_the_slowest(tmp_path, capsys):
    out = tmp_path / "comm.jsonl"
    code = main(["comm", "--world-size", "2", "--device", "cpu", "--collectives", "all_reduce,all_to_all",
                 "--max-bytes", "64K", "--warmup", "1", "--iters", "3", "--out", str(out)])
    assert code == 0
    run = json.loads(out.read_text())
    assert run["rank_time_reduction"] == MEAN_OVER_RANKS
    assert [(r["collective"], r["size_bytes"]) for r in run["rows"]] == [
        (name, size) for name in ("all_reduce", "all_to_all") for size in (1024, 2048, 4096, 8192, 16384,
                                                                           32768, 65536)]
    for row in run["rows"]:
        assert len(row["time_by_rank_s"]) == 2
        assert row["time_s"] == pytest.approx(fmean(row["time_by_rank_s"]))
        assert row["time_max_rank_s"] == max(row["time_by_rank_s"])
        assert row["algbw_bytes_per_s"] == pytest.approx(row["size_bytes"] / row["time_s"])
    assert "max-rank us" in capsys.readouterr().out


def test_comm_on_cpu_warns_past_the_cores_and_refuses_past_four_ranks_a_core_unless_told(capsys):
    import pytest

    from harness.cli.comm import check_comm_ranks
    from harness.machine import Machine
    from harness.spec import DeviceKind, SpecError

    two_cores = Machine(device=DeviceKind.CPU, devices_per_node=2)
    check_comm_ranks(2, two_cores, oversubscribe=False)
    assert capsys.readouterr().err == ""
    check_comm_ranks(8, two_cores, oversubscribe=False)             # 4 a core: warned, run
    assert "warning: 8 ranks on this machine's 2 cores" in capsys.readouterr().err
    with pytest.raises(SpecError, match="--world-size 64 puts 32 ranks on each of this machine's 2 cores, over 4"):
        check_comm_ranks(64, two_cores, oversubscribe=False)
    check_comm_ranks(64, two_cores, oversubscribe=True)
    assert "warning: 64 ranks" in capsys.readouterr().err
    check_comm_ranks(64, Machine(device=DeviceKind.CUDA, devices_per_node=8), oversubscribe=False)   # GPUs: not cores



def test_comm_s_refusal_says_how_many_ranks_a_core_unrounded():
    import pytest

    from harness.cli.comm import check_comm_ranks
    from harness.machine import Machine
    from harness.spec import DeviceKind, SpecError

    with pytest.raises(SpecError, match="--world-size 9 puts 4.5 ranks on each of this machine's 2 cores, over 4"):
        check_comm_ranks(9, Machine(device=DeviceKind.CPU, devices_per_node=2), oversubscribe=False)
    with pytest.raises(SpecError, match="--world-size 13 puts about 4.33 ranks on each of this machine's 3 cores"):
        check_comm_ranks(13, Machine(device=DeviceKind.CPU, devices_per_node=3), oversubscribe=False)

def test_concurrent_groups_hold_consecutive_ranks_or_ranks_a_group_count_apart():
    # 8 ranks on 2 nodes of 4 (filled one after another): pairs inside a node, or pairs 4 apart across them.
    assert groups_of(8, 2, "contiguous") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups_of(8, 2, "strided") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups_of(8, 4, "strided") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert (group_stride(8, 2, "contiguous"), group_stride(8, 2, "strided"), group_stride(8, 8, "strided")) == (1, 4, 1)
    for size in (1, 3):
        with pytest.raises(ValueError, match="divide the world size 8"):
            groups_of(8, size, "contiguous")
    with pytest.raises(ValueError, match="allowed: contiguous, strided"):
        groups_of(8, 2, "diagonal")


@pytest.mark.launch
def test_comm_in_concurrent_groups_records_the_groups_layout_and_a_groups_bandwidth(tmp_path):
    out = tmp_path / "comm.jsonl"
    code = main(["comm", "--world-size", "4", "--device", "cpu", "--collectives", "all_reduce,broadcast",
                 "--max-bytes", "4K", "--warmup", "1", "--iters", "2", "--group-size", "2", "--group-layout",
                 "strided", "--out", str(out)])
    assert code == 0
    run = json.loads(out.read_text())
    assert (run["world_size"], run["group_size"], run["group_stride"], run["threads_per_rank"]) == (4, 2, 2, 1)
    for row in run["rows"]:
        assert len(row["time_by_rank_s"]) == 4
        # busbw among the group's 2 ranks: an all-reduce's factor 2 (n - 1) / n = 1, a broadcast's 1.
        assert row["busbw_bytes_per_s"] == pytest.approx(row["algbw_bytes_per_s"])


def test_an_interrupted_benchmarks_row_is_kept_but_read_by_no_reader_of_measurements(tmp_path):
    import json

    from harness.record import COMMBENCH_KIND, read_rows

    measured = {"kind": COMMBENCH_KIND, "world_size": 2, "backend": "gloo", "device": "cpu",
                "rows": [{"collective": "all_reduce", "size_bytes": 1024, "time_s": 1e-4}]}
    interrupted = {"kind": COMMBENCH_KIND, "status": "interrupted", "message": "SIGTERM arrived 3 s into the benchmark",
                   "world_size": 2, "device": "cpu", "rows": []}
    out = tmp_path / "comm.jsonl"
    out.write_text(json.dumps(measured) + "\n" + json.dumps(interrupted) + "\n")
    assert [row["backend"] for row in read_rows([out], kind=COMMBENCH_KIND)] == ["gloo"]
    assert [row.get("status") for row in read_rows([out], kind=COMMBENCH_KIND, unmeasured=True)] == [None, "interrupted"]
