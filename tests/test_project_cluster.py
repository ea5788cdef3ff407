"""Cluster descriptions: presets with a public source for every value, TOML files, key=value overrides,
how ranks fill nodes, and one-line errors for bad input (harness.project.cluster)."""

import subprocess
import sys
from pathlib import Path

import pytest

from harness.project.cluster import (GPU_KEYS, REQUIRED_KEYS, load_cluster, node_layout, parse_overrides, preset)
from harness.project.presets import PRESETS
from harness.spec import SpecError
from one_line import assert_one_line_error   # tests/one_line.py


@pytest.mark.parametrize("name", list(PRESETS))
def test_each_preset_loads_and_every_value_has_a_public_source(name):
    cluster = preset(name)
    assert cluster.name == name and cluster.description
    assert set(cluster.sources) == set(REQUIRED_KEYS + GPU_KEYS)
    assert cluster.gpu and cluster.gpu_memory_GiB > 0
    for key, source in cluster.sources.items():
        assert "https://" in source, f"{name}.{key} has no address: {source!r}"


def test_dgx_h100_preset_halves_nvlinks_bidirectional_figure_and_sums_eight_400_gbit_nics():
    cluster = preset("dgx-h100-ib")
    assert cluster.gpus_per_node == 8
    assert cluster.intra_node.bandwidth_bytes_per_s == 450e9       # 900 GB/s both ways / 2
    assert cluster.inter_node.bandwidth_bytes_per_s == 400e9       # 8 x 400 Gb/s / 8 bits
    assert cluster.intra_node.latency_s == pytest.approx(3.4e-6)   # NCCL hwLat NVLINK ring/simple
    assert cluster.inter_node.latency_s == pytest.approx(14e-6)    # NCCL hwLat NET ring/simple


def test_presets_keep_intra_node_faster_than_each_gpus_share_of_the_nics():
    # A preset with the two links swapped would make the node's GPUs faster over the network than over
    # NVLink (or PCIe): never true of these systems.
    for name in PRESETS:
        cluster = preset(name)
        share = cluster.inter_node.bandwidth_bytes_per_s / cluster.gpus_per_node
        assert cluster.intra_node.bandwidth_bytes_per_s > share, name
        assert cluster.intra_node.latency_s < cluster.inter_node.latency_s, name


def test_a_toml_file_gives_a_cluster_in_its_stated_units(tmp_path):
    path = tmp_path / "lab.toml"
    path.write_text('description = "two 4-GPU boxes on 25 GbE"\n'
                    "gpus_per_node = 4\n"
                    "intra_node_bandwidth_GBps = 32\n"
                    "intra_node_latency_us = 5.7\n"
                    "inter_node_bandwidth_GBps = 3.125\n"
                    "inter_node_latency_us = 20\n"
                    "[sources]\n"
                    'inter_node_bandwidth_GBps = "25 Gb/s / 8"\n')
    cluster = load_cluster(path)
    assert cluster.name == "lab" and cluster.gpus_per_node == 4
    assert cluster.intra_node.bandwidth_bytes_per_s == 32e9
    assert cluster.intra_node.latency_s == pytest.approx(5.7e-6)
    assert cluster.inter_node.bandwidth_bytes_per_s == 3.125e9
    assert cluster.inter_node.latency_s == pytest.approx(20e-6)
    assert cluster.sources == {"inter_node_bandwidth_GBps": "25 Gb/s / 8"}


def test_overrides_replace_a_presets_value_and_drop_its_source():
    cluster = load_cluster("dgx-h100-ib", overrides=["inter_node_bandwidth_GBps=100", "gpus_per_node=4"])
    assert cluster.inter_node.bandwidth_bytes_per_s == 100e9
    assert cluster.gpus_per_node == 4
    assert cluster.intra_node.bandwidth_bytes_per_s == 450e9                  # untouched
    assert "inter_node_bandwidth_GBps" not in cluster.sources and "gpus_per_node" not in cluster.sources
    assert "intra_node_bandwidth_GBps" in cluster.sources
    assert "inter_node_bandwidth_GBps" in PRESETS["dgx-h100-ib"]["sources"]   # the preset itself unchanged


def test_flags_alone_describe_a_cluster():
    cluster = load_cluster(None, overrides={"gpus_per_node": 2, "intra_node_bandwidth_GBps": 10,
                                            "intra_node_latency_us": 1, "inter_node_bandwidth_GBps": 1,
                                            "inter_node_latency_us": 50})
    assert cluster.gpus_per_node == 2 and cluster.inter_node.latency_s == pytest.approx(50e-6)


def test_parse_overrides_reads_numbers_and_whole_gpu_counts():
    assert parse_overrides(["gpus_per_node=8", "inter_node_latency_us=2.5"]) == {
        "gpus_per_node": 8, "inter_node_latency_us": 2.5}


@pytest.mark.parametrize("ranks, gpus, nodes, per_node", [(1, 8, 1, 1), (6, 8, 1, 6), (8, 8, 1, 8),
                                                          (16, 8, 2, 8), (1024, 8, 128, 8), (3, 1, 3, 1)])
def test_ranks_fill_whole_nodes(ranks, gpus, nodes, per_node):
    layout = node_layout(ranks, gpus)
    assert (layout.nodes, layout.ranks_per_node) == (nodes, per_node)


def _full(**changes):
    values = {"gpus_per_node": 8, "intra_node_bandwidth_GBps": 450, "intra_node_latency_us": 3,
              "inter_node_bandwidth_GBps": 400, "inter_node_latency_us": 14}
    values.update(changes)
    return {k: v for k, v in values.items() if v is not None}


@pytest.mark.parametrize("call, words", [
    (lambda: preset("dgx-z100"), ["dgx-z100", "known", "dgx-h100-ib"]),
    (lambda: load_cluster("dgx-z100"), ["dgx-z100", "known", "aws-p5", ".toml"]),
    (lambda: load_cluster(None, overrides=_full(inter_node_latency_us=None)), ["missing", "inter_node_latency_us"]),
    (lambda: load_cluster(None, overrides=_full(intra_node_bandwidth_GBps=-5)),
     ["intra_node_bandwidth_GBps", "> 0", "-5"]),
    (lambda: load_cluster(None, overrides=_full(inter_node_bandwidth_GBps=0)), ["inter_node_bandwidth_GBps", "> 0"]),
    (lambda: load_cluster(None, overrides=_full(inter_node_latency_us=-1)), ["inter_node_latency_us", ">= 0"]),
    (lambda: load_cluster(None, overrides=_full(gpus_per_node=0)), ["gpus_per_node", ">= 1"]),
    (lambda: load_cluster(None, overrides=_full(gpus_per_node=2.5)), ["gpus_per_node", "whole number"]),
    (lambda: load_cluster(None, overrides=_full(intra_node_latency_us="fast")), ["intra_node_latency_us", "number"]),
    (lambda: load_cluster(None, overrides=_full(nic_count=8)), ["nic_count", "allowed", "gpus_per_node"]),
    (lambda: parse_overrides(["inter_node_bandwidth=100"]), ["inter_node_bandwidth=100", "inter_node_bandwidth_GBps"]),
    (lambda: parse_overrides(["gpus_per_node=eight"]), ["gpus_per_node", "eight", "whole number"]),
    (lambda: node_layout(12, 8), ["12", "8", "multiple of 8"]),
])
def test_bad_input_is_one_line_naming_the_field_and_what_is_allowed(call, words):
    assert_one_line_error(call, words)


def test_bad_toml_files_are_one_line_errors(tmp_path):
    broken = tmp_path / "broken.toml"
    broken.write_text("gpus_per_node = = 8\n")
    with pytest.raises(SpecError, match="broken.toml: not TOML") as raised:
        load_cluster(broken)
    assert "\n" not in str(raised.value)
    with pytest.raises(SpecError, match="absent.toml: cannot read"):
        load_cluster(tmp_path / "absent.toml")
    stray = tmp_path / "stray.toml"
    stray.write_text("\n".join(f"{k} = 1" for k in REQUIRED_KEYS) + '\n[sources]\nnics = "datasheet"\n')
    with pytest.raises(SpecError, match="sources names 'nics'"):
        load_cluster(stray)


@pytest.mark.launch
def test_the_project_package_imports_neither_torch_nor_the_registries():
    root = Path(__file__).parent.parent
    modules = [f"harness.project.{p.stem}" for p in (root / "harness" / "project").glob("*.py")]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + "harness.project.fit.load_calibration(['results/reference/ci-cpu/comm-ws2.jsonl'])\n"
            + "heavy = [m for m in ('torch', 'deepspeed', 'horovod', 'harness.strategies', 'workloads') "
              "if m in sys.modules]\nassert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
