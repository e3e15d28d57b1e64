"""What a compiled program communicates: its collectives read from the HLO text, and the bytes that cross hosts.

``collectives(compiled.as_text())`` lists every all-reduce, all-gather, reduce-scatter, all-to-all and
collective-permute with its per-device result bytes, its device groups (logical device ids: position ``i``
in the program's device assignment, ``mesh.devices.flat[i]`` for a jit over ``mesh``) and how many times one
run of the program executes it (inside while loops of known trip count: the product of the counts).
``cross_host_bytes`` prices one execution against a host assignment.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8}
_SHAPE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([0-9,]*)\]")
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[0-9,]*\},?)*)\}")
# XLA's mesh form: replica_groups=mesh['a'=2,'b'=4] {'b'} (optionally ", device_ids=(…)" after the axes, and
# sub-axes 'b':(pre)size in the braces): devices in one group differ only along the axes in braces
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((.*?)\))? \{([^}]*)\}")


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(r"\b(body|condition|to_apply|calls|branch_computations|true_computation|false_computation)="
                     r"(\{[^}]*\}|%?[\w.\-]+)")
_TRIP_COUNT = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


class Collective(NamedTuple):
    """One collective instruction: ``op``, elements of its largest result array, bytes of its results (per
    device), its device groups (``()``: every device is one group), for collective-permute its pairs, and
    ``count``, the times one run executes it."""

    op: str
    largest: int
    result_bytes: int
    groups: tuple[tuple[int, ...], ...]
    pairs: tuple[tuple[int, int], ...] = ()
    count: int = 1


_INDEX_COMMENT = re.compile(r"/\*index=\d+\*/")  # XLA marks every fifth element of a long tuple shape


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    """``({name: instruction lines}, entry name)``; the lines without XLA's ``/*index=N*/`` marks in tuples."""
    bodies, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        if current is None:
            if (match := _COMPUTATION.match(line)) and not line.startswith("HloModule"):
                current = match.group(1)
                bodies[current] = []
                entry = current if line.startswith("ENTRY") else entry
        elif line.strip() == "}":
            current = None
        else:
            bodies[current].append(_INDEX_COMMENT.sub("", line))
    return bodies, entry


def execution_counts(bodies: dict[str, list[str]], entry: str | None) -> dict[str, int]:
    """Times one run executes each computation: a while body or condition its trip count times per execution
    of the instruction (once when the count is unknown), every other called computation once."""
    counts = dict.fromkeys(bodies, 0)
    if entry is None:
        return dict.fromkeys(bodies, 1)

    def visit(name: str, times: int) -> None:
        counts[name] += times
        for line in bodies.get(name, ()):
            trip = _TRIP_COUNT.search(line)
            for kind, called in _CALLED.findall(line):
                repeat = int(trip.group(1)) if trip and kind in ("body", "condition") else 1
                for callee in re.findall(r"[\w.\-]+", called):
                    if callee in bodies and callee != name:
                        visit(callee, times * repeat)

    visit(entry, 1)
    return counts


def _int_lists(text: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(v) for v in group.split(",") if v) for group in re.findall(r"\{([0-9,]*)\}", text))


def _iota(shape: list[int], dims: list[int], perm: list[int] | None) -> np.ndarray:
    """XLA's iota tile assignment ``[shape]<=[dims]T(perm)``: iota(dims), transposed by ``perm``, reshaped."""
    ids = np.arange(math.prod(dims)).reshape(dims)
    return (ids.transpose(perm) if perm else ids).reshape(shape)


def _ints(text: str | None) -> list[int] | None:
    return [int(v) for v in text.split(",") if v] if text else None


def _mesh_groups(axes: str, device_ids: str | None, grouped: str) -> tuple[tuple[int, ...], ...]:
    """Groups of the mesh form: ``axes`` ``'name'=size,…``, ``device_ids`` the mesh's ids (iota when absent),
    ``grouped`` the axes (or sub-axes ``'name':(pre)size``) that vary within a group."""
    names, sizes = zip(*((name, int(size)) for name, size in re.findall(r"'([^']*)'=(\d+)", axes)))
    if device_ids is None:
        ids = np.arange(math.prod(sizes)).reshape(sizes)
    elif match := re.fullmatch(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", device_ids.strip()):
        ids = _iota(list(sizes), _ints(match.group(2)), _ints(match.group(3)))
    else:
        ids = np.array(_ints(re.sub(r"[^0-9,]", "", device_ids))).reshape(sizes)
    # per mesh axis, the part of a coordinate that varies within a group: (pre, size) of coordinate // pre % size
    varying = {names.index(n): (int(pre or 1), int(size) if size else sizes[names.index(n)])
               for n, pre, size in re.findall(r"'([^']*)'(?::\((\d+)\)(\d+))?", grouped)}
    groups = {}
    for coordinate in np.ndindex(*sizes):
        key = tuple(c - (c // varying[a][0] % varying[a][1]) * varying[a][0] if a in varying else c
                    for a, c in enumerate(coordinate))
        groups.setdefault(key, []).append(int(ids[coordinate]))
    return tuple(tuple(g) for g in groups.values())


def _groups(line: str) -> tuple[tuple[int, ...], ...]:
    """A collective's device groups; ``()`` for ``replica_groups={}`` (every device one group)."""
    if match := _MESH_GROUPS.search(line):
        return _mesh_groups(*match.groups())
    if match := _IOTA_GROUPS.search(line):  # [G,S]<=[dims]T(perm): iota(dims), transposed, reshaped to G × S
        ids = _iota(_ints(match.group(1)), _ints(match.group(2)), _ints(match.group(3)))
        return tuple(tuple(int(i) for i in row) for row in ids)
    if match := _EXPLICIT_GROUPS.search(line):
        return tuple(g for g in _int_lists(match.group(1)) if g)
    if "replica_groups=" in line:
        raise ValueError(f"unrecognised replica_groups syntax in: {line.strip()[:200]}")
    return ()


def arrays(shape: str) -> list[tuple[str, int]]:
    """``(dtype, elements)`` of every array in an HLO shape (one array or a tuple)."""
    return [(dtype, math.prod(int(d) for d in dims.split(",") if d)) for dtype, dims in _SHAPE.findall(shape)]


def top_level(shape: str) -> list[str]:
    """The elements of a tuple shape ``(a, (b, c), d)`` → ``["a", "(b, c)", "d"]``; an array's shape alone."""
    shape = shape.strip()
    if not shape.startswith("("):
        return [shape]
    elements, depth, start = [], 0, 1
    for i, char in enumerate(shape):  # dimensions [a,b] and layouts {1,0} nest as tuples do
        depth += (char in "([{") - (char in ")]}")
        if (char == "," and depth == 1) or (char == ")" and depth == 0):
            elements.append(shape[start:i].strip())
            start = i + 1
    return elements


def _results(op_shape: str, asynchronous: bool, op: str) -> str:
    """The results of a collective from its shape: an asynchronous start's shape also holds its operands first
    (``all-gather-start``: ``(operand, result)``, ``reduce-scatter-start``: ``((operands), result)``,
    ``collective-permute-start``: ``(operand, result, u32[], u32[])``), except ``all-reduce-start``'s."""
    if not asynchronous or op == "all-reduce" or not op_shape.strip().startswith("("):
        return op_shape
    return ", ".join(e for e in top_level(op_shape)[1:] if e.split("{")[0] != "u32[]")


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective instruction of a compiled program's HLO text, in program order."""
    bodies, entry = computations(hlo_text)
    executions = execution_counts(bodies, entry)
    found = []
    for name, lines in bodies.items() if bodies else [(None, hlo_text.splitlines())]:
        for line in lines:
            match = _OP.search(line)
            if not match:
                continue
            shapes = arrays(_results(match.group(1), match.group(3) is not None, match.group(2)))
            pairs = _PAIRS.search(line)
            found.append(Collective(op=match.group(2), largest=max((n for _, n in shapes), default=1),
                                    result_bytes=sum(n * DTYPE_BYTES[dtype] for dtype, n in shapes),
                                    groups=_groups(line),
                                    pairs=_int_lists(pairs.group(1)) if pairs else (),
                                    count=executions.get(name, 1)))
    return found


def cross_host_bytes(c: Collective, hosts: Sequence[int]) -> list[int]:
    """Bytes each host receives from other hosts for ``c``, ``hosts[i]`` being the host of logical device ``i``.

    The model is a host-aware (hierarchical) algorithm, the least any implementation must move: data is
    combined within a host before it crosses, and a host receives each remote byte it needs once. With
    ``k`` devices in a group on ``H`` hosts, ``g`` of them on this host, and ``N`` the bytes per device:
    all-gather ``(k − g)·N/k``; reduce-scatter (``N`` the input, ``k·result``) ``g·(H − 1)·N/k``;
    all-reduce both; all-to-all ``g·(k − g)·N/k``; collective-permute the bytes of every pair that arrives
    from another host. A flat ring over all devices (NCCL's default) moves up to ``≈ 2N`` per host for
    an all-reduce instead of ``2N·(H − 1)/H``.
    """
    received = [0] * (max(hosts) + 1)
    if c.op == "collective-permute":
        for source, target in c.pairs:
            if hosts[source] != hosts[target]:
                received[hosts[target]] += c.result_bytes
        return received
    for group in c.groups or (tuple(range(len(hosts))),):
        k, members = len(group), [hosts[d] for d in group]
        spanned = len(set(members))
        n = c.result_bytes * k if c.op == "reduce-scatter" else c.result_bytes  # N of the docstring
        for host in set(members):
            g = members.count(host)
            if c.op == "all-gather":
                received[host] += (k - g) * n // k
            elif c.op == "reduce-scatter":
                received[host] += g * (spanned - 1) * n // k
            elif c.op == "all-reduce":
                received[host] += g * (spanned - 1) * n // k + (k - g) * n // k
            else:  # all-to-all
                received[host] += g * (k - g) * n // k
    return received
