"""Scaling efficiency of cells, from their throughputs.

With X(N) the throughput (samples/s) of a cell at world size N:
- strong scaling (the global batch is fixed as N grows):
      E_strong(N) = X(N) / (N x X_ref(1)), X_ref(1) at the same global batch;
- weak scaling (the per-device batch is fixed, the global batch grows with N):
      E_weak(N)   = X(N) / (N x X_ref(1)), X_ref(1) at a global batch of global_batch(N) / N.
Each is given against two references: the same strategy WITH THE SAME OPTIONS at world size 1 (how the
strategy scales; a variant such as `bucket_cap_mb=1` is its own strategy here, never merged with the
default), and the plain single-device loop with no wrapper (what scaling buys over not distributing at
all, so a wrapper's own overhead shows). One exception: a pipeline's `stages` grows with the world size
by construction (a 1-rank pipeline has one stage), so it is not part of the reference's identity.
1.0 is perfect; rows on a shared device and cells without a reference get NaN (no figure), never 0.
A reference is measured under the cell's own conditions (`conditions_id`, harness.derive.identity: link
rate, placement, host type): a world-size-1 cell on another machine, or beside another emulated link,
never serves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:       # imported where a table is made: a plan reads this module's names, not its tables
    import pandas as pd

SAME_COMPUTATION = ["workload", "precision", "micro_batch", "device"]
LAYOUT_OPTIONS = ("stages",)   # options that follow the world size by construction (see above)


def reference_options(options: str) -> str:
    """A cell's options without the ones that follow the world size."""
    kept = [part for part in options.split(",") if part and part.split("=", 1)[0] not in LAYOUT_OPTIONS]
    return ",".join(kept)


def scaling_efficiency(cells: pd.DataFrame) -> pd.DataFrame:
    """`cells` has one row per cell: SAME_COMPUTATION, strategy, options, world_size, global_batch,
    samples_per_s and shared_device. Returns it with strong/weak efficiency columns against both
    references."""
    import pandas as pd

    cells = cells.copy()
    cells["_reference_options"] = cells["options"].fillna("").map(reference_options)
    # Tables built without identities (one set of conditions) have no column: one value for all.
    cells["_conditions"] = cells["conditions_id"] if "conditions_id" in cells else ""
    same_computation = SAME_COMPUTATION + ["_conditions"]
    usable = cells[~cells["shared_device"].astype(bool) & cells["samples_per_s"].notna()]
    ws1 = usable[usable["world_size"] == 1]
    same = ws1.groupby(same_computation + ["strategy", "_reference_options", "global_batch"])["samples_per_s"].median()
    plain = ws1[ws1["strategy"] == "plain"].groupby(same_computation + ["global_batch"])["samples_per_s"].median()

    def efficiency(row: pd.Series, reference: pd.Series, with_strategy: bool, weak: bool) -> float:
        if row["shared_device"] or pd.isna(row["samples_per_s"]):
            return float("nan")
        batch = row["global_batch"] // row["world_size"] if weak else row["global_batch"]
        if weak and batch * row["world_size"] != row["global_batch"]:
            return float("nan")
        key = (tuple(row[k] for k in same_computation)
               + ((row["strategy"], row["_reference_options"]) if with_strategy else ()) + (batch,))
        base = reference.get(key)
        if base is None or not base:
            return float("nan")
        return row["samples_per_s"] / (row["world_size"] * base)

    for weak, kind in ((False, "strong"), (True, "weak")):
        cells[f"{kind}_efficiency_vs_ws1"] = cells.apply(efficiency, axis=1, args=(same, True, weak))
        cells[f"{kind}_efficiency_vs_plain"] = cells.apply(efficiency, axis=1, args=(plain, False, weak))
    return cells.drop(columns=["_reference_options", "_conditions"])
