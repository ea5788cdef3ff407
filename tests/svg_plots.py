"""Reading the report's inline SVG plots back into data coordinates, independently of the code that drew them.

An axes' ticks give the mapping: each tick mark's pixel position and its label's text (the report keeps
text as text). Elements the report names (`gid`) are found by id: a filled band's path vertices, a marker
series' positions.
"""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET

SVG = "{http://www.w3.org/2000/svg}"
XLINK = "{http://www.w3.org/1999/xlink}"


def svgs(page: str) -> list[ET.Element]:
    return [ET.fromstring(text) for text in re.findall(r"<svg\b.*?</svg>", page, flags=re.DOTALL)]


def find(root: ET.Element, gid: str) -> ET.Element | None:
    return next((element for element in root.iter() if element.get("id") == gid), None)


def axes_holding(root: ET.Element, element: ET.Element) -> ET.Element:
    for group in root.iter(f"{SVG}g"):
        if (group.get("id") or "").startswith("axes_") and any(e is element for e in group.iter()):
            return group
    raise AssertionError("element is not inside any axes")


def ticks(axes: ET.Element, axis: str) -> list[tuple[float, float]]:
    """(pixel, value) of each labelled tick of the "x" or "y" axis."""
    found = []
    for tick in axes.iter(f"{SVG}g"):
        if not re.fullmatch(f"{axis}tick_\\d+", tick.get("id") or ""):
            continue
        mark = next(tick.iter(f"{SVG}use"))
        text = "".join(next(tick.iter(f"{SVG}text")).itertext()).strip().replace("\u2212", "-")
        if text:
            found.append((float(mark.get(axis)), float(text)))
    return found


def mapping(pairs: list[tuple[float, float]], log2: bool = False):
    """pixel -> value, from the first and last tick (linear in the value, or in log2 of it)."""
    (p0, v0), (p1, v1) = pairs[0], pairs[-1]
    scale = math.log2 if log2 else (lambda v: v)
    slope = (scale(v1) - scale(v0)) / (p1 - p0)
    if log2:
        return lambda p: 2 ** (scale(v0) + (p - p0) * slope)
    return lambda p: v0 + (p - p0) * slope


def path_vertices(group: ET.Element) -> list[tuple[float, float]]:
    """The vertices of the group's path in the picture's pixels: a collection (a filled band) writes its
    path once under <defs> and places it with a <use x= y=>, whose offset is added."""
    path = next(group.iter(f"{SVG}path"))
    numbers = [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", path.get("d"))]
    dx = dy = 0.0
    use = next((u for u in group.iter(f"{SVG}use") if u.get(f"{XLINK}href") == f"#{path.get('id')}"), None)
    if use is not None:
        dx, dy = float(use.get("x", 0)), float(use.get("y", 0))
    return [(x + dx, y + dy) for x, y in zip(numbers[0::2], numbers[1::2])]


def marker_positions(group: ET.Element) -> list[tuple[float, float]]:
    return [(float(use.get("x")), float(use.get("y"))) for use in group.iter(f"{SVG}use")]
