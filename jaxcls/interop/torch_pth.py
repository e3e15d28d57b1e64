"""PyTorch ``.pth`` state dicts (insightface arcface_torch's ``backbone.pth``) read without torch, running nothing,
and written without torch (``save_pth``).

``torch.save`` writes one of two layouts:

* zip (torch ≥ 1.6, the default): entries ``<archive>/data.pkl`` (the pickled object), ``<archive>/data/<key>`` (each
  storage's raw little-endian bytes, stored uncompressed), ``<archive>/byteorder`` (``little``; absent in old files)
  and a few version records. ``<archive>`` is any name: the first entry's folder.
* legacy (``_use_new_zipfile_serialization=False``): five pickles back to back (the magic number
  ``0x1950a86a20f9469cfc6c``, the protocol version 1001, a sys-info dict, the object, the sorted list of storage keys),
  then per listed key an int64 little-endian element count and that many little-endian elements.

In the object's pickle (protocol 2) a tensor is ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
requires_grad, backward_hooks[, metadata])``, a parameter ``torch._utils._rebuild_parameter(tensor, requires_grad,
backward_hooks)`` and a storage the persistent id ``('storage', torch.FloatStorage, key, location, numel)`` (legacy:
one more item, ``None``). A state dict is a ``collections.OrderedDict`` whose ``_metadata`` attribute (module versions,
set by BUILD) is dropped here. ``restricted_loads`` gives the pickle only these globals, each replaced by a function
or object here that checks what it gets and builds a placeholder; the arrays are cut from the storages afterwards,
once every view has been checked to lie inside its storage and the storages' sizes against the file.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickletools
import struct
import zipfile
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxcls.data.safe_pickle import restricted_loads
from jaxcls.errors import DataError

_KIND = "PyTorch state dict"
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001
# the arrays may take at most this many times the file's bytes: more than honest files' transposed or sliced copies of
# a storage, far less than a crafted file gets by viewing one storage again and again (identical views share an array)
_MAX_EXPANSION = 4


class _Frozen:
    """An object the pickle may hold but never change: BUILD, which sets attributes, is refused on it."""

    __slots__ = ()

    def __setstate__(self, state):
        raise ValueError(f"the pickle sets the state of a {type(self).__name__.strip('_')}, which torch never does")


class _StorageType(_Frozen):
    """``torch.FloatStorage`` and kin: named in persistent ids, only to give the storage's element type."""

    __slots__ = ("dtype",)

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)


class _Storage(_Frozen):
    """A persistent id's storage: ``numel`` elements of ``dtype`` in the zip entry or legacy slot ``key``."""

    __slots__ = ("key", "dtype", "numel")

    def __init__(self, key: str, dtype: np.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _Tensor(_Frozen):
    """``_rebuild_tensor_v2``'s arguments, checked for types; the view is checked against the storage later."""

    __slots__ = ("storage", "offset", "size", "stride")

    def __init__(self, storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...]):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride

    def view(self) -> tuple:
        return self.storage.key, self.offset, self.size, self.stride

    def nbytes(self) -> int:
        return math.prod(self.size) * self.storage.dtype.itemsize


class _OrderedDict(dict):
    """``collections.OrderedDict()`` (a dict keeps the order); BUILD may set only ``_metadata``, which is dropped."""

    __slots__ = ()

    def __setstate__(self, state):
        if not (isinstance(state, dict) and set(state) <= {"_metadata"}):
            raise ValueError(f"the pickle sets {state!r:.80} on an OrderedDict; torch sets only _metadata")


def _new_ordered_dict(*args) -> _OrderedDict:
    if args:  # torch's protocol-2 pickles build an empty one and SETITEMS its items
        raise ValueError(f"collections.OrderedDict called with {len(args)} arguments instead of none")
    return _OrderedDict()


def _is_sizes(value) -> bool:
    return isinstance(value, tuple) and all(type(v) is int and v >= 0 for v in value)


def _no_hooks(requires_grad, backward_hooks, function: str) -> None:
    if not isinstance(requires_grad, bool):
        raise ValueError(f"{function}: requires_grad is a {type(requires_grad).__name__}, not a bool")
    if not (isinstance(backward_hooks, dict) and not backward_hooks):  # torch always saves an empty OrderedDict
        raise ValueError(f"{function}: backward_hooks is {backward_hooks!r:.80}, not an empty OrderedDict")


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None) -> _Tensor:
    """A tensor: ``size``/``stride`` tuples of non-negative ints (elements), ``storage_offset`` likewise."""
    if not isinstance(storage, _Storage):
        raise ValueError(f"_rebuild_tensor_v2: the storage is a {type(storage).__name__}, not a persistent id's")
    if not (_is_sizes(size) and _is_sizes(stride) and len(size) == len(stride) and _is_sizes((storage_offset,))):
        raise ValueError(f"_rebuild_tensor_v2: offset {storage_offset!r:.40}, size {size!r:.80} and stride "
                         f"{stride!r:.80} are not non-negative ints, the size and stride of one length")
    _no_hooks(requires_grad, backward_hooks, "_rebuild_tensor_v2")
    if metadata is not None and not (isinstance(metadata, dict) and not any(metadata.values())):
        # {'neg': True} or {'conj': True}: a lazily negated or conjugated view, never in a state dict
        raise ValueError(f"_rebuild_tensor_v2: tensor metadata {metadata!r:.80} (a negated or conjugated view)")
    return _Tensor(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad, backward_hooks) -> _Tensor:
    """An ``nn.Parameter`` (``state_dict(keep_vars=True)``): its tensor."""
    if not isinstance(data, _Tensor):
        raise ValueError(f"_rebuild_parameter: the data is a {type(data).__name__}, not a tensor")
    _no_hooks(requires_grad, backward_hooks, "_rebuild_parameter")
    return data


_STORAGE_DTYPES = {"FloatStorage": np.float32, "HalfStorage": np.float16, "BFloat16Storage": ml_dtypes.bfloat16,
                   "DoubleStorage": np.float64, "LongStorage": np.int64, "IntStorage": np.int32,
                   "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_}
# every global torch.save writes for a dict of CPU or GPU tensors or parameters (also nested, as in a checkpoint)
TORCH_GLOBALS = {("collections", "OrderedDict"): _new_ordered_dict,
                 ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
                 ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
                 **{("torch", name): _StorageType(dtype) for name, dtype in _STORAGE_DTYPES.items()}}


def load_state_dict(path: str | os.PathLike, key: str | None = None) -> dict[str, np.ndarray]:
    """``torch.save(state_dict, path)``'s file (zip or legacy) → ``{name: array}`` in the file's order.

    Arrays are standalone C-contiguous copies (bfloat16 as ``ml_dtypes.bfloat16``); names whose tensors are the same
    view of one storage (tied weights) share one array. ``key`` picks the state dict out of a checkpoint dict
    (``{'state_dict_backbone': …, 'epoch': …}``); without it the file must hold the state dict itself.

    Nothing in the file runs: a pickle naming any global but ``TORCH_GLOBALS``' (a pickled ``nn.Module``, a payload)
    raises ``RefusedPickle``. A damaged or inconsistent file (a view outside its storage, a storage missing or of
    the wrong size, a size beyond the file) raises ``DataError`` naming the file (and the tensor), before any array
    is allocated.
    """
    where = str(path)
    with open(path, "rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"
    if zipped:
        with _zip_errors(where):
            archive = zipfile.ZipFile(path)
        with archive:
            return _load_zip(archive, os.path.getsize(path), where, key)
    return _load_legacy(Path(path).read_bytes(), where, key)


def _load_zip(archive: zipfile.ZipFile, file_size: int, where: str, key: str | None) -> dict[str, np.ndarray]:
    names = archive.namelist()
    if not names or "/" not in names[0]:
        raise DataError(f"{where}: not a PyTorch zip file: its first entry is not in an archive folder")
    prefix = names[0].split("/")[0] + "/"

    def entry(name: str, nbytes: int | None = None, what: str | None = None) -> bytes:
        """The entry's bytes, checked first to be stored and to fit the file (``nbytes``: exactly that long)."""
        try:
            info = archive.getinfo(prefix + name)
        except KeyError:
            raise DataError(f"{where}{what or ''}: the zip has no entry {prefix + name}") from None
        at = f"{where}{what or ''}: {info.filename}"
        if info.compress_type != zipfile.ZIP_STORED:  # torch stores entries; a compressed one could expand to anything
            raise DataError(f"{at} is compressed ({info.file_size} bytes in {info.compress_size}); torch never is")
        if info.file_size != info.compress_size:
            raise DataError(f"{at}: a damaged header: {info.file_size} bytes stored in {info.compress_size}")
        if nbytes is not None and info.file_size != nbytes:
            raise DataError(f"{at} holds {info.file_size} bytes, its storage needs {nbytes}")
        if info.header_offset + info.file_size > file_size:
            raise DataError(f"{at} declares {info.file_size} bytes from byte {info.header_offset}, past the end of the "
                            f"file ({file_size} bytes)")
        with _zip_errors(f"{where}{what or ''}"):
            return archive.read(info)

    if prefix + "byteorder" in names and (order := entry("byteorder")) != b"little":
        raise DataError(f"{where}: byte order {order[:20]!r}: only little-endian files are read")
    storages: dict[str, _Storage] = {}
    loaded = restricted_loads(entry("data.pkl"), where, TORCH_GLOBALS, persistent_load=_storage_ids(storages, 5, where),
                              kind=_KIND)
    tensors = _pick(loaded, key, where)
    return _arrays(tensors, file_size, where,
                   lambda storage, what: entry(f"data/{storage.key}", storage.numel * storage.dtype.itemsize, what))


@contextlib.contextmanager
def _zip_errors(where: str):
    try:
        yield
    except Exception as e:  # zipfile raises BadZipFile, EOFError, UnicodeDecodeError, struct.error… on damaged zips
        raise DataError(f"{where}: not a valid PyTorch zip file: {type(e).__name__}: {e}") from None


def _load_legacy(data: bytes, where: str, key: str | None) -> dict[str, np.ndarray]:
    if not data.startswith(b"\x80"):
        raise DataError(f"{where}: not a PyTorch file: neither a zip nor a pickle (the legacy format)")
    magic, pos = _pickle_at(data, 0, where)
    if magic != _LEGACY_MAGIC:
        raise DataError(f"{where}: not a PyTorch file: a pickle of {type(magic).__name__}, not torch's magic number")
    version, pos = _pickle_at(data, pos, where)
    if version != _LEGACY_PROTOCOL:
        raise DataError(f"{where}: legacy PyTorch protocol version {version!r:.40} is not {_LEGACY_PROTOCOL}")
    sys_info, pos = _pickle_at(data, pos, where)
    if not (isinstance(sys_info, dict) and sys_info.get("little_endian") is True):
        raise DataError(f"{where}: sys info {sys_info!r:.120}: only little-endian files are read")
    storages: dict[str, _Storage] = {}
    loaded, pos = _pickle_at(data, pos, where, _storage_ids(storages, 6, where))
    keys, pos = _pickle_at(data, pos, where)
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise DataError(f"{where}: the storage list is a {type(keys).__name__}, not a list of keys")
    slots = {}  # storage key → its bytes in the file (a view: nothing copied yet)
    for k in keys:
        storage = storages.get(k)
        if storage is None:
            raise DataError(f"{where}: the file stores storage {k!r:.40}, which its pickle never uses")
        if pos + 8 > len(data):
            raise DataError(f"{where}: the file ends at byte {len(data)}, before storage {k!r:.40}")
        numel = int.from_bytes(data[pos:pos + 8], "little", signed=True)
        pos += 8
        if numel != storage.numel or pos + numel * storage.dtype.itemsize > len(data):
            raise DataError(f"{where}: storage {k!r:.40} at byte {pos - 8}: {numel} elements (the pickle says "
                            f"{storage.numel}) in {len(data) - pos} bytes left")
        slots[k] = memoryview(data)[pos:pos + numel * storage.dtype.itemsize]
        pos += numel * storage.dtype.itemsize
    if pos != len(data):
        raise DataError(f"{where}: {len(data) - pos} bytes after the last storage")
    tensors = _pick(loaded, key, where)

    def slot(storage: _Storage, what: str) -> memoryview:
        if storage.key not in slots:
            raise DataError(f"{where}{what}: storage {storage.key!r:.40} is not in the file's storage list")
        return slots[storage.key]

    return _arrays(tensors, len(data), where, slot)


def _pickle_at(data: bytes, start: int, where: str, persistent_load=None):
    """The pickle starting at byte ``start`` (``TORCH_GLOBALS`` with ``persistent_load``, else no globals) and the
    byte after its STOP."""
    stream = io.BytesIO(data)  # shares data's buffer: reading the opcodes copies nothing
    stream.seek(start)
    try:
        for _ in pickletools.genops(stream):
            pass
    except Exception as e:  # genops raises ValueError, UnicodeDecodeError… on damaged opcodes
        raise DataError(f"{where}: not a valid legacy PyTorch file: the pickle at byte {start}: {e}") from None
    end = stream.tell()
    allowed = TORCH_GLOBALS if persistent_load else {}
    return restricted_loads(data[start:end], where, allowed, persistent_load=persistent_load, kind=_KIND), end


def _storage_ids(storages: dict[str, _Storage], length: int, where: str):
    """``persistent_load`` for ``('storage', storage type, key, location, numel)`` (``length`` 5; legacy: 6, with a
    ``None`` view): the storage, entered in ``storages`` (one per key)."""

    def persistent_load(pid) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == length and pid[0] == "storage"):
            raise DataError(f"{where}: persistent id {pid!r:.120} is not a storage's")
        _, storage_type, key, location, numel = pid[:5]
        if not (isinstance(storage_type, _StorageType) and isinstance(key, str) and isinstance(location, str)
                and type(numel) is int and numel >= 0):
            raise DataError(f"{where}: persistent id {pid!r:.120} is not (storage, type, key, location, numel)")
        if length == 6 and pid[5] is not None:  # torch < 1.0's views into a storage; later versions write None
            raise DataError(f"{where}: storage {key!r:.40} is a view {pid[5]!r:.80} (torch < 1.0), not read here")
        storage = storages.setdefault(key, _Storage(key, storage_type.dtype, numel))
        if (storage.dtype, storage.numel) != (storage_type.dtype, numel):
            raise DataError(f"{where}: storage {key!r:.40} is {numel} × {storage_type.dtype} and also "
                            f"{storage.numel} × {storage.dtype}")
        return storage

    return persistent_load


def _kind_of(value) -> str:
    return type(value).__name__.strip("_")  # the placeholders' names without their underscore: Tensor, OrderedDict


def _is_state_dict(value) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, _Tensor) for k, v in value.items())


def _pick(loaded, key: str | None, where: str) -> dict[str, _Tensor]:
    """The state dict: ``loaded`` itself, or its entry ``key``."""
    if key is not None:
        if not (isinstance(loaded, dict) and key in loaded):
            raise DataError(f"{where}: no entry {key!r} at the top of the file (a {_kind_of(loaded)}"
                            + (f" of {', '.join(map(repr, list(loaded)[:10]))}" if isinstance(loaded, dict) else "")
                            + ")")
        loaded, where = loaded[key], f"{where} [{key!r}]"
    if _is_state_dict(loaded):
        return loaded
    inner = [k for k, v in loaded.items() if _is_state_dict(v) and v] if isinstance(loaded, dict) else []
    raise DataError(f"{where}: not a state dict (names → tensors) but a {_kind_of(loaded)}"
                    + (f"; it holds state dicts under {', '.join(map(repr, inner))}: pass key={inner[0]!r} "
                       f"(--key {inner[0]} on the command line)" if inner else ""))


def _arrays(tensors: dict[str, _Tensor], file_size: int, where: str, read) -> dict[str, np.ndarray]:
    """Every tensor cut from its storage: views checked, then each storage read (``read(storage, what)`` → its
    bytes) once and all its views copied out."""
    views = {}  # storage key → {view: (name, tensor)}, one array per distinct view: tied weights share it
    for name, tensor in tensors.items():
        _check_view(tensor, f"{where} ({name})")
        views.setdefault(tensor.storage.key, {}).setdefault(tensor.view(), (name, tensor))
    total = sum(tensor.nbytes() for group in views.values() for _, tensor in group.values())
    if total > _MAX_EXPANSION * file_size:
        raise DataError(f"{where}: its tensors would take {total} bytes, more than {_MAX_EXPANSION}× the file's "
                        f"{file_size}: its views repeat their storages")
    out = {}
    for group in views.values():
        name, tensor = next(iter(group.values()))
        flat = np.frombuffer(read(tensor.storage, f" ({name})"), tensor.storage.dtype, tensor.storage.numel)
        out.update({view: _copy(flat, tensor) for view, (_, tensor) in group.items()})
        del flat  # the storage's bytes go before the next storage is read
    return {name: out[tensor.view()] for name, tensor in tensors.items()}


def _check_view(tensor: _Tensor, where: str) -> None:
    """The view's last element lies inside its storage: ``offset + Σ (size − 1) · stride < numel``."""
    # numpy's limits: 64 dimensions (32 before 2.0) and fewer than 2⁶³ bytes in the shape (zero sizes left out)
    if len(tensor.size) > 32 or math.prod(max(n, 1) for n in tensor.size) * tensor.storage.dtype.itemsize >= 2**62:
        raise DataError(f"{where}: size {tensor.size!r:.120} is no array's shape")
    if 0 in tensor.size:
        return  # holds nothing, wherever it points (as torch sees it)
    last = tensor.offset + sum((n - 1) * s for n, s in zip(tensor.size, tensor.stride))
    if last >= tensor.storage.numel:
        raise DataError(f"{where}: the view (offset {tensor.offset}, size {tensor.size}, stride {tensor.stride}) "
                        f"reaches element {last} of a storage of {tensor.storage.numel}")


def _copy(flat: np.ndarray, tensor: _Tensor) -> np.ndarray:
    """The checked view of ``flat`` (the storage's elements) as a standalone C-contiguous array."""
    if 0 in tensor.size:
        return np.empty(tensor.size, flat.dtype)
    view = np.lib.stride_tricks.as_strided(flat[tensor.offset:], tensor.size,
                                           [s * flat.itemsize for s in tensor.stride], writeable=False)
    return np.array(view, order="C")


_STORAGES = {np.dtype(np.float32): "FloatStorage", np.dtype(np.float16): "HalfStorage",
             np.dtype(np.float64): "DoubleStorage", np.dtype(np.int64): "LongStorage", np.dtype(np.int32): "IntStorage",
             np.dtype(np.uint8): "ByteStorage", np.dtype(np.bool_): "BoolStorage"}
_ALIGNMENT = 64  # torch.save starts every storage at a multiple of 64 bytes in the file


class _Pickle:
    """The few pickle (protocol 2) opcodes ``torch.save`` writes for a state dict, emitted directly: the torch globals
    it names need not exist in this process."""

    def __init__(self):
        self.out = io.BytesIO()
        self.out.write(b"\x80\x02")

    def op(self, code: bytes):
        self.out.write(code)

    def glob(self, module: str, name: str):
        self.out.write(b"c" + module.encode() + b"\n" + name.encode() + b"\n")

    def text(self, value: str):
        data = value.encode("utf-8")
        self.out.write(b"X" + struct.pack("<I", len(data)) + data)

    def int(self, value: int):
        if 0 <= value < 256:
            self.out.write(b"K" + bytes([value]))
        elif -2**31 <= value < 2**31:
            self.out.write(b"J" + struct.pack("<i", value))
        else:
            data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            self.out.write(b"\x8a" + bytes([len(data)]) + data)

    def ints(self, values):
        self.op(b"(")
        for v in values:
            self.int(v)
        self.op(b"t")


def _state_dict_pickle(state: dict[str, np.ndarray]) -> bytes:
    """``data.pkl`` of ``torch.save(OrderedDict(state))``: tensor ``i`` in storage ``str(i)``, C-contiguous."""
    p = _Pickle()
    p.glob("collections", "OrderedDict")
    p.op(b")R(")  # OrderedDict(), MARK for SETITEMS
    for i, (key, array) in enumerate(state.items()):
        p.text(key)
        p.glob("torch._utils", "_rebuild_tensor_v2")
        p.op(b"((")  # MARK args, MARK persistent id
        p.text("storage")
        p.glob("torch", _STORAGES[array.dtype])
        p.text(str(i))
        p.text("cpu")
        p.int(array.size)
        p.op(b"tQ")  # the persistent id tuple, BINPERSID
        p.int(0)  # storage offset
        p.ints(array.shape)
        p.ints([s // array.itemsize for s in array.strides])
        p.op(b"\x89")  # requires_grad False
        p.glob("collections", "OrderedDict")
        p.op(b")Rt")  # backward hooks OrderedDict(); the argument tuple
        p.op(b"R")  # _rebuild_tensor_v2(*args)
    p.op(b"u.")  # SETITEMS, STOP
    return p.out.getvalue()


def save_pth(path: str | os.PathLike, state: Mapping[str, np.ndarray]) -> None:
    """Write ``state`` (name → array of float32/16/64, int64/32, uint8 or bool) as ``torch.save`` does: a zip of
    ``archive/data.pkl``, ``archive/data/<i>`` (each array's little-endian bytes, stored uncompressed, 64-byte
    aligned), ``archive/byteorder`` and ``archive/version``. ``torch.load(path, weights_only=True)`` reads it as an
    ``OrderedDict`` of CPU tensors. Written to ``path``.tmp, then renamed."""
    arrays = {}
    for key, value in state.items():
        array = np.asarray(value)
        array = array.astype(array.dtype.newbyteorder("<"), order="C", copy=not array.flags.c_contiguous)
        if array.dtype not in _STORAGES:
            raise ValueError(f"{key}: cannot write {array.dtype} tensors (only {', '.join(map(str, _STORAGES))})")
        arrays[key] = array
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            def record(name: str, data: bytes):
                info = zipfile.ZipInfo(f"archive/{name}", date_time=(1980, 1, 1, 0, 0, 0))
                start = archive.fp.tell() + 30 + len(info.filename.encode())  # where the data would begin
                pad = -(start + 4) % _ALIGNMENT  # an extra field (id "FB", as torch's) pushes it to the alignment
                info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
                archive.writestr(info, data)

            record("data.pkl", _state_dict_pickle(arrays))
            record("byteorder", b"little")
            for i, array in enumerate(arrays.values()):
                record(f"data/{i}", array.tobytes())
            record("version", b"3\n")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
