"""The command line's shared argument types (`_count`, `_option`, ...), its one-line-error parser, and the argument
groups more than one subcommand takes, each written once here; a subcommand's own arguments live in its module.

    python -m harness memory --shape 4096,4096,32,32 --params 7B --dp 8 --option tp=8 --largest-layer 400M

It imports nothing heavy at module level: every `python -m harness` builds every subcommand's parser.
"""

from __future__ import annotations

import argparse
import decimal
import math
from typing import Callable

from harness.spec import SpecError


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _strategies(text: str) -> tuple[str, ...]:
    """Comma-separated strategies, each NAME or NAME[KEY=VALUE,...] (`harness project --strategies`): a comma
    inside brackets separates options, not strategies (harness.project.run.parse_strategy reads each)."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return tuple(part.strip() for part in (*parts, current) if part.strip())


def _int_csv(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in _csv(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None


SIZE_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
BYTE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
# The largest count a command takes: a 64-bit integer's, far beyond any model, batch or token budget, and below
# where a float would stop holding whole numbers apart (2^53 is already 9e15).
COUNT_LIMIT = 2**63 - 1


def _count(text: str, suffixes: dict[str, int] = SIZE_SUFFIXES) -> int:
    """'124M', '1.5B', '8.03B', '4096', '1e9' -> a whole number, exactly (decimal arithmetic: 8.03B is
    8,030,000,000, not a float's 8,029,999,999); byte sizes use binary K/M/G. Not a number, not finite, not whole,
    below 1 or past COUNT_LIMIT: an ArgumentTypeError naming what is allowed."""
    raw = text.strip().upper().removesuffix("IB").removesuffix("I")
    unit = raw[-1] if raw and raw[-1] in suffixes and not raw[-1].isdigit() else ""
    allowed = (f"a positive whole number with an optional suffix ({', '.join(s for s in suffixes if s)}), "
               f"at most {COUNT_LIMIT:.3g}")
    try:
        value = decimal.Decimal(raw[: len(raw) - len(unit)]) * suffixes[unit]
    except decimal.InvalidOperation:
        raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}") from None
    if not value.is_finite() or value < 1 or value > COUNT_LIMIT:
        raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}")
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}: {value.normalize():f} is not whole")
    return int(value)


def _bytes(text: str) -> int:
    return _count(text, BYTE_SUFFIXES)


def _seconds(text: str) -> float:
    """A timeout: a positive, finite number of seconds (0 would kill every launch at once, inf never)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive, finite number of seconds, got {text!r}")
    return value


def _threshold(text: str) -> tuple[str, float]:
    metric, _, value = text.rpartition("=")
    try:
        return metric or "*", float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or METRIC=NUMBER, got {text!r}") from None


def _shape(text: str) -> dict[str, object]:
    """--shape of `harness plan`, `memory` and `project` (harness.project.model.parse_shape)."""
    from harness.project.model import parse_shape

    try:
        return parse_shape(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _option(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, raw = text.split("=", 1)
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return key, lowered == "true"
    if lowered in ("none", "null"):
        return key, None
    for kind in (int, float):
        try:
            return key, kind(raw)
        except ValueError:
            pass
    return key, raw


class _Parser(argparse.ArgumentParser):
    """argparse, but errors are one line (no usage dump) so they read like the harness's own."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise SpecError(message)


def parser_of(*registrations: Callable[[argparse._SubParsersAction], None],
              description: str | None = None) -> argparse.ArgumentParser:
    """`python -m harness` with the subcommands that `registrations` (each a module's `add_parser`) add, in order:
    argparse lists them in that order in --help and in its errors."""
    parser = _Parser(prog="python -m harness", description=description)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for register in registrations:
        register(commands)
    return parser


# The cluster presets of harness.project.cluster, as every --cluster's help names them.
CLUSTER_PRESETS = "dgx-h100-ib, dgx-a100-ib, aws-p4d, aws-p5, commodity-100gbe"


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """--device of the commands whose ranks run on this machine's devices (run, comm)."""
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when a GPU is visible")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --shape, --params and --seq-len: a described decoder (harness.project.model.described), as `plan`
    and `memory` take it."""
    from harness.project.model import SHAPE_SYNTAX

    parser.add_argument("--model", help="a preset: every transformer workload (gpt2-small ... llama3-8b) and public "
                        "shapes (llama3.2-3b, llama3-70b, llama3.1-405b, gpt3-175b)")
    parser.add_argument("--shape", type=_shape, help=SHAPE_SYNTAX)
    parser.add_argument("--params", type=_count, help="parameters, e.g. 7B (default: the shape's own count)")
    parser.add_argument("--seq-len", type=int, help="tokens a sample, instead of the preset's")


def add_cluster_arguments(parser: argparse.ArgumentParser, *, cluster: str, overrides: str,
                          required: bool = False) -> None:
    """--cluster (a preset or a TOML file, harness.project.cluster.load_cluster) and --set KEY=VALUE overrides of its
    keys; `cluster` and `overrides` are their help, which says what each command prices on it."""
    parser.add_argument("--cluster", required=required, help=cluster)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=overrides)


def add_strategy_options(parser: argparse.ArgumentParser, *, help: str) -> None:
    """--option KEY=VALUE (repeatable): strategy options, each value read as a bool, None, int, float or text."""
    parser.add_argument("--option", type=_option, action="append", default=[], metavar="KEY=VALUE", help=help)


def add_timeout_argument(parser: argparse.ArgumentParser, *, default: float, help: str) -> None:
    """--timeout: seconds before a command's ranks are killed."""
    parser.add_argument("--timeout", type=_seconds, default=default, help=help)


def add_emulation_arguments(parser: argparse.ArgumentParser, *, link: str) -> None:
    """--emulate-link RATE and --emulate-nodes: an emulated cluster on this machine (harness.emulate); `link` is
    --emulate-link's help."""
    parser.add_argument("--emulate-link", metavar="RATE", help=link)
    parser.add_argument("--emulate-nodes", type=int, default=2, help="with --emulate-link: nodes (default 2)")


def add_threshold_argument(parser: argparse.ArgumentParser, *, help: str) -> None:
    """--threshold [METRIC=]X (repeatable) of the commands that judge regressions (compare, ab)."""
    parser.add_argument("--threshold", type=_threshold, action="append", default=[], metavar="[METRIC=]X", help=help)
