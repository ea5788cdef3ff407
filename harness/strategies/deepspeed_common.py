"""What the DeepSpeed strategies (ZeRO stages, pipeline) share: start-up, precision and the base config.

DeepSpeed is started by its own launcher (`deepspeed`, harness.launch.launcher.deepspeed) on this host, on
a hostfile's hosts and under Slurm alike. Its environment names the rank as torchrun's does (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT; LOCAL_SIZE for the ranks on the node), `torch.distributed` is
initialised from it as for every torchrun strategy, and `deepspeed.init_distributed` adopts that process
group. The optimizer is the common torch AdamW handed
over as a client optimizer, so no DeepSpeed op needs a JIT compile and the update rule is the same as
everywhere else.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from harness.spec import DeviceKind, Precision, RunSpec
from harness.strategies.base import Option, PrecisionRecipe, RankContext, torchrun_context
from harness.strategies.loss_scaling import deepspeed_fp16_config

PRECISION_OPTION = Option(
    "autocast", "bf16 recipe: DeepSpeed's torch_autocast section (fp32 weights, like torch.autocast "
    "everywhere else) or its bf16 section (bf16 weights with fp32 master copies)",
    choices=("autocast", "deepspeed-bf16"))

# What `precision_config` can give a DeepSpeed strategy: fp32, its torch_autocast section, its bf16 section (the
# precision_recipe option) and its fp16 section (fp16 on GPUs).
DEEPSPEED_RECIPES = (PrecisionRecipe.FP32, PrecisionRecipe.AUTOCAST, PrecisionRecipe.DEEPSPEED_BF16,
                     PrecisionRecipe.DEEPSPEED_FP16)


def start_deepspeed(spec: RunSpec) -> RankContext:
    context = torchrun_context(spec.device)
    if context.shared_device:
        # DeepSpeed binds cuda:LOCAL_RANK; ranks sharing one GPU must all name the device they were given.
        os.environ["LOCAL_RANK"] = str(context.device.index)
    import deepspeed
    import deepspeed.ops

    # DeepSpeed's comm backend probes every op builder (compiler subprocesses) and, on CPU, JIT-compiles a
    # shared-memory all-reduce (minutes on a small machine) that only `inference_all_reduce` uses; training
    # collectives go through torch.distributed either way. An empty compatibility table skips both
    # (deepspeed/comm/torch.py, build_shm_op, is its only reader in 0.19).
    deepspeed.ops.__compatible_ops__ = {}
    deepspeed.init_distributed(dist_backend=context.backend)
    return context


def precision_config(spec: RunSpec, options: Mapping[str, Any]) -> tuple[dict[str, Any], PrecisionRecipe]:
    """The config sections for the spec's precision under its strategy's resolved `options`, and the recipe a
    row records."""
    if spec.precision is Precision.FP32:
        return {}, PrecisionRecipe.FP32
    if spec.precision is Precision.FP16:
        # The fp16 section needs a device with fp16 kernels: DeepSpeed refuses it on this CPU ("Type fp16 is
        # not supported on your device"), so a CPU cell runs the torch_autocast section in float16.
        if spec.device is DeviceKind.CUDA:
            return deepspeed_fp16_config(), PrecisionRecipe.DEEPSPEED_FP16
        return {"torch_autocast": {"enabled": True, "dtype": "float16"}}, PrecisionRecipe.AUTOCAST
    if options.get("precision_recipe", "autocast") == "deepspeed-bf16":
        return {"bf16": {"enabled": True}}, PrecisionRecipe.DEEPSPEED_BF16
    return {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, PrecisionRecipe.AUTOCAST


def sixteen_bit_weights(spec: RunSpec, options: Mapping[str, Any]) -> bool:
    """Whether DeepSpeed keeps the model's weights in 16 bits under `spec` (its bf16 or fp16 section, with fp32
    master copies) rather than fp32 under its torch_autocast section."""
    return precision_config(spec, options)[1] in (PrecisionRecipe.DEEPSPEED_BF16, PrecisionRecipe.DEEPSPEED_FP16)


def base_config(spec: RunSpec, micro_batches: int) -> dict[str, Any]:
    """Batch geometry and the settings every DeepSpeed cell shares."""
    return {
        "train_batch_size": spec.global_batch,
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": micro_batches,
        "gradient_clipping": 0.0,              # no strategy clips: identical update rule everywhere
        "zero_allow_untested_optimizer": True,  # the client optimizer is torch's AdamW
        "steps_per_print": 2**31 - 1,          # no progress printing inside timed steps
        "wall_clock_breakdown": False,
        # DeepSpeed's ThroughputTimer is on by default and synchronises the device in every engine forward
        # and step from the engine's third step on (deepspeed/utils/timer.py ThroughputTimer.start/stop,
        # `synchronized: True`, 0.19.8): 2 syncs per micro-batch that DDP and FSDP2 do not pay.
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
    }


def throughput_timer_state(engine: Any) -> dict[str, Any]:
    """What the engine's throughput timer was left doing, as a row records it."""
    timer = engine.tput_timer.config
    return {"throughput_timer": {"enabled": timer.enabled, "synchronized": timer.synchronized}}
