"""What a launch would otherwise build inside its ranks, built once on the host before any cell starts.

DeepSpeed's CPU Adam (ZeRO-Offload's optimizer, harness.strategies.zero `zero_offload_adam`) is a C++ op JIT-built on
first use (`CPUAdamBuilder().load()`: torch.utils.cpp_extension under ~/.cache/torch_extensions). Left to the ranks,
the first offload cell on a machine spends its launch compiling (41 s on an idle 2-core VM, minutes on a loaded one,
past a launch's --timeout), times the build's load on the cells beside it, and, killed mid-build, leaves the build's
lock file behind: torch waits on that file without end, so every later offload cell hangs until its timeout (seen
here: every offload cell of a CI run timed out at 300 s behind a lock a killed build left). So the runner builds it
here first, before the timed cells, and removes a lock older than STALE_LOCK_S, which no live build holds that long.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterable

from harness.spec import RunSpec

# A cpu_adam build takes about a minute on an idle 2-core VM; a lock this old was left by a build that was killed.
STALE_LOCK_S = 15 * 60
OFFLOAD_OPTION = "offload_optimizer"


def needs_cpu_adam(spec: RunSpec) -> bool:
    """Whether the cell steps DeepSpeed's CPU Adam: a ZeRO cell with offload_optimizer."""
    return str(spec.options_dict.get(OFFLOAD_OPTION, "none")) != "none"


def build_before_launch(specs: Iterable[RunSpec], say: Callable[[str], None]) -> None:
    """Build the ops the cells `specs` would JIT-build in their ranks (cpu_adam), saying what it did; a build that
    fails is said and left to the cells, whose rows then record their own failure."""
    if not any(needs_cpu_adam(spec) for spec in specs):
        return
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except ImportError:
        return                  # the cells are skipped: DeepSpeed is not installed (Strategy.skip_reason)
    builder = CPUAdamBuilder()
    removed = remove_stale_lock(build_directory(builder.name))
    if removed:
        say(f"parbench: removed {removed}, a build lock left by a killed build (older than {STALE_LOCK_S // 60} min)")
    began = time.monotonic()
    try:
        builder.load(verbose=False)
    except Exception as error:          # compiler missing, build error: the offload cells will report it
        say(f"parbench: DeepSpeed's cpu_adam op did not build on the host ({error}); its cells will try in their ranks")
        return
    seconds = time.monotonic() - began
    if seconds > 5:     # loading a built op takes a second; longer means it was built now, here or by another run
        say(f"parbench: DeepSpeed's cpu_adam op (ZeRO-Offload's optimizer) ready on the host after {seconds:.0f} s "
            "(built, or another build waited for), before any timed cell")


def build_directory(name: str) -> Path:
    """Where torch's cpp_extension builds the op `name` (TORCH_EXTENSIONS_DIR, or its default under the cache)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def remove_stale_lock(directory: Path, now: float | None = None) -> Path | None:
    """The lock file in `directory` if it was older than STALE_LOCK_S and is now removed, else None."""
    lock = directory / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    if age <= STALE_LOCK_S:
        return None
    lock.unlink(missing_ok=True)
    return lock
