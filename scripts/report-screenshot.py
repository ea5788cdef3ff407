"""The README's picture of a report: the report of the committed CPU reference rows rendered in headless
Chromium, cropped to its top (the verdicts and the first plots) and scaled down.

    PYTHONPATH=$PWD .venv/bin/python scripts/report-screenshot.py docs/report.png

Needs chromium (scripts/install-test-tools.sh) and Pillow (installed with matplotlib).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image

from harness.report import write_report

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [Path("results/reference/ci-cpu/full.jsonl"), Path("results/reference/ci-cpu/comm-ws2.jsonl")]
WINDOW = (1400, 2200)       # CSS pixels: the page's width, and enough height for the part kept
KEEP_HEIGHT = 1500          # the verdicts and the throughput and efficiency plots of the reference rows
WIDTH = 1000                # of the saved picture


def main(out: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("report-screenshot: chromium is not installed (scripts/install-test-tools.sh)")
    out = out.resolve()
    os.chdir(ROOT)            # the report names its sources as given: relative to the checkout
    with tempfile.TemporaryDirectory() as folder:
        write_report(SOURCES, Path(folder))
        shot = Path(folder) / "shot.png"
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--window-size={WINDOW[0]},{WINDOW[1]}", f"--screenshot={shot}",
                        (Path(folder) / "report.html").as_uri()], check=True, capture_output=True, timeout=120)
        image = Image.open(shot).convert("RGB").crop((0, 0, WINDOW[0], KEEP_HEIGHT))
    image = image.resize((WIDTH, round(KEEP_HEIGHT * WIDTH / WINDOW[0])), Image.LANCZOS)
    # A palette of 256 colours keeps text sharp at a fifth of the size; the octree method keeps the plots'
    # few saturated colours apart (the default median cut merged green and red into grey).
    image.quantize(colors=256, method=Image.Quantize.FASTOCTREE).save(out, optimize=True)
    print(f"{out}: {out.stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "report.png")
