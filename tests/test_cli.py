"""The command line refuses bad input with one line and exit status 2, before launching anything."""

import subprocess
import sys

import pytest

from harness.cli import main


def run_cli(capsys, *args):
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("args, fragment", [
    (["--strategy", "mpi"], "unknown strategy 'mpi'; known:"),
    (["--workload", "bert"], "unknown workload 'bert'; known:"),
    (["--world-sizes", "0"], "world_size must be a whole number >= 1, got 0"),
    (["--global-batch", "12", "--world-sizes", "2"], "global_batch 12 must be divisible by"),
    (["--matrix", "huge"], "unknown matrix 'huge'; known: smoke, full"),
    (["--strategy", "ddp", "--option", "stages=2"], "option 'stages' belongs to none of the selected"),
    (["--strategy", "zero1", "--option", "stage3_prefetch=1"], "option 'stage3_prefetch' belongs to none"),
    (["--precision", "fp8"], "precision 'fp8' is not one of: fp32, bf16"),
    (["--strategy", "pipeline", "--option", "stages=9", "--world-sizes", "9", "--global-batch", "36",
      "--micro-batch", "4"], "pipeline stages=9 exceeds the 7 layers of gpt-tiny; allowed: 1..7"),
    (["--strategy", "pipeline", "--option", "stages=2", "--world-sizes", "3", "--global-batch", "12"],
     "world_size 3 is not divisible by pipeline stages=2"),
    (["--strategy", "zero2", "--option", "offload_optimizer=gpu"], "offload_optimizer='gpu' of strategy zero2"),
])
def test_bad_input_exits_2_with_one_line_and_launches_nothing(tmp_path, monkeypatch, capsys, args, fragment):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "rows.jsonl"
    matrix = [] if "--matrix" in args else ["--matrix", "smoke"]
    code, _, err = run_cli(capsys, "run", *matrix, "--workload", "gpt-tiny", "--out", str(out), *args) \
        if "--workload" not in args else run_cli(capsys, "run", *matrix, "--out", str(out), *args)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith("parbench: error: ")
    assert fragment in lines[0]
    assert not out.exists() and not (tmp_path / "rows-cells").exists()


def test_list_names_matrices_workloads_and_strategies(capsys):
    code, out, _ = run_cli(capsys, "list")
    assert code == 0
    for name in ("smoke", "full", "gpt2-small", "resnet50", "plain", "dataparallel", "ddp", "horovod", "zero1",
                 "zero2", "zero3", "fsdp2", "pipeline"):
        assert name in out


def test_the_module_entry_point_reports_errors_the_same_way(tmp_path):
    done = subprocess.run([sys.executable, "-m", "harness", "run", "--strategy", "mpi"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["parbench: error: unknown strategy 'mpi'; known: "
                                                "plain, dataparallel, ddp, horovod, zero1, zero2, zero3, fsdp2, "
                                                "pipeline"]
