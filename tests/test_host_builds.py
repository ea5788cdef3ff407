"""Host builds before launch (harness/launch/host_builds.py): which cells need DeepSpeed's cpu_adam, and the build lock
a killed build leaves, which torch would wait on without end."""

import os
import time

from harness.launch.host_builds import STALE_LOCK_S, needs_cpu_adam, remove_stale_lock
from harness.spec import RunSpec


def _spec(strategy="zero2", **options):
    return RunSpec(workload="gpt-tiny", strategy=strategy, world_size=2, global_batch=16, micro_batch=4,
                   options=options)


def test_only_cells_that_offload_the_optimizer_need_cpu_adam():
    assert needs_cpu_adam(_spec(offload_optimizer="cpu")) and needs_cpu_adam(_spec("zero3", offload_optimizer="cpu",
                                                                                   offload_param="cpu"))
    assert not needs_cpu_adam(_spec()) and not needs_cpu_adam(_spec(offload_optimizer="none"))
    assert not needs_cpu_adam(_spec("fsdp2", offload_policy="cpu"))      # torch's own optimizer on the host


def test_a_lock_older_than_any_build_is_removed_and_a_fresh_one_is_left_to_its_build(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    now = time.time()
    os.utime(lock, (now - STALE_LOCK_S + 60, now - STALE_LOCK_S + 60))      # a build 14 minutes in: still building
    assert remove_stale_lock(tmp_path, now=now) is None and lock.exists()
    os.utime(lock, (now - STALE_LOCK_S - 60, now - STALE_LOCK_S - 60))      # 16 minutes: killed, nothing holds it
    assert remove_stale_lock(tmp_path, now=now) == lock and not lock.exists()
    assert remove_stale_lock(tmp_path, now=now) is None                     # no lock: nothing to do
