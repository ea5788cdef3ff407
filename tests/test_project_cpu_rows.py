"""A projection of CPU rows onto a cluster says in its first lines what such rows can and cannot tell: the machinery
carries over, a CPU's compute and overlap do not (harness.project.run.CPU_ROWS_CAVEAT)."""

from __future__ import annotations

import json
from pathlib import Path

from harness.cli import main
from harness.project.run import CPU_ROWS_CAVEAT

REFERENCE = Path(__file__).resolve().parent.parent / "results" / "reference" / "ci-cpu"
ARGUMENTS = ["--world-sizes", "8", "--scaling", "weak"]


def printed_lines(capsys, *arguments) -> list[str]:
    assert main(["project", *arguments, *ARGUMENTS]) == 0
    return capsys.readouterr().out.splitlines()


def test_cpu_rows_onto_a_cluster_open_with_the_caveat(capsys):
    lines = printed_lines(capsys, str(REFERENCE / "smoke.jsonl"), "--cluster", "dgx-h100-ib")
    assert lines[0].startswith("parbench: projection onto cluster dgx-h100-ib")
    assert lines[1] == CPU_ROWS_CAVEAT
    for words in ("CPU rows prove the machinery", "their compute and overlap are a CPU's",
                  "not a GPU's", "world size 1 cell gives the per-GPU compute"):
        assert words in CPU_ROWS_CAVEAT


def test_rows_of_a_gpu_or_onto_the_cpu_hosts_own_network_carry_no_caveat(capsys, tmp_path):
    # Onto the calibrated CPU host's network the rows' compute is the target's own.
    lines = printed_lines(capsys, str(REFERENCE / "smoke.jsonl"), "--comm", str(REFERENCE / "comm-ws2.jsonl"))
    assert CPU_ROWS_CAVEAT not in lines
    # The same rows as if measured on a GPU.
    rows = [json.loads(line) for line in (REFERENCE / "smoke.jsonl").read_text().splitlines()]
    for row in rows:
        row["spec"]["device"] = "cuda"
    gpu_rows = tmp_path / "gpu.jsonl"
    gpu_rows.write_text("".join(json.dumps(row) + "\n" for row in rows))
    lines = printed_lines(capsys, str(gpu_rows), "--cluster", "dgx-h100-ib")
    assert lines[0].startswith("parbench: projection onto cluster") and CPU_ROWS_CAVEAT not in lines
