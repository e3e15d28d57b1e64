"""What a compiled program communicates: its collectives read from the HLO text, and the bytes that cross hosts.

``collectives(compiled.as_text())`` lists every all-reduce, all-gather, reduce-scatter, all-to-all and
collective-permute with its per-device result bytes, its device groups (logical device ids: position ``i``
in the program's device assignment, ``mesh.devices.flat[i]`` for a jit over ``mesh``) and how many times one
run of the program executes it (inside while loops of known trip count: the product of the counts).
``cross_host_bytes`` prices one execution against a host assignment.
"""

from __future__ import annotations

import collections
import math
import os
import re
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8}
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
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


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    """``({name: instruction lines}, entry name)``."""
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
            bodies[current].append(line)
    return bodies, entry


def _executions(bodies: dict[str, list[str]], entry: str | None) -> dict[str, int]:
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


def _arrays(shape: str) -> list[tuple[str, int]]:
    """``(dtype, elements)`` of every array in an HLO shape (one array or a tuple)."""
    return [(dtype, math.prod(int(d) for d in dims.split(",") if d)) for dtype, dims in _SHAPE.findall(shape)]


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective instruction of a compiled program's HLO text, in program order."""
    bodies, entry = _computations(hlo_text)
    executions = _executions(bodies, entry)
    found = []
    for name, lines in bodies.items() if bodies else [(None, hlo_text.splitlines())]:
        for line in lines:
            match = _OP.search(line)
            if not match:
                continue
            shapes = _arrays(match.group(1))
            pairs = _PAIRS.search(line)
            found.append(Collective(op=match.group(2), largest=max((n for _, n in shapes), default=1),
                                    result_bytes=sum(n * _BYTES[dtype] for dtype, n in shapes), groups=_groups(line),
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


class Kernel(NamedTuple):
    """One instruction that the GPU runs as its own kernel (or library call): ``kind`` (``KERNEL_KINDS``), its
    name, the dtype and bytes of its (first) result, how many times one run executes it, for library calls
    what was called (cuDNN target and layout), the bytes it reads and writes per execution, and the JAX
    operation it came from (``origins``).

    ``moved_bytes`` is what a memory-bound kernel reads and writes: a fusion's parameters whole or what its
    slices and gathers take of them, its result whole or, updated in place, the update; other kernels their
    operands and results whole."""

    kind: str
    name: str
    dtype: str
    result_bytes: int
    count: int
    detail: str = ""
    moved_bytes: int = 0
    origin: str = ""


KERNEL_KINDS = ("cuDNN convolution", "GEMM", "fusion", "copy/transpose", "collective", "sort", "other")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\([^=]*?\)|\S+)\s+([\w\-]+)\(")
_NOT_KERNELS = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional", "call",
                "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "copy-start",
                "copy-done", "send-done", "recv-done"}
_SCHEDULED = re.compile(r"\b(body|condition|branch_computations|true_computation|false_computation)="
                        r"(\{[^}]*\}|%?[\w.\-]+)")


def _scheduled(bodies: dict[str, list[str]], entry: str | None) -> list[str]:
    """The computations whose instructions run as kernels: the entry and the bodies of its loops and branches
    (not fusion bodies or reducers)."""
    seen, todo = [], [entry] if entry else list(bodies)
    while todo:
        name = todo.pop()
        if name in seen or name not in bodies:
            continue
        seen.append(name)
        for line in bodies[name]:
            for _, called in _SCHEDULED.findall(line):
                todo += re.findall(r"[\w.\-]+", called)
    return seen


def _kernel_kind(op: str, name: str, line: str) -> str:
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]*)"', line)
        target = target.group(1) if target else ""
        return ("cuDNN convolution" if target.startswith("__cudnn$conv") else
                "GEMM" if "gemm" in target or "matmul" in target or "cublas" in target else
                "sort" if "sort" in target.lower() else "other")
    if op == "fusion":
        if re.search(r'"kind":"(__triton_gemm|__triton_nested_gemm_fusion|__cudnn\$fusion|__cublas)', line):
            return "GEMM"
        return "copy/transpose" if re.search(r"transpose|^copy", name) else "fusion"
    if op.removesuffix("-start") in COLLECTIVES:
        return "collective"
    return {"copy": "copy/transpose", "transpose": "copy/transpose", "sort": "sort"}.get(op, "other")


def _bytes(shape: str) -> int:
    """Bytes of every array in an HLO shape (one array or a tuple)."""
    return sum(n * _BYTES.get(dtype, 0) for dtype, n in _arrays(shape))


def _operands(line: str, start: int) -> list[str]:
    """Names of the operands of the instruction ``line`` whose argument list opens at ``start``."""
    depth = 1
    for end in range(start, len(line)):
        depth += {"(": 1, ")": -1}.get(line[end], 0)
        if depth == 0:
            return re.findall(r"%([\w.\-]+)", line[start:end])
    return []


_PARTIAL_READS = ("slice", "dynamic-slice", "gather")
_IN_PLACE = {"scatter": 2, "dynamic-update-slice": 1}  # an op that updates its operand 0 → its update's operand


def _fusion_moved(body: list[str], result_shape: str) -> int:
    """Bytes a fusion reads and writes: each parameter whole, or only what its slices and gathers take (through
    bitcasts and conversions); the result whole, or, where the fusion scatters into (or updates a slice of) a
    parameter in place, just the update."""
    shapes, users, params, root = {}, collections.defaultdict(list), [], None
    for line in body:
        if not (match := _INSTRUCTION.match(line)):
            continue
        name, shape, op = match.groups()
        operands = _operands(line, match.end())
        shapes[name] = shape
        for operand in operands:
            users[operand].append((name, op, shape, operands))
        params += [name] * (op == "parameter")
        root = (op, operands) if line.lstrip().startswith("ROOT") else root

    def read(name: str) -> int:
        whole, taken = _bytes(shapes[name]), 0
        if not users[name]:
            return whole
        for user, op, shape, operands in users[name]:
            if op in ("bitcast", "convert"):  # element for element: the part of it read, in this one's dtype
                taken += read(user) * whole // max(_bytes(shape), 1)
            elif op in _PARTIAL_READS and operands[0] == name:
                taken += _bytes(shape)
            else:
                return whole
        return min(taken, whole)

    written, in_place = _bytes(result_shape), None
    if root and root[0] in _IN_PLACE and root[1][0] in params:
        in_place, written = root[1][0], _bytes(shapes.get(root[1][_IN_PLACE[root[0]]], ""))
    return written + sum(read(p) for p in params if p != in_place)


def origins(hlo_text: str) -> dict[str, str]:
    """Each HLO instruction's JAX origin from its metadata: ``name → "op_name (file:line)"``. The source line is
    written inline (``source_file=… source_line=…``) or, in newer XLA, as a ``stack_frame_id`` into the module's
    ``FileNames`` / ``FileLocations`` / ``StackFrames`` tables."""

    def table(section):  # id → the rest of its line
        body = re.search(rf"^{section}\n(.*?)(?:\n\n|\Z)", hlo_text, re.S | re.M)
        return dict(line.split(" ", 1) for line in body.group(1).splitlines()) if body else {}

    files, locations, frames = table("FileNames"), table("FileLocations"), table("StackFrames")
    field = lambda text, key: re.search(rf"{key}=(\d+)", text).group(1)

    def frame(frame_id):
        location = locations[field(frames[frame_id], "file_location_id")]
        return os.path.basename(files[field(location, "file_name_id")].strip('"')), field(location, "line")

    found = {}
    for m in re.finditer(r'^\s*(?:ROOT )?%?([\w.-]+) = .*?metadata=\{op_name="([^"]*)"([^}]*)\}', hlo_text, re.M):
        name, op, rest = m.groups()
        inline = re.search(r'source_file="([^"]*)" source_line=(\d+)', rest)
        frame_id = re.search(r"stack_frame_id=(\d+)", rest)
        where = ((os.path.basename(inline.group(1)), inline.group(2)) if inline
                 else frame(frame_id.group(1)) if frame_id and frame_id.group(1) in frames else None)
        found[name] = f"{op} ({where[0]}:{where[1]})" if where else op
    return found


def kernels(hlo_text: str) -> list[Kernel]:
    """Every kernel of a compiled GPU program's HLO text (instructions of the scheduled computations that launch
    work; control flow, tuples, bitcasts and async ``-done`` halves left out), with its execution count."""
    bodies, entry = _computations(hlo_text)
    executions, origin = _executions(bodies, entry), origins(hlo_text)
    found = []
    for computation in _scheduled(bodies, entry):
        shapes = {}
        for line in bodies[computation]:
            match = _INSTRUCTION.match(line)
            if match:
                shapes[match.group(1)] = match.group(2)
            if not match or match.group(3) in _NOT_KERNELS or match.group(3).endswith("-done"):
                continue
            name, shape, op = match.groups()
            dtype, elements = (_arrays(shape) or [("", 0)])[0]
            size = elements * _BYTES.get(dtype, 0)
            detail = " ".join(m.group(1) for m in (re.search(r'custom_call_target="([^"]*)"', line),
                                                    re.search(r"dim_labels=([^,]+)", line)) if m)
            fused = re.search(r"calls=%?([\w.\-]+)", line) if op == "fusion" else None
            moved = (_fusion_moved(bodies[fused.group(1)], shape) if fused and fused.group(1) in bodies else
                     _bytes(shape) + sum(_bytes(shapes.get(o, "")) for o in _operands(line, match.end())))
            found.append(Kernel(_kernel_kind(op, name, line), name, dtype, size, executions.get(computation, 1),
                                detail, moved, origin.get(name, "")))
    return found
