"""A dry run plans from shapes alone (harness.launch.dry_run): no tensor with storage, no batch, no forward pass and no
DeepSpeed or Horovod import, on the matrices whose cells are the largest (GPT-2 XL, Llama 3 8B, ResNet-50 pipelines)
for GPU nodes; and what it reads instead (each layer's output shape and a ResNet's MACs from its config, the layers
built on the meta device without their initialisation) is what building and running the model gives. In-process,
nothing launched.

    pytest tests/test_dry_run_builds_nothing.py
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import workloads.gpt
import workloads.resnet
from harness.cli import main
from harness.project import cells, facts
from harness.strategies import base
from workloads import WORKLOADS, data
from workloads.resnet import forward_macs

# Libraries a plan must not import: seconds each, and a planning host need not have them.
LIBRARIES = ("deepspeed", "horovod")


class StorageRefused(TorchDispatchMode):
    """Records every tensor an operation makes off the meta device (one with storage), and stops there."""

    def __init__(self, seen: list[str]):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        for tensor in outputs:
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
                self.seen.append(f"{func} made a tensor of shape {tuple(tensor.shape)} on {tensor.device}")
                raise AssertionError(self.seen[-1])
        return result


@pytest.fixture
def nothing_built(monkeypatch):
    """[what was refused]: tensors with storage (StorageRefused), a batch, a forward pass, DeepSpeed or Horovod,
    each recorded (code that swallows the exception still leaves its record) and raised."""
    seen: list[str] = []

    def refused(what: str):
        def refuse(*args, **kwargs):
            seen.append(what)
            raise AssertionError(f"a dry run called {what}")
        return refuse

    for workload in {type(w) for w in WORKLOADS.values()}:
        monkeypatch.setattr(workload, "batch", refused(f"{workload.__name__}.batch"))
    for module, name in ((data, "mix32"), (data, "image_batch"), (data, "token_batch"),
                         (workloads.resnet, "image_batch"), (workloads.gpt, "token_batch")):
        monkeypatch.setattr(module, name, refused(f"{module.__name__}.{name}"))
    monkeypatch.setattr(nn.Module, "__call__", refused("a module's forward"))
    # Installed as far as the plan asks (a strategy that needs them stays in the plan), yet not importable.
    monkeypatch.setattr(base, "_importable", lambda module: True)
    for name in [name for name in sys.modules if name.split(".")[0] in LIBRARIES] + list(LIBRARIES):
        monkeypatch.setitem(sys.modules, name, None)
    # A plan made earlier in this process would answer from these caches without building anything.
    facts._meta_layers.cache_clear()
    cells._cell_layout.cache_clear()
    with StorageRefused(seen):
        yield seen
    facts._meta_layers.cache_clear()
    cells._cell_layout.cache_clear()


@pytest.mark.parametrize("matrix, priced", [("full", {"pipeline", "zero3", "horovod"}),
                                             ("hybrid", {"pipeline", "autotp", "fsdp2-tp"}),
                                             ("memory-techniques", {"pipeline", "zero3", "autotp"})])
def test_a_dry_run_for_gpu_nodes_builds_no_tensor_batch_or_forward_and_imports_no_library(matrix, priced, nothing_built,
                                                                                         capsys, tmp_path):
    status = main(["run", "--matrix", matrix, "--dry-run", "--device", "cuda", "--gpus-per-node", "8",
                   "--nnodes", "4", "--out", str(tmp_path / "rows.jsonl")])
    out = capsys.readouterr().out
    assert nothing_built == []
    assert status == 0
    # Not a plan that left the heavy cells out: the strategies that need DeepSpeed or Horovod, and the Llamas, are
    # priced, as on a GPU cluster.
    labels = [line.split(" x")[0] for line in out.splitlines() if "/cuda x" in line and not line.startswith(" ")]
    assert priced <= {label.split("/")[1].split("[")[0] for label in labels}
    assert any(label.startswith("llama3") for label in labels)
    assert out.count("\n  projected: ") == len(labels)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "resnet20-cifar", "resnet18", "resnet50"])
def test_each_layers_output_shape_from_the_config_is_what_a_forward_pass_gives(name):
    workload = WORKLOADS[name]
    layers = [layer.to_empty(device="cpu").eval() for layer in workload.build_layers_on_meta()]
    x, _ = workload.batch(0, 0, torch.arange(1), torch.device("cpu"))
    shapes = []
    with torch.no_grad():
        for layer in layers:
            x = layer(x)
            shapes.append(tuple(x.shape[1:]))
    assert workload.layer_output_shapes() == tuple(shapes)


@pytest.mark.parametrize("name", ["resnet20-cifar", "resnet18"])
def test_a_resnets_macs_from_its_config_are_those_a_forward_pass_counts(name):
    # ResNet-50's are held to the published 4.09 GMACs in tests/test_workloads.py.
    workload = WORKLOADS[name]
    model = nn.Sequential(*workload.build_layers_on_meta()).to_empty(device="cpu").eval()
    side = workload.config.image_size
    with torch.no_grad():
        assert workload.forward_macs_per_sample == forward_macs(model, (1, 3, side, side))


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_layers_built_on_meta_skip_their_initialisation_and_keep_every_shape_and_tie(name):
    workload = WORKLOADS[name]
    with torch.device("meta"):
        initialised = workload.build_layers()
    skipped = workload.build_layers_on_meta()

    def described(layers):
        found, owners = [], {}
        for index, layer in enumerate(layers):
            for parameter_name, p in layer.named_parameters(remove_duplicate=False):
                key = f"{index}.{parameter_name}"
                found.append((key, tuple(p.shape), p.dtype, p.requires_grad, p.is_meta, owners.setdefault(id(p), key)))
            found += [(f"{index}.{buffer_name}", tuple(b.shape), b.dtype, b.is_meta)
                      for buffer_name, b in layer.named_buffers()]
        return found

    assert described(skipped) == described(initialised)


def test_skipping_initialisation_on_meta_leaves_a_real_tensors_initialisation_alone():
    from workloads.base import build_on_meta

    torch.manual_seed(0)
    real = torch.zeros(4, 4)

    def build():
        nn.init.normal_(real)             # a tensor made before, with storage: filled as ever
        return nn.Linear(4, 4)

    linear = build_on_meta(build)
    assert linear.weight.is_meta and real.abs().sum() > 0


def test_zeros_lower_precision_modules_are_deepspeeds():
    torch_autocast = pytest.importorskip("deepspeed.runtime.torch_autocast")
    from harness.strategies.zero import LOWER_PRECISION_SAFE_MODULES

    assert list(LOWER_PRECISION_SAFE_MODULES) == list(torch_autocast.LOWER_PRECISION_SAFE_MODULES)
