"""Named clusters, each value with its public source, in the keys and units of a cluster TOML file
(harness.project.cluster's docstring): copy one into a file to change it.

    python -c "from harness.project.presets import PRESETS; print(list(PRESETS))"

Bandwidths are datasheet peaks halved where the datasheet counts both directions (NVLink's "900 GB/s" is
bidirectional: 450 GB/s each way), NIC rates divided by 8 (Gb/s -> GB/s) and summed over a node's NICs.
Measured bandwidths come out below these (a peer-to-peer copy over H100 NVLink reached 380 of the 450 GB/s
one way; NVIDIA/nccl#1264): calibrating on the real cluster with `harness comm` is the better figure when there is
one. Latencies are NCCL's `hwLat` table for its ring algorithm with the Simple protocol (the one it uses for
the large buckets of gradient traffic), in src/graph/tuning.cc at b6475625fbcaa2c3c0e50eed2fa1255d7514d4a2
(NCCL 2.20.3-1): 3.4 us per step over NVLink, 5.7 us over PCIe and 14.0 us over the network (NET, which NCCL
uses for InfiniBand, RoCE and AWS EFA alike); the same three figures stand in 2.30 (tunerConstants
hwLatencies). They are hwLat alone, a floor of what NCCL itself charges a step: on more than one node it
raises the in-node step to at least 3 x NCCL_NET_OVERHEAD (3 us on Intel hosts, 6 us on AMD ones) and adds
the network plugin's own reported latency twice to the NET step.

Each GPU is named as torch names it (`gpu`), so that its dense peak FLOP/s come from harness.derive.peaks, which
cites the datasheet of each (H100 SXM5: 989.4 TFLOP/s bf16 dense; A100: 312); `gpu_memory_GiB` is the
datasheet's memory per GPU, as `harness plan` compares what a layout needs with it.

Each source says where its figure was read. "not opened" marks a page these values were not checked against
(the page could not be reached from the tools used to audit them); the figure it is cited for was then read
where the source says, or is marked unconfirmed.
"""

from __future__ import annotations

from typing import Any

_NCCL_HWLAT = ("NCCL src/graph/tuning.cc hwLat, Ring/Simple, read at "
               "https://github.com/NVIDIA/nccl/blob/b6475625fbcaa2c3c0e50eed2fa1255d7514d4a2/src/graph/tuning.cc")
# Opened: DGX BasePOD reference architecture, "NVIDIA DGX H200 and H100 Systems": "Eight NVIDIA Hopper GPUs",
# "640 GB total GPU memory for H100", "Four OSFP ports serving eight single-port NVIDIA ConnectX-7 VPI, ...
# up to 400 Gb/s InfiniBand/Ethernet"; four OSFP ports carry the compute fabric.
_BASEPOD = ("https://docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-foundation-enterprise-ai/"
            "latest/core-components.html")
_DGX_A100 = "https://docs.nvidia.com/dgx/dgxa100-user-guide/introduction-to-dgxa100.html"
_H100 = "https://www.nvidia.com/en-us/data-center/h100/"
_A100 = "https://www.nvidia.com/en-us/data-center/a100/"
_HGX_H100_BLOG = ("https://developer.nvidia.com/blog/introducing-nvidia-hgx-h100-an-accelerated-server-platform-"
                  "for-ai-and-high-performance-computing/")
# Opened: NVIDIA's NVLink page (German edition): A100 "supports up to twelve third-generation NVLink
# connections for a total bandwidth of 600 GB/s".
_NVLINK_DE = "https://www.nvidia.com/de-de/data-center/nvlink/"
_P4D = "https://aws.amazon.com/ec2/instance-types/p4/"
_P5 = "https://aws.amazon.com/ec2/instance-types/p5/"

PRESETS: dict[str, dict[str, Any]] = {
    "dgx-h100-ib": {
        "description": "NVIDIA DGX H100: 8 H100 SXM on NVLink 4 / NVSwitch, 8 x 400 Gb/s InfiniBand NDR per node",
        "gpus_per_node": 8,
        "gpu": "NVIDIA H100 80GB HBM3",
        "gpu_memory_GiB": 80.0,
        "intra_node_bandwidth_GBps": 450.0,
        "intra_node_latency_us": 3.4,
        "inter_node_bandwidth_GBps": 400.0,
        "inter_node_latency_us": 14.0,
        "sources": {
            "gpu": ("H100 SXM5 (DGX H100's GPUs are SXM); its peaks in harness.derive.peaks from NVIDIA's H100 "
                    "whitepaper, table \"NVIDIA H100 SXM5\": BF16 tensor 989.4 TFLOP/s dense; the H100 product page not opened: "
                    f"{_H100}"),
            "gpu_memory_GiB": (f"DGX BasePOD reference architecture, DGX H100: \"640 GB total GPU memory for H100\" "
                               f"over eight GPUs -> 80 each; {_BASEPOD}"),
            "gpus_per_node": f"DGX BasePOD reference architecture, DGX H100: \"Eight NVIDIA Hopper GPUs\"; {_BASEPOD}",
            "intra_node_bandwidth_GBps": (
                "H100 SXM NVLink 900 GB/s, bidirectional -> 450 GB/s each way: NVIDIA's \"Introducing NVIDIA HGX "
                "H100\" blog, \"the NVLink bidirectional speed of 900 gigabytes per second\", "
                f"{_HGX_H100_BLOG} (read in a syndicated copy), and NVIDIA/nccl#1264 (\"450GB/s theoretical\" "
                f"one way); the H100 product page was not opened: {_H100}"),
            "intra_node_latency_us": f"{_NCCL_HWLAT} (NVLINK: 3.4 us)",
            "inter_node_bandwidth_GBps": (
                "DGX BasePOD reference architecture, DGX H100: eight single-port ConnectX-7, up to 400 Gb/s "
                f"InfiniBand each -> 8 x 50 GB/s = 400 GB/s per node each way; {_BASEPOD}"),
            "inter_node_latency_us": f"{_NCCL_HWLAT} (NET: 14.0 us)",
        },
    },
    "dgx-a100-ib": {
        "description": "NVIDIA DGX A100: 8 A100 SXM on NVLink 3 / NVSwitch, 8 x 200 Gb/s InfiniBand HDR per node",
        "gpus_per_node": 8,
        "gpu": "NVIDIA A100-SXM4-80GB",
        "gpu_memory_GiB": 80.0,
        "intra_node_bandwidth_GBps": 300.0,
        "intra_node_latency_us": 3.4,
        "inter_node_bandwidth_GBps": 200.0,
        "inter_node_latency_us": 14.0,
        "sources": {
            "gpu": ("A100 SXM4 80GB; its peaks in harness.derive.peaks from NVIDIA's A100 datasheet: BF16 312 TFLOP/s "
                    f"dense; the A100 product page not opened: {_A100}"),
            "gpu_memory_GiB": (f"DGX A100 User Guide, the 640 GB system: 8 x A100 80GB (the 320 GB system has 40 GB "
                               f"GPUs: --set gpu_memory_GiB=40 --set \"gpu=NVIDIA A100-SXM4-40GB\"); not opened: {_DGX_A100} "
                               "(unconfirmed here)"),
            "gpus_per_node": (f"DGX A100 User Guide, hardware overview: 8 x NVIDIA A100 GPUs; not opened: {_DGX_A100} "
                              "(unconfirmed here)"),
            "intra_node_bandwidth_GBps": (
                "A100 NVLink: twelve third-generation links, 600 GB/s in total (NVIDIA's NVLink page, "
                f"{_NVLINK_DE}), 12 x 25 GB/s each way -> 300 GB/s each way; the A100 product page was not "
                f"opened: {_A100}"),
            "intra_node_latency_us": f"{_NCCL_HWLAT} (NVLINK: 3.4 us)",
            "inter_node_bandwidth_GBps": (
                "DGX A100 User Guide: \"NVIDIA ConnectX-6 or ConnectX-7 Single Port InfiniBand (default): Up to "
                "200Gbps\" (the line read as quoted in github.com/leptonai/gpud, "
                "components/accelerator/nvidia/infiniband); eight of them for the compute fabric, one per GPU, "
                f"is unconfirmed here -> 8 x 25 GB/s = 200 GB/s per node each way; guide not opened: {_DGX_A100}"),
            "inter_node_latency_us": f"{_NCCL_HWLAT} (NET: 14.0 us)",
        },
    },
    "aws-p4d": {
        "description": "AWS p4d.24xlarge: 8 A100 40GB on NVSwitch, 400 Gb/s EFA per instance (4 x 100 Gb/s)",
        "gpus_per_node": 8,
        "gpu": "NVIDIA A100-SXM4-40GB",
        "gpu_memory_GiB": 40.0,
        "intra_node_bandwidth_GBps": 300.0,
        "intra_node_latency_us": 3.4,
        "inter_node_bandwidth_GBps": 50.0,
        "inter_node_latency_us": 14.0,
        "sources": {
            "gpu": ("A100 SXM4 40GB; its peaks in harness.derive.peaks from NVIDIA's A100 datasheet: BF16 312 TFLOP/s "
                    f"dense; the A100 product page not opened: {_A100}"),
            "gpu_memory_GiB": ("AWS P4d deep-dive blog: \"8 x 40 GB NVIDIA Tesla A100 GPUs\", "
                               "https://aws.amazon.com/blogs/compute/amazon-ec2-p4d-instances-deep-dive/ (read in a "
                               "syndicated copy)"),
            "gpus_per_node": (
                "AWS P4d deep-dive blog: \"8 x 40 GB NVIDIA Tesla A100 GPUs with NVSwitch\", "
                "https://aws.amazon.com/blogs/compute/amazon-ec2-p4d-instances-deep-dive/ (read in a syndicated "
                f"copy); the P4 instance page was not opened: {_P4D}"),
            "intra_node_bandwidth_GBps": (
                "A100 NVLink through NVSwitch: 600 GB/s in total (NVIDIA's NVLink page, "
                f"{_NVLINK_DE}) -> 300 GB/s each way; the P4 instance page's \"600 GB/s NVSwitch\" was not "
                f"opened: {_P4D}"),
            "intra_node_latency_us": f"{_NCCL_HWLAT} (NVLINK: 3.4 us)",
            "inter_node_bandwidth_GBps": (
                "AWS P4d deep-dive blog: \"400 Gbps Elastic Fabric Adapter (EFA)\" per instance, "
                "https://aws.amazon.com/blogs/compute/amazon-ec2-p4d-instances-deep-dive/ (read in a syndicated "
                "copy) -> 50 GB/s per node each way (nccl-tests all-reduce across two p4d reached about 342 of the "
                f"400 Gb/s, so the figure is one direction); the P4 instance page was not opened: {_P4D}"),
            "inter_node_latency_us": f"{_NCCL_HWLAT} (NET: 14.0 us; EFA reaches NCCL as a NET plugin)",
        },
    },
    "aws-p5": {
        "description": "AWS p5.48xlarge: 8 H100 on NVSwitch, 3200 Gb/s EFA per instance (32 x 100 Gb/s)",
        "gpus_per_node": 8,
        "gpu": "NVIDIA H100 80GB HBM3",
        "gpu_memory_GiB": 80.0,
        "intra_node_bandwidth_GBps": 450.0,
        "intra_node_latency_us": 3.4,
        "inter_node_bandwidth_GBps": 400.0,
        "inter_node_latency_us": 14.0,
        "sources": {
            "gpu": ("H100 80GB; its peaks in harness.derive.peaks from NVIDIA's H100 whitepaper, H100 SXM5: BF16 989.4 "
                    f"TFLOP/s dense; that p5's H100s are SXM5 is read from its NVSwitch, the page not opened: {_P5}"),
            "gpu_memory_GiB": (f"Amazon EC2 P5 instances, p5.48xlarge: 640 GB HBM3 over 8 GPUs -> 80 each; not opened: "
                               f"{_P5} (unconfirmed here)"),
            "gpus_per_node": (f"Amazon EC2 P5 instances, p5.48xlarge: 8 NVIDIA H100 GPUs; not opened: {_P5} "
                              "(read only as transcribed in third-party notes)"),
            "intra_node_bandwidth_GBps": (
                "H100 NVLink 900 GB/s bidirectional -> 450 GB/s each way (NVIDIA/nccl#1264, "
                "https://github.com/NVIDIA/nccl/issues/1264); the P5 instance page's \"900 GB/s NVSwitch\" was not "
                f"opened: {_P5}"),
            "intra_node_latency_us": f"{_NCCL_HWLAT} (NVLINK: 3.4 us)",
            "inter_node_bandwidth_GBps": (
                f"Amazon EC2 P5 instances: 3200 Gbps EFA per instance -> 400 GB/s per node; not opened: {_P5} "
                "(read only as transcribed in third-party notes; the EC2 user guide's EFA page, "
                "https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html, configures P5 "
                "with 32 EFA devices)"),
            "inter_node_latency_us": f"{_NCCL_HWLAT} (NET: 14.0 us; EFA reaches NCCL as a NET plugin)",
        },
    },
    "commodity-100gbe": {
        "description": "8 A100 PCIe per node with no NVLink bridge (PCIe Gen4 x16 each), one 100 GbE port per node",
        "gpus_per_node": 8,
        "gpu": "NVIDIA A100 80GB PCIe",
        "gpu_memory_GiB": 80.0,
        "intra_node_bandwidth_GBps": 32.0,
        "intra_node_latency_us": 5.7,
        "inter_node_bandwidth_GBps": 12.5,
        "inter_node_latency_us": 14.0,
        "sources": {
            "gpu": ("assumed: A100 80GB PCIe; its peaks in harness.derive.peaks from NVIDIA's A100 datasheet: BF16 312 "
                    f"TFLOP/s dense (the same on every A100 board); product page not opened: {_A100}"),
            "gpu_memory_GiB": f"assumed: the 80 GB A100 PCIe (a 40 GB one exists); product page not opened: {_A100}",
            "gpus_per_node": ("assumed: a common 8-GPU PCIe server, no single vendor's page; A100 PCIe product page "
                              f"for the GPU, not opened: {_A100}"),
            "intra_node_bandwidth_GBps": (
                "PCIe Gen4 x16: 16 GT/s x 16 lanes / 8 = 32 GB/s each way before 128b/130b encoding (31.5 after), "
                "the arithmetic alone (the A100 product page's \"PCIe Gen4: 64GB/s\" both ways was not opened: "
                f"{_A100}); an upper bound where GPUs share a PCIe switch or root port"),
            "intra_node_latency_us": f"{_NCCL_HWLAT} (PCI: 5.7 us)",
            "inter_node_bandwidth_GBps": ("IEEE Std 802.3ba-2010 (ratified 17 June 2010), 100 Gb/s Ethernet, full "
                                          "duplex: one port per node -> 12.5 GB/s each way; task force page not "
                                          "opened: https://www.ieee802.org/3/ba/"),
            "inter_node_latency_us": (f"{_NCCL_HWLAT} (NET: 14.0 us; over TCP sockets without RDMA expect more: "
                                      "calibrate with harness comm)"),
        },
    },
}
