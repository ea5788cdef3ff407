"""Reports of results files: Markdown and self-contained HTML that lead with their verdicts, CSV and Parquet.

    python -m harness report results/full-*.jsonl --out report/

The report answers first (`verdicts`: the fastest strategy per workload and world size and by how much,
the lowest memory per rank, where exposed communication dominates, parity mismatches, cells that did not
run), then shows the plots (`plots`; `projected` for rows of kind "projection", drawn as bands with the
measured points on top), then a compact table (`table`). `document` assembles and writes them. Every
figure is derived from the raw rows by `harness.derive` (the tables the console summary prints), so a
figure means the same wherever it is shown.
"""

from harness.report.document import write_report

__all__ = ["write_report"]
