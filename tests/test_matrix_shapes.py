"""Every matrix, planned for every machine shape users have (1 to 64 CPU cores; 1 to 8 GPUs per node x 1 to
128 nodes), builds valid cells that fit the machine and hold the figures' references. The machines are
described, never detected: nothing here depends on the host the tests run on."""

from collections import defaultdict

import pytest

from harness.derive.parity import reference_key
from harness.matrix import MATRICES, Machine, Selection, build_matrix
from harness.spec import DeviceKind, RunSpec

CPU_SHAPES = [Machine(device=DeviceKind.CPU, devices_per_node=cores) for cores in (1, 2, 3, 8, 64)]
CPU_SHAPES.append(Machine(device=DeviceKind.CPU, devices_per_node=2, nodes=2))     # two namespace hosts
GPU_SHAPES = [Machine(device=DeviceKind.CUDA, devices_per_node=gpus, nodes=nodes)
              for gpus in (1, 2, 4, 8) for nodes in (1, 2, 16, 128)]
SHAPES = CPU_SHAPES + GPU_SHAPES

# Written out here, not read from harness.matrix: samples per data-parallel replica per step at the
# matrix's largest data-parallel size (docs/methodology.md, "Batch plans").
PER_DEVICE = {"gpt-tiny": 8, "llama-tiny": 8, "resnet20-cifar": 8, "resnet50": 256, "gpt2-small": 16,
              # the Llamas at their presets' sequences: 4 x 2048 tokens and 1 x 8192 (49.3 GiB and, sharded over 8
              # GPUs, 76.8 GiB of an 80 GB GPU by harness plan's memory)
              "llama3.2-1b": 4, "llama3-8b": 1}
MEMORY_PER_DEVICE = {"gpt-tiny": 4, "gpt2-small": 1, "gpt2-medium": 1, "gpt2-large": 1, "gpt2-xl": 1, "llama3.2-1b": 1,
                     "llama3-8b": 1}
ONE_NODE_ONLY = {"dataparallel"}    # one process driving one node's GPUs
DATA_PARALLEL = {"ddp", "horovod", "fsdp2", "zero1", "zero2", "zero3"}
PARAMETER_SERVERS = {"ps", "ps-async"}


def shape_id(machine: Machine) -> str:
    return f"{machine.device.value}-{machine.devices_per_node}x{machine.nodes}"


def evenly(machine: Machine, ranks: int) -> bool:
    """Whether `ranks` spread evenly over whole nodes of the machine (any count on one CPU host, which shares its
    cores): 3 ranks fit one node of 4 GPUs or 3 of 1, never 2 nodes of 2."""
    if machine.device is DeviceKind.CPU and machine.nodes == 1:
        return True
    return any(ranks % k == 0 and ranks // k <= machine.devices_per_node for k in range(1, machine.nodes + 1))


def largest_power_of_two(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def doubling(limit: int) -> list[int]:
    return [1 << k for k in range(largest_power_of_two(limit).bit_length())]


def sizes_by_strategy(specs, workload):
    sizes = defaultdict(set)
    for spec in specs:
        if spec.workload == workload:
            sizes[spec.strategy].add(spec.world_size)
    return {strategy: sorted(found) for strategy, found in sizes.items()}


@pytest.mark.parametrize("machine", SHAPES, ids=shape_id)
@pytest.mark.parametrize("matrix", list(MATRICES))
def test_every_matrix_builds_valid_cells_that_fit_the_machine(matrix, machine):
    specs = build_matrix(matrix, machine)
    assert specs
    for spec in specs:
        assert RunSpec.from_dict(spec.to_dict()) == spec     # validates itself again from its row form
        assert spec.device is machine.device
        limit = machine.devices_per_node if spec.strategy in ONE_NODE_ONLY else machine.devices_per_node * machine.nodes
        if matrix in ("smoke", "zero-memory", "ci", "memory-techniques", "reference"):
            # Their two ranks check communication and sharding, which one rank cannot: on a one-device
            # machine they share it (docs/methodology.md, "Batch plans").
            limit = max(limit, 2)
        if matrix in ("hybrid", "fault-tolerance", "moe", "long-context"):
            # World sizes 2 and 4 on any CPU (model parallelism and resharded resume are checked, not sped up); 2 on
            # one GPU.
            limit = max(limit, 4 if machine.device is DeviceKind.CPU else 2)
        if matrix == "parameter-server" and machine.device is DeviceKind.CPU and machine.nodes == 1:
            # 2 and 4 workers on any CPU host, as the hybrids' ranks.
            limit = max(limit, 4)
        if machine.device is DeviceKind.CPU and machine.nodes == 1 and spec.strategy in PARAMETER_SERVERS:
            # The workers and their dedicated servers (at most 2) on one host, cores shared where fewer.
            limit += 2
        assert spec.world_size <= limit, spec.label
    assert len({spec.cell_id for spec in specs}) == len(specs)


@pytest.mark.parametrize("machine", SHAPES, ids=shape_id)
@pytest.mark.parametrize("matrix", list(MATRICES))
def test_every_cell_has_its_plain_reference_at_the_same_global_batch(matrix, machine):
    specs = build_matrix(matrix, machine)
    references = {reference_key(spec.to_dict()) for spec in specs if spec.strategy == "plain"}
    for spec in specs:
        assert reference_key(spec.to_dict()) in references, spec.label


@pytest.mark.parametrize("machine", SHAPES, ids=shape_id)
def test_scaling_reaches_the_largest_power_of_two_of_devices_x_nodes(machine):
    specs = build_matrix("scaling", machine)
    expected = doubling(machine.devices_per_node * machine.nodes)
    for workload in {spec.workload for spec in specs}:
        sizes = sizes_by_strategy(specs, workload)
        assert set(sizes) - {"ps-async"} == DATA_PARALLEL | {"plain", "ps"}
        for strategy in (*DATA_PARALLEL, "ps"):
            assert sizes[strategy] == expected, (workload, strategy)
        # ps-async: 2 workers or more and one server beside them, where nodes hold them evenly.
        assert sizes.get("ps-async", []) == [n + 1 for n in expected if n >= 2 and evenly(machine, n + 1)]


@pytest.mark.parametrize("machine", SHAPES, ids=shape_id)
def test_scaling_holds_one_strong_global_batch_and_the_per_device_batch_for_weak(machine):
    specs = build_matrix("scaling", machine)
    largest = largest_power_of_two(machine.devices_per_node * machine.nodes)
    for workload in {spec.workload for spec in specs}:
        per_device = PER_DEVICE[workload]
        strong = per_device * largest
        for strategy in (*DATA_PARALLEL, "ps"):
            cells = {(s.world_size, s.global_batch) for s in specs if s.workload == workload and s.strategy == strategy}
            # strong: every size at the largest size's global batch; weak: the per-device batch at every size
            assert cells == {(size, strong) for size in doubling(largest)} | {(size, per_device * size)
                                                                            for size in doubling(largest)}
        plain = {s.global_batch for s in specs if s.workload == workload and s.strategy == "plain"}
        assert plain == {per_device * size for size in doubling(largest)}


@pytest.mark.parametrize("machine", SHAPES, ids=shape_id)
def test_wide_runs_every_strategy_up_to_the_machine_on_one_global_batch_per_workload(machine):
    specs = build_matrix("wide", machine)
    devices = machine.devices_per_node * machine.nodes
    for workload in {spec.workload for spec in specs}:
        assert {s.global_batch for s in specs if s.workload == workload} == {
            PER_DEVICE[workload] * largest_power_of_two(devices)}
        sizes = sizes_by_strategy(specs, workload)
        assert {"plain", "bare"} <= set(sizes)        # the references: parity's, and the harness's own cost
        for strategy, found in sizes.items():
            if strategy in ("plain", "bare"):
                assert found == [1]
            elif strategy in ONE_NODE_ONLY:
                assert found == doubling(machine.devices_per_node)
            elif strategy == "ps-async":
                assert found == [n + 1 for n in doubling(devices) if n >= 2 and evenly(machine, n + 1)]
            else:
                assert found == doubling(devices), strategy


@pytest.mark.parametrize("machine", SHAPES, ids=shape_id)
def test_zero_memory_runs_at_the_largest_size_and_smoke_at_two_ranks(machine):
    devices = machine.devices_per_node * machine.nodes
    memory = build_matrix("zero-memory", machine)
    size = max(2, largest_power_of_two(devices))
    for spec in memory:
        if spec.strategy != "plain":
            assert spec.world_size == size
            assert spec.global_batch == MEMORY_PER_DEVICE[spec.workload] * size
    smoke = build_matrix("smoke", machine)
    assert sorted((s.strategy, s.world_size) for s in smoke) == [("ddp", 2), ("plain", 1)]


@pytest.mark.parametrize("machine", SHAPES, ids=shape_id)
def test_ci_runs_every_strategy_on_gpt_tiny_and_llama_tinys_own_cells_at_two_ranks_for_five_steps(machine):
    specs = build_matrix("ci", machine)
    pairs = sorted((s.strategy, s.world_size) for s in specs if s.workload == "gpt-tiny")
    # DataParallel's one process drives one node's devices: none at 2 ranks on a one-device node.
    one_node = ["dataparallel"] if machine.devices_per_node >= 2 else []
    others = ["autotp", "ddp", "fsdp2", "fsdp2-tp", "horovod", "pipeline", "ps", "tp", "zero1", "zero2", "zero3"]
    assert pairs == sorted([("plain", 1)] + [(name, 2) for name in one_node + others])
    # llama-tiny: one cell each of what its family brings (FSDP2 around its blocks and untied head, tp's layout).
    assert sorted((s.strategy, s.world_size) for s in specs if s.workload == "llama-tiny") == [
        ("fsdp2", 2), ("plain", 1), ("tp", 2)]
    assert {(s.workload, s.precision.value, s.global_batch, s.micro_batch, s.warmup_steps, s.timed_steps)
            for s in specs} == {("gpt-tiny", "fp32", 16, 4, 2, 3), ("llama-tiny", "fp32", 16, 4, 2, 3)}


def test_parameter_server_cells_in_the_generic_matrices_are_colocated_so_their_workers_are_the_world_size():
    specs = build_matrix("full", Machine(device=DeviceKind.CUDA, devices_per_node=8, nodes=2))
    assert {(s.world_size, s.options_dict["placement"]) for s in specs if s.strategy == "ps"} == {
        (1, "colocated"), (2, "colocated"), (4, "colocated"), (8, "colocated"), (16, "colocated")}


def test_pipeline_cells_keep_their_stage_rule():
    specs = build_matrix("full", Machine(device=DeviceKind.CUDA, devices_per_node=8, nodes=2))
    stages = {s.world_size: s.options_dict["stages"] for s in specs if s.strategy == "pipeline"}
    assert stages == {1: 1, 2: 2, 4: 2, 8: 2, 16: 2}


@pytest.mark.parametrize("machine", GPU_SHAPES, ids=shape_id)
def test_full_on_gpus_is_wide(machine):
    assert build_matrix("full", machine) == build_matrix("wide", machine)


def test_full_on_two_cpu_cores_is_every_strategy_at_two_ranks_on_gpt_tiny_beside_the_plain_loop():
    machine = Machine(device=DeviceKind.CPU, devices_per_node=2)
    cells = [(s.workload, s.strategy, s.world_size, s.repeats) for s in build_matrix("full", machine)]
    at_2 = ("dataparallel", "ddp", "horovod", "zero1", "zero2", "zero3", "fsdp2", "pipeline", "tp", "fsdp2-tp",
            "autotp", "ps")
    assert cells == [("gpt-tiny", "plain", 1, 1), *[("gpt-tiny", s, 2, 1) for s in at_2], ("gpt-tiny", "ps-async", 3, 1)]
    # On 8 cores: the largest world size alone.
    eight = {(s.strategy, s.world_size) for s in build_matrix("full", Machine(device=DeviceKind.CPU, devices_per_node=8))}
    assert ("ddp", 8) in eight and ("ddp", 4) not in eight and ("plain", 1) in eight


def test_what_full_leaves_to_wide_on_cpu_comes_back_where_the_user_asks_for_it():
    machine = Machine(device=DeviceKind.CPU, devices_per_node=2)
    llama = build_matrix("full", machine, Selection(workloads=("llama-tiny",), strategies=("plain", "ddp")))
    assert [(s.workload, s.strategy, s.world_size) for s in llama] == [("llama-tiny", "plain", 1), ("llama-tiny", "ddp", 2)]
    sizes = build_matrix("full", machine, Selection(strategies=("ddp",), world_sizes=(1, 2)))
    assert [(s.strategy, s.world_size) for s in sizes] == [("ddp", 1), ("ddp", 2)]
    bare = build_matrix("full", machine, Selection(strategies=("plain", "bare")))
    assert [(s.strategy, s.repeats) for s in bare] == [("plain", 5), ("bare", 5)]     # the harness's cost, 5 a side


def test_two_cpu_cores_keep_the_batches_they_had():
    # The plans before batches followed the machine: micro-batch 4, global 16 at sizes 1 and 2; the weak
    # series at 8 per rank; the memory sweep at global 8 on 2 ranks.
    machine = Machine(device=DeviceKind.CPU, devices_per_node=2)
    labels = {s.label.rsplit("/", 2)[0] for s in build_matrix("wide", machine)}
    assert {"gpt-tiny/ddp/ws1/gb16/mb4", "gpt-tiny/ddp/ws2/gb16/mb4", "resnet20-cifar/zero2/ws2/gb16/mb4",
            "resnet20-cifar/plain/ws1/gb16/mb4"} <= labels
    assert {s.global_batch for s in build_matrix("wide", machine)} == {16}
    scaling = {s.label.rsplit("/", 2)[0] for s in build_matrix("scaling", machine, Selection(workloads=("gpt-tiny",)))}
    assert {"gpt-tiny/ddp/ws1/gb8/mb4", "gpt-tiny/ddp/ws1/gb16/mb4", "gpt-tiny/ddp/ws2/gb16/mb4",
            "gpt-tiny/plain/ws1/gb8/mb4", "gpt-tiny/plain/ws1/gb16/mb4"} <= scaling
    memory = [(s.strategy, s.world_size, s.global_batch, s.micro_batch) for s in build_matrix("zero-memory", machine)]
    assert memory == [("plain", 1, 8, 4), ("ddp", 2, 8, 4), ("zero1", 2, 8, 4), ("zero2", 2, 8, 4),
                      ("zero3", 2, 8, 4), ("fsdp2", 2, 8, 4)]


def test_four_8_gpu_nodes_plan_their_batches_from_32_devices():
    machine = Machine(device=DeviceKind.CUDA, devices_per_node=8, nodes=4)
    strong = {(s.workload, s.global_batch, s.micro_batch) for s in build_matrix("full", machine)}
    # 8192 images, 512 sequences of GPT-2 small, 128 of Llama 3.2 1B, 32 of Llama 3 8B
    assert strong == {("resnet50", 256 * 32, 256), ("gpt2-small", 16 * 32, 16), ("llama3.2-1b", 4 * 32, 4),
                      ("llama3-8b", 1 * 32, 1)}


def test_user_world_sizes_share_one_global_batch():
    # Sizes 3 and 4 both split 8 x lcm(3, 4) = 96 in micro-batches of 4 (32 and 24 per rank); the largest
    # size alone, 8 x 4 = 32, would not split over 3 ranks.
    machine = Machine(device=DeviceKind.CPU, devices_per_node=2)
    specs = build_matrix("full", machine, Selection(workloads=("gpt-tiny",), strategies=("ddp",), world_sizes=(3, 4)))
    assert {(s.world_size, s.global_batch) for s in specs} == {(3, 96), (4, 96)}


def test_user_world_sizes_beyond_a_node_drop_only_the_one_node_strategies():
    machine = Machine(device=DeviceKind.CUDA, devices_per_node=8, nodes=2)
    specs = build_matrix("full", machine, Selection(strategies=("dataparallel", "ddp"), world_sizes=(8, 16)))
    assert sorted({(s.strategy, s.world_size) for s in specs}) == [("dataparallel", 8), ("ddp", 8), ("ddp", 16)]


@pytest.mark.parametrize("name", sorted(MATRICES))
def test_every_gpu_matrix_launches_the_plain_loop_at_least_twice_and_a_cpu_one_as_asked(name):
    # On a GPU parity's tolerances follow the plain loop's own launch-to-launch noise (harness.derive.parity), which
    # needs two of its launches of every reference key; the CPU repeats itself bit for bit.
    gpu = Machine(device=DeviceKind.CUDA, devices_per_node=8, nodes=2)
    cpu = Machine(device=DeviceKind.CPU, devices_per_node=2)
    specs = build_matrix(name, gpu, Selection(repeats=1))
    plain = [spec for spec in specs if spec.strategy == "plain"]
    assert plain and all(spec.repeats == 2 for spec in plain)
    assert all(spec.repeats == 1 for spec in specs if spec.strategy != "plain")
    assert all(spec.repeats == 1 for spec in build_matrix(name, cpu, Selection(repeats=1)) if spec.strategy == "plain")


@pytest.mark.parametrize("matrix", ["full", "scaling", "hybrid", "zero-memory", "memory-techniques"])
def test_the_gpu_matrices_run_both_llamas_on_two_8_gpu_nodes(matrix):
    specs = build_matrix(matrix, Machine(device=DeviceKind.CUDA, devices_per_node=8, nodes=2))
    for llama in ("llama3.2-1b", "llama3-8b"):
        mine = [spec for spec in specs if spec.workload == llama]
        assert 16 in {spec.world_size for spec in mine}, llama
        assert {"plain", "ddp", "fsdp2"} <= {spec.strategy for spec in mine}, llama
        if matrix in ("hybrid", "memory-techniques"):
            assert "fsdp2-tp" in {spec.strategy for spec in mine}, llama
