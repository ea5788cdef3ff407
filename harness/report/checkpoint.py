"""The report's "checkpoint and resume" lines: for each checkpoint cell (harness.strategies.state_checkpoint), its
library's save in seconds and GB/s, its load, the checkpoint's bytes against the model-state plan's, whether the
resumed steps reproduced the uninterrupted run, and after a planted kill the recovery; from the cell table alone
(harness.derive.cells; the figures in harness.derive.resume).

On CPU these figures check the machinery (what was written, by whom, resumed how exactly), not a storage system's
speed: the files land in the page cache of the machine's disk.
"""

from __future__ import annotations

from typing import Any, Mapping

import pandas as pd

MB = 1e6


def checkpoint_lines(cells: pd.DataFrame) -> list[str]:
    """One line per checkpoint cell, ok or not; [] where none ran."""
    if cells.empty or "checkpoint_method" not in cells:
        return []
    lines = []
    for record in cells.to_dict("records"):
        if not _present(record.get("checkpoint_method")):
            if "checkpoint=" in str(record.get("options") or "") and record.get("status") != "ok":
                lines.append(f"{record['label']}: {record['status']}: {str(record.get('message', ''))[:300]}")
            continue
        lines.append(_line(record))
    return lines


def _line(r: Mapping[str, Any]) -> str:
    save, load = r.get("checkpoint_save_s"), r.get("checkpoint_load_s")
    size = f"{r['checkpoint_bytes'] / MB:.2f} MB in {int(r['checkpoint_files'])} files"
    if _present(r.get("checkpoint_bytes_expected")) and _present(r.get("checkpoint_tensor_bytes")):
        held = "within" if r.get("checkpoint_size_holds") else "beyond"
        tensors, expected = r["checkpoint_tensor_bytes"], r["checkpoint_bytes_expected"]
        size += (f": tensors {tensors / MB:.2f} MB, {tensors / expected - 1:+.2%} against the plan's "
                 f"{expected / MB:.2f} MB ({held} 5%), the formats' overhead "
                 f"{(r['checkpoint_bytes'] - tensors) / 1e3:.0f} KB")
    rate = f", {r['checkpoint_save_GBps']:.3f} GB/s" if _present(r.get("checkpoint_save_GBps")) else ""
    text = f"{r['label']}: {r['checkpoint_method']} saved in {save:.3f} s{rate}, {size}"
    if _present(r.get("checkpoint_async_blocked_s")):
        text += (f" (async_save: blocked {r['checkpoint_async_blocked_s']:.3f} s, written in "
                 f"{r['checkpoint_async_write_s']:.3f} s)")
    if _present(load):
        text += f", loaded in {load:.3f} s"
    verdict = r.get("resume")
    text += f"; resumed steps: {verdict}" + (f" ({r['resume_failed']})" if r.get("resume_failed") else "")
    if _present(r.get("recovery_s")):
        text += (f"; a rank killed, {int(r['restarts'])} restart, recovered in {r['recovery_s']:.1f} s with "
                 f"{int(r['steps_recomputed'])} steps recomputed")
    return text


def _present(value: Any) -> bool:
    return value is not None and value == value
