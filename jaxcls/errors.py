"""The error of every reader of untrusted files (RecordIO, images, ``.bin`` pairs, ``.pth`` state dicts, IJB
protocols): ``DataError``, whose message starts with where the problem is."""


class DataError(ValueError):
    """Unusable training or evaluation data; the message starts with where: file, key, ``.idx`` line, byte offset."""


def location(where) -> str:
    """A ``where`` argument as text: a string, or a function giving it (called only when an error names the record,
    so reading and decoding format nothing per image)."""
    return where() if callable(where) else where
