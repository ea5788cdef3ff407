"""Scaling efficiency, computed from rows at report time.

With X(N) the throughput (samples/s) of a cell at world size N:
- strong scaling (the global batch is fixed as N grows):
      E_strong(N) = X(N) / (N x X_ref(1)), X_ref(1) at the same global batch;
- weak scaling (the per-device batch is fixed, the global batch grows with N):
      E_weak(N)   = X(N) / (N x X_ref(1)), X_ref(1) at a global batch of global_batch(N) / N.
Each is given against two references: the same strategy at world size 1 (how the strategy scales), and the
plain single-device loop with no wrapper (what scaling buys over not distributing at all, so a wrapper's
own overhead shows). 1.0 is perfect; rows on a shared device are excluded, since their speed means
nothing.
"""

from __future__ import annotations

import pandas as pd

CELL_KEYS = ["workload", "precision", "micro_batch", "device"]


def scaling_efficiency(table: pd.DataFrame) -> pd.DataFrame:
    """`table` has one row per cell: the CELL_KEYS, strategy, world_size, global_batch, samples_per_s and
    shared_device. Returns it with strong/weak efficiency columns against both references."""
    table = table.copy()
    usable = table[~table["shared_device"].astype(bool)]
    ws1 = usable[usable["world_size"] == 1]
    same = ws1.groupby(CELL_KEYS + ["strategy", "global_batch"])["samples_per_s"].median()
    plain = ws1[ws1["strategy"] == "plain"].groupby(CELL_KEYS + ["global_batch"])["samples_per_s"].median()

    def efficiency(row: pd.Series, reference: pd.Series, with_strategy: bool, weak: bool) -> float:
        if row["shared_device"]:
            return float("nan")
        batch = row["global_batch"] // row["world_size"] if weak else row["global_batch"]
        if weak and batch * row["world_size"] != row["global_batch"]:
            return float("nan")
        key = tuple(row[k] for k in CELL_KEYS) + ((row["strategy"],) if with_strategy else ()) + (batch,)
        base = reference.get(key)
        if base is None or not base:
            return float("nan")
        return row["samples_per_s"] / (row["world_size"] * base)

    for weak, kind in ((False, "strong"), (True, "weak")):
        table[f"{kind}_efficiency_vs_ws1"] = table.apply(efficiency, axis=1, args=(same, True, weak))
        table[f"{kind}_efficiency_vs_plain"] = table.apply(efficiency, axis=1, args=(plain, False, weak))
    return table
