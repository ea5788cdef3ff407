"""`harness doctor` on this CPU machine (harness/doctor.py): every strategy named as runnable or with the reason it is
not, and a non-zero exit for a matrix with cells this machine would skip."""

import pytest
import torch

from harness.cli import main
from harness.strategies import STRATEGIES

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU is told")


def _lines(capsys, *arguments) -> tuple[int, list[str]]:
    status = main(["doctor", *arguments])
    return status, capsys.readouterr().out.splitlines()


def test_every_strategy_is_named_runnable_or_with_its_reason(capsys):
    status, lines = _lines(capsys)
    assert status == 0
    [runnable] = [line for line in lines if line.startswith("strategies")]
    names = runnable.split(": ", 1)[1].split(", ")
    cannot = {line.split()[0]: line.split(" cannot: ", 1)[1] for line in lines if " cannot: " in line}
    assert sorted([*names, *cannot]) == sorted(STRATEGIES)
    assert cannot.keys() == {"dataparallel", "cp"}
    assert cannot["dataparallel"] == "DataParallel replicates over CUDA devices only; on CPU it would not be parallel"
    assert cannot["cp"].startswith("torch's context parallelism handles the CUDA attention kernels alone")
    assert runnable.startswith(f"strategies  {len(STRATEGIES) - 2} of {len(STRATEGIES)} can run here (cpu): ")
    assert any(line.startswith("machine") and "no CUDA device visible" in line for line in lines)
    assert any(line.startswith("horovod") and "Gloo yes" in line for line in lines)
    assert any(line.startswith("launchers") and "torchrun /" in line for line in lines)


def test_the_reference_set_cannot_run_whole_here_and_says_which_cells_and_why(capsys):
    # The GPU reference set on CPU runs the tiny stand-ins, but FSDP2's offload_policy moves nothing on a CPU device.
    status, lines = _lines(capsys, "--matrix", "reference")
    assert status == 1
    [heading] = [line for line in lines if line.startswith("matrix")]
    assert heading.startswith("matrix      reference: 36 of 37 cells can run here; 1 would be skipped:")
    assert any(line.strip().startswith("1 x offload_policy=cpu moves parameters") and line.endswith("(fsdp2)")
               for line in lines)


def test_a_matrix_whose_every_cell_runs_exits_0(capsys):
    status, lines = _lines(capsys, "--matrix", "smoke")
    assert status == 0 and any("smoke: 2 of 2 cells can run here (every one)" in line for line in lines), lines
