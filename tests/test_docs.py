"""The README and docs/ hold together: every relative link and anchor resolves, the README's first screen
answers first, and every doc block marked as tested is run by a test."""

from __future__ import annotations

import re
from pathlib import Path

from doc_blocks import MARKER, ROOT, marked_blocks

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCED = re.compile(r"^```.*?^```$", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *$", re.M)
SCREEN = 40     # lines a reader sees before scrolling


def prose(page: Path) -> str:
    """The page without its code blocks: a `#` comment in a shell block is no heading, a link there no link."""
    return FENCED.sub("", page.read_text())


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than - and _ dropped, spaces made -, and
    -1, -2, ... added to repeats."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(prose(page)):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z]+:", target):          # https:, mailto: are not checked offline
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target} (no heading with that anchor)")
    return broken


def test_the_anchor_rule_matches_githubs_on_headings_with_code_and_punctuation(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Calibration from `harness comm` rows\n## Projecting a step: `python -m harness project`\n"
                    "## Notes\n## Notes\n```sh\n# not a heading\n```\n")
    assert anchors(page) == {"calibration-from-harness-comm-rows", "projecting-a-step-python--m-harness-project",
                             "notes", "notes-1"}


def test_a_broken_link_or_anchor_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Top\n[ok](#top) [gone](missing.md) [bad anchor](#bottom) [web](https://example.org)\n")
    assert broken_links(page) == ["missing.md (no such file)", "#bottom (no heading with that anchor)"]


def test_every_relative_link_and_anchor_in_the_readme_and_docs_resolves():
    broken = {page.relative_to(ROOT).as_posix(): broken_links(page) for page in PAGES}
    assert not {page: links for page, links in broken.items() if links}


def test_the_readme_shows_the_command_what_it_prints_and_the_report_within_one_screen():
    screen = "\n".join((ROOT / "README.md").read_text().splitlines()[:SCREEN])
    assert "make run" in screen and "python -m harness run --matrix full" in screen
    assert re.search(r"^gpt-tiny/ddp/ws2/\S+ +ok ", screen, re.M), "the smoke run's printed DDP row"
    assert "![" in screen and "](docs/report.png)" in screen


def test_the_readme_stays_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) < 150


def test_every_block_marked_tested_is_named_by_a_test():
    tests = "".join(path.read_text() for path in (ROOT / "tests").glob("test_*.py"))
    for page in PAGES:
        doc = page.relative_to(ROOT).as_posix()
        for name in marked_blocks(doc):
            assert f'"{name}"' in tests, f"{doc}: the block {MARKER}{name} --> is run by no test"
