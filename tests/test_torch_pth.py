"""PyTorch ``.pth`` state dicts read without torch: both of ``torch.save``'s layouts give exactly torch's tensors; a
file carrying code is refused and nothing in it runs; a damaged one raises ``DataError`` naming the file.

torch writes the files (it is a test dependency; the reader never imports it): tests that need it skip without it.
Damage is made by hand: pickles re-zipped or re-joined after editing their bytes, zip headers patched.
"""

import collections
import io
import os
import pickle
import pickletools
import re
import struct
import subprocess
import sys
import tempfile
import tracemalloc
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxcls.errors import DataError
from jaxcls.data.safe_pickle import RefusedPickle
from jaxcls.interop import torch_pth
from jaxcls.interop.torch_pth import load_state_dict, save_pth
from test_safe_pickle import Payload

FORMATS = ("zip", "legacy")
INSIGHTFACE = Path(__file__).resolve().parents[2] / "shared" / "bench" / "insightface"


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch", reason="torch writes the files these tests read")


def save(torch, obj, path, layout):
    torch.save(obj, path, _use_new_zipfile_serialization=layout == "zip")
    return path


def every_kind(torch):
    """Every dtype; contiguous, transposed, sliced, permuted and offset views, some sharing one storage; a tied
    weight; 0-d and empty tensors."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 6, generator=g)
    sd = collections.OrderedDict(w=w, **{"w.t": w.t(), "w.slice": w[1:, ::2], "tied": w, "w.none": w[4:]})
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        sd[str(dtype)] = torch.randn(3, 5, generator=g).to(dtype)
    for dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        sd[str(dtype)] = torch.randint(-100 if dtype.is_signed else 0, 100, (7,), generator=g, dtype=dtype)
    sd["bool"] = torch.randn(2, 3, generator=g) > 0
    sd["bf16.t"] = sd["torch.bfloat16"].t()
    sd["permuted"] = torch.randn(2, 3, 4, generator=g).permute(2, 0, 1)
    sd["offset"] = torch.arange(10.0)[3:7]
    sd["scalar"] = torch.tensor(3.5)
    sd["num_batches_tracked"] = torch.tensor(7)
    sd["empty"] = torch.zeros(0, 5)
    return sd


def assert_same(got, expected, torch):
    """``got`` (the reader's) holds ``expected``'s (torch's) tensors exactly, in order, as standalone arrays."""
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        array, tensor = got[name], tensor.detach()
        assert array.shape == tuple(tensor.shape) and array.flags.c_contiguous and array.base is None, name
        if tensor.dtype == torch.bfloat16:
            assert array.dtype == ml_dtypes.bfloat16, name
            np.testing.assert_array_equal(array.astype(np.float32), tensor.float().numpy(), err_msg=name)
        else:
            assert array.dtype == tensor.numpy().dtype, name
            np.testing.assert_array_equal(array, tensor.numpy(), err_msg=name)


@pytest.mark.parametrize("layout", FORMATS)
def test_every_dtype_and_view_reads_exactly(torch, tmp_path, layout):
    sd = every_kind(torch)
    got = load_state_dict(save(torch, sd, tmp_path / "every.pth", layout))
    assert_same(got, sd, torch)
    assert got["tied"] is got["w"]  # one storage, one view: one array, as torch gives one tensor's storage twice
    got["w.t"][0, 0] = 100.0  # a copy: the other views of its storage stay
    assert got["w"][0, 0] == sd["w"][0, 0].item()


@pytest.mark.parametrize("layout", FORMATS)
def test_parameters_plain_dicts_and_checkpoints(torch, tmp_path, layout):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    params = model.state_dict(keep_vars=True)  # nn.Parameter: _rebuild_parameter
    assert isinstance(params["0.weight"], torch.nn.Parameter)
    assert_same(load_state_dict(save(torch, params, tmp_path / "params.pth", layout)), params, torch)
    plain = dict(model.state_dict())
    assert_same(load_state_dict(save(torch, plain, tmp_path / "plain.pth", layout)), plain, torch)
    assert load_state_dict(save(torch, {}, tmp_path / "none.pth", layout)) == {}

    # arcface_torch's checkpoint_gpu_<rank>.pt: the backbone, an SGD optimizer's state (as its state_dict() has it:
    # importing torch.optim alone takes seconds) and plain values
    optimizer = {"state": {0: {"momentum_buffer": torch.ones(4, 3)}, 1: {"momentum_buffer": torch.ones(4)}},
                 "param_groups": [{"lr": 0.1, "momentum": 0.9, "nesterov": False, "foreach": None, "params": [0, 1]}]}
    checkpoint = {"epoch": 3, "global_step": 100, "state_dict_backbone": model.state_dict(),
                  "state_optimizer": optimizer}
    path = save(torch, checkpoint, tmp_path / "checkpoint.pt", layout)
    assert_same(load_state_dict(path, key="state_dict_backbone"), model.state_dict(), torch)
    with pytest.raises(DataError, match="it holds state dicts under 'state_dict_backbone': pass "
                                        r"key='state_dict_backbone' \(--key state_dict_backbone on the command "
                                        r"line\)") as error:
        load_state_dict(path)
    assert str(error.value).startswith(f"{path}: not a state dict")
    with pytest.raises(DataError, match="no entry 'model' at the top of the file .*'epoch', 'global_step'"):
        load_state_dict(path, key="model")
    with pytest.raises(DataError, match=r"\['epoch'\]: not a state dict .* but a int"):
        load_state_dict(path, key="epoch")


@pytest.fixture(scope="module")
def arcface_r18(torch):
    """arcface_torch's r18 backbone's state dict after one training-mode batch (running stats and
    num_batches_tracked leave their defaults)."""
    if not (INSIGHTFACE / "backbones").is_dir():
        pytest.skip(f"insightface's arcface_torch backbones are not at {INSIGHTFACE}")
    sys.path.insert(0, str(INSIGHTFACE))
    try:
        from backbones import get_model
    finally:
        sys.path.remove(str(INSIGHTFACE))
    torch.manual_seed(0)
    model = get_model("r18", fp16=False, num_features=512)
    with torch.no_grad():
        model(torch.randn(2, 3, 112, 112))
    return model.state_dict()


@pytest.mark.parametrize("layout", FORMATS)
@pytest.mark.filterwarnings("ignore:`torch.cuda.amp.autocast:FutureWarning")  # iresnet's forward, with fp16=False
def test_an_arcface_torch_backbone_reads_exactly(torch, arcface_r18, tmp_path, layout):
    sd = arcface_r18
    assert sd["bn1.num_batches_tracked"].item() == 1 and sd["bn1.num_batches_tracked"].dtype == torch.int64
    got = load_state_dict(save(torch, sd, tmp_path / "backbone.pth", layout))
    assert_same(got, sd, torch)
    assert got["bn1.running_var"].dtype == np.float32 and got["bn1.num_batches_tracked"].dtype == np.int64


def payloads(marker):
    python = f"open({str(marker)!r}, 'w').write('ran')"
    return {"system": Payload(os.system, f"touch {marker}"), "exec": Payload(exec, python),
            "call": Payload(subprocess.call, [sys.executable, "-c", python])}


PLACES = {"top level": lambda payload, sd: payload,
          "in the state dict": lambda payload, sd: collections.OrderedDict([("evil", payload), *sd.items()]),
          "deep in a checkpoint": lambda payload, sd: {"state_dict": sd, "log": [1, {"hooks": (payload,)}]}}


@pytest.mark.parametrize("layout", FORMATS)
def test_a_payload_torch_would_run_is_proven_real(torch, tmp_path, layout):
    """The payload files below are real: torch.load without weights_only runs them."""
    marker = tmp_path / "marker"
    path = save(torch, PLACES["in the state dict"](payloads(marker)["system"], {"w": torch.ones(2)}),
                tmp_path / "evil.pth", layout)
    torch.load(path, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("layout", FORMATS)
@pytest.mark.parametrize("place", PLACES)
def test_a_file_carrying_code_is_refused_and_nothing_runs(torch, tmp_path, layout, place):
    marker = tmp_path / "marker"
    for name, payload in payloads(marker).items():
        path = save(torch, PLACES[place](payload, {"w": torch.ones(2)}), tmp_path / f"{name}.pth", layout)
        with pytest.raises(RefusedPickle, match=rf"\.{name}, which a PyTorch state dict never holds") as refused:
            load_state_dict(path)
        assert str(refused.value).startswith(f"{path}: refused to load"), refused.value
        assert "nothing in the file was run" in str(refused.value)
        assert not marker.exists(), f"{name} ran"


def legacy_parts(data: bytes) -> tuple[list[bytes], bytes]:
    """A legacy file's five pickles and the storages after them."""
    stream, parts = io.BytesIO(data), []
    for _ in range(5):
        start = stream.tell()
        list(pickletools.genops(stream))
        parts.append(data[start:stream.tell()])
    return parts, data[stream.tell():]


def rezip(path: Path, edits: dict, compression=zipfile.ZIP_STORED) -> Path:
    """``path`` written again with the entries named in ``edits`` (name → bytes, or function of the old bytes)
    replaced; ``compression`` for those entries."""
    with zipfile.ZipFile(path) as old:
        entries = [(info.filename, old.read(info)) for info in old.infolist()]
    with zipfile.ZipFile(path, "w") as new:
        for name, data in entries:
            short = name.split("/", 1)[1]
            edit = edits.get(short)
            new.writestr(name, edit(data) if callable(edit) else data if edit is None else edit,
                         compression if short in edits else zipfile.ZIP_STORED)
    return path


def edit_pickle(path: Path, layout: str, edit) -> Path:
    """The state dict's pickle in ``path`` replaced by ``edit(pickle)``."""
    if layout == "zip":
        return rezip(path, {"data.pkl": edit})
    parts, storages = legacy_parts(path.read_bytes())
    path.write_bytes(b"".join(parts[:3]) + edit(parts[3]) + parts[4] + storages)
    return path


def replace_once(old: bytes, new: bytes):
    def edit(data: bytes) -> bytes:
        assert data.count(old) == 1, (old, data)
        return data.replace(old, new)
    return edit


def zip_file(path: Path, data_pkl: bytes) -> Path:
    """A zip in torch's layout holding ``data_pkl`` and no storages."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("crafted/data.pkl", data_pkl)
        archive.writestr("crafted/version", "3\n")
    return path


def test_payloads_in_crafted_pickles_are_refused(tmp_path):
    """Hand-made pickles, no torch needed: code in a zip's data.pkl, and in each of a legacy stream's five pickles, is
    refused (plain pickle.loads runs it)."""
    marker = tmp_path / "marker"
    path = zip_file(tmp_path / "crafted.pth",
                    pickle.dumps(collections.OrderedDict(w=payloads(marker)["system"]), protocol=2))
    with pytest.raises(RefusedPickle, match=rf"^{re.escape(str(path))}: refused to load: .*\.system"):
        load_state_dict(path)
    parts = [pickle.dumps(value, protocol=2) for value in (0x1950A86A20F9469CFC6C, 1001, {"little_endian": True},
                                                            collections.OrderedDict(), [])]
    evil = pickle.dumps([payloads(marker)["system"]], protocol=2)
    for i in range(5):
        path.write_bytes(b"".join(parts[:i]) + evil + b"".join(parts[i + 1:]))
        with pytest.raises(RefusedPickle, match=r"\.system"):
            load_state_dict(path)
        assert not marker.exists()
    pickle.loads(evil)
    assert marker.exists()


def test_the_pickle_cannot_change_the_readers_objects(tmp_path):
    """BUILD sets attributes: on a global handed to the pickle (here the function's defaults, or the dtype a storage
    type stands for) it would change them for every later load; on an OrderedDict it may set only _metadata."""
    builds = {"Global": b"ctorch._utils\n_rebuild_tensor_v2\nN}X\x0c\x00\x00\x00__defaults__)s\x86b.",
              "StorageType": b"ctorch\nHalfStorage\nN}X\x05\x00\x00\x00dtypeK\x01s\x86b.",
              "OrderedDict": b"ccollections\nOrderedDict\n)R}X\x04\x00\x00\x00evilK\x01sb."}
    refusals = {"Global": "attributes of _rebuild_tensor_v2", "StorageType": "a StorageType",
                "OrderedDict": "on an OrderedDict"}  # the first refused by safe_pickle, the others here
    for name, build in builds.items():
        with pytest.raises(DataError, match=f"the pickle sets .*{refusals[name]}"):
            load_state_dict(zip_file(tmp_path / f"{name}.pth", b"\x80\x02" + build))
    assert torch_pth._rebuild_tensor_v2.__defaults__ == (None,)
    assert torch_pth.TORCH_GLOBALS["torch", "HalfStorage"].dtype == np.float16


@pytest.mark.parametrize("layout", FORMATS)
def test_whole_modules_and_other_objects_are_refused(torch, tmp_path, layout):
    module = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(RefusedPickle, match="torch.nn.modules.container.Sequential, which a PyTorch state dict"):
        load_state_dict(save(torch, module, tmp_path / "module.pth", layout))
    with pytest.raises(DataError, match="not a state dict .* but a Tensor"):
        load_state_dict(save(torch, torch.ones(3), tmp_path / "tensor.pth", layout))
    with pytest.raises(DataError, match="not a state dict .* but a list"):
        load_state_dict(save(torch, [torch.ones(3)], tmp_path / "list.pth", layout))
    with pytest.raises(DataError, match="tensor metadata {'neg': True}"):  # a lazily negated view
        load_state_dict(save(torch, {"w": torch.ones(2)._neg_view()}, tmp_path / "neg.pth", layout))


def test_files_not_from_torch_are_refused(tmp_path):
    path = tmp_path / "x.pth"
    for data, message in [(b"", "neither a zip nor a pickle"), (b"\x00" * 100, "neither a zip nor a pickle"),
                          (pickle.dumps({"a": 1}, protocol=2), "a pickle of dict, not torch's magic number"),
                          (pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + pickle.dumps(999, protocol=2),
                           "protocol version 999")]:
        path.write_bytes(data)
        with pytest.raises(DataError, match=message):
            load_state_dict(path)
    for names, message in [(["data.pkl"], "not in an archive folder"), (["a/version"], "no entry a/data.pkl")]:
        with zipfile.ZipFile(path, "w") as archive:
            for name in names:
                archive.writestr(name, b"")
        with pytest.raises(DataError, match=message):
            load_state_dict(path)


def small(torch):
    return collections.OrderedDict(w=torch.arange(6.0).reshape(2, 3), b=torch.ones(3, dtype=torch.float16),
                                   n=torch.tensor(2))


# w's persistent id, then its offset, size (2, 3) and stride (3, 1), as protocol 2 writes them (BININT1 K, TUPLE2)
NUMEL = {"zip": b"K\x06t", "legacy": b"K\x06Nt"}
OFFSET, STRIDE = b"QK\x00K\x02K\x03\x86", b"K\x03K\x01\x86"


@pytest.mark.parametrize("layout", FORMATS)
def test_views_outside_their_storage_and_wrong_sizes_are_refused(torch, tmp_path, layout):
    cases = {"offset": (OFFSET, b"QK\x01K\x02K\x03\x86", r"\(w\): the view \(offset 1, .*reaches element 6 of a "
                                                          r"storage of 6"),
             "stride": (STRIDE, b"K\x04K\x01\x86", r"\(w\): the view .*stride \(4, 1\)\) reaches element 6"),
             "numel": (NUMEL[layout], NUMEL[layout].replace(b"\x06", b"\x07"),
                       r"\(w\): .*data/0 holds 24 bytes, its storage needs 28" if layout == "zip" else
                       r"storage '\d+' at byte \d+: 6 elements \(the pickle says 7\)"),
             "expanded": (STRIDE, b"K\x00K\x00\x86", None)}  # a legal view (stride 0): read like torch
    for case, (old, new, message) in cases.items():
        path = save(torch, small(torch), tmp_path / f"{case}.pth", layout)
        edit_pickle(path, layout, replace_once(old, new))
        if message is None:
            np.testing.assert_array_equal(load_state_dict(path)["w"], torch.load(path)["w"].numpy())
            continue
        with pytest.raises(DataError, match=message) as error:
            load_state_dict(path)
        assert str(error.value).startswith(str(path)), error.value
    path = save(torch, small(torch), tmp_path / "short.pth", layout)
    if layout == "zip":
        rezip(path, {"data/0": lambda data: data[:-4]})
        message = r"\(w\): .*data/0 holds 20 bytes, its storage needs 24"
    else:
        parts, storages = legacy_parts(path.read_bytes())
        path.write_bytes(b"".join(parts) + storages[:-1])
        message = "the file ends|bytes left"
    with pytest.raises(DataError, match=message):
        load_state_dict(path)


def test_views_repeating_a_storage_are_refused(torch, tmp_path):
    """A few bytes viewed as a huge tensor (stride 0), or one storage viewed again and again, would fill memory."""
    path = save(torch, {"w": torch.ones(1).expand(10_000)}, tmp_path / "expanded.pth", "zip")
    with pytest.raises(DataError, match=r"tensors would take 40000 bytes, more than 4× the file's \d+"):
        load_state_dict(path)
    w = torch.ones(1000)
    path = save(torch, {f"w{i}": w[i:] for i in range(200)}, tmp_path / "repeated.pth", "zip")
    with pytest.raises(DataError, match="more than 4× the file's"):
        load_state_dict(path)
    path = save(torch, {f"w{i}": w for i in range(200)}, tmp_path / "tied.pth", "zip")  # identical views: one array
    assert len({id(array) for array in load_state_dict(path).values()}) == 1


def peak_bytes(load, path):
    """``load(path)``'s DataError message and the most memory it held meanwhile."""
    tracemalloc.start()
    try:
        with pytest.raises(DataError) as error:
            load(path)
        return str(error.value), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def patch_central_sizes(data: bytes, name: bytes, size: int) -> bytes:
    """The zip with entry ``name``'s sizes in the central directory set to ``size``."""
    record = data.index(b"PK\x01\x02", data.index(b"PK\x05\x06") - 1000)  # the records sit before its end
    while data[record + 46:record + 46 + len(name)] != name:
        record = data.index(b"PK\x01\x02", record + 4)
    return data[:record + 20] + struct.pack("<II", size, size) + data[record + 28:]


@pytest.mark.parametrize("layout", FORMATS)
def test_absurd_sizes_are_refused_before_allocating(torch, tmp_path, layout):
    """A storage of 2²⁹ floats (2 GiB) declared in the pickle and in the zip's header or the legacy element count:
    refused while the memory held stays far below."""
    huge = 1 << 29
    path = save(torch, {"w": torch.arange(6.0).reshape(2, 3)}, tmp_path / "huge.pth", layout)
    numel = NUMEL[layout].replace(b"K\x06", b"J" + struct.pack("<i", huge))  # BININT: a 4-byte int
    edit_pickle(path, layout, replace_once(NUMEL[layout], numel))
    if layout == "zip":
        path.write_bytes(patch_central_sizes(path.read_bytes(), b"huge/data/0", 4 * huge))
        expected = rf"^{re.escape(str(path))} \(w\): huge/data/0 declares {4 * huge} bytes from byte \d+, past the end"
    else:
        parts, storages = legacy_parts(path.read_bytes())
        path.write_bytes(b"".join(parts) + struct.pack("<q", huge) + storages[8:])  # w's is the only storage
        expected = (rf"^{re.escape(str(path))}: storage '\d+' at byte \d+: {huge} elements \(the pickle says {huge}\) "
                    r"in 24 bytes left")
    message, peak = peak_bytes(load_state_dict, path)
    assert re.search(expected, message) and peak < 1 << 20, (message, peak)


def test_compressed_storages_are_refused(torch, tmp_path):
    """torch stores its entries uncompressed: a compressed one is refused unread, and a zip bomb (here 16 MiB of zeros
    in a file of 17 KiB) is refused before anything is decompressed."""
    path = save(torch, {"w": torch.randn(1000)}, tmp_path / "deflated.pth", "zip")
    rezip(path, {"data/0": None}, zipfile.ZIP_DEFLATED)
    with pytest.raises(DataError, match=r"deflated\.pth \(w\): deflated/data/0 is compressed \(4000 bytes in \d+\)"):
        load_state_dict(path)
    path = save(torch, {"w": torch.zeros(1 << 22)}, tmp_path / "bomb.pth", "zip")
    rezip(path, {"data/0": None}, zipfile.ZIP_DEFLATED)
    assert path.stat().st_size < 1 << 15
    message, peak = peak_bytes(load_state_dict, path)
    assert message.startswith(f"{path}: its tensors would take 16777216 bytes, more than 4× the file's"), message
    assert peak < 1 << 20, peak


@pytest.fixture(scope="module")
def originals(torch):
    """Small files in both layouts, their bytes and what they hold."""
    sd = small(torch)
    with tempfile.TemporaryDirectory() as d:
        files = {layout: save(torch, sd, Path(d) / f"small-{layout}.pth", layout).read_bytes() for layout in FORMATS}
    return files, {name: tensor.numpy() for name, tensor in sd.items()}


@pytest.mark.parametrize("layout", FORMATS)
def test_every_truncation_is_refused(originals, tmp_path, layout):
    files, _ = originals
    path = tmp_path / "truncated.pth"
    data = files[layout]
    # a zip cut anywhere loses its directory at the end: every 7th byte there, every other of the legacy file
    for n in range(0, len(data), 7 if layout == "zip" else 2):
        path.write_bytes(data[:n])
        with pytest.raises(DataError) as error:
            load_state_dict(path)
        assert str(error.value).startswith(f"{path}: ") or str(error.value).startswith(f"{path} ("), (n, error.value)


DAMAGE = st.tuples(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=8),
                   st.one_of(st.none(), st.integers(0, 10**6)))
FUZZ = settings(max_examples=100, deadline=2000, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("layout", FORMATS)
@FUZZ
@given(damage=DAMAGE)
def test_damaged_files_give_the_data_or_a_data_error(originals, tmp_path, layout, damage):
    """Zip entries carry CRCs: damage gives exactly the data or a DataError. Legacy files have none: a changed byte
    of a storage changes a value, of the pickle a name, so any state dict may come back there."""
    files, expected = originals
    writes, cut = damage
    data = bytearray(files[layout])
    for position, value in writes:
        data[position % len(data)] = value
    path = tmp_path / "damaged.pth"
    path.write_bytes(bytes(data[:cut % len(data)] if cut is not None else data))
    try:
        got = load_state_dict(path)
    except DataError as e:
        assert str(e).startswith(str(path)), e
        return
    assert all(isinstance(k, str) and isinstance(v, np.ndarray) for k, v in got.items())
    if layout == "zip":
        assert list(got) == list(expected)
        for name, array in expected.items():
            np.testing.assert_array_equal(got[name], array)


def test_save_pth_writes_what_torch_loads(torch, tmp_path):
    rng = np.random.default_rng(0)
    state = {"w": rng.normal(size=(3, 4)).astype(np.float32), "t": rng.normal(size=(4, 3)).astype(np.float32).T,
             "n": np.array(7, np.int64), "h": np.arange(5, dtype=np.float16), "d": np.zeros((2, 0, 3)),
             "b": np.array([True, False]), "u": np.arange(3, dtype=np.uint8), "i": np.arange(-2, 2, dtype=np.int32),
             "naïve.ключ": np.float32([1, 2]), "big-endian": np.arange(3, dtype=">f4")}
    save_pth(tmp_path / "m.pth", state)
    loaded = torch.load(tmp_path / "m.pth", weights_only=True)
    assert list(loaded) == list(state)
    for key, value in state.items():
        assert loaded[key].numpy().dtype == value.dtype.newbyteorder("=") and np.array_equal(loaded[key], value), key
    ours = load_state_dict(tmp_path / "m.pth")
    assert all(np.array_equal(ours[k], v) and ours[k].dtype == v.dtype.newbyteorder("=") for k, v in state.items())
    with zipfile.ZipFile(tmp_path / "m.pth") as archive:  # storages aligned as torch.save aligns them
        for info in archive.infolist():
            if "/data/" in info.filename:
                assert (info.header_offset + 30 + len(info.filename) + len(info.extra)) % 64 == 0
    with pytest.raises(ValueError, match="complex64"):
        save_pth(tmp_path / "c.pth", {"c": np.zeros(2, np.complex64)})
