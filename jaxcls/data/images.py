"""Checked image decoding for every reader of images (RecordIO records, image folders, ``.bin`` pairs, IJB crops):
damage and decompression bombs found before any pixel is trusted."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np
from PIL import Image

from jaxcls.errors import DataError, location

try:  # libjpeg-turbo that releases the GIL while it decodes; without it Pillow decodes every image (slower)
    import simplejpeg
except ImportError:
    simplejpeg = None


# the files torchvision's ImageFolder (arcface_torch's reader of image folders) takes as images
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def image_files(folder: str | os.PathLike) -> tuple[list[Path], list[Path]]:
    """``(images, others)``: the files under ``folder`` at any depth (links followed), in torchvision's order
    (sorted folders, each one's sorted names), split by ``IMAGE_SUFFIXES`` (any case)."""
    images, others = [], []
    for parent, _, names in sorted(os.walk(folder, followlinks=True)):
        for name in sorted(names):
            (images if name.lower().endswith(IMAGE_SUFFIXES) else others).append(Path(parent) / name)
    return images, others


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
    exactly the scan's bytes, neither finishing early nor running past its end (libjpeg's "Corrupt JPEG data"
    warnings, on which simplejpeg's strict decode raises too). Truncation anywhere and damaged headers fail; bytes
    after EOI are ignored, as Pillow does. A PNG is checked against every chunk's CRC (``Image.verify``). What no
    check can see (a changed byte that still decodes into valid codes, formats without checksums) and how much
    random damage is caught: docs/training.md ("Data").
    """
    try:
        if data[:2] == b"\xff\xd8":
            return _decode_jpeg(data, at_least)
        with _pillow_open(io.BytesIO(data)) as img:  # reads the header only
            _check_pixels(*img.size)
            img.verify()
        with _pillow_open(io.BytesIO(data)) as img:
            return _rgb(img)
    except Exception as e:  # Pillow raises many types on damaged data: every one is a bad image
        raise DataError(f"{location(where)}: cannot decode image: {e}") from e


def _rgb(img: Image.Image) -> np.ndarray:
    """uint8 ``[H, W, 3]``; 16-bit grey levels (a 16-bit greyscale PNG) keep their high byte, as OpenCV's colour read
    does (Pillow's ``convert`` would clip them at 255)."""
    if img.mode.startswith("I;16") or img.mode == "I":
        grey = (np.asarray(img).astype(np.int64) >> 8).clip(0, 255).astype(np.uint8)
        return np.repeat(grey[..., None], 3, axis=-1)
    return np.asarray(img.convert("RGB"))


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
