"""The emulated cluster (harness.emulate): refused in one line where it cannot be built, shaped to the rate
asked, a cell and the collective benchmark run across its nodes and record it, and nothing is left behind."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.cli import main
from harness.derive.identity import cell_identity
from harness.emulate.network import EmulatedNetwork, burst_bytes, check_can_emulate, emulated_network, parse_rate
from harness.record import COMMBENCH_KIND, read_results, read_rows
from harness.spec import SpecError, Status
from one_line import assert_one_line_error

pytestmark = pytest.mark.launch


def _can_emulate() -> str:
    try:
        check_can_emulate()
    except SpecError as error:
        return str(error)
    return ""


needs_namespaces = pytest.mark.skipif(bool(_can_emulate()), reason=_can_emulate() or "possible")


@pytest.mark.parametrize("text", ["100", "fast", "0mbit", "-5mbit", "100 mb", "1e3mbit"])
def test_a_rate_tc_would_not_read_is_one_line(text):
    assert_one_line_error(lambda: parse_rate(text), ["--emulate-link", "kbit, mbit or gbit"])


def test_rates_and_buckets_by_hand():
    assert parse_rate("100mbit") == 100e6 and parse_rate("1gbit") == 1e9 and parse_rate("512kbit") == 512e3
    assert burst_bytes(100e6) == 64 * 1024                 # 100e6 / 8 x 4 ms = 50 kB < one 64 KiB GSO packet
    assert burst_bytes(1e9) == 500_000                     # 1e9 / 8 x 4 ms


@pytest.mark.parametrize("argv, words", [
    (["--emulate-link", "100mbit", "--hostfile", "hosts"], ["--emulate-link", "excludes --hostfile"]),
    (["--emulate-link", "100mbit", "--nnodes", "2"], ["--emulate-nodes N"]),
    (["--emulate-link", "100mbit", "--emulate-nodes", "1"], ["--emulate-nodes must be >= 2"]),
    (["--emulate-link", "fast"], ["'fast' is not a link rate"]),
])
def test_bad_emulation_flags_are_one_line_before_launch(argv, words, capsys):
    assert main(["run", "--matrix", "smoke", "--dry-run", *argv]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and all(word in error for word in words), error


def test_without_root_it_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert main(["run", "--matrix", "smoke", "--emulate-link", "100mbit"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "needs root" in error and "uid 1000" in error


def _reference_row(tmp_path, *, emulated: bool) -> tuple[Path, str]:
    """A results file holding one committed emulated-cluster row (DDP, 4 ranks on 2 nodes), or the same row
    as if it had run on two real hosts; and the row's run id."""
    reference = Path(__file__).parent.parent / "results" / "reference" / "emulated-rerun" / "cells.jsonl"
    row = next(r for r in read_rows([reference]) if r["spec"]["strategy"] == "ddp" and r["spec"]["nnodes"] == 2)
    if not emulated:
        row["environment"].pop("emulated_network")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(row) + "\n")
    return rows, row["run_id"]


@pytest.mark.parametrize("emulated, words", [(True, ["needs root", "uid 1000"]),
                                              (False, ["ran on 2 hosts", "--hostfile"])])
def test_reproducing_a_row_from_several_nodes_is_refused_in_one_line_where_it_cannot_run(
        tmp_path, monkeypatch, capsys, emulated, words):
    # An emulated row runs again on an emulated cluster, which needs root; a row from two real hosts
    # cannot run again here. Either way, one line before anything launches, and the file is unchanged.
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    rows, run_id = _reference_row(tmp_path, emulated=emulated)
    before = rows.read_text()
    assert main(["reproduce", run_id[:12], "--results", str(rows)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and all(word in error for word in words), error
    assert rows.read_text() == before


def _leftovers(network: EmulatedNetwork) -> list[str]:
    return network.existing() + [str(p) for p in Path("/etc/netns").glob(f"pb{network.tag}*")]


SINK = """
import socket, sys
server = socket.socket(); server.bind((sys.argv[1], 5201)); server.listen(1); print("ready", flush=True)
connection, _ = server.accept(); received = 0
while chunk := connection.recv(1 << 16): received += len(chunk)
print(received, flush=True)
"""
SEND = """
import socket, sys, time
data = bytes(1 << 20); sock = socket.create_connection((sys.argv[1], 5201)); began = time.perf_counter()
for _ in range(int(sys.argv[2])): sock.sendall(data)
sock.shutdown(socket.SHUT_WR); sock.recv(1); print(time.perf_counter() - began)
"""


@needs_namespaces
def test_the_links_are_shaped_to_the_rate_both_ways_and_nothing_is_left():
    network = EmulatedNetwork.planned("80mbit")
    with emulated_network(network):
        for node, device in ((network.namespaces[0], "pbeth"), (network.switch, "pbp1")):
            shown = subprocess.run(["ip", "netns", "exec", node, "tc", "qdisc", "show", "dev", device],
                                   capture_output=True, text=True).stdout
            assert "tbf" in shown and "rate 80Mbit" in shown, shown
        for node in network.namespaces:        # not the host's default (BBR on these machines): reno
            control = subprocess.run(["ip", "netns", "exec", node, "sysctl", "-n", "net.ipv4.tcp_congestion_control"],
                                     capture_output=True, text=True).stdout.strip()
            assert control == "reno", control
        sink = subprocess.Popen(network.shell(1, f"{sys.executable} -c '{SINK}' {network.addresses[1]}"),
                                stdout=subprocess.PIPE, text=True)
        assert sink.stdout.readline().strip() == "ready"
        megabytes = 4
        sent = subprocess.run(network.shell(0, f"{sys.executable} -c '{SEND}' {network.addresses[1]} {megabytes}"),
                              capture_output=True, text=True, timeout=60)
        sink.wait(timeout=30)
        seconds = float(sent.stdout.split()[-1])
        # An upper bound only (a busy machine makes it slower, never faster): 4 MiB at 80 Mbit/s take
        # 4 x 8 x 1048576 / 80e6 = 0.42 s; the bucket lets 64 KiB through at once. Unshaped, a veth moves
        # 4 MiB in a few milliseconds.
        assert megabytes * 8 * 2 ** 20 / seconds < 1.25 * 80e6
    assert _leftovers(network) == []


@needs_namespaces
def test_a_ddp_cell_and_the_collective_benchmark_run_across_the_nodes_and_record_it(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert main(["run", "--matrix", "smoke", "--strategy", "ddp", "--world-sizes", "2", "--emulate-link", "400mbit",
                 "--timed-steps", "2", "--warmup-steps", "1", "--timeout", "300", "--out", str(out)]) == 0
    [row] = read_results([out])
    assert row.status is Status.OK, row.message
    network = row.environment["emulated_network"]
    assert network["link_rate_bits_per_s"] == 400e6 and network["nodes"] == 2 and network["shaper"] == "tc tbf"
    assert network["tcp_congestion_control"] == "reno"
    assert row.spec.nnodes == 2
    # One rank on each node's namespace, both on this machine (one kernel): its cores carry the two of them.
    assert row.environment["placement"] == "emulated"
    assert row.measurements["ranks_on_host_by_rank"] == [1, 1]
    assert row.measurements["ranks_on_machine_by_rank"] == [2, 2]
    nodes = [command[3] for command in row.to_dict()["node_launch_commands"]]
    assert len(set(nodes)) == 2 and all(name.startswith("pb") for name in nodes)
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count(nodes[0]) == 0

    # Reproduced on a fresh emulated cluster of the same rate and nodes: the same losses, bit for bit.
    assert main(["reproduce", row.run_id[:12], "--results", str(out)]) == 0
    assert "losses identical, bit for bit" in capsys.readouterr().out
    again = read_results([out])[-1]
    assert again.status is Status.OK and again.run_id != row.run_id and again.spec == row.spec
    assert again.environment["emulated_network"]["link_rate_bits_per_s"] == 400e6
    assert cell_identity(again.to_dict()) == cell_identity(row.to_dict())     # the same cell, launched again
    assert {command[3] for command in again.to_dict()["node_launch_commands"]}.isdisjoint(nodes)

    comm = tmp_path / "comm.jsonl"
    assert main(["comm", "--world-size", "2", "--emulate-link", "400mbit", "--collectives", "all_reduce",
                 "--max-bytes", "64K", "--warmup", "1", "--iters", "2", "--out", str(comm)]) == 0
    [record] = read_rows([comm], kind=COMMBENCH_KIND)
    assert record["environment"]["emulated_network"]["link_rate_bits_per_s"] == 400e6
    assert "ip netns exec pb" in " ".join(record["launch_command"])        # node 0's torchrun, in its namespace
