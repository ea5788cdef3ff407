"""The per-rank program every launcher starts: build, wrap, warm up, time, report.

    torchrun --nproc-per-node 2 -m harness.rank.worker --spec CELL/spec.json --out CELL

Every rank builds the workload from the spec's seed (identical weights everywhere), lets the strategy wrap
it, runs the warm-up steps and then the timed steps, each over this rank's slice of a deterministic
global batch. Data for a step is made before its clock starts, and ranks meet at a barrier there, so a
step's time is training alone. After the last step the ranks exchange their losses and times (outside
any timed region) and rank 0 writes `measurements.json` into the cell folder. A rank that fails writes
`rank<N>.error.json` there instead, with its status (`oom` or `failed`), and exits non-zero; the harness
turns either file into the cell's row.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import psutil
import torch

from harness.rank.routing import RoutingRecord, routing_measurements
from harness.strategies.expert_parallel import Dispatcher, plant_dispatch_fault
from harness.strategies.sequence_parallel import plant_causal_leak
from harness.rank.comm_counter import CollectiveCounter
from harness.rank.bare_loop import run_bare_loop
from harness.rank.compute_only import CompletedPass, compute_only_pass
from harness.rank.checkpointed_run import CheckpointedRun, restart_count
from harness.rank.horovod_elastic import ElasticSteps, is_elastic
from harness.rank.faults import (CAUSAL_LEAK, CHECKPOINT_WITHOUT_OPTIMIZER, DISPATCH_KINDS, RESUME_DATA_FROM_START, Fault,
                                 fault_from_environment)
from harness.rank.memory_model import (ModelStateReader, PeakRssSince, TimedStepsGrowth, import_optimizer_modules,
                                       largest_module_own_parameters, outside_census_flag_bytes, reset_peak_memory,
                                       resident_bytes)
from harness.rank.recompute_pass import recompute_pass
from harness.rank.saved_activations import SavedActivationCensus
from harness.spec import Precision, RunSpec, Status
from harness.strategies import Strategy, Trainer, get_strategy
from harness.strategies.base import ExpectedTraffic, GradientsReady, RankContext
from harness.strategies.checkpointing import count_checkpointed, interval_of, setting
from harness.strategies.compiling import CompileReading, compile_figures, compiles
from harness.strategies.offload import ACTIVATION_OFFLOAD_NAME, packed_bytes
from harness.strategies.state_checkpoint import plan_of, shrunk_spec
from harness.rank.teardown import exit_without_teardown
from harness.rank.parent_death import die_with_launcher
from harness.rank.timing import StepTimer
from harness.rank.facts import cell_facts, host_load, host_load_figures, memory_figures, rank_memory
from workloads import Workload, count_parameters, get_workload

MEASUREMENTS_FILE = "measurements.json"
ERROR_FILE = "rank{rank}.error.json"
THREADS_ENV = "PARBENCH_THREADS_PER_RANK"
PROFILE_ENV = "PARBENCH_PROFILE_STEPS"      # GPU only: steps to run under the profiler after the timed ones


def main(argv: list[str] | None = None) -> int:
    die_with_launcher()      # a rank outlives neither its launcher nor the harness (harness.rank.parent_death)
    parser = argparse.ArgumentParser(prog="python -m harness.rank.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, type=Path, help="the cell's spec.json")
    parser.add_argument("--out", required=True, type=Path, help="the cell's folder for measurements.json")
    args = parser.parse_args(argv)

    spec = RunSpec.from_dict(json.loads(args.spec.read_text()))
    strategy = get_strategy(spec.strategy)
    if os.environ.get(THREADS_ENV):
        torch.set_num_threads(int(os.environ[THREADS_ENV]))
    rank = int(os.environ.get("RANK", os.environ.get("HOROVOD_RANK", 0)))
    if restart_count() > 0:
        # The report this rank wrote in the attempt its launcher restarted (a peer it lost) is kept, by another name:
        # this attempt's outcome is the launch's.
        report = args.out / ERROR_FILE.format(rank=rank)
        if report.exists():
            report.replace(report.with_name(f"attempt{restart_count() - 1}-{report.name}"))
    try:
        spec = node_left(spec)
        counter = CollectiveCounter()
        strategy.instrument(counter)      # before start: DeepSpeed keeps the torch functions it finds
        _phase(rank, "interpreter and imports ready")
        context = strategy.start(spec)
        rank = context.rank
        _phase(rank, f"{spec.strategy} started ({context.backend})")
        if strategy.times_whole_loop:       # the bare loop: nothing of the harness's among its timed steps
            measurements = run_bare_loop(spec, strategy, context)
        else:
            measurements = run_cell(spec, strategy, context, counter)
        _phase(rank, "steps done")
        if context.rank == 0:
            _write_json(args.out / MEASUREMENTS_FILE, measurements)
        return 0
    except BaseException as error:  # every failure becomes a status the harness can record
        status = Status.OOM if _is_out_of_memory(error) else Status.FAILED
        message = f"rank {rank}: {type(error).__name__}: {error}".splitlines()[0][:500]
        _write_json(args.out / ERROR_FILE.format(rank=rank),
                    {"status": status.value, "message": message, "traceback": traceback.format_exc()})
        traceback.print_exc()
        return 3 if status is Status.OOM else 1


def node_left(spec: RunSpec) -> RunSpec:
    """The cell as this rank runs it: where a node left on purpose (`checkpoint=at:K:leave=S`) and torchrun restarted
    the ranks left at a smaller world size, the cell at that size (`shrunk_spec`: the global batch kept). A world size
    that differs from the spec anywhere else is an error: a first rendezvous that went ahead without a node."""
    launched = os.environ.get("WORLD_SIZE")
    if launched is None or int(launched) == spec.world_size:
        return spec
    plan = plan_of(spec) if get_strategy(spec.strategy).checkpoint_method else None
    if plan is not None and plan.leave_step is not None and restart_count() > 0 \
            and int(launched) == shrunk_spec(spec).world_size:
        return shrunk_spec(spec)
    raise RuntimeError(f"launched at world size {launched}, where the cell's is {spec.world_size}")


def _node_rank() -> int:
    """Which node of a multi-node launch this rank runs on, as its launcher numbers them (torchrun:
    GROUP_RANK, DeepSpeed's launcher: CROSS_RANK, horovodrun: HOROVOD_CROSS_RANK); 0 on one host."""
    for name in ("GROUP_RANK", "CROSS_RANK", "HOROVOD_CROSS_RANK"):
        if os.environ.get(name):
            return int(os.environ[name])
    return 0


def run_cell(spec: RunSpec, strategy: Strategy, context: RankContext, counter: CollectiveCounter) -> dict[str, Any]:
    workload = get_workload(spec.workload)
    layout = strategy.layout(spec)
    torch.manual_seed(spec.seed)
    # What the model-state reading measures this rank's resident growth from: after the imports and the process
    # group, and what a torch optimizer first imports, before the model and everything the strategy builds around it.
    import_optimizer_modules()
    resident_before_model = resident_bytes(context.device)
    layers = workload.build_layers()                  # on CPU from the seed: identical on every rank
    # A loss term the layers send to the gradients themselves (MoE's load balancing) is scaled as accumulate() scales
    # each micro-batch's loss: 1 / the micro-batches a rank runs (DeepSpeed's engine divides by the same count).
    workload.scale_auxiliary_losses(layers, 1 / layout.micro_batches)
    parameters = count_parameters(torch.nn.Sequential(*layers))
    largest_module = largest_module_own_parameters(torch.nn.Sequential(*layers))
    expected_traffic = strategy.expected_traffic(spec, layers)   # before wrapping converts or shards them
    reduce_dtypes = strategy.gradient_reduce_dtypes(spec, torch.nn.Sequential(*layers))   # parity's tolerances
    # Before wrapping, which may shard the weights in place (ZeRO-3 leaves empty placeholders).
    facts_for_checkpoint = {"holds": list(strategy.checkpoint_holds(strategy.resolved(spec))),
                            "model_tensors": len(torch.nn.Sequential(*layers).state_dict()),
                            "tied_parameters": sum(_tied_weight(layers, tie).numel() for tie in workload.ties())}
    trainer = strategy.wrap(spec, context, workload, layers)
    _phase(context.rank, "model wrapped")
    fault = fault_from_environment()
    if fault and fault.kind in DISPATCH_KINDS:
        plant_dispatch_fault([m for layer in layers for m in layer.modules() if isinstance(m, Dispatcher)],
                             fault.kind)
    if fault and fault.kind == CAUSAL_LEAK:
        plant_causal_leak(layers, spec, strategy)
    # A checkpoint cell's launch (harness.rank.checkpointed_run): it may start from a save, save at step K, stop there.
    run = CheckpointedRun.from_environment(strategy.checkpoint_method,
                                           omit_optimizer=bool(fault and fault.kind == CHECKPOINT_WITHOUT_OPTIMIZER))
    if run:
        run.facts = facts_for_checkpoint
    first_step = run.start(trainer) if run else 0
    if run and run.loads:
        _phase(context.rank, f"resumed at step {first_step} from {run.directory}")

    timer = StepTimer(context.device)
    losses: list[torch.Tensor] = []
    outcomes: list[tuple[bool, float] | None] = []       # fp16: each step's (applied, loss scale)
    model_states = ModelStateReader(trainer, context.device, spec.warmup_steps, resident_before=resident_before_model,
                                    strategy=spec.strategy)
    growth = TimedStepsGrowth(context.device, spec.warmup_steps, spec.timed_steps)     # a leak of every step
    peak_rss_since = PeakRssSince.PROCESS_START
    norms = FirstStepNorms(spec, trainer)
    # A checkpoint cell reads the same norms in step K, the first its resumed launch runs (harness.derive.resume).
    probe = FirstStepNorms(spec, trainer, step=run.at) if run else None
    # Saved-for-backward bytes in the last warm-up step, beside the functional collectives' sampling.
    census = SavedActivationCensus(torch.nn.Sequential(*layers))
    routing = RoutingRecord(layers)            # an MoE model's choices, each step (nothing elsewhere)
    census_step = spec.warmup_steps - 1
    offloaded = None            # bytes activation offload copied to the host in that step
    disarm = lambda: None       # noqa: E731
    # A loud fault fires in a group's first attempt alone: the attempt its launcher restarted resumes past it.
    armed = restart_count() == 0
    # torch.compile's account where the cell compiles: at the first timed step's start and after the last.
    compiled = compiles(strategy.resolved(spec))
    compile_readings: dict[str, CompileReading] = {}

    def steps(begin: int) -> dict[str, Any] | None:
        """Steps `begin`.. to the end; what a launch that stops after its save returns, else None."""
        nonlocal peak_rss_since, offloaded, disarm
        for step in range(begin, spec.warmup_steps + spec.timed_steps):
            if run and run.saves_before(step):
                run.save(trainer, losses, norms.figures())
                if run.stops_after(step):
                    return _stopped(trainer, run, losses)
            if fault and armed:
                if run and fault.kills(context.rank, step):
                    run.mark_kill(context.rank, step)
                fault.fire(context.rank, step)
            if fault:
                trainer.loss_multipliers = fault.loss_multipliers(context.rank, step, layout.micro_batches)
                disarm = fault.scale_tensor_gradients(context.rank, step, torch.nn.Sequential(*layers))
                fault.before_step(context.rank, step, trainer.torch_optimizer)
            # The planted `resume-data-from-start` bug: a resumed launch reads the data from the start again.
            data_step = step - first_step if fault and fault.kind == RESUME_DATA_FROM_START else step
            micro_batches = [strategy.rank_batch(spec, context, workload.batch(
                spec.seed, data_step, strategy.sample_indices(spec, context, index), context.device))
                for index in range(layout.micro_batches)]
            routing.before_step()
            growth.before_step(step)        # before the barrier: its gc.collect() delays no rank's clock
            trainer.barrier()
            timed = step >= spec.warmup_steps
            if step == spec.warmup_steps:
                # Peaks of the timed steps alone, for every strategy alike: not the set-up (a whole model on
                # the device before sharding), nor the warm-up steps.
                peak_rss_since = reset_peak_memory(context.device)
            if compiled and timed and "timed_start" not in compile_readings:
                compile_readings["timed_start"] = CompileReading.now()
            # Functional collectives (DTensor's) are counted in the last warm-up step alone: their dispatch mode
            # would slow the timed ones (harness.rank.comm_counter).
            with timer.measure(record=timed), counter.counting(record=timed,
                                                               sample_functional=step == spec.warmup_steps - 1), \
                    census.counting(step == census_step, data=[t for batch in micro_batches for t in batch]):
                if fault:
                    fault.in_step(context.rank, step, context.device)
                started = time.perf_counter()
                trainer.step_outcome = None
                packed_before = packed_bytes()
                ready = _together(norms.gradients_ready(step), model_states.gradients_ready(step, micro_batches),
                                  probe.gradients_ready(step) if probe else None)
                losses.append(trainer.train_step(micro_batches, ready))
                if fault and fault.slows(context.rank, step, spec.strategy):
                    _sleep_planted_slowdown(fault, context.device, started)
            if step == census_step:
                offloaded = packed_bytes() - packed_before
            disarm()
            outcome = trainer.step_outcome
            outcomes.append((outcome.applied, outcome.loss_scale) if outcome else None)
            if fault:
                fault.after_step(context.rank, step, trainer.torch_optimizer, trainer)
            norms.after_step(step)
            if probe:
                probe.after_step(step)
            if run:
                run.after_step(step, context.device)
            model_states.after_step(step, micro_batches)
            growth.after_step(step)
            routing.after_step()

        return None

    elastic = None
    if is_elastic():
        # Horovod Elastic (harness.rank.horovod_elastic): a lost rank's peers go back to the commit before step K, at
        # the world size the hosts left give.
        def on_reset(step: int) -> None:
            nonlocal spec, layout, armed
            armed = False          # the planted fault has fired: the job goes on without that rank
            spec = _elastic_size(spec, trainer)
            layout = strategy.layout(spec)
            # The global batch is kept: each rank now accumulates more micro-batches before Horovod all-reduces.
            trainer.optimizer.set_backward_passes_per_step(layout.micro_batches)
            # The lost step's backward left its gradients behind; the restored state holds weights and AdamW's.
            trainer.model.zero_grad(set_to_none=True)
            # Every step from the start again: the ones before the commit come from the save's record.
            del losses[:], outcomes[:]
            timer.forget()
            counter.forget()
            if run:
                run.restored_in_memory(step)
            _phase(context.rank, f"Horovod Elastic: back to step {step} at {context.world_size} ranks")

        elastic = ElasticSteps(trainer, steps, on_reset)
        if run:
            run.commit_in_memory = elastic.commit
    stopped = elastic.run(first_step) if elastic else steps(first_step)
    if stopped is not None:
        return stopped

    trainer.loss_multipliers = None        # a fault in the last step must not reach the passes below
    if compiled:
        compile_readings["timed_end"] = CompileReading.now()    # before the passes below compile models of their own
    _phase(context.rank, "timed steps done")
    memory = rank_memory(context, peak_rss_since)   # before the compute-only pass adds a model of its own
    compute_only, compute_only_note = _compute_only_times(spec, strategy, context, workload, trainer)
    compute_only_raw = compute_only._asdict() if compute_only else None
    _phase(context.rank, "compute-only pass done")
    recompute = _recompute_times(spec, strategy, context, workload, trainer)
    profiled = _profile(spec, strategy, context, workload, trainer)
    global_losses = trainer.global_losses(torch.stack(losses).float()).tolist()
    if run:
        global_losses = run.restored_losses() + global_losses
    by_rank = trainer.gather({"times": timer.seconds, "wall": timer.wall_seconds, "memory": memory,
                              "stalled": timer.stalled, "host_lost": timer.host_lost_seconds,
                              "host": socket.gethostname(), "node": _node_rank(), "comm": counter.per_step(),
                              "compute_only": compute_only_raw,
                              "model_states": _model_state_figures(model_states, growth),
                              "parameters_held": trainer.parameters_held(parameters),
                              "expert_parameters_held": trainer.expert_parameters_held(),
                              "parameters_kept_whole": trainer.parameters_kept_whole(),
                              "saved_activations": census.peak, "recompute": recompute, "outcomes": outcomes,
                              "offloaded": offloaded, "strategy_figures": trainer.rank_figures(),
                              "routing": routing.rank_figures(strategy.replica(spec, context)),
                              "host_load": host_load(context),
                              "checkpoint": run.rank_figures() if run else None,
                              "compile": {name: vars(reading) for name, reading in compile_readings.items()}})
    measurements = _measurements(spec, workload, layout, context, trainer, parameters, global_losses, by_rank)
    measurements.update(host_load_figures([r["host_load"] for r in by_rank]))
    measurements.update(routing_measurements([r["routing"] for r in by_rank]))
    measurements.update(_loss_scaling_figures(spec, by_rank))
    measurements.update(_activation_figures(spec, strategy, layers, by_rank))
    measurements.update(compile_figures(compiled, [r["compile"] for r in by_rank]))
    measurements.update(norms.figures(), gradient_reduce_dtypes=list(reduce_dtypes))
    if run:
        measurements.update(run.restored_norms(context.world_size))
        measurements["checkpoint"] = run.measurements([r["checkpoint"] for r in by_rank])
        measurements["checkpoint_probe"] = {"step": run.at, **probe.figures()}
    measurements.update(_communication(spec, strategy, by_rank, expected_traffic, compute_only_note))
    measurements.update(profiled)
    measurements.update(_model_state_facts(spec, strategy, layout, context, trainer, parameters, largest_module,
                                           by_rank))
    trainer.close()
    return measurements


def _tied_weight(layers: list[torch.nn.Module], tie) -> torch.Tensor:
    """The weight a tie shares (`Tie.weight_attr` of its owner layer, e.g. wte.weight)."""
    owner = layers[tie.owner]
    for name in tie.weight_attr.split("."):
        owner = getattr(owner, name)
    return owner


def _elastic_size(spec: RunSpec, trainer: Trainer) -> RunSpec:
    """The cell at the world size Horovod Elastic initialised again with, its global batch kept; `trainer.context` takes
    the rank's new place."""
    hvd = trainer.hvd
    context = trainer.context
    context.rank, context.world_size = hvd.rank(), hvd.size()
    context.local_rank, context.local_world_size = hvd.local_rank(), hvd.local_size()
    if hvd.size() == spec.world_size:
        return spec
    return spec.replace(world_size=hvd.size(), nnodes=1 if hvd.size() < spec.nnodes else spec.nnodes)


def _stopped(trainer: Trainer, run: CheckpointedRun, losses: list[torch.Tensor]) -> dict[str, Any]:
    """What a launch that only saves (`stop`, at another world size than its cell's) reports: its save and the
    losses before it."""
    by_rank = trainer.gather(run.rank_figures())
    figures = {"loss_per_step": trainer.global_losses(torch.stack(losses).float()).tolist(),
               "checkpoint": run.measurements(by_rank), "stopped_at_step": run.at}
    trainer.close()
    return figures


def _sleep_planted_slowdown(fault: Fault, device: torch.device, started: float) -> None:
    """A slow-step fault's sleep, inside the step's timed region: the train step's own time is read once the
    device has finished it (only here, where a fault is planted: an honest step is never synchronised)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    time.sleep(fault.slowdown_s(time.perf_counter() - started))


class FirstStepNorms:
    """The parity probe (harness.derive.parity): in step 0, a warm-up step, the global L2 norm of the reduced
    gradients between reduction and update, and after the step the global norm of the parameters and of
    the step's update theta_1 - theta_0; the gradient's and the update's norms also tensor by tensor, by
    parameter name in the unwrapped model. Every rank takes part (sharded trainers all-reduce their
    squares, in a warm-up step, which the collective counter does not record)."""

    PROBED_STEP = 0

    def __init__(self, spec: RunSpec, trainer: Trainer, step: int = PROBED_STEP) -> None:
        self.trainer = trainer
        self.step = step
        self.unavailable_because = trainer.norms_unavailable_because if not trainer.reaches_gradients_ready else ""
        if spec.warmup_steps == 0 and not self.unavailable_because:
            self.unavailable_because = ("no warm-up step: the probe's reads and collectives would land in a "
                                        "timed step")
        self.readings: dict[str, Any] = {}
        self.before: list[torch.Tensor] = []
        self.names: list[str] = []

    def gradients_ready(self, step: int) -> GradientsReady | None:
        """What the step's `train_step` is given: the probe in the probed step, else nothing."""
        return self._read_gradients if step == self.step and not self.unavailable_because else None

    def _read_gradients(self) -> None:
        try:
            parts, _ = self.trainer.local_parameters()
        except NotImplementedError as error:     # a strategy that does not list them: losses alone, said so
            self.unavailable_because = str(error)
            return
        if not self.trainer.gradient_norm_after_step:
            self.readings["gradient_norm_first_step"] = self.trainer.gradient_norm()
        try:
            self.names = self.trainer.parameter_names()
        except NotImplementedError as error:     # one that does not name them: the global norms alone, said so
            self.readings["norms_by_tensor_unavailable_because"] = str(error)
        else:
            self.readings["gradient_norm_by_tensor_first_step"] = dict(
                zip(self.names, self.trainer.tensor_norms(*self.trainer.local_gradients()), strict=True))
        # In host memory: on a GPU the copy (4 bytes per parameter on top of AdamW's 16 of model states)
        # would land in the cell's peak device memory. On CPU it can add as much to a rank's peak RSS.
        self.before = [part.detach().to("cpu", copy=True) for part in parts]

    def after_step(self, step: int) -> None:
        if step != self.step or self.unavailable_because:
            return
        if self.trainer.gradient_norm_after_step:
            self.readings["gradient_norm_first_step"] = self.trainer.gradient_norm()
        parts, sharded = self.trainer.local_parameters()
        self.readings["parameter_norm_after_first_step"] = self.trainer.global_norm(parts, sharded)
        update = (part.detach().cpu() - before for part, before in zip(parts, self.before))   # one at a time
        self.readings["update_norm_first_step"] = self.trainer.global_norm(update, sharded)
        if self.names:
            update = (part.detach().cpu() - before for part, before in zip(parts, self.before))
            self.readings["update_norm_by_tensor_first_step"] = dict(
                zip(self.names, self.trainer.tensor_norms(update, sharded), strict=True))
        self.before = []

    def figures(self) -> dict[str, Any]:
        if self.unavailable_because:
            return {"norms_unavailable_because": self.unavailable_because}
        return dict(self.readings)


def _together(*hooks: GradientsReady | None) -> GradientsReady | None:
    """One `gradients_ready` running every given probe in turn (the parity probe of step 0 and the memory
    reading of the last warm-up step meet when there is one warm-up step), or None where none is given."""
    given = [hook for hook in hooks if hook is not None]
    if not given:
        return None

    def run_all() -> None:
        for hook in given:
            hook()
    return run_all


def _compute_only_times(spec: RunSpec, strategy: Strategy, context: RankContext, workload: Workload,
                        trainer: Trainer) -> tuple[CompletedPass | None, str]:
    """This rank's own work with no communication (harness.rank.compute_only), or None and why not."""
    reason = strategy.compute_only_unavailable(spec)
    if reason:
        return None, reason
    try:
        return compute_only_pass(spec, strategy, context, workload, trainer.barrier), ""
    except torch.OutOfMemoryError:
        return None, "the unwrapped model did not fit beside the wrapped one"
    finally:
        if context.device.type == "cuda":
            torch.cuda.empty_cache()


def _recompute_times(spec: RunSpec, strategy: Strategy, context: RankContext, workload: Workload,
                     trainer: Trainer) -> dict[str, Any] | str | None:
    """Where the cell checkpoints blocks, this rank's recompute pass (harness.rank.recompute_pass) as plain
    values, or why it has none (a string); None where nothing is checkpointed."""
    interval = interval_of(strategy.resolved(spec))
    if not interval:
        return None
    try:
        times = recompute_pass(spec, strategy, context.device, workload, interval,
                               lambda micro: strategy.sample_indices(spec, context, micro), trainer.barrier)
        return times._asdict()
    except torch.OutOfMemoryError:
        return "the unwrapped model did not fit beside the wrapped one"
    finally:
        if context.device.type == "cuda":
            torch.cuda.empty_cache()


def _activation_figures(spec: RunSpec, strategy: Strategy, layers: list[torch.nn.Module],
                        by_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Each rank's saved-for-backward peak (harness.rank.saved_activations) and, where blocks are checkpointed,
    the recompute pass's times; the recompute cost is derived from them at read time (harness.derive.techniques)."""
    options = strategy.resolved(spec)
    offload = options.get(ACTIVATION_OFFLOAD_NAME, "none")
    figures: dict[str, Any] = {"activation_checkpointing": setting(interval_of(options)),
                               # of the model's blocks (a pipeline stage holds some of them)
                               "activation_checkpointed_blocks": count_checkpointed(layers, interval_of(options)),
                               ACTIVATION_OFFLOAD_NAME: offload}
    if spec.warmup_steps == 0:
        figures["saved_activation_unmeasured_because"] = ("no warm-up step: the census's hooks would slow a "
                                                          "timed step")
    elif offload != "none":
        figures["saved_activation_unmeasured_because"] = ("activation offload's save_on_cpu hook is the innermost "
                                                          "and hides the saved tensors from the census's")
        # What its pack hook copied to the host in the last warm-up step; backward copies it back.
        figures["activation_offload_bytes_by_rank"] = [r["offloaded"] for r in by_rank]
    else:
        figures["saved_activation_bytes_by_rank"] = [r["saved_activations"] for r in by_rank]
    recompute = [r["recompute"] for r in by_rank]
    if recompute[0] is None:
        return figures
    unavailable = next((r for r in recompute if isinstance(r, str)), "")
    if unavailable:
        figures["recompute_unavailable_because"] = unavailable
        return figures
    # A synchronous pass ends when its slowest rank ends (as `step_time_s`).
    figures["recompute_checkpointed_step_time_s"] = [max(times) for times in
                                                     zip(*(r["checkpointed_s"] for r in recompute))]
    figures["recompute_kept_step_time_s"] = [max(times) for times in zip(*(r["kept_s"] for r in recompute))]
    return figures


def _profile(spec: RunSpec, strategy: Strategy, context: RankContext, workload: Workload,
             trainer: Trainer) -> dict[str, Any]:
    """NCCL kernel time and its overlapped fraction from a profiled pass (harness.rank.profile_pass), on GPU
    when PARBENCH_PROFILE_STEPS asks for it; after the timed steps, so it never touches them."""
    steps = int(os.environ.get(PROFILE_ENV, "0") or 0)
    if steps <= 0 or context.device.type != "cuda":
        return {}
    from harness.rank.profile_pass import profile_steps

    layout = strategy.layout(spec)

    def run_step(step: int) -> None:
        data_step = spec.warmup_steps + step
        trainer.barrier()
        trainer.train_step([workload.batch(spec.seed, data_step, strategy.sample_indices(spec, context, index),
                                           context.device) for index in range(layout.micro_batches)])

    return profile_steps(run_step, steps)      # rank 0's figures become the row's


def _communication(spec: RunSpec, strategy: Strategy, by_rank: list[dict[str, Any]],
                   expected: ExpectedTraffic, compute_only_note: str) -> dict[str, Any]:
    """Raw communication facts: the collectives each rank issued per step (sizes, calls, dtypes, group
    sizes), the collectives the strategy says a step should issue, and each rank's compute-only pass.
    Wire bytes and exposed communication are derived from them (harness.derive.comm, .exposed)."""
    compute_only = [r["compute_only"] for r in by_rank]
    available = all(c is not None for c in compute_only)
    figures: dict[str, Any] = {
        "comm_per_step_by_rank": [r["comm"] for r in by_rank],
        "comm_expected_per_step": expected.to_dict(),
        "comm_intercepted": strategy.comm_interception,
        "compute_only_kind": strategy.compute_only_plan(spec).kind if available else None,
        "compute_only_step_time_s_by_rank": [c["times_s"] for c in compute_only] if available else None,
        "compute_only_host_stalled_by_rank": [c["stalled"] for c in compute_only] if available else None,
        "compute_only_optimizer_elements_by_rank": ([c["optimizer_elements"] for c in compute_only]
                                                    if available else None),
        # A synchronous step ends when its slowest rank ends (as `step_time_s`).
        "compute_only_step_time_s": ([max(per_rank) for per_rank in zip(*(c["times_s"] for c in compute_only))]
                                     if available else None),
        "compute_only_unavailable_because": "" if available else (
            compute_only_note or "another rank's unwrapped model did not fit beside its wrapped one"),
    }
    return figures


def _stalled_steps(stalled_by_rank: list[list[bool]]) -> set[int]:
    """Steps the host stalled on any rank: a synchronous step waits for its slowest rank."""
    return {step for step, flags in enumerate(zip(*stalled_by_rank)) if any(flags)}


def _model_state_facts(spec: RunSpec, strategy: Strategy, layout, context: RankContext, trainer: Trainer,
                       parameters: int, largest_module: int, by_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The model states each rank measured, and the facts their prediction is derived from at read time
    (harness.derive.memory): the strategy's plan, the parameters each rank held, and for ZeRO-2/3
    DeepSpeed's own estimate."""
    readings = [r["model_states"] for r in by_rank]
    figures: dict[str, Any] = {
        "model_state_plan": strategy.model_state_plan(strategy.state_sharding_ranks(spec), trainer.precision_recipe,
                                                      strategy.resolved(spec)).to_dict(),
        "parameters_held_by_rank": [r["parameters_held"] for r in by_rank],
        "weights_kept_whole_parameters_by_rank": [r["parameters_kept_whole"] for r in by_rank],
        "largest_module_own_parameters": largest_module,
    }
    degree = strategy.expert_parallel_degree(context.world_size, strategy.resolved(spec))
    if degree:
        # The routed experts' states: the plan over the ranks holding the same experts (ZeRO shards them there).
        figures["expert_model_state_plan"] = strategy.model_state_plan(
            layout.data_parallel // degree, trainer.precision_recipe, strategy.resolved(spec)).to_dict()
        figures["expert_parameters_held_by_rank"] = [r["expert_parameters_held"] for r in by_rank]
    if readings[0]["unavailable_because"]:
        figures["model_state_unavailable_because"] = readings[0]["unavailable_because"]
    else:
        figures["model_state_read_at"] = readings[0]["read_at"]
        figures["model_state_census_bytes_by_rank"] = [r["census"] for r in readings]
        if readings[0]["note"]:
            figures["model_state_census_note"] = readings[0]["note"]
        if context.device.type == "cuda":
            figures["model_state_bytes_measured_by_rank"] = [r["allocated"] for r in readings]
            figures["model_state_bytes_measured_excludes"] = "the step's input and target tensors, still referenced"
        # Memory outside the census at the same reading (harness.rank.memory_model): tensors the interpreter
        # reaches that are neither model states nor inputs (exact), and the resident growth since the model was
        # built (RssAnon on CPU, allocator bytes on CUDA) less the census: the gap, flagged above a stated size.
        figures["untracked_tensor_bytes_by_rank"] = [r["untracked"] for r in readings]
        figures["resident_growth_bytes_by_rank"] = [r["resident_growth"] for r in readings]
        figures["memory_outside_census_bytes_by_rank"] = [r["outside_census"] for r in readings]
        figures["memory_outside_census_flag_bytes"] = outside_census_flag_bytes(context.device, spec.strategy)
        figures["memory_outside_census_flagged"] = any(r["flagged"] for r in readings)
    # Growth over the timed steps, from the last warm-up step's start (harness.rank.memory_model.TimedStepsGrowth): a
    # leak of every step.
    growth = readings[0]["timed_growth"]
    if growth["unavailable_because"]:
        figures["memory_growth_timed_steps_unavailable_because"] = growth["unavailable_because"]
    else:
        figures["memory_growth_steps"] = growth["steps"]
        figures["memory_growth_timed_steps_bytes_by_rank"] = [r["timed_growth"]["resident"] for r in readings]
        figures["memory_growth_timed_steps_flag_bytes"] = growth["flag_bytes"]["resident"]
        if context.device.type == "cuda":
            figures["allocated_growth_timed_steps_bytes_by_rank"] = [r["timed_growth"]["allocated"] for r in readings]
            figures["allocated_growth_timed_steps_flag_bytes"] = growth["flag_bytes"]["allocated"]
        figures["memory_growth_timed_steps_flagged"] = any(r["timed_growth"]["flagged"] for r in readings)
        if growth["note"]:
            figures["memory_growth_timed_steps_note"] = growth["note"]
    # The cell's own cluster, from its spec rather than a launcher's environment variable: DeepSpeed divides
    # by num_nodes x num_gpus_per_node, which must be the world it shards over.
    estimate = strategy.deepspeed_estimate_bytes(parameters, largest_module, spec.ranks_per_node, spec.nnodes,
                                                 strategy.resolved(spec))
    if estimate is not None:
        figures["model_state_bytes_deepspeed_estimate"] = estimate
    return figures


def _model_state_figures(reader: ModelStateReader, growth: TimedStepsGrowth) -> dict[str, Any]:
    """What this rank's model-state reading and its growth over the timed steps found, as plain values for the
    gather."""
    return {"census": reader.census, "allocated": reader.allocated, "note": reader.note, "read_at": reader.read_at,
            "unavailable_because": reader.unavailable_because, "untracked": reader.untracked,
            "resident_growth": reader.resident_growth, "outside_census": reader.outside_census,
            "flagged": reader.flagged,
            "timed_growth": {"resident": growth.resident, "allocated": growth.allocated, "flagged": growth.flagged,
                             "steps": growth.steps, "flag_bytes": growth.flag_bytes(), "note": growth.note,
                             "unavailable_because": growth.unavailable_because}}


def _loss_scaling_figures(spec: RunSpec, by_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """fp16 (harness.strategies.loss_scaling): per step, warm-up included (as `loss_per_step`), whether every
    rank applied its optimizer step, each rank's verdict, and the loss scale rank 0 multiplied the step's
    losses by (a pipeline's stages each keep their own scaler)."""
    if spec.precision is not Precision.FP16:
        return {}
    outcomes = [r["outcomes"] for r in by_rank]
    missing = [rank for rank, steps in enumerate(outcomes) if any(step is None for step in steps)]
    if missing:
        raise RuntimeError(f"fp16 cell: ranks {missing} did not say whether their optimizer steps were applied")
    applied_by_rank = [[applied for applied, _ in steps] for steps in outcomes]
    return {"optimizer_step_applied": [all(step) for step in zip(*applied_by_rank)],
            "optimizer_step_applied_by_rank": applied_by_rank,
            "loss_scale_per_step": [scale for _, scale in outcomes[0]]}


def _measurements(spec: RunSpec, workload: Workload, layout, context: RankContext, trainer: Trainer,
                  parameters: int, losses: list[float], by_rank: list[dict[str, Any]]) -> dict[str, Any]:
    times_by_rank = [r["times"] for r in by_rank]
    # A synchronous step ends when its slowest rank ends (an asynchronous strategy says otherwise). Medians,
    # throughput and every other figure are derived from these raw times when rows are read (harness.derive),
    # never stored in their place.
    step_time = trainer.combined_step_times(times_by_rank)
    stalled = _stalled_steps([r["stalled"] for r in by_rank])
    figures: dict[str, Any] = {
        "loss_per_step": losses,
        "step_time_s": step_time,
        "step_time_s_by_rank": times_by_rank,
        "step_wall_time_s_by_rank": [r["wall"] for r in by_rank],
        "host_stalled_steps": len(stalled),
        "host_stalled_step_indices": sorted(stalled),
        "host_lost_cpu_s_per_step": by_rank[0]["host_lost"],
        **({"strategy_figures_by_rank": [r["strategy_figures"] for r in by_rank]}
           if any(r["strategy_figures"] for r in by_rank) else {}),
        "hosts": sorted({r["host"] for r in by_rank}),
        "node_rank_by_rank": [r["node"] for r in by_rank],
        **cell_facts(workload, layout, context, trainer, parameters),
        **memory_figures(context, [r["memory"] for r in by_rank]),
    }
    return figures


def _phase(rank: int, what: str) -> None:
    """Log seconds since this process started, so a cell's log shows where its launch time goes."""
    started = psutil.Process().create_time()
    print(f"[parbench rank {rank}] +{time.time() - started:.1f}s {what}", file=sys.stderr, flush=True)


def _is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(error)
    return "out of memory" in text.lower() or "CUDA_ERROR_OUT_OF_MEMORY" in text


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)  # readers never see half a file


if __name__ == "__main__":
    exit_without_teardown(main())
