"""MXNet RecordIO face data sets (MS1MV2/3, Glint360K, WebFace) read without mxnet.

A ``.rec`` file is a sequence of chunks: little-endian uint32 magic ``0xced7230a``, uint32
``lrec = cflag << 29 | length``, ``length`` payload bytes zero-padded to 4. ``cflag`` 0 is a whole
record; 1/2/3 start/continue/end a record that was split where the magic occurred in it (the reader puts
the magic back between the parts). The ``.idx`` file has ``key\\tbyte_offset`` lines.

A record's payload starts with ``IRHeader`` (``struct 'IfQQ'``: flag, label, id, id2); with ``flag > 0``,
``flag`` float32 labels follow, then the image bytes. insightface files start with a header record 0
(``flag = 2``, label ``(N+1, N+K+1)``, no image): images are keys ``1..N``. Files made by plain im2rec
have no such header: every key in the ``.idx`` is an image.
"""

from __future__ import annotations

import functools
import os
import struct
import threading
import weakref
from pathlib import Path

import numpy as np

from jaxcls.data.images import decode_image
from jaxcls.errors import DataError, location

MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", MAGIC)
_HEADER = struct.Struct("<IfQQ")
_LENGTH_MASK = (1 << 29) - 1
# A record's first bytes as MXFaceDataset.labels reads them: magic, lrec, then IRHeader's flag and label, and with
# flag > 0 the first of its labels (after id and id2)
_HEAD_FIELDS = ((0, "<u4"), (4, "<u4"), (8, "<u4"), (12, "<f4"), (8 + _HEADER.size, "<f4"))
_HEAD_BYTES = 8 + _HEADER.size + 4
_LABELS_AT_ONCE = 1 << 17  # records a step of the count (a [n, 36] gather: 37 MB of indices)


class RecordIndex:
    """A ``.idx`` file (``key\\tbyte_offset`` lines) held as sorted numpy arrays: 20 bytes per record, so the 42M
    records of WebFace42M take 0.8 GB rather than the several GB of a dict; ``index[key] -> (offset, .idx line)``."""

    def __init__(self, path: str | os.PathLike):
        keys, offsets, lines = [], [], []
        with open(path, "rb") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    key, offset = map(int, line.split(b"\t"))
                except ValueError:
                    raise DataError(f"{path}:{line_no}: expected 'key<TAB>offset', got {line.strip()!r}") from None
                if not 0 <= offset < 1 << 63 or not -(1 << 63) <= key < 1 << 63:
                    raise DataError(f"{path}:{line_no}: key or offset outside the 64-bit range: {line.strip()!r}")
                keys.append(key)
                offsets.append(offset)
                lines.append(line_no)
        order = np.argsort(keys, kind="stable")
        self.keys = np.asarray(keys, np.int64)[order]
        self.offsets, self.lines = np.asarray(offsets, np.int64)[order], np.asarray(lines, np.int32)[order]
        repeated = np.flatnonzero(np.diff(self.keys) == 0)
        if repeated.size:
            i = repeated[0]
            raise DataError(f"{path}:{self.lines[i + 1]}: key {self.keys[i]} is also on line {self.lines[i]}")

    def __len__(self) -> int:
        return len(self.keys)

    def _find(self, key: int) -> int:
        i = int(np.searchsorted(self.keys, key))
        return i if i < len(self.keys) and self.keys[i] == key else -1

    def __contains__(self, key: int) -> bool:
        return self._find(key) >= 0

    def __getitem__(self, key: int) -> tuple[int, int]:
        i = self._find(key)
        if i < 0:
            raise KeyError(key)
        return int(self.offsets[i]), int(self.lines[i])


_OPENING = threading.Lock()  # a module's, not an instance's: sources are pickled into data workers


class RecordFile:
    """Random access to the records of one ``.rec`` file (safe across fork: reopened per process)."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self.size = os.path.getsize(self.path)
        self._fd, self._pid = None, None

    def __getstate__(self):  # a copy opens its own descriptor: this one's closes when this object goes
        return {**self.__dict__, "_fd": None, "_pid": None}

    def _read(self, offset: int, n: int, where) -> bytes:
        if offset + n > self.size:
            raise DataError(f"{location(where)}: truncated record: {n} bytes wanted at byte offset {offset}, "
                            f"the file has {self.size}")
        if self._pid != os.getpid():
            with _OPENING:  # threads of one process share one descriptor, opened once
                if self._pid != os.getpid():
                    fd = os.open(self.path, os.O_RDONLY)
                    weakref.finalize(self, os.close, fd)
                    self._fd, self._pid = fd, os.getpid()
        data = os.pread(self._fd, n, offset)
        if len(data) != n:
            raise DataError(f"{location(where)}: truncated record: {n} bytes wanted at byte offset {offset}, "
                            f"got {len(data)}")
        return data

    def read(self, offset: int, where=None) -> bytes:
        """The payload of the record starting at ``offset`` (split records joined); errors begin with ``where`` (text
        or a function giving it).

        Every chunk is checked before it is read (magic, continuation flag, length within the file), so a damaged
        file fails at once with the chunk's byte offset.
        """
        where = where or f"{self.path} (byte offset {offset})"
        parts = []
        while True:
            magic, lrec = struct.unpack("<II", self._read(offset, 8, where))
            if magic != MAGIC:
                raise DataError(f"{location(where)}: bad magic 0x{magic:08x} at byte offset {offset}")
            cflag, length = lrec >> 29, lrec & _LENGTH_MASK
            if cflag not in ((2, 3) if parts else (0, 1)):
                raise DataError(f"{location(where)}: continuation flag {cflag} at byte offset {offset} "
                                f"{'inside' if parts else 'starting'} a record")
            parts.append(self._read(offset + 8, length, where))
            offset += 8 + length + (-length % 4)
            if cflag in (0, 3):
                return _MAGIC_BYTES.join(parts)


def unpack(payload: bytes, where="") -> tuple[np.ndarray, bytes]:
    """IRHeader payload → (float32 labels, image bytes); errors begin with ``where`` (text, or a function giving
    it)."""
    if len(payload) < _HEADER.size:
        raise DataError(f"{location(where)}: record of {len(payload)} bytes is shorter than its header")
    flag, label, _, _ = _HEADER.unpack_from(payload)
    if flag == 0:
        return np.array([label], np.float32), payload[_HEADER.size:]
    end = _HEADER.size + 4 * flag
    if len(payload) < end:
        raise DataError(f"{location(where)}: header announces {flag} labels but the record ends first")
    return np.frombuffer(payload[_HEADER.size:end], np.float32).copy(), payload[end:]


def _whole(x) -> bool:
    """A float32 label or count that is a finite non-negative integer."""
    return bool(np.isfinite(x) and x >= 0 and x == int(x))


class MXFaceDataset:
    """``root/train.rec`` + ``root/train.idx``: ``len()`` images, ``[i] -> (uint8 [H, W, 3] RGB, int label)``.

    ``raw(i)`` gives ``(image bytes, label)`` without decoding, for pipelines that decode in workers; ``where(i)``
    names the record. Every failure is a ``DataError`` naming the file, key, ``.idx`` line and byte offset.
    """

    generated = False

    @classmethod
    def from_config(cls, data, num_classes: int) -> MXFaceDataset:
        """``config.data.root`` (a training source of ``jaxcls.data.sources``); with ``data.bad_records = "skip"``
        a bad record does not stop the count of classes either."""
        return cls(data.root, skip_bad_records=data.bad_records == "skip")

    def __init__(self, root: str | os.PathLike, name: str = "train", skip_bad_records: bool = False):
        root = Path(root)
        self.rec = RecordFile(root / f"{name}.rec")
        self.idx_path = root / f"{name}.idx"
        self.index = RecordIndex(self.idx_path)
        if not self.index:
            raise DataError(f"{self.idx_path}: empty index")
        self.skip_bad_records = skip_bad_records
        self.header_classes = None  # identity count announced by an insightface header record
        self.keys = self._image_keys()
        self._labels = None

    def _image_keys(self) -> np.ndarray:
        keys = self.index.keys
        if 0 in self.index:
            labels, image = unpack(self._read(0), self._where(0))
            if (len(labels) >= 2 and not image and _whole(labels[0]) and _whole(labels[1])
                    and 2 <= labels[0] <= len(keys) + 1 and labels[1] > labels[0]):
                self.header_classes = int(labels[1] - labels[0])  # insightface header record
                return np.arange(1, int(labels[0]), dtype=np.int64)
        return keys

    def _where(self, key: int) -> str:
        if key not in self.index:
            return f"{self.rec.path} (key {key})"
        offset, line = self.index[key]
        return f"{self.rec.path} (key {key}, .idx line {line}, byte offset {offset})"

    def _read(self, key: int) -> bytes:
        try:
            offset = self.index[key][0]
        except KeyError:
            raise DataError(f"{self._where(key)}: key missing from {self.idx_path}") from None
        return self.rec.read(offset, functools.partial(self._where, key))

    def where(self, i: int) -> str:
        """Image ``i``'s record: ``<file.rec> (key K, .idx line L, byte offset O)``."""
        return self._where(int(self.keys[i]))

    def __len__(self) -> int:
        return len(self.keys)

    def raw(self, i: int) -> tuple[bytes, int]:
        return self._image_and_label(int(self.keys[i]))

    def _image_and_label(self, key: int) -> tuple[bytes, int]:
        labels, image = unpack(self._read(key), functools.partial(self._where, key))
        if not image:
            raise DataError(f"{self._where(key)}: record holds no image")
        if not _whole(labels[0]) or labels[0] >= 2**31:
            raise DataError(f"{self._where(key)}: label {labels[0]} is not a class number")
        return image, int(labels[0])

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        image, label = self.raw(i)
        return decode_image(image, self.where(i)), label

    def num_classes(self) -> int:
        """Identities in the file: from the insightface header, else 1 + the largest label."""
        if self.header_classes is not None:
            return self.header_classes
        labels = self.labels()
        if not (labels >= 0).any():
            raise DataError(f"{self.rec.path}: no readable record among its {len(self):,} images")
        return int(labels.max()) + 1

    def labels(self) -> np.ndarray:
        """Every image's label, cached; -1 for a bad record skipped (``skip_bad_records``), else its error is raised.

        Read from the records' headers alone, many at once (a file without an insightface header record, as im2rec
        and arcface_torch's shuffle_rec.py write, is counted this way: ~40 bytes of each record rather than its
        image); a record whose header is not that of a whole, clean record is read in full by ``raw``, whose error
        names it."""
        if self._labels is None:
            self._labels = np.concatenate([self._header_labels(self.keys[start:start + _LABELS_AT_ONCE])
                                           for start in range(0, len(self.keys), _LABELS_AT_ONCE)])
        return self._labels

    def _header_labels(self, keys: np.ndarray) -> np.ndarray:
        """The labels of the records of ``keys`` (int64 ``[n]``)."""
        positions = np.minimum(np.searchsorted(self.index.keys, keys), len(self.index) - 1)
        indexed = self.index.keys[positions] == keys  # a key missing from the .idx: read whole, its error names it
        offsets, size = self.index.offsets[positions], self.rec.size
        in_file = indexed & (offsets <= size - _HEAD_BYTES)  # (an offset near 2**63 plus 36 would wrap)
        if size >= _HEAD_BYTES:
            head = np.memmap(self.rec.path, np.uint8, mode="r")[np.where(in_file, offsets, 0)[:, None]
                                                                   + np.arange(_HEAD_BYTES)]
            magic, lrec, flag, label, first = (np.ascontiguousarray(head[:, i:i + 4]).view(dtype)[:, 0]
                                               for i, dtype in _HEAD_FIELDS)
            length, image_start = (lrec & _LENGTH_MASK).astype(np.int64), _HEADER.size + 4 * flag.astype(np.int64)
            value = np.where(flag == 0, label, first)
            with np.errstate(invalid="ignore"):
                clean = (in_file & (magic == MAGIC) & (lrec >> 29 == 0) & (length > image_start)
                         & (offsets + 8 + length <= size) & np.isfinite(value) & (value >= 0)
                         & (value < 2**31) & (value == np.floor(value)))
            labels = np.where(clean, value, -1).astype(np.int64)
        else:
            labels, clean = np.full(len(keys), -1, np.int64), np.zeros(len(keys), bool)
        for i in np.flatnonzero(~clean):  # read whole: its label, or the error that names what is wrong
            try:
                labels[i] = self._image_and_label(int(keys[i]))[1]
            except DataError:
                if not self.skip_bad_records:
                    raise
        return labels


def pack(labels, image: bytes, ids: tuple[int, int] = (0, 0)) -> bytes:
    """IRHeader payload: one label → ``flag = 0``; several → ``flag = count`` float32 labels first. ``ids``: the
    header's ``id`` and ``id2`` (insightface writes the record's key and 0; its header record 0 and 1)."""
    labels = np.atleast_1d(np.asarray(labels, np.float32))
    if len(labels) == 1:
        return _HEADER.pack(0, float(labels[0]), *ids) + image
    return _HEADER.pack(len(labels), 0.0, *ids) + labels.tobytes() + image


def _chunk(cflag: int, data: bytes) -> bytes:
    return struct.pack("<II", MAGIC, (cflag << 29) | len(data)) + data + b"\0" * (-len(data) % 4)


def encode_record(payload: bytes) -> bytes:
    """One record as MXNet writes it: split wherever the magic occurs at a 4-byte aligned offset."""
    cuts = [i for i in range(0, len(payload) - 3, 4) if payload[i:i + 4] == _MAGIC_BYTES]
    parts, start = [], 0
    for c in cuts:
        parts.append(payload[start:c])
        start = c + 4
    parts.append(payload[start:])
    if len(parts) == 1:
        return _chunk(0, payload)
    flags = [1] + [2] * (len(parts) - 2) + [3]
    return b"".join(_chunk(f, p) for f, p in zip(flags, parts))


def write_records(root: str | os.PathLike, records, name: str = "train") -> Path:
    """Write ``{key: payload}``, or ``(key, payload)`` pairs as they come, as ``root/name.rec`` + ``root/name.idx``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.rec", "wb") as rec, open(root / f"{name}.idx", "w") as idx:
        for key, data in records.items() if isinstance(records, dict) else records:
            idx.write(f"{key}\t{rec.tell()}\n")
            rec.write(encode_record(data))
    return root
