"""`harness doctor`: its arguments and `command_doctor`, which prints what this machine can run (harness.doctor).

    python -m harness doctor --matrix reference
"""

from __future__ import annotations

import argparse

from harness.matrix import MATRICES
from harness.spec import DeviceKind


def add_parser(commands: argparse._SubParsersAction) -> None:
    doctor = commands.add_parser("doctor", help="what this machine can run: GPUs, versions, Horovod's and "
                                 "DeepSpeed's builds, launchers, strategies (exit 1: --matrix has cells it cannot run)")
    doctor.set_defaults(handler=command_doctor)
    doctor.add_argument("--matrix", choices=list(MATRICES), help="also check this matrix's cells here")
    doctor.add_argument("--device", choices=[d.value for d in DeviceKind], help="cpu or cuda (default: cuda if "
                        "visible)")


def command_doctor(args: argparse.Namespace) -> int:
    from harness.doctor import render, report

    findings, status = report(args.matrix, args.device)
    print(render(findings))
    return status
