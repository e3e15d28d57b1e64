"""Every measured figure in README.md comes from a raw file: docs/measurements/README.md maps each one to the JSON it
is read from, and this recomputes it.

A figure is an img/s count (``5,477 img/s``), a ratio (``3.6×``), a class count with a decimal (``18.6M classes``) or
a memory size (``75.0 GiB``, read from bytes).
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MEASUREMENTS = ROOT / "docs" / "measurements"
FIGURES = [re.compile(r"(?<![\w.,])(\d[\d,]*(?:\.\d+)?) img/s"), re.compile(r"(?<![\w.,])(\d+(?:\.\d+)?×)"),
           re.compile(r"(?<![\w.,])(\d+\.\d+M) classes"), re.compile(r"(?<![\w.,])(\d+(?:\.\d+)? GiB)")]
ROW = re.compile(r"^\| (\d[\d,.]*(?:[×M]| GiB)?) \| [^|]+ \| `([^`]+)` \|$")


def readme_figures(text: str) -> set[str]:
    """The figures a text states, as written (``"5,477"``, ``"3.6×"``, ``"18.6M"``, ``"75.0 GiB"``)."""
    text = " ".join(text.split())  # a figure and its unit may be wrapped onto two lines
    return {m.group(1) for pattern in FIGURES for m in pattern.finditer(text)}


def table() -> dict[str, str]:
    """``{figure: source}`` from the table of docs/measurements/README.md."""
    rows = [ROW.match(line) for line in (MEASUREMENTS / "README.md").read_text().splitlines()]
    return {m.group(1): m.group(2) for m in rows if m}


def value(source: str) -> float:
    """``FILE:KEY.PATH`` read from its JSON under docs/measurements/, or ``A / B`` of two such."""
    if " / " in source:
        numerator, denominator = source.split(" / ")
        return value(numerator) / value(denominator)
    file, path = source.split(":")
    item = json.loads((MEASUREMENTS / file).read_text())
    for key in path.split("."):
        item = item[int(key)] if isinstance(item, list) else item[key]
    return float(item)


def as_written(number: float, figure: str) -> str:
    """``number`` rounded and formatted as ``figure`` is: its decimals, thousands commas, a ``×``, ``M`` or `` GiB``
    (``number`` then in bytes)."""
    suffix = " GiB" if figure.endswith(" GiB") else figure[-1] if figure[-1] in "×M" else ""
    digits = figure.removesuffix(suffix).replace(",", "")
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    scaled = number / {"M": 1e6, " GiB": 2**30}.get(suffix, 1)
    return f"{scaled:{',' if ',' in figure else ''}.{decimals}f}{suffix}"


def test_every_readme_figure_has_a_row_and_every_row_a_figure():
    stated, mapped = readme_figures((ROOT / "README.md").read_text()), set(table())
    assert stated, "no figure found in README.md: the patterns no longer match its text"
    assert not stated - mapped, f"README.md states figures with no raw file in docs/measurements/README.md: " \
                                f"{sorted(stated - mapped)}"
    assert not mapped - stated, f"docs/measurements/README.md maps figures README.md no longer states: " \
                                f"{sorted(mapped - stated)}"


@pytest.mark.parametrize("figure", sorted(table()))
def test_each_figure_is_its_raw_file_rounded(figure):
    source = table()[figure]
    assert as_written(value(source), figure) == figure, f"{figure} in README.md, but {source} gives {value(source)}"


def test_the_figures_and_their_rounding_are_read_as_written():
    text = "ran 5,477 img/s at\nbatch 128 and 540 img/s (3.6× and 10×), 18.6M classes; 8M classes, 89.5M px, 75.0\nGiB"
    assert readme_figures(text) == {"5,477", "540", "3.6×", "10×", "18.6M", "75.0 GiB"}
    written = [(5476.6, "5,477"), (539.6, "540"), (3.61, "3.6×"), (18_641_000, "18.6M"), (80_552_201_728, "75.0 GiB")]
    assert [as_written(v, f) for v, f in written] == [f for _, f in written]
    assert as_written(5474.4, "5,477") != "5,477" and as_written(3.66, "3.6×") != "3.6×"
