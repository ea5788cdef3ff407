"""Ulysses' projection validated on the emulated cluster (docs/clusters.md, "Ulysses' all-to-alls on the emulated
cluster"): the table the docs show is what the committed rows give, so a change to the model shows as a change to the
documented table."""

from pathlib import Path

from harness.derive.rows import load_rows
from harness.project.validate import markdown_table, validate
from harness.record import COMMBENCH_KIND, read_rows
from test_validate import _shown

ROOT = Path(__file__).parent.parent
REFERENCE = ROOT / "results" / "reference" / "emulated-long-context"


def test_the_long_context_table_in_the_docs_is_the_committed_rows_validated():
    result = validate(load_rows([REFERENCE / "cells.jsonl"]), read_rows([REFERENCE / "comm.jsonl"], kind=COMMBENCH_KIND))
    # ulysses over every rank at 2 and 4 ranks, at 50, 100 and 200 Mbit/s, each cell launched twice; sp=2 at 4 ranks,
    # without a partner at 2, named and not predicted.
    assert len(result.cells) == 6 and {cell.launches for cell in result.cells} == {2}
    assert sorted({(c.strategy, c.world_size) for c in result.cells}) == [("ulysses", 2), ("ulysses", 4)]
    assert len([note for note in result.left_out if "no other multi-rank cell" in note]) == 3
    clusters = (ROOT / "docs" / "clusters.md").read_text()
    assert _shown(clusters, "long-context-validation-table") == markdown_table(result)
    joined = " ".join(clusters.split())
    assert (f"Over the 6 cells the median |error| is {result.median_abs_error:.1%} and the p90 "
            f"{result.p90_abs_error:.1%}, against the baseline's {result.baseline_median_abs_error:.1%} and "
            f"{result.baseline_p90_abs_error:.1%}") in joined
