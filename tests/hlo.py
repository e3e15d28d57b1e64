"""Read the collectives out of compiled HLO text."""

import math
import re

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter", "collective-permute")
_SHAPE = re.compile(r"\b(?:pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64)\[([0-9,]*)\]")
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def collectives(hlo_text: str) -> list[tuple[str, int]]:
    """``(op, largest array elements among its result shapes)`` for every collective instruction."""
    found = []
    for line in hlo_text.splitlines():
        match = _OP.search(line)
        if not match:
            continue
        sizes = [math.prod(int(d) for d in dims.split(",") if d) for dims in _SHAPE.findall(match.group(1))]
        found.append((match.group(2), max(sizes, default=1)))
    return found
