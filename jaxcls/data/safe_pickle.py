"""Unpickling files from strangers: only the few functions a format needs are ever looked up, and nothing else runs.

A pickle is a program: while it loads it may import and call any function (``os.system``, ``exec``,
``subprocess.Popen``…), so ``pickle.load`` on a downloaded ``.bin`` or ``.pth`` runs whatever its author wrote.
``restricted_loads`` reads a pickle in two passes:

1. The opcodes alone (as ``pickletools.genops`` reads them, constructing nothing): every length must lie inside the
   data (so no length field makes the loader allocate what the file does not hold), and every global the pickle
   names, by ``GLOBAL``/``INST`` or by ``STACK_GLOBAL`` on the two strings pushed just before it, must be in the
   caller's ``allowed`` table. Any other global is refused here, before a single object is built, whether it sits at
   the top level or deep inside a list.
2. The load, by an unpickler whose ``find_class`` gives out only ``allowed``'s functions (each of which checks its
   own arguments), wrapped so that the pickle can call them but not change them, and whose ``persistent_load`` is
   the caller's or refuses. Values in ``allowed`` that are not callable are handed out as they are: they must
   refuse BUILD themselves (``__setstate__``) if they can be changed.
"""

from __future__ import annotations

import codecs
import io
import pickle
import pickletools
from collections.abc import Callable, Mapping

from jaxcls.errors import DataError

Allowed = Mapping[tuple[str, str], Callable]

_STRING_PUSHES = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING",
                  "STRING"}
_MEMO_GETS = {"GET", "BINGET", "LONG_BINGET"}
_MEMO_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}


class RefusedPickle(DataError):
    """A pickle that would look up a function its format never needs (the message names it); nothing was run."""


def restricted_loads(data: bytes, where: str, allowed: Allowed, *, persistent_load: Callable | None = None,
                     encoding: str = "bytes", kind: str = "file"):
    """The object pickled in ``data``, built only with ``allowed[(module, name)]`` functions.

    ``where`` starts every error (a file's path); ``kind`` says what the file should be (``"verification .bin"``).
    A refused global raises ``RefusedPickle`` before anything is built; any other damage raises ``DataError``.
    ``encoding`` decodes Python 2 ``str`` (``"bytes"``: they stay ``bytes``, as images must).
    """
    _check_opcodes(data, where, allowed, kind, persistent_load is not None)
    unpickler = _Unpickler(io.BytesIO(data), encoding=encoding)
    unpickler.where, unpickler.allowed, unpickler.kind, unpickler.handler = where, allowed, kind, persistent_load
    try:
        return unpickler.load()
    except DataError:
        raise
    except Exception as e:  # damaged pickles raise almost any type
        raise DataError(f"{where}: not a valid {kind}: {type(e).__name__}: {e}") from None


def _refuse(where: str, kind: str, what: str, allowed: Allowed) -> RefusedPickle:
    names = ", ".join(sorted({f"{m}.{n}" for m, n in allowed})) or "none"
    return RefusedPickle(f"{where}: refused to load: the pickle asks for {what}, which a {kind} never holds "
                         f"(it may only use: {names}); nothing in the file was run")


def _check_opcodes(data: bytes, where: str, allowed: Allowed, kind: str, persistent_ids: bool) -> None:
    """Pass 1: walk the opcodes (building nothing); refuse unknown globals and persistent ids, lengths past the end."""
    pushed, memo = [], {}  # the recent pushes' string values (None: not a string), and the memo's strings
    try:
        for name, arg in _opcodes(data):
            if name in ("GLOBAL", "INST"):
                module, _, attribute = arg.partition(" ")
                if (module, attribute) not in allowed:
                    raise _refuse(where, kind, f"{module}.{attribute}", allowed)
            elif name == "STACK_GLOBAL":
                module, attribute = pushed[-2:] if len(pushed) >= 2 else (None, None)
                if not isinstance(module, str) or not isinstance(attribute, str) or (module, attribute) not in allowed:
                    raise _refuse(where, kind, f"{module}.{attribute}" if module and attribute
                                  else "a global whose name it computes", allowed)
            elif name in ("PERSID", "BINPERSID") and not persistent_ids:
                raise _refuse(where, kind, "a persistent id (an object stored outside the pickle)", allowed)
            elif name.startswith("EXT"):
                raise _refuse(where, kind, "a global from the extension registry", allowed)
            if name in _MEMO_PUTS or name == "MEMOIZE":
                memo[arg if name in _MEMO_PUTS else len(memo)] = pushed[-1] if pushed else None
            elif name in _MEMO_GETS:
                pushed.append(memo.get(arg))
            elif name in _STRING_PUSHES:
                pushed.append(arg.decode("latin1") if isinstance(arg, bytes) else arg)
            elif name != "FRAME":
                pushed.append(None)
            del pushed[:-2]
    except RefusedPickle:
        raise
    except Exception as e:  # the argument readers raise ValueError on lengths past the end
        raise DataError(f"{where}: not a valid {kind}: {e}") from None


def _opcodes(data: bytes):
    """``(opcode name, argument)`` up to STOP: ``pickletools.genops``, but with protocol 0's quoted ``STRING`` read
    as bytes (genops wants ASCII there, which Python 2's pickles of binary ``str`` are not)."""
    stream = io.BytesIO(data)
    while True:
        code = stream.read(1)
        opcode = pickletools.code2op.get(code.decode("latin-1"))
        if opcode is None:
            raise ValueError(f"at byte {stream.tell() - 1}: opcode {code!r} unknown" if code else
                             "the pickle ends before its STOP opcode")
        if opcode.name == "STRING":
            line = stream.readline()
            if not (line.endswith(b"\n") and len(line) >= 3 and line[0] == line[-2] and line[:1] in (b"'", b'"')):
                raise ValueError(f"at byte {stream.tell() - len(line)}: a STRING without quotes and newline")
            arg = codecs.escape_decode(line[1:-2])[0]
        else:
            arg = opcode.arg.reader(stream) if opcode.arg else None
        yield opcode.name, arg
        if opcode.name == "STOP":
            return


class _Guarded:
    """An allowed function as the unpickler hands it out: callable (REDUCE), but nothing of it can be changed by
    BUILD, which would otherwise set its attributes (``__defaults__``…) for the whole process."""

    __slots__ = ("function",)

    def __init__(self, function):
        self.function = function

    def __call__(self, *args):
        return self.function(*args)

    def __setstate__(self, state):
        raise ValueError(f"the pickle sets attributes of {getattr(self.function, '__name__', 'a function')}")


class _Unpickler(pickle.Unpickler):
    """Pass 2: ``find_class`` and ``persistent_load`` limited to what the caller allows."""

    def find_class(self, module, name):
        if (module, name) not in self.allowed:  # pass 1 saw every name already; kept as the rule itself
            raise _refuse(self.where, self.kind, f"{module}.{name}", self.allowed)
        value = self.allowed[module, name]
        return _Guarded(value) if callable(value) else value

    def persistent_load(self, pid):
        if self.handler is None:
            raise _refuse(self.where, self.kind, "a persistent id (an object stored outside the pickle)",
                          self.allowed)
        return self.handler(pid)
