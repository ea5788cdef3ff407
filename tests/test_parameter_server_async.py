"""The asynchronous parameter server (harness.strategies.parameter_server_async): its staleness, its step time and
its parity verdict worked out by hand, and a real run with one worker slowed, beside the same server planted to
wait for every worker (a synchronous server under the asynchronous name), which must show no staleness."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.derive.parity import Verdict, judge
from harness.derive.staleness import staleness_summary
from harness.spec import RunSpec, SpecError
from harness.strategies import STRATEGIES, checked
from harness.strategies.parameter_server import Roles
from harness.strategies.parameter_server_async import AsyncParameterServerTrainer

ROOT = Path(__file__).resolve().parent.parent
PS_ASYNC = STRATEGIES["ps-async"]


def _row(strategy, losses, config=None, figures=None):
    m = {"loss_per_step": losses, "strategy_config": config or {}}
    if figures is not None:
        m["strategy_figures_by_rank"] = figures
    return {"status": "ok", "spec": {"workload": "gpt-tiny", "strategy": strategy, "global_batch": 16, "micro_batch": 4,
                                     "precision": "fp32", "seed": 0, "device": "cpu", "warmup_steps": 1,
                                     "timed_steps": 3, "world_size": 3 if strategy != "plain" else 1},
            "measurements": m}


def test_an_asynchronous_row_is_never_a_match_even_with_the_plain_loops_very_losses():
    plain = _row("plain", [6.0, 5.9, 5.8, 5.7])
    same = _row("ps-async", [6.0, 5.9, 5.8, 5.7], {"updates": "asynchronous"},
                [{}, {}, {"updates_applied": 8, "staleness": [0, 1, 1, 2, 0, 1, 3, 1]}])
    verdict = judge([same, plain])[0]
    assert verdict.verdict is Verdict.NOT_COMPARABLE and verdict.verdict.value == "not comparable: asynchronous"
    # Final losses side by side after the same 4 steps of 16 samples; staleness [0,1,1,2,0,1,3,1]: sorted
    # 0,0,1,1,1,1,2,3, median (1 + 1) / 2 = 1, max 3, 6 of 8 above 0 = 75%.
    assert verdict.note == ("final loss 5.7000 against the plain loop's 5.7000 after the same 4 steps of 16 samples; "
                            "staleness of the 8 updates applied: median 1, max 3, 75% stale")
    # The same losses from a synchronous strategy are a match: the verdict is the updates', not the losses'.
    assert judge([_row("ps", [6.0, 5.9, 5.8, 5.7]), plain])[0].verdict is Verdict.MATCH


def test_staleness_is_summarised_over_every_server():
    # Two servers: [2, 0] and [1]: median of 0, 1, 2 is 1, max 2, 2 of 3 stale.
    m = {"strategy_figures_by_rank": [{}, {"staleness": [2, 0]}, {"staleness": [1]}]}
    assert staleness_summary(m) == {"updates": 3, "median": 1, "max": 2, "stale_share": 2 / 3}
    assert staleness_summary({"strategy_figures_by_rank": [{}, {}]}) is None


def test_a_server_counts_the_updates_applied_since_the_worker_last_pulled(monkeypatch):
    import torch

    from harness.strategies import parameter_server_async

    replies = []
    monkeypatch.setattr(parameter_server_async.dist, "isend", lambda tensor, dst, tag: replies.append(dst))
    trainer = AsyncParameterServerTrainer.__new__(AsyncParameterServerTrainer)
    trainer.applied, trainer.pulled_at, trainer.staleness = 0, {}, []
    trainer.shard = torch.nn.Parameter(torch.zeros(2))
    trainer.optimizer = torch.optim.SGD([trainer.shard], lr=1.0)
    for worker in [0, 1, 0, 0, 1]:
        trainer._apply(worker, torch.ones(2))
    # worker 0 first: 0; worker 1, 1 applied since the start: 1; worker 0, pulled at 1, now 2: 1; worker 0 again,
    # pulled at 3: 0; worker 1, pulled at 2, now 4: 2. Each gradient applied on arrival, each answered at once.
    assert trainer.staleness == [0, 1, 1, 0, 2]
    assert trainer.shard.tolist() == [-5.0, -5.0] and replies == [0, 1, 0, 0, 1]


def test_the_step_time_is_the_one_at_which_the_workers_together_deliver_a_global_batch():
    trainer = AsyncParameterServerTrainer.__new__(AsyncParameterServerTrainer)
    trainer.roles = Roles.of(3, 1, "dedicated")
    # Workers at 1 s and 3 s a step (each half of the batch): together 1/1 + 1/3 = 4/3 half-batches a second, a
    # global batch (2 halves) in 2 / (4/3) = 1.5 s. The server's 9 s steps are not the workers'.
    assert trainer.combined_step_times([[1.0, 2.0], [3.0, 2.0], [9.0, 9.0]]) == pytest.approx([1.5, 2.0])


def test_on_gpus_it_is_skipped_with_the_reason_nccl_has_no_receive_from_any_source():
    spec = RunSpec(workload="gpt-tiny", strategy="ps-async", world_size=3, global_batch=16, micro_batch=4,
                   device="cuda")
    assert "NCCL does not" in PS_ASYNC.skip_reason(spec)
    assert PS_ASYNC.skip_reason(RunSpec(workload="gpt-tiny", strategy="ps-async", world_size=3, global_batch=16,
                                        micro_batch=4)) is None


def test_its_servers_are_dedicated_and_it_needs_a_worker():
    with pytest.raises(SpecError, match="no option 'placement'"):
        checked(RunSpec(workload="gpt-tiny", strategy="ps-async", world_size=3, global_batch=16, micro_batch=4,
                        options={"placement": "colocated"}))
    assert "needs a world size above it" in PS_ASYNC.skip_reason(
        RunSpec(workload="gpt-tiny", strategy="ps-async", world_size=2, global_batch=16, micro_batch=4,
                options={"servers": 2}))


PLANTED_SYNCHRONOUS = r'''
"""ps-async with its servers waiting for every worker's gradient, averaging them into one update and answering all
of them: a synchronous server under the asynchronous name."""
import torch.distributed as dist

from harness.strategies.parameter_server_async import AsyncParameterServer, AsyncParameterServerTrainer


class WaitsForAll(AsyncParameterServerTrainer):
    def serve(self):
        arrived = dict(self._next_gradient() for _ in self.roles.workers)
        for worker in arrived:
            self.staleness.append(self.applied - self.pulled_at.get(worker, 0))
        self.shard.grad = sum(arrived[w] for w in sorted(arrived)) / len(arrived)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.applied += 1
        for worker in arrived:
            self.pulled_at[worker] = self.applied
        return [dist.isend(self.shard.detach().clone(), dst=worker, tag=2) for worker in arrived]


class Planted(AsyncParameterServer):
    name = "ps-async-waits"
    trainer_class = WaitsForAll


STRATEGIES = {"ps-async-waits": Planted()}
'''


@pytest.mark.launch
@pytest.mark.matrix
def test_a_slowed_worker_leaves_stale_updates_and_a_server_planted_to_wait_for_all_leaves_none(tmp_path):
    (tmp_path / "planted.py").write_text(PLANTED_SYNCHRONOUS)
    out = tmp_path / "rows.jsonl"
    done = subprocess.run([sys.executable, "-m", "harness", "run", "--workload", "gpt-tiny", "--world-sizes", "2",
                           "--strategy", "plain,ps-async,ps-async-waits", "--global-batch", "16",
                           "--warmup-steps", "1", "--timed-steps", "4", "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "PARBENCH_EXTRA_STRATEGIES": f"{tmp_path / 'planted.py'}:STRATEGIES",
                               "PARBENCH_FAULT": "slow-step:factor=3:rank=1:step=0"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by_strategy = {row["spec"]["strategy"]: row for row in rows}
    assert all(row["status"] == "ok" for row in rows), [row.get("message") for row in rows]
    honest = staleness_summary(by_strategy["ps-async"]["measurements"])
    planted = staleness_summary(by_strategy["ps-async-waits"]["measurements"])
    # 2 workers x 5 steps: 10 gradients, each applied on arrival; the planted server folds each round's 2 into
    # one update, every gradient computed on the parameters of the last. Worker 1 takes 3 times as long a step, so
    # worker 0 pushes about 3 times between two of its pulls: some update is 2 or more behind. (Workers in
    # lock-step, as a server answering them in a fixed order would keep them, leave every update at most 1 behind.)
    assert honest["updates"] == 10 and honest["max"] >= 2
    assert planted == {"updates": 10, "median": 0, "max": 0, "stale_share": 0.0}
    verdicts = {row["spec"]["strategy"]: parity.verdict for row, parity in zip(rows, judge(rows))}
    assert verdicts == {"plain": Verdict.REFERENCE, "ps-async": Verdict.NOT_COMPARABLE,
                        "ps-async-waits": Verdict.NOT_COMPARABLE}
