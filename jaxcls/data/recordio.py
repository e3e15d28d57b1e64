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

import io
import os
import struct
from pathlib import Path

import numpy as np
from PIL import Image

MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", MAGIC)
_HEADER = struct.Struct("<IfQQ")
_LENGTH_MASK = (1 << 29) - 1


class RecordError(ValueError):
    """A corrupt or truncated record; the message names the file and byte offset."""


def read_index(path: str | os.PathLike) -> dict[int, int]:
    """``.idx`` file → ``{key: byte_offset}``."""
    index = {}
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                key, offset = line.split("\t")
                index[int(key)] = int(offset)
            except ValueError:
                raise RecordError(f"{path}:{line_no}: expected 'key<TAB>offset', got {line.strip()!r}") from None
    return index


class RecordFile:
    """Random access to the records of one ``.rec`` file (safe across fork: reopened per process)."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self.size = os.path.getsize(self.path)
        self._fd, self._pid = None, None

    def _read(self, offset: int, n: int) -> bytes:
        if self._pid != os.getpid():
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        data = os.pread(self._fd, n, offset)
        if len(data) != n:
            raise RecordError(f"{self.path}: truncated record at byte offset {offset} "
                              f"(wanted {n} bytes, file has {self.size})")
        return data

    def read(self, offset: int) -> bytes:
        """The payload of the record starting at ``offset`` (split records joined)."""
        start, parts = offset, []
        while True:
            magic, lrec = struct.unpack("<II", self._read(offset, 8))
            if magic != MAGIC:
                raise RecordError(f"{self.path}: bad magic 0x{magic:08x} at byte offset {offset} "
                                  f"(record starting at {start})")
            cflag, length = lrec >> 29, lrec & _LENGTH_MASK
            parts.append(self._read(offset + 8, length))
            offset += 8 + length + (-length % 4)
            if cflag in (0, 3):
                if cflag == 0 and len(parts) > 1:
                    raise RecordError(f"{self.path}: whole record inside a split record at byte offset {offset}")
                return _MAGIC_BYTES.join(parts)
            if cflag not in (1, 2):
                raise RecordError(f"{self.path}: bad continuation flag {cflag} at byte offset {offset}")


def unpack(payload: bytes, where: str = "") -> tuple[np.ndarray, bytes]:
    """IRHeader payload → (float32 labels, image bytes)."""
    if len(payload) < _HEADER.size:
        raise RecordError(f"{where}: record of {len(payload)} bytes is shorter than its header")
    flag, label, _, _ = _HEADER.unpack_from(payload)
    if flag == 0:
        return np.array([label], np.float32), payload[_HEADER.size:]
    end = _HEADER.size + 4 * flag
    if len(payload) < end:
        raise RecordError(f"{where}: header announces {flag} labels but the record ends first")
    return np.frombuffer(payload[_HEADER.size:end], np.float32).copy(), payload[end:]


def decode_image(data: bytes) -> np.ndarray:
    """JPEG/PNG bytes → uint8 ``[H, W, 3]`` RGB."""
    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


class MXFaceDataset:
    """``root/train.rec`` + ``root/train.idx``: ``len()`` images, ``[i] -> (uint8 [H, W, 3] RGB, int label)``.

    ``raw(i)`` gives ``(image bytes, label)`` without decoding, for pipelines that decode in workers.
    """

    generated = False

    @classmethod
    def from_config(cls, data, num_classes: int) -> MXFaceDataset:
        """``config.data.root`` (a training source of ``jaxcls.data.sources``)."""
        return cls(data.root)

    def __init__(self, root: str | os.PathLike, name: str = "train"):
        root = Path(root)
        self.rec = RecordFile(root / f"{name}.rec")
        self.index = read_index(root / f"{name}.idx")
        if not self.index:
            raise RecordError(f"{root / (name + '.idx')}: empty index")
        self.header_classes = None  # identity count announced by an insightface header record
        self.keys = self._image_keys()
        self._labels = None

    def _image_keys(self) -> np.ndarray:
        keys = sorted(self.index)
        if 0 in self.index:
            labels, image = unpack(self.rec.read(self.index[0]), self._where(0))
            if len(labels) >= 2 and not image and labels[0] == int(labels[0]) and 1 <= labels[0] - 1 <= len(keys):
                self.header_classes = int(labels[1] - labels[0])  # insightface header record
                return np.arange(1, int(labels[0]), dtype=np.int64)
        return np.asarray(keys, np.int64)

    def _where(self, key: int) -> str:
        return f"{self.rec.path} (key {key}, byte offset {self.index[key]})"

    def __len__(self) -> int:
        return len(self.keys)

    def raw(self, i: int) -> tuple[bytes, int]:
        key = int(self.keys[i])
        if key not in self.index:
            raise RecordError(f"{self.rec.path}: key {key} is missing from the index")
        labels, image = unpack(self.rec.read(self.index[key]), self._where(key))
        if not image:
            raise RecordError(f"{self._where(key)}: record holds no image")
        return image, int(labels[0])

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        image, label = self.raw(i)
        try:
            return decode_image(image), label
        except Exception as e:
            key = int(self.keys[i])
            raise RecordError(f"{self._where(key)}: cannot decode image: {e}") from e

    def num_classes(self) -> int:
        """Identities in the file: from the insightface header, else 1 + the largest label."""
        return self.header_classes if self.header_classes is not None else int(self.labels().max()) + 1

    def labels(self) -> np.ndarray:
        """Every image's label (reads each record header once; cached)."""
        if self._labels is None:
            self._labels = np.array([self.raw(i)[1] for i in range(len(self))], np.int64)
        return self._labels


def pack(labels, image: bytes) -> bytes:
    """IRHeader payload: one label → ``flag = 0``; several → ``flag = count`` float32 labels first."""
    labels = np.atleast_1d(np.asarray(labels, np.float32))
    if len(labels) == 1:
        return _HEADER.pack(0, float(labels[0]), 0, 0) + image
    return _HEADER.pack(len(labels), 0.0, 0, 0) + labels.tobytes() + image


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


def write_records(root: str | os.PathLike, records: dict[int, bytes], name: str = "train") -> Path:
    """Write ``{key: payload}`` as ``root/name.rec`` + ``root/name.idx``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rec, idx = bytearray(), []
    for key, data in records.items():
        idx.append(f"{key}\t{len(rec)}\n")
        rec += encode_record(data)
    (root / f"{name}.rec").write_bytes(bytes(rec))
    (root / f"{name}.idx").write_text("".join(idx))
    return root
