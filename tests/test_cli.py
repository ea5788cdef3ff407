"""The command line refuses bad input with one line and exit status 2, before launching anything."""

import argparse
import ast
import importlib
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from harness.cli import build_parser, main
from harness.cli.arguments import add_model_arguments, parser_of


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
    (["--repeats", "0"], "repeats must be a whole number >= 1, got 0"),      # not the matrix's default
    (["--timeout", "-1"], "argument --timeout: expected a positive, finite number of seconds, got '-1'"),
    (["--timeout", "0"], "argument --timeout: expected a positive, finite number of seconds, got '0'"),
    (["--timeout", "nan"], "argument --timeout: expected a positive, finite number of seconds, got 'nan'"),
    (["--timeout", "inf"], "argument --timeout: expected a positive, finite number of seconds, got 'inf'"),
    (["--peak-tflops", "inf"], "--peak-tflops must be a positive TFLOP/s figure, got inf"),
])
def test_bad_input_exits_2_with_one_line_and_launches_nothing(tmp_path, monkeypatch, capsys, args, fragment):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "rows.jsonl"
    matrix = [] if "--matrix" in args else ["--matrix", "smoke"]
    workload = [] if "--workload" in args else ["--workload", "gpt-tiny"]
    # --device cpu: the same plan on every host (a GPU host would otherwise plan its GPU workloads)
    code, _, err = run_cli(capsys, "run", *matrix, *workload, "--device", "cpu", "--out", str(out), *args)
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


@pytest.mark.launch
def test_the_module_entry_point_reports_errors_the_same_way(tmp_path):
    done = subprocess.run([sys.executable, "-m", "harness", "run", "--strategy", "mpi"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["parbench: error: unknown strategy 'mpi'; known: "
                                                "plain, bare, dataparallel, ddp, horovod, zero1, zero2, zero3, fsdp2, "
                                                "pipeline, tp, fsdp2-tp, autotp, ps, ps-async, ep, horovod-ep, "
                                                "deepspeed-moe, ulysses, cp"]


def test_memory_prints_the_zero_predictions_without_running(capsys):
    code, out, _ = run_cli(capsys, "memory", "--params", "7.5B", "--dp", "64", "--recipe", "deepspeed-bf16",
                           "--no-deepspeed")
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:] if line.split()}
    # The paper's fig. 1 (Psi = 7.5B, N_d = 64, K = 12): P_os 31.4 GB, P_os+g 16.6 GB, P_os+g+p 1.9 GB. Its 120 GB
    # baseline is no strategy's here: DDP runs no DeepSpeed recipe, and its row says so (tests/test_memory_command.py).
    assert rows["zero1"][6] == "29.249"         # 7.5e9 x (2 + 2 + 12 / 64) = 31.40625e9 bytes in GiB
    assert rows["zero2"][6] == "15.498"         # 7.5e9 x (2 + (2 + 12) / 64) = 16.640625e9 bytes in GiB
    assert rows["zero3"][6] == "1.746"          # 1.875e9 bytes in GiB


def test_memory_asks_deepspeed_for_the_cluster_of_dp_gpus_not_one_node_of_gpus_per_node(capsys):
    pytest.importorskip("deepspeed")
    # DeepSpeed 0.19.8 without offload, total_gpus = num_nodes x num_gpus_per_node = 8 x 8 = 64:
    #   ZeRO-2 (stage_1_and_2.py): 2 P + int(18 P / 64) = 15,000,000,000 + 2,109,375,000 = 17,109,375,000 B
    #          = 17,109,375,000 / 2^30 = 15.934 GiB
    #   ZeRO-3 (stage3.py): 4 L + int(18 P / 64), L = P / 20 = 375,000,000 (the default largest layer)
    #          = 1,500,000,000 + 2,109,375,000 = 3,609,375,000 B = 3.361 GiB
    # One node of 8 GPUs would give 15e9 + 16.875e9 B = 29.686 GiB and 1.5e9 + 16.875e9 B = 17.113 GiB.
    code, out, _ = run_cli(capsys, "memory", "--params", "7.5B", "--dp", "64", "--recipe", "deepspeed-bf16",
                           "--gpus-per-node", "8")
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:] if line.split()}
    assert (rows["zero2"][8], rows["zero3"][8]) == ("15.934", "3.361")
    assert "for 64 GPUs (8 node(s) x 8 GPUs)" in out
    # Left out, --gpus-per-node is --dp: one node of 64 GPUs, the same 64-way division.
    code, out, _ = run_cli(capsys, "memory", "--params", "7.5B", "--dp", "64", "--recipe", "deepspeed-bf16")
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:] if line.split()}
    assert (rows["zero2"][8], rows["zero3"][8]) == ("15.934", "3.361")
    assert "not recipe" not in out
    # Under the default recipe (autocast: fp32 weights and gradients beside ZeRO's fp32 optimizer states,
    # 4 + 4 + 12 bytes a parameter) ZeRO-2's own column is 7.5e9 x (4 + (4 + 12) / 64) = 31.875e9 B = 29.686
    # GiB beside DeepSpeed's 16-bit 15.934: the output must say the two count different recipes, not leave a
    # 2x disagreement unexplained.
    code, out, _ = run_cli(capsys, "memory", "--params", "7.5B", "--dp", "64", "--gpus-per-node", "8")
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:] if line.split()}
    assert (rows["zero2"][6], rows["zero2"][8]) == ("29.686", "15.934")
    assert "it counts 16-bit weights and gradients with fp32 master copies and moments (2 + 2 + 12 bytes a " \
           "parameter), not recipe autocast's: compare it with --recipe deepspeed-bf16" in out


@pytest.mark.parametrize("args, fragment", [
    (["memory", "--params", "7.5B", "--dp", "64", "--gpus-per-node", "7"], "--dp 64 must be a whole number of "
                                                                           "nodes of --gpus-per-node 7"),
    (["memory", "--params", "7.5B", "--dp", "64", "--gpus-per-node", "0"], "of --gpus-per-node 0"),
    (["comm", "--timeout", "0"], "argument --timeout: expected a positive, finite number of seconds, got '0'"),
    (["reproduce", "3f2a9c", "--timeout", "-5"], "argument --timeout: expected a positive, finite number of "
                                                 "seconds, got '-5'"),
    (["memory", "--params", "lots", "--dp", "2"], "expected a positive whole number with an optional suffix"),
    (["memory", "--params", "1M", "--dp", "2", "--recipe", "fp8"], "recipe 'fp8' is not one of"),
    (["comm", "--world-size", "1"], "--world-size must be >= 2"),
    (["comm", "--collectives", "all_reduce,gossip"], "unknown collective 'gossip'"),
])
def test_memory_comm_and_reproduce_refuse_bad_input_in_one_line(capsys, args, fragment):
    code, _, err = run_cli(capsys, *args)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and fragment in err


@pytest.mark.launch
def test_comm_benchmark_runs_at_two_ranks_and_prints_busbw_per_size(tmp_path, capsys):
    out = tmp_path / "comm.jsonl"
    code, printed, _ = run_cli(capsys, "comm", "--world-size", "2", "--device", "cpu", "--min-bytes", "1K",
                               "--max-bytes", "16K", "--warmup", "1", "--iters", "3", "--out", str(out))
    assert code == 0
    names = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
    lines = [line.split() for line in printed.splitlines() if line.split() and line.split()[0] in names]
    assert [(line[0], int(line[1])) for line in lines] == [
        (name, size) for name in names for size in (1024, 2048, 4096, 8192, 16384)]
    row = json.loads(out.read_text())
    assert row["kind"] == "commbench" and row["world_size"] == 2 and row["backend"] == "gloo"
    for measured in row["rows"]:
        factor = {"all_reduce": 1.0, "broadcast": 1.0}.get(measured["collective"], 0.5)
        assert measured["busbw_bytes_per_s"] == pytest.approx(measured["algbw_bytes_per_s"] * factor)
        assert measured["algbw_bytes_per_s"] == pytest.approx(measured["size_bytes"] / measured["time_s"])


def test_scaling_and_memory_matrices_hold_the_cells_their_figures_need(capsys):
    # Planned for 2 CPU cores whatever this host has (harness.machine; tests/test_matrix_shapes.py plans every
    # other shape with build_matrix).
    assert main(["run", "--matrix", "scaling", "--workload", "gpt-tiny", "--strategy", "plain,ddp", "--device", "cpu",
                 "--cpus-per-node", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    # strong: gb16 at ws1 and ws2; weak: the per-device batch (8) at ws1; plain references at both batches
    for label in ("gpt-tiny/ddp/ws1/gb16/", "gpt-tiny/ddp/ws2/gb16/", "gpt-tiny/ddp/ws1/gb8/",
                  "gpt-tiny/plain/ws1/gb16/", "gpt-tiny/plain/ws1/gb8/"):
        assert label in out, label
    assert "/ws4/" not in out
    assert main(["run", "--matrix", "zero-memory", "--device", "cpu", "--cpus-per-node", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    for strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp2"):
        assert f"gpt-tiny/{strategy}/ws2/gb8/mb4/" in out, strategy
    assert "gpt-tiny/plain/ws1/gb8/mb4/" in out


# ---- outputs that cannot be written, and a report of nothing: one line, before anything runs -----------------

REFERENCE = Path(__file__).resolve().parents[1] / "results" / "reference" / "ci-cpu" / "smoke.jsonl"
COMMANDS_WRITING = {   # each command that writes, with what it needs besides where to write
    "run": ["run", "--matrix", "smoke", "--workload", "gpt-tiny", "--strategy", "plain", "--device", "cpu"],
    "comm": ["comm", "--world-size", "2", "--device", "cpu"],
    "project": ["project", "--params", "1.5B", "--compute-ms", "120", "--cluster", "dgx-h100-ib"],
    "report": ["report", str(REFERENCE)],
}


def one_line_error(capsys, *args) -> str:
    code, out, err = run_cli(capsys, *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("parbench: error: "), (code, out, err)
    return lines[0]


@pytest.mark.parametrize("command", COMMANDS_WRITING)
def test_an_out_in_a_folder_that_takes_no_files_is_refused_naming_the_path(tmp_path, monkeypatch, capsys, command):
    monkeypatch.chdir(tmp_path)
    # /proc exists and root passes its permission checks, yet no file can be made there: only trying tells.
    out = "/proc/parbench-out" if command == "report" else "/proc/rows.jsonl"
    line = one_line_error(capsys, *COMMANDS_WRITING[command], "--out", out)
    assert f"--out {out}: cannot " in line and ("/proc" in line.split(": cannot ")[1])
    assert not list(tmp_path.iterdir())                 # nothing ran: no results folder, no cell folder


@pytest.mark.parametrize("command", COMMANDS_WRITING)
def test_an_out_under_a_file_is_refused_naming_the_file(tmp_path, capsys, command):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file where a folder would have to be\n")
    out = blocker / ("report" if command == "report" else "rows.jsonl")
    line = one_line_error(capsys, *COMMANDS_WRITING[command], "--out", str(out))
    assert line.endswith(f"--out {out}: {blocker} is a file, not a folder")
    assert blocker.read_text() == "a file where a folder would have to be\n"


@pytest.mark.parametrize("command", ["run", "comm", "project"])
def test_a_results_file_that_is_a_folder_is_refused(tmp_path, capsys, command):
    line = one_line_error(capsys, *COMMANDS_WRITING[command], "--out", str(tmp_path))
    assert line.endswith(f"--out {tmp_path} is a folder; expected a results file (.jsonl) to append rows to")


@pytest.mark.parametrize("content", ["", "\n\n", json.dumps({"kind": "projection", "status": "projected"}) + "\n"])
def test_a_report_of_a_results_file_with_no_rows_is_refused_naming_the_file(tmp_path, capsys, content):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(content)
    line = one_line_error(capsys, "report", str(REFERENCE), str(empty), "--out", str(tmp_path / "report"))
    assert line == f"parbench: error: {empty} holds no cell rows and no `harness comm` rows: nothing to report"
    assert not (tmp_path / "report").exists()


def test_a_compare_with_a_side_that_holds_no_rows_is_refused_naming_the_file(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for base, new in ((REFERENCE, empty), (empty, REFERENCE)):
        line = one_line_error(capsys, "compare", str(base), str(new))
        assert line == f"parbench: error: {empty} holds no cell rows: nothing to compare"


# ---- the parser: each subcommand's arguments in its own module, and an argument several take written once ------

CLI = Path(__file__).resolve().parents[1] / "harness" / "cli"


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [commands] = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    return commands.choices


def test_every_subcommand_is_registered_by_its_own_module_under_harness_cli():
    handlers = {name: parser.get_default("handler") for name, parser in subcommands(build_parser()).items()}
    modules = {name: handler.__module__ for name, handler in handlers.items()}
    assert len(set(modules.values())) == len(modules) and all(m.startswith("harness.cli.") for m in modules.values())
    for name, module in modules.items():   # the module whose command_* it runs adds it, and nothing else
        assert list(subcommands(parser_of(importlib.import_module(module).add_parser))) == [name]


def test_an_argument_several_subcommands_take_alike_is_written_once():
    calls = Counter(", ".join(ast.unparse(part) for part in (*call.args, *call.keywords))
                    for path in sorted(CLI.glob("*.py")) for call in ast.walk(ast.parse(path.read_text()))
                    if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "add_argument")
    assert [call for call, count in calls.items() if count > 1] == []
    group = argparse.ArgumentParser(add_help=False)
    add_model_arguments(group)
    shared = [(action.option_strings, action.type, action.help) for action in group._actions]
    for name in ("plan", "memory"):     # both describe the model through that one group
        taken = [(action.option_strings, action.type, action.help) for action in
                 subcommands(build_parser())[name]._actions]
        assert all(option in taken for option in shared), name


def test_python_m_harness_cli_runs_the_command_line_as_python_m_harness_does(monkeypatch, capsys):
    import gc
    import runpy

    monkeypatch.setattr(gc, "freeze", lambda: None)      # harness/__main__.py's: not on this test process's objects
    monkeypatch.setattr(sys, "argv", ["harness.cli", "list"])
    with pytest.raises(SystemExit) as ended:
        runpy.run_module("harness.cli", run_name="__main__", alter_sys=True)
    assert ended.value.code == 0 and capsys.readouterr().out.startswith("matrices:")
