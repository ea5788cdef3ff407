"""The report of the committed CPU reference rows (and their projection to 8 ranks) as a browser lays it out
(headless Chromium).

A copy of report.html gets a script that measures the laid-out page and writes the figures into the DOM,
which `chromium --dump-dom` prints: where the verdicts, the first plot and the table start; each plot's
data area (the background patch of every matplotlib axes) and each legend's box. From those: the verdicts
come first, no legend covers a data area or a label or falls outside its picture, no two labels of a plot
overlap, and no table column is empty.
Skipped, with the reason, where Chromium is not installed (scripts/install-test-tools.sh installs it).
"""

import html
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import matplotlib
import pytest

import svg_plots   # tests/svg_plots.py
from harness.cli import main
from harness.report import write_report

REFERENCE = Path(__file__).resolve().parent.parent / "results" / "reference" / "ci-cpu"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = [pytest.mark.launch,
              pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/install-test-tools.sh "
                                                          "installs it with apt where root)")]

MEASURE = """<script>
(() => {
  const out = document.createElement('pre'); out.id = 'measured'; document.body.appendChild(out);
  try {
    const box = element => { const r = element.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
    const found = {svgs: [], axes: [], legends: [], texts: []};
    document.querySelectorAll('svg').forEach((svg, index) => {
      found.svgs.push(box(svg));
      svg.querySelectorAll('g[id^="axes_"]').forEach(axes => {
        const patch = axes.querySelector(':scope > g[id^="patch_"]');   // the axes' background: its data area
        if (patch) found.axes.push({svg: index, box: box(patch)});
      });
      svg.querySelectorAll('g[id^="legend_"]').forEach(legend => found.legends.push({svg: index, box: box(legend)}));
      svg.querySelectorAll('text').forEach(text => {
        const angle = /rotate\((-?[\d.]+)/.exec(text.getAttribute('transform') || '');
        found.texts.push({svg: index, box: box(text), text: text.textContent,
                          in_legend: text.closest('g[id^="legend_"]') !== null,
                          rotated: angle !== null && Math.abs(parseFloat(angle[1])) % 180 !== 0});
      });
    });
    const drawn = selector => [...document.querySelectorAll(selector)].filter(g => box(g)[2] > box(g)[0]).length;
    found.bands = drawn('g[id^="projected-band-"]'); found.measured_points = drawn('g[id^="measured-"]');
    const startOf = selector => { const e = document.querySelector(selector); return e ? box(e)[1] : null; };
    found.verdicts = startOf('#verdicts'); found.first_plot = startOf('svg'); found.table = startOf('#cells table');
    found.headings = [...document.querySelectorAll('h2')].map(h => h.textContent);
    out.textContent = JSON.stringify(found);
  } catch (error) {
    out.textContent = JSON.stringify({error: String(error)});
  }
})();
</script>"""


class Tables(HTMLParser):
    """The text of every table cell, by table and row."""

    def __init__(self):
        super().__init__()
        self.tables, self._cell = [], None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def overlap(a, b) -> float:
    width = min(a[2], b[2]) - max(a[0], b[0])
    height = min(a[3], b[3]) - max(a[1], b[1])
    return max(width, 0) * max(height, 0)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rendered")
    projected = folder / "projected.jsonl"      # the reference rows projected to 8 ranks on their own host
    assert main(["project", str(REFERENCE / "full.jsonl"), "--comm", str(REFERENCE / "comm-ws2.jsonl"),
                 "--world-sizes", "1,2,4,8", "--out", str(projected)]) == 0
    write_report([REFERENCE / "full.jsonl", REFERENCE / "comm-ws2.jsonl", projected], folder)
    return _measured_in_chromium(folder, MEASURE)


def _measured_in_chromium(folder, script):
    """(what `script`, run in the rendered report.html of `folder`, wrote into <pre id="measured">, the DOM)."""
    measured = folder / "measured.html"
    measured.write_text((folder / "report.html").read_text().replace("</body>", script + "</body>"))
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          "--window-size=1400,3000", "--dump-dom", measured.as_uri()],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    figures = re.search(r'<pre id="measured">(.*?)</pre>', dom, flags=re.DOTALL)
    assert figures, "the measuring script did not run"
    found = json.loads(html.unescape(figures.group(1)))
    assert "error" not in found, found
    return found, dom


def test_the_verdicts_come_before_the_plots_and_the_table(rendered):
    found, _ = rendered
    assert found["headings"][0] == "Verdicts"
    assert found["verdicts"] < found["first_plot"] < found["table"]


def test_the_projection_is_drawn_as_bands_with_measured_points(rendered):
    found, _ = rendered
    # Six data-parallel strategies, weak and strong; measured strong points of each at world sizes 1 and 2.
    assert found["bands"] == 12 and found["measured_points"] == 6


def test_no_legend_covers_a_plot_or_leaves_its_picture(rendered):
    found, _ = rendered
    # Throughput, efficiency, projection, memory, communication, bus bandwidth, loss: each has its legend.
    assert len(found["legends"]) >= 7 and len(found["axes"]) >= len(found["legends"])
    for legend in found["legends"]:
        for axes in found["axes"]:
            if axes["svg"] == legend["svg"]:
                assert overlap(legend["box"], axes["box"]) == 0, (legend, axes)
        picture = found["svgs"][legend["svg"]]
        left, top, right, bottom = legend["box"]
        assert picture[0] - 1 <= left and right <= picture[2] + 1 and picture[1] - 1 <= top and bottom <= picture[3] + 1


def test_no_legend_covers_a_label_and_no_labels_overlap(rendered):
    found, _ = rendered
    texts = [t for t in found["texts"] if t["text"].strip()]
    assert len(texts) > 50
    for legend in found["legends"]:
        for text in texts:
            if text["svg"] == legend["svg"] and not text["in_legend"]:
                assert overlap(legend["box"], text["box"]) == 0, (legend, text)
    # Labels written along the axes (titles, tick labels, annotations); a rotated label's box is only its
    # bounding rectangle, so those are left out of this pairwise check.
    level = [t for t in texts if not t["in_legend"] and not t["rotated"]]
    for i, first in enumerate(level):
        for second in level[i + 1:]:
            if first["svg"] == second["svg"]:
                assert overlap(first["box"], second["box"]) < 1, (first, second)


def test_no_table_column_is_empty(rendered):
    _, dom = rendered
    parser = Tables()
    parser.feed(dom[dom.index('id="cells"'):])
    assert parser.tables
    for table in parser.tables:
        header, *rows = table
        assert rows
        for column, title in enumerate(header):
            assert any(row[column] not in ("", "-") for row in rows), title


# ---- issue 33, finding 8: the report of a fresh `make run` (cell rows only, no `harness comm` rows) -------------

FRESH_MEASURE = """<script>
(() => {
  const out = document.createElement('pre'); out.id = 'measured'; document.body.appendChild(out);
  try {
    const box = element => { const r = element.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
    const found = {bars: [], texts: [], deviation: []};
    document.querySelectorAll('svg').forEach((svg, index) => {
      svg.querySelectorAll('g[id]').forEach(group => {
        if (/^(wire|exposed_comm_share|step_beyond_ws1_share)-/.test(group.id)) {
          const path = group.querySelector('path');
          found.bars.push({svg: index, id: group.id, fill: getComputedStyle(path).fill, box: box(path)});
        }
        if (group.id.startsWith('loss-deviation-'))
          found.deviation.push({svg: index, id: group.id, markers: [...group.querySelectorAll('use')].map(box)});
      });
      svg.querySelectorAll('text').forEach(text => found.texts.push({svg: index, text: text.textContent}));
    });
    found.busbw = document.querySelector('#busbw').innerText;
    found.losses = document.querySelector('#losses').innerText;
    out.textContent = JSON.stringify(found);
  } catch (error) {
    out.textContent = JSON.stringify({error: String(error)});
  }
})();
</script>"""


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fresh")
    write_report([REFERENCE / "full.jsonl"], folder)
    return _measured_in_chromium(folder, FRESH_MEASURE)


def _rgb(colour: str) -> str:
    red, green, blue = (round(255 * c) for c in matplotlib.colors.to_rgb(colour))
    return f"rgb({red}, {green}, {blue})"


def test_the_exposed_bars_are_drawn_in_none_of_the_collectives_colours(fresh):
    # They were all in tab:purple, the colour the figure's one legend gives `send`; the bytes panel takes its
    # collectives' colours from the property cycle, so none of the exposed bars may take one of those.
    found, _ = fresh
    wire = {bar["fill"] for bar in found["bars"] if bar["id"].startswith("wire-")}
    exposed = {bar["fill"] for bar in found["bars"] if bar["id"].startswith("exposed_comm_share-")}
    beyond = {bar["fill"] for bar in found["bars"] if bar["id"].startswith("step_beyond_ws1_share-")}
    cycle = {_rgb(c) for c in matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]}
    assert len(wire) == 3 and wire <= cycle                     # all_gather, all_reduce, reduce_scatter
    assert len(exposed) == 1 and len(beyond) == 1 and exposed != beyond
    assert not (exposed | beyond) & cycle
    # Six cells at 2 ranks, each with both figures, every bar laid out with a height.
    assert sum(bar["id"].startswith(("exposed", "step_beyond")) and bar["box"][3] > bar["box"][1]
               for bar in found["bars"]) == 12
    legend = {t["text"] for t in found["texts"]}
    assert {"step beyond the compute-only pass (exposed communication)",
            "step beyond the strategy's own world-size-1 step"} <= legend


def test_no_plot_claims_hatching_that_is_not_there(fresh):
    # The exposed plot's title said "hatched: a bound"; no baseline of these rows is a bound, nothing is hatched.
    found, dom = fresh
    assert not [t for t in found["texts"] if "hatch" in t["text"].lower()]
    assert "url(#h" not in dom


def test_the_empty_bus_bandwidth_section_says_how_to_fill_it(fresh):
    found, _ = fresh
    assert "No rows with these figures" not in found["busbw"]
    assert "python -m harness comm --world-size 2 --device cpu --out results/comm.jsonl" in found["busbw"]
    assert f"python -m harness report {REFERENCE / 'full.jsonl'} results/comm.jsonl" in found["busbw"]


def test_the_loss_section_shows_each_cell_s_deviation_against_the_tolerance(fresh):
    # Twelve cells held against the plain loop, each with a marker at each of parity's four steps. ddp at 2
    # ranks, step 0, by hand: |l0 - r0| / r0 over fp32's tolerance of 1e-6.
    found, dom = fresh
    assert len(found["deviation"]) == 12 and all(len(series["markers"]) == 4 for series in found["deviation"])
    rows = [json.loads(line) for line in (REFERENCE / "full.jsonl").read_text().splitlines()]
    losses = {(r["spec"]["strategy"], r["spec"]["world_size"]): r["measurements"]["loss_per_step"] for r in rows}
    (l0, r0) = losses[("ddp", 2)][0], losses[("plain", 1)][0]
    expected = abs(l0 - r0) / abs(r0) / 1e-6
    assert 0.01 < expected < 1
    [svg] = [s for s in svg_plots.svgs(dom[dom.index('id="losses"'):]) if svg_plots.find(s, "loss-deviation-ddp-ws2")]
    series = svg_plots.find(svg, "loss-deviation-ddp-ws2")
    y = svg_plots.mapping(svg_plots.ticks(svg_plots.axes_holding(svg, series), "y"))
    assert y(svg_plots.marker_positions(series)[0][1]) == pytest.approx(expected, abs=0.01)
    assert "parity tolerance (above: a mismatch)" in {t["text"] for t in found["texts"]}
    assert "in units of the tolerance" in found["losses"]
