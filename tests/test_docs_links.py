"""Every relative link in README.md, docs/ and notebooks' markdown reaches a file of the repository and, where it names
a section (``file.md#section``), a heading of that file, slugged as GitHub slugs them."""

import functools
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)")  # [text](target), [text](<target>), [text](target "title")


def prose(text: str) -> str:
    """``text`` without its fenced code blocks and inline code spans, where nothing is a link."""
    text = re.sub(r"^[ \t]*```.*?^[ \t]*```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to
    hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache  # a file's anchors, read once however many links point into it
def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings (a repeated heading's get ``-1``, ``-2``, … as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        if in_code or not (m := re.match(r"#{1,6} (.+)", line)):
            continue
        base = slug(m.group(1))
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return found


def markdown_of_notebooks() -> list[tuple[str, str]]:
    return [(f"{path.relative_to(ROOT)} cell {i}", "".join(cell["source"]))
            for path in sorted((ROOT / "notebooks").glob("*.ipynb"))
            for i, cell in enumerate(json.loads(path.read_text())["cells"]) if cell["cell_type"] == "markdown"]


def test_links_are_found_as_markdown_writes_them_and_not_in_code():
    text = 'a [b](x.md#c) [d](<y.md>) [e](z.md "title") `[f](in-code.md)`\n```\n[g](in-block.md)\n```\n'
    assert LINK.findall(prose(text)) == ["x.md#c", "y.md", "z.md"]


def test_slugs_follow_githubs_rule():
    assert slug("One H100, the fourth lease (2026-11-27)") == "one-h100-the-fourth-lease-2026-11-27"
    assert slug("XLA:GPU plans, compiled for H100s without a GPU") == "xlagpu-plans-compiled-for-h100s-without-a-gpu"
    assert slug("The FC path's bytes per sampled row") == "the-fc-paths-bytes-per-sampled-row"
    assert slug("Compact FC storage and accuracy") == "compact-fc-storage-and-accuracy"
    assert slug("One-byte momentum (`fc_state_dtype=int8`)") == "one-byte-momentum-fc_state_dtypeint8"


@pytest.mark.parametrize("where,text,base,own", [(str(p.relative_to(ROOT)), p.read_text(), p.parent, p)
                                                 for p in DOCUMENTS]
                         + [(name, text, ROOT / "notebooks", None) for name, text in markdown_of_notebooks()],
                         ids=lambda v: v if isinstance(v, str) and len(v) < 60 else "")
def test_every_relative_link_reaches_its_file_and_section(where, text, base, own):
    """(A notebook's sections are not read: a link to one of its own would fail as having none.)"""
    broken = []
    for target in LINK.findall(prose(text)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, section = target.partition("#")
        path = (base / file).resolve() if file else own
        if path is None or not path.exists():
            broken.append(f"{target}: no such file")
        elif section and path.suffix == ".md" and section not in anchors(path):
            broken.append(f"{target}: no such section")
    assert not broken, f"{where}: {broken}"
