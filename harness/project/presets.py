"""Named clusters, each value with its public source, in the keys and units of a cluster TOML file
(harness.project.cluster's docstring): copy one into a file to change it.

    python -c "from harness.project.presets import PRESETS; print(list(PRESETS))"

Bandwidths are datasheet peaks halved where the datasheet counts both directions (NVLink's "900 GB/s" is
bidirectional: 450 GB/s each way), NIC rates divided by 8 (Gb/s -> GB/s) and summed over a node's NICs.
Measured bandwidths come out below these (a peer-to-peer copy over H100 NVLink reached 380 of the 450 GB/s
one way; NVIDIA/nccl#1264): calibrating on the real cluster with `harness comm` is the better figure when there is
one. Latencies are NCCL's own per-step figures for its ring algorithm with the Simple protocol (the one it
uses for the large buckets of gradient traffic): `hwLat` in src/graph/tuning.cc at
b6475625fbcaa2c3c0e50eed2fa1255d7514d4a2 is 3.4 us per step over NVLink, 5.7 us over PCIe and 14.0 us over
the network (NET, which NCCL uses for InfiniBand, RoCE and AWS EFA alike).
"""

from __future__ import annotations

from typing import Any

_NCCL_HWLAT = ("NCCL src/graph/tuning.cc hwLat, Ring/Simple, "
               "https://github.com/NVIDIA/nccl/blob/b6475625fbcaa2c3c0e50eed2fa1255d7514d4a2/src/graph/tuning.cc")
_DGX_H100 = "https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html"
_DGX_A100 = "https://docs.nvidia.com/dgx/dgxa100-user-guide/introduction-to-dgxa100.html"
_H100 = "https://www.nvidia.com/en-us/data-center/h100/"
_A100 = "https://www.nvidia.com/en-us/data-center/a100/"
_P4D = "https://aws.amazon.com/ec2/instance-types/p4/"
_P5 = "https://aws.amazon.com/ec2/instance-types/p5/"

PRESETS: dict[str, dict[str, Any]] = {
    "dgx-h100-ib": {
        "description": "NVIDIA DGX H100: 8 H100 SXM on NVLink 4 / NVSwitch, 8 x 400 Gb/s InfiniBand NDR per node",
        "gpus_per_node": 8,
        "intra_node_bandwidth_GBps": 450.0,
        "intra_node_latency_us": 3.4,
        "inter_node_bandwidth_GBps": 400.0,
        "inter_node_latency_us": 14.0,
        "sources": {
            "gpus_per_node": f"DGX H100 User Guide, hardware overview: 8 x NVIDIA H100 GPUs; {_DGX_H100}",
            "intra_node_bandwidth_GBps": ("H100 SXM datasheet: NVLink 900 GB/s (bidirectional) -> 450 GB/s each way; "
                                          f"{_H100}"),
            "intra_node_latency_us": f"{_NCCL_HWLAT} (NVLINK: 3.4 us)",
            "inter_node_bandwidth_GBps": ("DGX H100 User Guide: 8 x single-port ConnectX-7, 400 Gb/s InfiniBand each "
                                          f"-> 8 x 50 GB/s = 400 GB/s per node each way; {_DGX_H100}"),
            "inter_node_latency_us": f"{_NCCL_HWLAT} (NET: 14.0 us)",
        },
    },
    "dgx-a100-ib": {
        "description": "NVIDIA DGX A100: 8 A100 SXM on NVLink 3 / NVSwitch, 8 x 200 Gb/s InfiniBand HDR per node",
        "gpus_per_node": 8,
        "intra_node_bandwidth_GBps": 300.0,
        "intra_node_latency_us": 3.4,
        "inter_node_bandwidth_GBps": 200.0,
        "inter_node_latency_us": 14.0,
        "sources": {
            "gpus_per_node": f"DGX A100 User Guide, hardware overview: 8 x NVIDIA A100 GPUs; {_DGX_A100}",
            "intra_node_bandwidth_GBps": ("A100 SXM datasheet: NVLink 600 GB/s (bidirectional) -> 300 GB/s each way; "
                                          f"{_A100}"),
            "intra_node_latency_us": f"{_NCCL_HWLAT} (NVLINK: 3.4 us)",
            "inter_node_bandwidth_GBps": ("DGX A100 User Guide: 8 x single-port ConnectX-6, 200 Gb/s HDR InfiniBand "
                                          f"each -> 8 x 25 GB/s = 200 GB/s per node each way; {_DGX_A100}"),
            "inter_node_latency_us": f"{_NCCL_HWLAT} (NET: 14.0 us)",
        },
    },
    "aws-p4d": {
        "description": "AWS p4d.24xlarge: 8 A100 40GB on NVSwitch, 400 Gb/s EFA per instance",
        "gpus_per_node": 8,
        "intra_node_bandwidth_GBps": 300.0,
        "intra_node_latency_us": 3.4,
        "inter_node_bandwidth_GBps": 50.0,
        "inter_node_latency_us": 14.0,
        "sources": {
            "gpus_per_node": f"Amazon EC2 P4 instances, p4d.24xlarge: 8 NVIDIA A100 GPUs; {_P4D}",
            "intra_node_bandwidth_GBps": ("Amazon EC2 P4 instances: 600 GB/s NVSwitch GPU interconnect "
                                          f"(A100 NVLink, bidirectional) -> 300 GB/s each way; {_P4D}"),
            "intra_node_latency_us": f"{_NCCL_HWLAT} (NVLINK: 3.4 us)",
            "inter_node_bandwidth_GBps": ("Amazon EC2 P4 instances: 400 Gbps EFA per instance -> 50 GB/s per node; "
                                          f"{_P4D}"),
            "inter_node_latency_us": f"{_NCCL_HWLAT} (NET: 14.0 us; EFA reaches NCCL as a NET plugin)",
        },
    },
    "aws-p5": {
        "description": "AWS p5.48xlarge: 8 H100 on NVSwitch, 3200 Gb/s EFA per instance",
        "gpus_per_node": 8,
        "intra_node_bandwidth_GBps": 450.0,
        "intra_node_latency_us": 3.4,
        "inter_node_bandwidth_GBps": 400.0,
        "inter_node_latency_us": 14.0,
        "sources": {
            "gpus_per_node": f"Amazon EC2 P5 instances, p5.48xlarge: 8 NVIDIA H100 GPUs; {_P5}",
            "intra_node_bandwidth_GBps": ("Amazon EC2 P5 instances: 900 GB/s NVSwitch GPU interconnect "
                                          f"(bidirectional) -> 450 GB/s each way; {_P5}"),
            "intra_node_latency_us": f"{_NCCL_HWLAT} (NVLINK: 3.4 us)",
            "inter_node_bandwidth_GBps": ("Amazon EC2 P5 instances: 3200 Gbps EFA per instance -> 400 GB/s per node; "
                                          f"{_P5}"),
            "inter_node_latency_us": f"{_NCCL_HWLAT} (NET: 14.0 us; EFA reaches NCCL as a NET plugin)",
        },
    },
    "commodity-100gbe": {
        "description": "8 A100 PCIe per node with no NVLink bridge (PCIe Gen4 x16 each), one 100 GbE port per node",
        "gpus_per_node": 8,
        "intra_node_bandwidth_GBps": 32.0,
        "intra_node_latency_us": 5.7,
        "inter_node_bandwidth_GBps": 12.5,
        "inter_node_latency_us": 14.0,
        "sources": {
            "gpus_per_node": ("a common 8-GPU PCIe server (assumed: the count a PCIe chassis holds); A100 PCIe "
                              f"datasheet for the GPU; {_A100}"),
            "intra_node_bandwidth_GBps": ("A100 PCIe datasheet: PCIe Gen4 64 GB/s (bidirectional) -> 32 GB/s each "
                                          f"way, an upper bound where GPUs share a PCIe switch or root port; {_A100}"),
            "intra_node_latency_us": f"{_NCCL_HWLAT} (PCI: 5.7 us)",
            "inter_node_bandwidth_GBps": ("IEEE 802.3ba-2010, 100 Gb/s Ethernet: one port per node -> 12.5 GB/s "
                                          "each way; https://www.ieee802.org/3/ba/"),
            "inter_node_latency_us": (f"{_NCCL_HWLAT} (NET: 14.0 us; over TCP sockets without RDMA expect more: "
                                      "calibrate with harness comm)"),
        },
    },
}
