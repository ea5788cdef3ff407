"""Offload (harness.strategies.offload): what each option's memory plan keeps on the device and on the host, checked
against DeepSpeed's own estimator and by hand; the one-line refusals; and the skip on a CPU device.

Hand arithmetic, 1.5e9 parameters over 8 data-parallel ranks (one node of 8 GPUs) in DeepSpeed's fp16 recipe
(2 + 2 + 12 bytes a parameter, Rajbhandari et al. 2020). ZeRO-Offload (Ren et al. 2021) keeps on the host the fp32
master weights, momentum, variance and the fp32 gradients they step on, 16 bytes a parameter over the ranks:
- ZeRO-2 with offload_optimizer=cpu: the device keeps the fp16 weights whole, 2 x 1.5e9 = 3.0e9 B (DeepSpeed's
  estimate_zero2_model_states_mem_needs(cpu_offload=True) says 2 x params on the GPU); the host 16 x 1.5e9 / 8 =
  3.0e9 B;
- ZeRO-1 keeps its 16-bit gradients whole on the device until the boundary: (2 + 2) x 1.5e9 = 6.0e9 B there, and
  the same 3.0e9 B on the host;
- ZeRO-3 with offload_optimizer=cpu: the device keeps its weight shard, 2 x 1.5e9 / 8 = 3.75e8 B, the host 3.0e9 B;
  with offload_param=cpu too, the device nothing and the host the 16-bit shard as well, 18 x 1.5e9 / 8 = 3.375e9 B
  (DeepSpeed's estimate_zero3_model_states_mem_needs: 16 and 18 bytes a parameter a node on the CPU, and on the
  GPU its largest layer's working copy beside that, which the plan leaves out); 1,000 parameters it keeps whole
  (persistent, 2 bytes each) stay on the device: 2,000 B there;
- FSDP2 with offload_policy=cpu in its autocast recipe (4 + 4 + 8): nothing on the device, every shard on the host,
  16 x 1.5e9 / 8 = 3.0e9 B.
"""

import pytest
import torch

from harness.derive.memory import plan_bytes
from harness.spec import RunSpec, SpecError
from harness.strategies import STRATEGIES
from harness.strategies.base import PrecisionRecipe
from harness.strategies.offload import saved_on_host

PARAMETERS, DP = 1_500_000_000, 8


def planned(strategy, recipe=PrecisionRecipe.DEEPSPEED_FP16, kept_whole=0, **options):
    plan = STRATEGIES[strategy].model_state_plan(DP, recipe, STRATEGIES[strategy].resolve_options(options))
    figures = plan_bytes(plan, PARAMETERS, kept_whole)
    return figures["total"], figures["host"]


def test_zero2_offload_keeps_the_weights_on_the_device_as_deepspeeds_estimate_says():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    _, gpu = estimate_zero2_model_states_mem_needs(PARAMETERS, DP, 1, cpu_offload=True)
    assert planned("zero2", offload_optimizer="cpu") == (gpu, 3.0e9) == (3.0e9, 3.0e9)
    assert planned("zero2") == (3.0e9 + 2 * PARAMETERS / DP + 12 * PARAMETERS / DP, 0.0)    # without: all on it


def test_zero3_offload_keeps_on_the_host_what_deepspeeds_estimate_counts_there():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    largest = 10_000_000
    for offload_param, device, host in ((False, 3.75e8, 3.0e9), (True, 0.0, 3.375e9)):
        # One node of DP GPUs, no buffer factor: the CPU figure is the node's, DP ranks' worth.
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(PARAMETERS, largest, DP, 1, cpu_offload=True,
                                                            cpu_offload_params=offload_param,
                                                            additional_buffer_factor=1)
        options = {"offload_optimizer": "cpu", **({"offload_param": "cpu"} if offload_param else {})}
        assert planned("zero3", **options) == (device, host)
        assert (gpu - 4 * largest, cpu / DP) == (device, host)
    assert planned("zero3", kept_whole=1_000, offload_optimizer="cpu", offload_param="cpu") == (2_000, 3.375e9)


def test_zero1_offload_keeps_its_whole_gradients_and_fsdp2s_policy_keeps_nothing_on_the_device():
    assert planned("zero1", offload_optimizer="cpu") == (6.0e9, 3.0e9)
    assert planned("fsdp2", PrecisionRecipe.AUTOCAST, offload_policy="cpu") == (0.0, 3.0e9)


def spec(strategy, device="cpu", **options):
    return RunSpec(workload="gpt-tiny", strategy=strategy, world_size=2, global_batch=16, micro_batch=4,
                   device=device, options=options)


@pytest.mark.parametrize("strategy, option", [("ddp", "activation_offload"), ("fsdp2", "offload_policy")])
def test_an_offloading_cell_is_skipped_on_a_cpu_device_with_the_reason(strategy, option):
    reason = STRATEGIES[strategy].skip_reason(spec(strategy, **{option: "cpu"}))
    assert f"{option}=cpu moves" in reason and "on a CPU device they are there already" in reason
    assert STRATEGIES[strategy].skip_reason(spec(strategy)) is None


@pytest.mark.parametrize("strategy, options", [("zero1", {"offload_optimizer": "cpu"}),
                                               ("zero2", {"offload_optimizer": "cpu"}),
                                               ("zero3", {"offload_optimizer": "cpu", "offload_param": "cpu"})])
def test_zero_offload_runs_on_a_cpu_device_where_deepspeed_runs_its_cpu_adam(strategy, options):
    # Its optimizer and fetch path are other code than the GPU-resident stages', whose arithmetic a CPU cell checks;
    # ZeRO-3's offload_param with activation offload is still skipped, for activation offload's reason.
    assert STRATEGIES[strategy].skip_reason(spec(strategy, **options)) is None
    both = STRATEGIES[strategy].skip_reason(spec(strategy, **options, activation_offload="cpu"))
    assert "activation_offload=cpu moves saved activations" in both and "offload_optimizer" not in both


def _optimizer_with(**changed):
    from harness.strategies.base import ADAMW_HYPERPARAMETERS
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], **{**ADAMW_HYPERPARAMETERS, **changed})


def test_the_offload_optimizers_hyperparameters_are_read_back_and_must_be_the_common_adamws():
    from harness.strategies.zero import check_adamw_hyperparameters

    check_adamw_hyperparameters(_optimizer_with())       # torch's AdamW at the common values passes
    for changed, named in (({"lr": 2e-3}, "lr 0.002 (expected 0.001)"), ({"betas": (0.9, 0.999)}, "betas"),
                           ({"eps": 1e-6}, "eps"), ({"weight_decay": 0.0}, "weight_decay 0.0"),
                           ({"amsgrad": True}, "AMSGrad")):
        with pytest.raises(RuntimeError, match="departs from the common AdamW") as raised:
            check_adamw_hyperparameters(_optimizer_with(**changed))
        assert named in str(raised.value)
    coupled = _optimizer_with()
    coupled.adam_w_mode = False                          # DeepSpeedCPUAdam(adamw_mode=False): Adam's L2 decay
    with pytest.raises(RuntimeError, match="coupled weight decay"):
        check_adamw_hyperparameters(coupled)


# ---- launched: ZeRO-Offload on this CPU, held against the plain loop --------------------------------------------


@pytest.mark.launch
@pytest.mark.matrix
def test_every_zero_offload_cell_runs_deepspeeds_cpu_adam_and_matches_the_plain_loop(offload_rows):
    from harness.derive.parity import Verdict, judge

    rows = [row.to_dict() for row in offload_rows]
    assert [row["spec"]["strategy"] for row in rows] == ["plain", "zero1", "zero2", "zero3", "zero3"]
    for row, parity in list(zip(rows, judge(rows)))[1:]:
        label = f"{row['spec']['strategy']} {row['spec']['options']}"
        assert row["status"] == "ok", (label, row["message"])
        config = row["measurements"]["strategy_config"]
        assert config["optimizer"] == "deepspeed.ops.adam.DeepSpeedCPUAdam", label
        assert (config["lr"], config["betas"], config["eps"], config["weight_decay"]) == (1e-3, [0.9, 0.95], 1e-8,
                                                                                          0.01), label
        assert config["deepspeed_config"]["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}, label
        assert parity.verdict is Verdict.MATCH, (label, parity)
        # Every quantity compared, the update tensor by tensor among them: the CPU Adam's steps were the common AdamW's.
        assert "update_norm_by_tensor_first_step" in {q.value for q in parity.deviations}, label
    assert rows[-1]["measurements"]["strategy_config"]["deepspeed_config"]["zero_optimization"]["offload_param"] == \
        {"device": "cpu"}


@pytest.mark.parametrize("strategy, why", [("pipeline", "inside train_batch"), ("dataparallel", "run in threads")])
def test_strategies_whose_forward_a_hook_cannot_reach_refuse_activation_offload_in_one_line(strategy, why):
    with pytest.raises(SpecError, match=why) as refused:
        STRATEGIES[strategy].validate(spec(strategy, activation_offload="cpu"))
    assert "\n" not in str(refused.value)


def test_activation_offload_is_torchs_save_on_cpu_and_only_when_asked():
    assert isinstance(saved_on_host(spec("ddp", activation_offload="cpu")), torch.autograd.graph.save_on_cpu)
    assert not isinstance(saved_on_host(spec("ddp")), torch.autograd.graph.save_on_cpu)


def test_activation_offload_counts_every_byte_its_pack_hook_copies_to_the_host():
    # x (8 x 16) @ w (16 x 4) saves x and w for backward, relu its output: 4 bytes each element,
    # 8 x 16 x 4 + 16 x 4 x 4 + 8 x 4 x 4 = 512 + 256 + 128 = 896 bytes.
    from harness.strategies.offload import packed_bytes

    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(16, 4, requires_grad=True)
    before = packed_bytes()
    with saved_on_host(spec("ddp", activation_offload="cpu")):
        (x @ w).relu().sum().backward()
    assert packed_bytes() - before == 896
    assert x.grad.shape == (8, 16)
