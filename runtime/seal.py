"""Seals: bytes that leave a process through a file or a store, tagged with the job's secret so
that the reader can tell them from anyone else's before it decodes them.

A seal is an HMAC-SHA256 tag over a context (what kind of bytes these are), the name they are
stored under (so one rank's file cannot stand in for another's) and the bytes themselves.
"""

from __future__ import annotations

import hashlib
import hmac

from .errors import TamperedError
from .wire import secret_bytes

__all__ = ["TAG_BYTES", "seal", "unseal"]

TAG_BYTES = hashlib.sha256().digest_size
"""Length of the tag that precedes the sealed bytes."""


def _tag(secret: str, context: bytes, name: str, data: bytes) -> bytes:
    return hmac.new(secret_bytes(secret), context + b"\0" + name.encode() + b"\0" + data, hashlib.sha256).digest()


def seal(secret: str, context: bytes, name: str, data: bytes) -> bytes:
    """``data`` preceded by its tag under ``secret`` for ``context`` and ``name``."""
    return _tag(secret, context, name, data) + data


def unseal(secret: str, context: bytes, name: str, blob: bytes) -> bytes:
    """The data of a :func:`seal` ed ``blob``; :class:`TamperedError` when the tag does not match."""
    tag, data = blob[:TAG_BYTES], blob[TAG_BYTES:]
    if len(tag) != TAG_BYTES or not hmac.compare_digest(tag, _tag(secret, context, name, data)):
        raise TamperedError(f"{name!r} is not sealed with this job's secret; refusing to read it")
    return data
