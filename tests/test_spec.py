import pytest

from harness.spec import DeviceKind, Precision, RunResult, RunSpec, SpecError, Status
from harness.strategies import STRATEGIES, checked, layout_of
from one_line import assert_one_line_error


def spec(**changes):
    base = dict(workload="gpt-tiny", strategy="ddp", world_size=2, global_batch=16, micro_batch=4)
    return checked(RunSpec(**{**base, **changes}))


@pytest.mark.parametrize("changes, message", [
    ({"strategy": "mpi"}, "unknown strategy 'mpi'; known: " + ", ".join(STRATEGIES)),
    ({"workload": "bert"}, "unknown workload 'bert'; known: resnet20-cifar"),
    ({"world_size": 0}, "world_size must be a whole number >= 1, got 0"),
    ({"global_batch": 12}, "global_batch 12 must be divisible by data-parallel size x micro_batch = 2 x 4 = 8"),
    ({"precision": "fp8"}, "precision 'fp8' is not one of: fp32, bf16"),
    ({"options": {"bucket_size": 3}}, "strategy ddp has no option 'bucket_size'; its options:"),
    ({"options": {"bucket_cap_mb": "big"}}, "option bucket_cap_mb of strategy ddp takes a float"),
    ({"warmup_steps": -1}, "warmup_steps must be a whole number >= 0"),
])
def test_spec_rejects_bad_input_with_one_line_naming_what_is_allowed(changes, message):
    with pytest.raises(SpecError) as error:
        spec(**changes)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_layout_accumulates_micro_batches_when_fewer_ranks():
    assert layout_of(spec(world_size=1)).micro_batches == 4
    assert layout_of(spec(world_size=2)).micro_batches == 2
    assert layout_of(spec(world_size=4)).micro_batches == 1


def test_the_fields_are_checked_on_construction_and_the_registries_above():
    # harness.spec imports no registry (they import it): a spec of an unknown strategy is built, and refused by
    # harness.strategies.checked, as every matrix applies it.
    unchecked = RunSpec(workload="gpt-tiny", strategy="mpi", world_size=2, global_batch=16, micro_batch=4)
    with pytest.raises(SpecError, match="unknown strategy 'mpi'"):
        checked(unchecked)
    with pytest.raises(SpecError, match="world_size must be a whole number"):
        RunSpec(workload="gpt-tiny", strategy="mpi", world_size=0, global_batch=16, micro_batch=4)


def test_spec_round_trips_through_dict():
    original = spec(precision="bf16", options={"bucket_cap_mb": 5.0})
    again = RunSpec.from_dict(original.to_dict())
    assert again == original
    assert again.precision is Precision.BF16 and again.device is DeviceKind.CPU


def test_cell_id_ignores_repeats_but_not_the_rest():
    assert spec(repeats=1).cell_id == spec(repeats=5).cell_id
    assert spec().cell_id != spec(seed=1).cell_id


def test_result_round_trips_and_refuses_newer_schema():
    result = RunResult(spec=spec(), status=Status.OK, run_id="r1", measurements={"x_s": 1.0})
    data = result.to_dict()
    assert RunResult.from_dict(data).measurements == {"x_s": 1.0}
    with pytest.raises(SpecError, match="schema_version"):
        RunResult.from_dict({**data, "schema_version": 999})


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, float("nan"), float("inf")])
def test_run_options_refuse_a_timeout_that_is_not_a_positive_finite_number_of_seconds(tmp_path, timeout_s):
    from harness.runner import RunOptions

    assert_one_line_error(lambda: RunOptions(results=tmp_path / "rows.jsonl", timeout_s=timeout_s),
                          ["timeout_s must be a positive, finite number of seconds", repr(timeout_s)])
