"""The code blocks of the docs that tests run, so that a worked example which stops working fails a test.

A block is marked by a comment line right above its opening fence, invisible where the Markdown is rendered:

    <!-- tested: hand_allreduce.py -->
    ```python
    ...
    ```
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- tested: "
MARKED_BLOCK = re.compile(r"^<!-- tested: (?P<name>[^>]+?) -->\n```[\w-]*\n(?P<code>.*?)^```$", re.M | re.S)


def marked_blocks(doc: str) -> dict[str, str]:
    """{name: code} of every marked block of `doc` (a path from the repository root)."""
    text = (ROOT / doc).read_text()
    blocks: dict[str, str] = {}
    for match in MARKED_BLOCK.finditer(text):
        if match["name"] in blocks:
            raise ValueError(f"{doc}: two blocks are marked {match['name']!r}")
        blocks[match["name"]] = match["code"]
    markers = len(re.findall(f"^{MARKER}", text, re.M))    # a marker starts its line; prose may quote one
    if len(blocks) != markers:     # a marker whose fence moved away would silently test nothing
        raise ValueError(f"{doc}: {markers} markers but {len(blocks)} marked blocks; a marker must sit on the line "
                         "right above its block's opening fence")
    return blocks


def code_block(doc: str, name: str) -> str:
    blocks = marked_blocks(doc)
    if name not in blocks:
        raise KeyError(f"{doc} has no block marked {MARKER}{name} -->; marked: {', '.join(blocks) or 'none'}")
    return blocks[name]


def load_module(path: Path) -> ModuleType:
    """Import a Python file saved from a doc block, as the strategy registry imports PARBENCH_EXTRA_STRATEGIES
    files."""
    spec = importlib.util.spec_from_file_location(f"parbench_doc_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module     # before it runs: its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module
