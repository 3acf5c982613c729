"""Byte payloads passed between a launcher and its ranks through files, sealed with the job secret.

A payload file is an HMAC-SHA256 tag over the bytes, then the bytes. Files are written under a
temporary name and renamed into place, so a reader never sees half a payload; a reader checks the
tag before returning anything, so nothing that did not come from a holder of the job secret is
ever unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from typing import Union

from spark_hvd.runtime.wire import secret_bytes

__all__ = ["write_sealed", "read_sealed", "TamperedPayloadError", "FUNCTION_FILE", "result_file"]

FUNCTION_FILE = "fn"
"""Name of the file that holds the function a launcher sends to its ranks."""


def result_file(rank: int) -> str:
    """Name of the file in which ``rank`` leaves its outcome."""
    return f"result.{rank}"


_TAG_BYTES = hashlib.sha256().digest_size
_CONTEXT = b"spark-hvd/1 payload\0"


class TamperedPayloadError(PermissionError):
    """A payload file's tag does not match its contents under the job secret."""


def _tag(secret: str, name: str, data: bytes) -> bytes:
    # The file name is part of the tag, so one rank's payload cannot stand in for another's.
    return hmac.new(secret_bytes(secret), _CONTEXT + name.encode() + b"\0" + data, hashlib.sha256).digest()


def write_sealed(path: Union[str, os.PathLike], secret: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, sealed with ``secret``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(_tag(secret, path.name, data))
        f.write(data)
    os.replace(tmp, path)


def read_sealed(path: Union[str, os.PathLike], secret: str) -> bytes:
    """The bytes of a sealed payload; TamperedPayloadError when the seal does not match."""
    path = Path(path)
    blob = path.read_bytes()
    tag, data = blob[:_TAG_BYTES], blob[_TAG_BYTES:]
    if len(tag) != _TAG_BYTES or not hmac.compare_digest(tag, _tag(secret, path.name, data)):
        raise TamperedPayloadError(
            f"payload {str(path)!r} is not sealed with this job's secret; refusing to read it"
        )
    return data
