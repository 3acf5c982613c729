"""Byte payloads passed between a launcher and its ranks through files, sealed with the job secret.

A payload file is an HMAC-SHA256 tag over the bytes, then the bytes. Files are written under a
temporary name and renamed into place, so a reader never sees half a payload; a reader checks the
tag before returning anything, so nothing that did not come from a holder of the job secret is
ever unpickled.
"""

from __future__ import annotations

import io
import os
import types
from collections import ChainMap
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Union

from spark_hvd.runtime.seal import seal, unseal

__all__ = ["write_sealed", "read_sealed", "dumps_call", "FUNCTION_FILE", "result_file"]

FUNCTION_FILE = "fn"
"""Name of the file that holds the function a launcher sends to its ranks."""


def result_file(rank: int) -> str:
    """Name of the file in which ``rank`` leaves its outcome."""
    return f"result.{rank}"


_CONTEXT = b"spark-hvd/1 payload"


def dumps_call(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> bytes:
    """``(fn, args, kwargs)`` pickled with cloudpickle for the ranks, keeping the file name of every
    function pickled by value (cloudpickle writes "<dynamic-code>"), so a rank's traceback points
    at the user's own file and line."""
    import cloudpickle

    def code_reduce(code: types.CodeType) -> Any:
        rebuild, fields = cloudpickle.cloudpickle._code_reduce(code)
        return rebuild, tuple(code.co_filename if field == "<dynamic-code>" else field for field in fields)

    class CallPickler(cloudpickle.Pickler):
        dispatch_table = ChainMap({types.CodeType: code_reduce}, cloudpickle.Pickler.dispatch_table)

    with io.BytesIO() as buffer:
        CallPickler(buffer).dump((fn, tuple(args), dict(kwargs)))
        return buffer.getvalue()


def write_sealed(path: Union[str, os.PathLike], secret: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, sealed with ``secret`` (the file name is sealed too, so
    one rank's payload cannot stand in for another's)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(seal(secret, _CONTEXT, path.name, data))
    os.replace(tmp, path)


def read_sealed(path: Union[str, os.PathLike], secret: str) -> bytes:
    """The bytes of a sealed payload; ``spark_hvd.runtime.errors.TamperedError`` when the seal does not match."""
    path = Path(path)
    return unseal(secret, _CONTEXT, path.name, path.read_bytes())
