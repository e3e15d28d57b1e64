"""Restricted unpickling: a pickle that carries code is refused and nothing in it runs; honest files load exactly.

Every payload below would create a marker file if it ran. Each is placed at the top level, inside the image list
and inside the pair flags of a verification ``.bin``, pickled with every protocol (0–5), and the marker must not exist
after the load was refused.
"""

import io
import os
import pickle
import pickletools
import struct
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from PIL import Image

from jaxcls.errors import DataError
from jaxcls.eval.verification import BIN_GLOBALS, load_bin
from jaxcls.data.safe_pickle import RefusedPickle, restricted_loads
from test_recordio import GLYPHS, needs_glyphs


def png(seed, size=8):
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), np.uint8)).save(buf, "PNG")
    return buf.getvalue()


class Payload:
    """Pickles as a call of ``function(*args)``, which would write the marker file."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def payloads(marker):
    python = f"open({str(marker)!r}, 'w').write('ran')"
    return {
        "os.system": Payload(os.system, f"touch {marker}"),
        "builtins.exec": Payload(exec, python),
        "builtins.eval": Payload(eval, f"{python} or 1"),
        "subprocess.call": Payload(subprocess.call, [sys.executable, "-c", python]),
        "builtins.open": Payload(open, str(marker), "w"),
        # a function whose name contains an allowed one
        "builtins.bytes.fromhex": Payload(bytes.fromhex, "00"),
    }


PLACES = {
    "top level": lambda payload, bins, flags: (payload, (bins, flags)),
    "in the images": lambda payload, bins, flags: (bins[:1] + [payload] + bins[1:], flags),
    "in the pair flags": lambda payload, bins, flags: (bins, flags[:1] + [payload] + flags[1:]),
}


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("place", PLACES)
def test_a_bin_carrying_code_is_refused_and_nothing_runs(tmp_path, place, protocol):
    marker = tmp_path / "marker"
    bins, flags = [png(i) for i in range(4)], [True, False]
    for name, payload in payloads(marker).items():
        path = tmp_path / f"{name}.bin"
        path.write_bytes(pickle.dumps(PLACES[place](payload, bins, flags), protocol=protocol))
        with pytest.raises(RefusedPickle) as refused:
            load_bin(path, size=8)
        message = str(refused.value)
        assert message.startswith(f"{path}: refused to load") and "nothing in the file was run" in message
        # the refused function is named as pickle names it (os.system is posix.system; exec, builtins or __builtin__)
        assert name.rsplit(".", 1)[-1] in message, message
        assert not marker.exists(), f"{name} ran"


def stack_global(module: bytes, name: bytes, memo_trick: bool) -> bytes:
    """A protocol 4 pickle calling ``module.name('x')``; with ``memo_trick`` the module string is memoized by an
    allowed global first and fetched back from the memo for the payload."""
    s = lambda text: b"\x8c" + bytes([len(text)]) + text + b"\x94"  # SHORT_BINUNICODE + MEMOIZE
    call = s(b"x") + b"\x85R"  # ('x',) and REDUCE
    if memo_trick:
        allowed = s(b"builtins") + s(b"bytes") + b"\x93" + b")R"  # builtins.bytes() → memo 0, 1, 2
        return b"\x80\x04" + allowed + b"h\x00" + s(name) + b"\x93" + call + b"\x86."  # memo 0 is 'builtins'
    return b"\x80\x04" + s(module) + s(name) + b"\x93" + call + b"."


@pytest.mark.parametrize("memo_trick", [False, True])
def test_stack_global_names_are_read_from_the_opcodes_and_the_memo(tmp_path, memo_trick):
    data = stack_global(b"builtins", b"exec", memo_trick)
    with pytest.raises(RefusedPickle, match="asks for builtins.exec"):
        restricted_loads(data, "f", BIN_GLOBALS)
    assert len(list(pickletools.genops(data))) > 5  # a well-formed pickle: refused for its global, not as garbage


@pytest.mark.parametrize("data, what", [
    (b"\x80\x04N\x8c\x04exec\x94\x93.", "a global whose name it computes"),  # the module is None at run time
    (b"\x80\x02X\x01\x00\x00\x00xQ.", "a persistent id"),
    (b"\x80\x02\x82\x01.", "the extension registry"),
    (b"(cos\nsystem\nS'true'\no.", "os.system"),  # INST's older sibling OBJ via MARK + GLOBAL
    (b"(S'true'\nios\nsystem\n.", "os.system"),  # INST
])
def test_every_way_to_name_a_global_is_checked(data, what):
    with pytest.raises(RefusedPickle, match=what):
        restricted_loads(data, "f", BIN_GLOBALS)


def test_a_refusal_comes_before_anything_is_built():
    built = []
    allowed = {("m", "f"): lambda *a: built.append(a)}
    # m.f('ok') is called first, os.system comes last: pass 1 refuses the file before m.f runs
    data = b"\x80\x02cm\nf\nX\x02\x00\x00\x00ok\x85Rcos\nsystem\nX\x01\x00\x00\x00x\x85R\x86."
    with pytest.raises(RefusedPickle, match="os.system"):
        restricted_loads(data, "f", allowed)
    assert built == []
    assert restricted_loads(data[:data.index(b"cos")] + b".", "f", allowed) is None and built == [("ok",)]


@pytest.mark.parametrize("call", [b"c__builtin__\nbytes\nJ\x00\x00\x00\x7f\x85R",  # bytes(2**31): 2 GB of zeros
                                  b"c_codecs\nencode\nX\x01\x00\x00\x00xX\x05\x00\x00\x00utf16\x86R",
                                  b"c__builtin__\nbytearray\nJ\x00\x00\x00\x7f\x85R"])
def test_allowed_functions_take_only_what_honest_pickles_give_them(call):
    with pytest.raises(DataError, match="not how bytes are pickled"):
        restricted_loads(b"\x80\x02" + call + b".", "f", BIN_GLOBALS)


@pytest.mark.parametrize("length_field", [b"B\xff\xff\xff\x7f", b"\x8e" + struct.pack("<Q", 1 << 62),
                                          b"\x8d" + struct.pack("<Q", 1 << 40)])
def test_a_length_beyond_the_data_is_refused_without_allocating_it(length_field):
    # (CPython's unpickler allocates a BINBYTES' length before reading it: 2 GB for the first one)
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match="not a valid file"):
            restricted_loads(b"\x80\x04" + length_field + b"abc.", "f", BIN_GLOBALS)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


def python2_pickle(bins, flags, protocol: int) -> bytes:
    """``(bins, flags)`` as Python 2's cPickle wrote it: images as ``str`` (STRING / BINSTRING), bools as ``I01``
    (protocols 0–1) or NEWTRUE (2)."""
    if protocol == 0:
        escape = lambda b: "".join(chr(c) if 32 <= c < 127 and c not in b"'\\" else f"\\x{c:02x}" for c in b)
        images = "".join(f"S'{escape(b)}'\na" for b in bins)
        bools = "".join(f"I0{int(f)}\na" for f in flags)
        return f"((l{images}(l{bools}t.".encode("latin1")
    strings = b"".join((b"U" + bytes([len(b)]) if len(b) < 256 else b"T" + struct.pack("<i", len(b))) + b
                       for b in bins)
    bools = b"".join((b"\x88" if f else b"\x89") if protocol == 2 else b"I0%d\n" % f for f in flags)
    body = b"](" + strings + b"e](" + bools + b"e"
    return (b"\x80\x02" + body + b"\x86." if protocol == 2 else b"(" + body + b"t.")


def honest_pickles(bins, flags):
    return ({f"protocol {p}": pickle.dumps((bins, flags), protocol=p) for p in range(pickle.HIGHEST_PROTOCOL + 1)}
            | {f"Python 2 protocol {p}": python2_pickle(bins, flags, p) for p in range(3)}
            | {"bytearrays, protocol 2": pickle.dumps(([bytearray(b) for b in bins], flags), protocol=2),
               "a tuple of images, protocol 4": pickle.dumps((tuple(bins), flags), protocol=4),
               "protocol 5 out-of-band-able bytearrays": pickle.dumps(([bytearray(b) for b in bins], flags),
                                                                      protocol=5)})


def test_honest_bins_of_every_protocol_load_the_same_pixels(tmp_path, rng):
    bins = [png(int(rng.integers(1 << 31)), size=int(rng.integers(4, 20))) for _ in range(6)]
    flags = [bool(f) for f in rng.integers(0, 2, 3)]
    expected = np.stack([np.asarray(Image.open(io.BytesIO(b)).convert("RGB").resize((8, 8), Image.BILINEAR))
                         for b in bins])
    for name, data in honest_pickles(bins, flags).items():
        (tmp_path / "x.bin").write_bytes(data)
        images, same = load_bin(tmp_path / "x.bin", size=8)
        np.testing.assert_array_equal(images, expected, err_msg=name)
        assert same.tolist() == flags and same.dtype == bool, name


@needs_glyphs
def test_the_glyphs_pairs_load_the_same_in_every_protocol(tmp_path):
    whole = (GLYPHS / "glyphs_pairs.bin").read_bytes()
    bins, flags = restricted_loads(whole, "glyphs_pairs.bin", BIN_GLOBALS)
    assert len(bins) == 12_000 and len(flags) == 6_000
    # every image of the shared file as Pillow decodes it, then the first 100 pairs in every protocol
    images, same = load_bin(GLYPHS / "glyphs_pairs.bin")
    assert same.tolist() == list(flags) and images.shape == (12_000, 112, 112, 3)
    np.testing.assert_array_equal(images[:9], [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in bins[:9]])
    for name, data in honest_pickles(list(bins[:200]), list(flags[:100])).items():
        (tmp_path / "x.bin").write_bytes(data)
        part, part_same = load_bin(tmp_path / "x.bin")
        np.testing.assert_array_equal(part, images[:200], err_msg=name)
        assert part_same.tolist() == list(flags[:100]), name


def test_the_pickle_cannot_change_an_allowed_function():
    # BUILD on _codecs.encode with the state (None, {'__defaults__': ('utf-8',)}) would set _latin1.__defaults__
    # for the rest of the process
    defaults = BIN_GLOBALS["_codecs", "encode"].__defaults__
    build = b"\x80\x02c_codecs\nencode\nN}X\x0c\x00\x00\x00__defaults__X\x05\x00\x00\x00utf-8\x85s\x86b."
    with pytest.raises(DataError, match="the pickle sets attributes of _latin1"):
        restricted_loads(build, "f", BIN_GLOBALS)
    assert BIN_GLOBALS["_codecs", "encode"].__defaults__ == defaults
