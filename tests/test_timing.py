"""Host-stall detection: steps during which the virtual machine was not running are named, not hidden."""

import pandas as pd
import torch

from harness.derive.gate import Verdict, gate
from harness.spec import RunResult, RunSpec, Status
from harness.rank.timing import HostClock, StepTimer


def test_a_step_the_host_descheduled_is_stalled_and_an_ordinary_one_is_not():
    clock = HostClock()
    clock.cpus = 2
    # Figures read off /proc/stat on the 2-vCPU development VM: a 31 ms step accounted 6 ticks (60 ms of
    # CPU over 2 CPUs); a 1.27 s step accounted 88 ticks besides steal; a 1.215 s step 131.
    assert not clock.stalled(running_s=0.06, wall_s=0.031)
    assert not clock.stalled(running_s=0.04, wall_s=0.031)        # two ticks short: tick granularity
    assert clock.stalled(running_s=0.88, wall_s=1.274)
    assert clock.lost_s(running_s=0.88, wall_s=1.274) == 2 * 1.274 - 0.88
    assert clock.stalled(running_s=1.31, wall_s=1.215)             # one vCPU paused, the other idle
    assert not clock.stalled(running_s=1.9, wall_s=1.0)            # a long step the machine fully ran


def test_the_timer_records_one_stall_flag_and_lost_time_per_timed_step():
    timer = StepTimer(torch.device("cpu"))
    with timer.measure(record=False):
        pass
    for _ in range(3):
        with timer.measure():
            sum(range(10_000))
    assert len(timer.seconds) == len(timer.stalled) == len(timer.host_lost_seconds) == 3
    assert all(lost is None or lost < 1.0 for lost in timer.host_lost_seconds)


def _row(step_times: list[float], stalled: list[int], repeat: int) -> RunResult:
    spec = RunSpec(workload="gpt-tiny", strategy="plain", world_size=1, global_batch=16, micro_batch=4)
    return RunResult(spec=spec, status=Status.OK, run_id=f"row-{len(stalled)}-{repeat}", repeat=repeat,
                     measurements={"step_time_s": step_times, "host_stalled_step_indices": stalled})


def test_the_gate_sets_stalled_steps_aside():
    clean = [0.030 + 0.001 * (i % 5) for i in range(20)]
    # Same software, but the new launches had a third of their steps stalled by the host for a second.
    stalled = [i for i in range(20) if i % 3 == 0]
    noisy = [t + 1.0 if i in stalled else t for i, t in enumerate(clean)]
    base = [_row(clean, [], k) for k in range(3)]
    result = gate(base, [_row(noisy, stalled, k) for k in range(3)], {"*": 0.15})
    assert [j.verdict for j in result.judgements] == [Verdict.SAME]
    # A real 25% slowdown of every step is still caught.
    slower = [t * 1.25 for t in clean]
    result = gate(base, [_row(slower, [], k) for k in range(3)], {"*": 0.15})
    assert [j.verdict for j in result.judgements] == [Verdict.REGRESSION]


def test_throughput_rests_on_unstalled_steps_only_where_the_host_stalled():
    from harness.derive.throughput import Basis, throughput_basis

    def row(stalled, status="ok"):
        return {"status": status, "spec": {}, "measurements": {
            "step_time_s": [0.03, 0.05, 0.04], "host_stalled_step_indices": stalled}}

    assert throughput_basis([row([]), row([1]), row([], "failed")]) is Basis.UNSTALLED
    assert throughput_basis([row([]), row([])]) is Basis.ALL_STEPS
    assert throughput_basis([row([]), row([0, 1, 2])]) is Basis.ALL_STEPS    # a launch with no clean step
    assert throughput_basis([{"status": "ok", "spec": {}, "measurements": {"step_time_s": [0.1]}}]) \
        is Basis.ALL_STEPS                                                    # rows from before stalls
