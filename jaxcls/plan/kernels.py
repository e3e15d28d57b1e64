"""A compiled program's kernels, for profiling without a profiler: what each launches, of which kind, how many
bytes it reads and writes, and the JAX source line it came from (``kernels(compiled.as_text())``, ``origins``).
"""

from __future__ import annotations

import collections
import os
import re
from typing import NamedTuple

from jaxcls.plan.hlo import COLLECTIVES, DTYPE_BYTES, arrays, computations, execution_counts


class Kernel(NamedTuple):
    """One instruction that the GPU runs as its own kernel (or library call): ``kind`` (``KERNEL_KINDS``), its
    name, the dtype and bytes of its (first) result, how many times one run executes it, for library calls
    what was called (cuDNN target, layout and any ``feature_group_count``), the bytes it reads and writes per
    execution, the JAX operation it came from (``origins``), and ``(dtype, elements)`` of each of its results
    (``jaxcls.plan.hlo.arrays``: a multi-output fusion's all).

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
    results: tuple[tuple[str, int], ...] = ()


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
    return sum(n * DTYPE_BYTES.get(dtype, 0) for dtype, n in arrays(shape))


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


def _rows_kernel_moved(line: str, operands: list[str], result_shape: str) -> int:
    """Bytes of one of jaxcls's Pallas row kernels (``jaxcls.losses.rows_stats``, ``rows_backward``): of each array it
    indexes (an operand with more rows than its index, operand 0, or one that its outputs alias) only the index's
    rows, read once and, where aliased, written once; its other operands and results whole. (The statistics and the
    embeddings' gradient read a block of rows once per block of the batch, side by side: counted once, as XLA's own
    kernels count an operand; the update's programs each read the whole batch: counted once. A tile shorter than
    the padded batch would have the batch's arrays counted as indexed: the FC path's tiles are far longer.)"""
    aliases = re.findall(r"\{(\d*)\}:\s*\((\d+)", line)
    aliased, written = {int(o) for _, o in aliases}, {int(r or 0) for r, _ in aliases}
    rows = arrays(operands[0])[0][1]
    leading = lambda shape: int(re.search(r"\[(\d+)", shape).group(1))  # an array's rows
    moved = sum((1 + (i in aliased)) * rows * _bytes(shape) // leading(shape)
                if i in aliased or leading(shape) > rows else _bytes(shape) for i, shape in enumerate(operands))
    results = arrays(result_shape)
    return moved + sum(n * DTYPE_BYTES.get(dtype, 0) for i, (dtype, n) in enumerate(results) if i not in written)


def _fusion_moved(body: list[str], result_shape: str) -> int:
    """Bytes a fusion reads and writes: each parameter whole, or only what its slices and gathers take (through
    bitcasts and conversions, and of a slice or gather only what is taken of it in turn: a fused gather of a
    gathered tile's rows reads those rows alone); the result whole, or, where the fusion scatters into (or updates
    a slice of) a parameter in place, just the update."""
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
                taken += read(user)
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
    bodies, entry = computations(hlo_text)
    executions, origin = execution_counts(bodies, entry), origins(hlo_text)
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
            results = tuple(arrays(shape))
            dtype, elements = (results or (("", 0),))[0]
            size = elements * DTYPE_BYTES.get(dtype, 0)
            detail = " ".join(m.group(1) for m in (re.search(r'custom_call_target="([^"]*)"', line),
                                                    re.search(r"dim_labels=([^,]+)", line),
                                                    re.search(r"(feature_group_count=\d+)", line)) if m)
            fused = re.search(r"calls=%?([\w.\-]+)", line) if op == "fusion" else None
            operands = [shapes.get(o, "") for o in _operands(line, match.end())]
            moved = (_fusion_moved(bodies[fused.group(1)], shape) if fused and fused.group(1) in bodies else
                     _rows_kernel_moved(line, operands, shape) if 'name = "rows_' in line else
                     _bytes(shape) + sum(map(_bytes, operands)))
            found.append(Kernel(_kernel_kind(op, name, line), name, dtype, size, executions.get(computation, 1),
                                detail, moved, origin.get(name, ""), results))
    return found


def moved_by_origin(found: list[Kernel]) -> collections.Counter:
    """Bytes that the kernels ``found`` read and write per step, by ``"kind: [backward ]operation (file:line)"`` (a
    gradient's kernels are those whose JAX operation is named ``transpose(…)``)."""
    by_origin = collections.Counter()
    for k in found:
        backward = "backward " if "transpose(" in k.origin else ""
        by_origin[f"{k.kind}: {backward}{k.origin.split('/')[-1]}"] += k.moved_bytes * k.count
    return by_origin
