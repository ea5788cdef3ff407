import math
from pathlib import Path

import pytest
import torch

from workloads import WORKLOADS, count_parameters
from workloads.data import image_batch, rank_sample_indices, token_batch
from workloads.gpt import palm_train_flops_per_token
from workloads.resnet import conv2d_macs, training_flops_per_sample


def meta_parameters(name):
    with torch.device("meta"):
        return count_parameters(WORKLOADS[name].build_model())


@pytest.mark.parametrize("name, published", [
    ("resnet50", 25_557_032), ("resnet18", 11_689_512), ("resnet20-cifar", 269_722),
])
def test_parameter_counts_equal_published(name, published):
    assert meta_parameters(name) == published == WORKLOADS[name].published_params


# GPT-2's published sizes (Radford et al. 2019; Hugging Face's gpt2 checkpoints) and widths. The model pads its
# 50,257-token vocabulary to 50,304 rows (a multiple of 64): 47 rows of n_embd more parameters than published.
@pytest.mark.parametrize("name, published, n_embd", [
    ("gpt2-small", 124_439_808, 768), ("gpt2-medium", 354_823_168, 1024), ("gpt2-large", 774_030_080, 1280),
    ("gpt2-xl", 1_557_611_200, 1600),
])
def test_gpt2_parameter_counts_are_published_plus_the_padded_rows(name, published, n_embd):
    assert 50_304 - 50_257 == 47 and 50_304 % 64 == 0
    assert meta_parameters(name) == published + 47 * n_embd
    assert WORKLOADS[name].published_params == published
    described = WORKLOADS[name].describe()
    assert (described["vocab_size"], described["padded_vocab_size"]) == (50_257, 50_304)
    assert described["published_parameters"] == published


def test_gpt2_data_never_reaches_the_padded_rows():
    workload = WORKLOADS["gpt2-small"]
    inputs, targets = workload.batch(0, 0, torch.arange(64), torch.device("cpu"))
    assert int(inputs.max()) < 50_257 and int(targets.max()) < 50_257
    assert int(targets.max()) > 50_000        # the real vocabulary's top is drawn: the bound above is tight


def test_gpt_tiny_vocabulary_is_already_a_multiple_of_64():
    assert WORKLOADS["gpt-tiny"].config.padded_vocab_size == WORKLOADS["gpt-tiny"].config.vocab_size == 512


def test_resnet_inputs_are_channels_last_on_cuda_only():
    workload = WORKLOADS["resnet50"]
    assert workload.input_memory_format("cuda") == torch.channels_last
    assert workload.input_memory_format("cpu") == torch.contiguous_format
    images, _ = WORKLOADS["resnet20-cifar"].batch(0, 0, torch.arange(2), torch.device("cpu"))
    assert images.is_contiguous()
    assert WORKLOADS["gpt2-small"].input_memory_format("cuda") == torch.contiguous_format


def test_gpt_head_is_tied_to_token_embedding():
    layers = WORKLOADS["gpt-tiny"].build_layers()
    assert layers[-1].weight is layers[0].wte.weight


def test_every_workload_is_an_ordered_list_of_layers():
    for workload in WORKLOADS.values():
        with torch.device("meta"):
            layers = workload.build_layers()
        assert len(layers) == workload.layer_count >= 4, workload.name


def test_batches_are_a_function_of_seed_step_and_sample_index():
    whole_x, whole_y = token_batch(3, 7, torch.arange(8), 16, 100)
    part_x, part_y = token_batch(3, 7, torch.tensor([5, 6]), 16, 100)
    assert torch.equal(whole_x[5:7], part_x) and torch.equal(whole_y[5:7], part_y)
    again_x, _ = token_batch(3, 7, torch.arange(8), 16, 100)
    assert torch.equal(whole_x, again_x)
    other_step, _ = token_batch(3, 8, torch.arange(8), 16, 100)
    other_seed, _ = token_batch(4, 7, torch.arange(8), 16, 100)
    assert not torch.equal(whole_x, other_step) and not torch.equal(whole_x, other_seed)
    images, labels = image_batch(0, 0, torch.arange(4), 3, 8, 10)
    images2, labels2 = image_batch(0, 0, torch.arange(2, 4), 3, 8, 10)
    assert torch.equal(images[2:], images2) and torch.equal(labels[2:], labels2)
    assert images.dtype == torch.float32 and labels.max() < 10


def test_next_token_targets_are_the_inputs_shifted():
    inputs, targets = token_batch(0, 0, torch.arange(2), 16, 100)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_replica_micro_batches_cut_the_global_batch_the_same_at_every_world_size():
    one_rank = [rank_sample_indices(replica=0, micro_batch_index=k, micro_batches=4, micro_batch=2)
                for k in range(4)]
    two_ranks = [rank_sample_indices(replica=r, micro_batch_index=k, micro_batches=2, micro_batch=2)
                 for r in range(2) for k in range(2)]
    assert [t.tolist() for t in one_rank] == [t.tolist() for t in two_ranks]
    assert torch.cat(one_rank).tolist() == list(range(8))


def test_conv_macs_of_resnet50_first_layer_by_hand():
    # 7x7 conv, 3 -> 64 channels, stride 2 on 224x224: output 112x112.
    assert conv2d_macs(3, 64, (7, 7), (112, 112)) == 64 * 112 * 112 * 3 * 49 == 118_013_952


def test_resnet50_training_flops_match_its_known_forward_macs():
    # 4.09 GMACs per 224x224 image (conv + fc) is the figure fvcore and the literature give.
    macs = WORKLOADS["resnet50"].forward_macs_per_sample
    assert macs == 4_089_184_256
    assert WORKLOADS["resnet50"].train_flops_per_sample == training_flops_per_sample(macs) == 6 * macs


def test_gpt2_small_flops_per_token_follow_palm_appendix_b():
    # N excludes the position embedding and counts the padded rows the head multiplies:
    # 124,439,808 + 47 * 768 - 1024 * 768.
    n = 124_439_808 + 47 * 768 - 1024 * 768
    assert WORKLOADS["gpt2-small"].matmul_params == n
    expected = 6 * n + 12 * 12 * 12 * 64 * 1024
    assert palm_train_flops_per_token(n, 12, 12, 64, 1024) == expected
    assert math.isclose(WORKLOADS["gpt2-small"].train_flops_per_sample, expected * 1024)


def test_a_gpt2_small_row_records_the_padded_vocabulary_and_both_parameter_counts():
    # What the worker writes into a row about its cell (harness.rank.facts.cell_facts), for GPT-2 small on this CPU.
    from torch import nn

    from harness.rank.facts import cell_facts
    from harness.spec import RunSpec
    from harness.strategies import get_strategy

    spec = RunSpec(workload="gpt2-small", strategy="plain", world_size=1, global_batch=1, micro_batch=1)
    strategy = get_strategy("plain")
    context = strategy.start(spec)
    workload = WORKLOADS["gpt2-small"]
    torch.manual_seed(0)
    layers = workload.build_layers()
    trainer = strategy.wrap(spec, context, workload, layers)
    facts = cell_facts(workload, strategy.layout(spec), context, trainer, count_parameters(nn.Sequential(*layers)))
    assert facts["parameters"] == 124_439_808 + 47 * 768
    described = facts["workload_description"]
    assert (described["vocab_size"], described["padded_vocab_size"]) == (50_257, 50_304)
    assert described["published_parameters"] == 124_439_808
    assert facts["input_memory_format"] == "contiguous_format"
    assert layers[0].wte.weight.shape == (50_304, 768)


def test_the_resnet50_gpu_plan_builds_channels_last_inputs():
    # The spec the full matrix plans for one GPU, as the worker turns it into inputs (workloads.base.input_memory_format),
    # and what its dry run prints for it.
    from harness.launch.dry_run import describe_plan
    from harness.launch.placement import LocalPlacement
    from harness.matrix import Machine, Selection, build_matrix
    from harness.spec import DeviceKind

    specs = build_matrix("full", Machine(device=DeviceKind.CUDA, devices_per_node=1), Selection(workloads=("resnet50",)))
    plain = next(spec for spec in specs if spec.strategy == "plain")
    assert WORKLOADS[plain.workload].input_memory_format(plain.device.value) == torch.channels_last
    plan = describe_plan([plain], LocalPlacement(), results=Path("results/x.jsonl"), timeout_s=60)
    assert "resnet50/plain/ws1/gb256/mb256/bf16/cuda x" in plan and "\n  inputs: channels_last\n" in plan


def test_a_resnet_batch_is_laid_out_as_its_device_type_asks(monkeypatch):
    # No GPU here: the CPU stands in for one, and the batch the worker makes follows the layout asked for.
    workload = WORKLOADS["resnet20-cifar"]
    monkeypatch.setattr(type(workload), "input_memory_format",
                        lambda self, device_type: torch.channels_last if device_type == "cpu" else torch.contiguous_format)
    images, _ = workload.batch(0, 0, torch.arange(2), torch.device("cpu"))
    assert images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()
