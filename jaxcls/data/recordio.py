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
import io
import os
import re
import struct
import threading
import weakref
from pathlib import Path
from typing import NamedTuple

import numpy as np
from PIL import Image

try:  # libjpeg-turbo that releases the GIL while it decodes; without it Pillow decodes every image (slower)
    import simplejpeg
except ImportError:
    simplejpeg = None

MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", MAGIC)
_HEADER = struct.Struct("<IfQQ")
_LENGTH_MASK = (1 << 29) - 1


class DataError(ValueError):
    """Unusable training or evaluation data; the message starts with where: file, key, ``.idx`` line, byte offset."""


def _text(where) -> str:
    """A ``where`` argument as text: a string, or a function giving it (called only when an error names the record,
    so reading and decoding format nothing per image)."""
    return where() if callable(where) else where


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

    def _read(self, offset: int, n: int, where) -> bytes:
        if offset + n > self.size:
            raise DataError(f"{_text(where)}: truncated record: {n} bytes wanted at byte offset {offset}, "
                            f"the file has {self.size}")
        if self._pid != os.getpid():
            with _OPENING:  # threads of one process share one descriptor, opened once
                if self._pid != os.getpid():
                    fd = os.open(self.path, os.O_RDONLY)
                    weakref.finalize(self, os.close, fd)
                    self._fd, self._pid = fd, os.getpid()
        data = os.pread(self._fd, n, offset)
        if len(data) != n:
            raise DataError(f"{_text(where)}: truncated record: {n} bytes wanted at byte offset {offset}, "
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
                raise DataError(f"{_text(where)}: bad magic 0x{magic:08x} at byte offset {offset}")
            cflag, length = lrec >> 29, lrec & _LENGTH_MASK
            if cflag not in ((2, 3) if parts else (0, 1)):
                raise DataError(f"{_text(where)}: continuation flag {cflag} at byte offset {offset} "
                                f"{'inside' if parts else 'starting'} a record")
            parts.append(self._read(offset + 8, length, where))
            offset += 8 + length + (-length % 4)
            if cflag in (0, 3):
                return _MAGIC_BYTES.join(parts)


def unpack(payload: bytes, where="") -> tuple[np.ndarray, bytes]:
    """IRHeader payload → (float32 labels, image bytes); errors begin with ``where`` (text, or a function giving
    it)."""
    if len(payload) < _HEADER.size:
        raise DataError(f"{_text(where)}: record of {len(payload)} bytes is shorter than its header")
    flag, label, _, _ = _HEADER.unpack_from(payload)
    if flag == 0:
        return np.array([label], np.float32), payload[_HEADER.size:]
    end = _HEADER.size + 4 * flag
    if len(payload) < end:
        raise DataError(f"{_text(where)}: header announces {flag} labels but the record ends first")
    return np.frombuffer(payload[_HEADER.size:end], np.float32).copy(), payload[end:]


def _whole(x) -> bool:
    """A float32 label or count that is a finite non-negative integer."""
    return bool(np.isfinite(x) and x >= 0 and x == int(x))


# Pillow's decompression-bomb limit (it warns above, refuses twice this): a 9,459² image, 268 MB of RGB pixels
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485
MAX_IMAGE_PIXELS_VARIABLE = "JAXCLS_MAX_IMAGE_PIXELS"


def max_image_pixels() -> int:
    """The largest image (width × height, as its header states) any reader decodes: ``$JAXCLS_MAX_IMAGE_PIXELS``
    when set (data worker processes inherit it), else ``DEFAULT_MAX_IMAGE_PIXELS``."""
    value = os.environ.get(MAX_IMAGE_PIXELS_VARIABLE)
    if value is None:
        return DEFAULT_MAX_IMAGE_PIXELS
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if limit <= 0:
        raise ValueError(f"{MAX_IMAGE_PIXELS_VARIABLE}={value!r}: expected a positive number of pixels")
    return limit


def _check_pixels(width: int, height: int) -> None:
    limit = max_image_pixels()
    if width * height > limit:
        raise ValueError(f"its header claims {width} × {height} = {width * height:,} pixels, more than the limit of "
                         f"{limit:,} (a decompression bomb, or raise {MAX_IMAGE_PIXELS_VARIABLE}); not decoded")


def read_image_header(path: str | os.PathLike) -> tuple[int, int]:
    """``(width, height)`` of the image file at ``path`` from its header alone (nothing decoded); an unreadable
    header or more pixels than ``max_image_pixels()`` → ``DataError`` naming the file."""
    try:
        with open(path, "rb") as f, _pillow_open(f) as img:
            _check_pixels(*img.size)
            return img.size
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: {e}") from None


def decode_image(data: bytes, where="image", at_least: int = 0) -> np.ndarray:
    """Encoded image → uint8 ``[H, W, 3]`` RGB, exactly as Pillow decodes it; any damage found → ``DataError`` whose
    message starts with ``where`` (text, or a function giving it, called only then).

    An image whose header claims more than ``max_image_pixels()`` pixels is refused before any pixel is decoded: a
    small file can claim 65,535² pixels (12.8 GB of RGB).

    ``at_least > 0``: a JPEG whose sides are both at least twice that is decoded straight at 1/2, 1/4 or 1/8 scale
    (libjpeg's DCT scaling; the smallest scale keeping both sides ``>= at_least``, Pillow's ``draft`` rule), giving
    ``[ceil(H/f), ceil(W/f), 3]``; other images and formats decode at full size.

    JPEGs with one or three components decode with libjpeg-turbo through ``simplejpeg`` when it is installed (it
    releases the GIL; pixels identical to Pillow's, itself libjpeg-turbo), else with Pillow. simplejpeg runs strict:
    any libjpeg warning is damage, and Pillow's check below then names it (its message, else libjpeg's).

    Pillow alone ignores most damage to a JPEG's entropy-coded data (libjpeg only warns and fills in), so a JPEG is
    first checked here: its marker structure (SOI, segment lengths inside the data, a frame before the first scan,
    scan data holding only stuffed ``FF 00`` bytes and restart markers in order, nothing but EOI after the scan of a
    one-scan image) and, for a one-scan Huffman image (baseline, as cv2 and Pillow write), that the decoder needs
    exactly the scan's bytes: it must not finish before the scan's last byte (damage that ends it early) nor run
    past its end (damage that makes it want more; libjpeg would pad with grey). Both are what libjpeg reports as
    "Corrupt JPEG data" warnings, on which simplejpeg's strict decode raises too, as on any other libjpeg warning
    (bad Huffman codes…): with simplejpeg a little more damage is found (16 of 3,000 random flips, cuts and insertions
    near the end of glyph scans were errors only there; none the other way round). Truncation anywhere and damaged
    headers fail too; bytes after EOI are ignored, as Pillow does. A PNG is checked against every chunk's CRC
    (``Image.verify``).

    Not detectable: a changed byte that still decodes into valid Huffman codes using up exactly the scan (about half
    of random byte flips inside a JPEG's scan: the codes resynchronize; no decoder can tell, there is no checksum),
    changed table or header values that stay valid, damage to multi-scan (progressive) JPEGs beyond the structure
    check, and damage to formats without checksums (BMP).
    """
    try:
        if data[:2] == b"\xff\xd8":
            return _decode_jpeg(data, at_least)
        with _pillow_open(io.BytesIO(data)) as img:  # reads the header only
            _check_pixels(*img.size)
            img.verify()
        with _pillow_open(io.BytesIO(data)) as img:
            return np.asarray(img.convert("RGB"))
    except Exception as e:  # Pillow raises many types on damaged data: every one is a bad image
        raise DataError(f"{_text(where)}: cannot decode image: {e}") from e


def _pillow_open(stream: io.BytesIO) -> Image.Image:
    """``Image.open``, whose own bomb check refuses twice ``PIL.Image.MAX_IMAGE_PIXELS`` before ours can look."""
    try:
        return Image.open(stream)
    except Image.DecompressionBombError as e:
        raise ValueError(f"{e} (Pillow's limit, twice PIL.Image.MAX_IMAGE_PIXELS: raise that too to read it); "
                         "not decoded") from None


_SOF = set(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # frame headers (0xC4 DHT, 0xC8 reserved, 0xCC DAC)
_LOOKAHEAD = b"\0" * 8  # libjpeg-turbo's Huffman decoder reads up to 7 bytes ahead of the bits it decodes
_MARKER = re.compile(rb"\xff[^\x00]")  # in scan data: a marker (FF 00 is a stuffed FF byte)


class _Frame(NamedTuple):
    """What ``_jpeg_structure`` found: the EOI's offset, whether the image is one Huffman-coded scan of every
    component, and the frame header's height, width and component count."""

    scan_end: int
    one_scan: bool
    height: int
    width: int
    components: int


def _dct_scale(frame: _Frame, at_least: int) -> int:
    """``f`` in 8, 4, 2, 1: the largest with both sides ``>= f · at_least`` (1 when ``at_least`` is 0)."""
    room = min(frame.height, frame.width) // at_least if at_least > 0 else 1
    return next((f for f in (8, 4, 2) if f <= room), 1)


def _decode_jpeg(data: bytes, at_least: int) -> np.ndarray:
    frame = _jpeg_structure(data)
    _check_pixels(frame.width, frame.height)
    if simplejpeg is None or frame.components not in (1, 3):  # CMYK / YCCK: Pillow's conversion
        return _pillow_jpeg(data, frame, at_least)
    f = _dct_scale(frame, at_least)
    try:  # strict: libjpeg's "Corrupt JPEG data" and "Premature end" warnings are errors; scaled to exactly 1/f
        return simplejpeg.decode_jpeg(data, "RGB", strict=True, min_height=-(-frame.height // f),
                                      min_width=-(-frame.width // f))
    except ValueError as e:
        _pillow_jpeg(data, frame, at_least)  # names the damage when its check finds it
        raise ValueError(f"JPEG data is damaged (libjpeg: {e})") from None


def _pillow_jpeg(data: bytes, frame: _Frame, at_least: int) -> np.ndarray:
    if not frame.one_scan:
        with _pillow_open(io.BytesIO(data)) as img:
            if at_least:
                img.draft("RGB", (at_least, at_least))
            return np.asarray(img.convert("RGB"))
    # The scan without its EOI, then zeros: the decoder can read ahead but suspends (truncated) if the image needs
    # any bits past the scan. It gets the data in two reads, the first stopping one byte short of the scan's end:
    # finishing on that first read means the image used fewer bytes than the scan has.
    stream = io.BytesIO(data[:frame.scan_end] + _LOOKAHEAD)
    with _pillow_open(stream) as img:
        if at_least:
            img.draft("RGB", (at_least, at_least))
        img.decodermaxblock = frame.scan_end - 1
        try:
            img.load()
        except OSError as e:
            raise ValueError(f"JPEG scan data is damaged or truncated ({e})") from None
        if stream.tell() < frame.scan_end:
            raise ValueError("JPEG scan data is damaged: the image ends before the scan's last byte")
        return np.asarray(img.convert("RGB"))


def _jpeg_structure(data: bytes) -> _Frame:
    """Check a JPEG's markers; what they say about the image (see ``_Frame``)."""
    pos, frame, components, size, scans, restarts, one_scan = 2, None, 0, (0, 0), 0, False, False
    while True:
        if pos + 2 > len(data) or data[pos] != 0xFF:
            raise ValueError(f"JPEG: no marker at image byte {pos} (truncated or damaged)")
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0xD9 and scans:
            return _Frame(pos, one_scan, *size, components)
        if one_scan or not (marker in _SOF or marker in (0xC4, 0xCC) or marker >= 0xDA):
            raise ValueError(f"JPEG: unexpected marker 0x{marker:02x} at image byte {pos}")
        end = pos + 2 + int.from_bytes(data[pos + 2:pos + 4], "big")
        if pos + 4 > len(data) or end > len(data) or end < pos + 4:
            raise ValueError(f"JPEG: segment 0x{marker:02x} at image byte {pos} runs past the end of the data")
        if marker in _SOF:
            frame, components = marker, data[pos + 9] if end > pos + 9 else 0
            if components:  # P, then Y and X: 16-bit big-endian
                size = int.from_bytes(data[pos + 5:pos + 7], "big"), int.from_bytes(data[pos + 7:pos + 9], "big")
        elif marker == 0xDD:
            restarts = end >= pos + 6 and data[pos + 4:pos + 6] != b"\0\0"
        elif marker == 0xDA:
            if frame is None:
                raise ValueError(f"JPEG: scan before the frame header at image byte {pos}")
            scans += 1
            one_scan = scans == 1 and frame in (0xC0, 0xC1) and end > pos + 4 and data[pos + 4] == components
            end = _scan_end(data, end, restarts)
        pos = end


def _scan_end(data: bytes, pos: int, restarts: bool) -> int:
    """Offset of the marker ending the entropy-coded data at ``pos``: only ``FF 00`` and RST0..7 in turn inside."""
    restart = 0
    while marker := _MARKER.search(data, pos):
        pos, code = marker.start(), data[marker.start() + 1]
        if code == 0xFF:  # fill before a marker
            pos += 1
        elif 0xD0 <= code <= 0xD7:
            if not restarts or code != 0xD0 + restart:
                raise ValueError(f"JPEG: restart marker RST{code - 0xD0} out of turn at image byte {pos}")
            restart, pos = (restart + 1) % 8, pos + 2
        else:
            return pos
    raise ValueError("JPEG: the scan data runs to the end without a marker (truncated)")


class MXFaceDataset:
    """``root/train.rec`` + ``root/train.idx``: ``len()`` images, ``[i] -> (uint8 [H, W, 3] RGB, int label)``.

    ``raw(i)`` gives ``(image bytes, label)`` without decoding, for pipelines that decode in workers; ``where(i)``
    names the record. Every failure is a ``DataError`` naming the file, key, ``.idx`` line and byte offset.
    """

    generated = False

    @classmethod
    def from_config(cls, data, num_classes: int) -> MXFaceDataset:
        """``config.data.root`` (a training source of ``jaxcls.data.sources``)."""
        return cls(data.root)

    def __init__(self, root: str | os.PathLike, name: str = "train"):
        root = Path(root)
        self.rec = RecordFile(root / f"{name}.rec")
        self.idx_path = root / f"{name}.idx"
        self.index = RecordIndex(self.idx_path)
        if not self.index:
            raise DataError(f"{self.idx_path}: empty index")
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
        key = int(self.keys[i])
        labels, image = unpack(self._read(key), functools.partial(self._where, key))
        if not image:
            raise DataError(f"{self._where(key)}: record holds no image")
        if not _whole(labels[0]):
            raise DataError(f"{self._where(key)}: label {labels[0]} is not a class number")
        return image, int(labels[0])

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        image, label = self.raw(i)
        return decode_image(image, self.where(i)), label

    def num_classes(self) -> int:
        """Identities in the file: from the insightface header, else 1 + the largest label."""
        return self.header_classes if self.header_classes is not None else int(self.labels().max()) + 1

    def labels(self) -> np.ndarray:
        """Every image's label (reads each record header once; cached)."""
        if self._labels is None:
            self._labels = np.array([self.raw(i)[1] for i in range(len(self))], np.int64)
        return self._labels


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
