"""NCCL through ctypes: find ``libnccl.so.2``, report its version, make communicators, run collectives.

The library comes from the ``nvidia-nccl-cu12`` wheel (``pip install "spark-hvd[nccl]"``), from
the copy a CUDA build of torch brings, from ``SPARK_HVD_NCCL_LIBRARY``, or from the system. Loading
it needs no GPU; making a communicator does. Every call's status is checked: a failure raises
:class:`NcclError` with NCCL's own message.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
from typing import Any, List, Optional, Sequence

from .errors import CollectiveError
from .ops import ReduceOp

__all__ = ["NcclError", "NcclUnavailable", "NcclLibrary", "NcclComm", "library_candidates", "load_nccl",
           "UNIQUE_ID_BYTES", "nccl_dtype", "nccl_op"]

UNIQUE_ID_BYTES = 128

# ncclDataType_t and ncclRedOp_t, as nccl.h numbers them.
_DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "int64": 4, "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9,
           "bool": 1}
_OPS = {ReduceOp.Sum: 0, ReduceOp.Product: 1, ReduceOp.Max: 2, ReduceOp.Min: 3, ReduceOp.Average: 4}


class NcclError(CollectiveError):
    """An NCCL call failed; the message is NCCL's."""


class NcclUnavailable(RuntimeError):
    """NCCL cannot be used here; the message says why and what would fix it."""


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


def nccl_dtype(wire: str) -> int:
    try:
        return _DTYPES[wire]
    except KeyError:
        raise ValueError(f"NCCL has no type for {wire!r}; expected one of {sorted(_DTYPES)}") from None


def nccl_op(op: ReduceOp) -> int:
    try:
        return _OPS[ReduceOp(op)]
    except KeyError:
        raise NotImplementedError(f"op={ReduceOp(op).name} has no NCCL reduction") from None


def library_candidates(explicit: Optional[str] = None) -> List[str]:
    """Where libnccl is looked for, in order: the explicit path, the nvidia-nccl-cu12 wheel, torch's
    own library folder, then the system's loader path."""
    found: List[str] = []
    if explicit:
        found.append(explicit)
    for package, pattern in (("nvidia", os.path.join("nccl", "lib", "libnccl.so*")),
                             ("torch", os.path.join("lib", "libnccl.so*"))):
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        for root in (spec.submodule_search_locations or []) if spec is not None else []:
            found.extend(sorted(glob.glob(os.path.join(root, pattern))))
    system = ctypes.util.find_library("nccl")
    if system:
        found.append(system)
    return found


class NcclComm:
    """One NCCL communicator: collectives on device pointers, queued on a CUDA stream."""

    def __init__(self, lib: "NcclLibrary", handle: ctypes.c_void_p, rank: int, size: int) -> None:
        self._lib = lib
        self.handle = handle
        self.rank = rank
        self.size = size

    def all_reduce(self, send: int, recv: int, count: int, wire: str, op: ReduceOp, stream: int) -> None:
        self._lib.call("ncclAllReduce", ctypes.c_void_p(send), ctypes.c_void_p(recv), ctypes.c_size_t(count),
                       nccl_dtype(wire), nccl_op(op), self.handle, ctypes.c_void_p(stream))

    def broadcast(self, send: int, recv: int, count: int, wire: str, root: int, stream: int) -> None:
        self._lib.call("ncclBroadcast", ctypes.c_void_p(send), ctypes.c_void_p(recv), ctypes.c_size_t(count),
                       nccl_dtype(wire), root, self.handle, ctypes.c_void_p(stream))

    def reduce(self, send: int, recv: int, count: int, wire: str, op: ReduceOp, root: int, stream: int) -> None:
        self._lib.call("ncclReduce", ctypes.c_void_p(send), ctypes.c_void_p(recv), ctypes.c_size_t(count),
                       nccl_dtype(wire), nccl_op(op), root, self.handle, ctypes.c_void_p(stream))

    def reduce_scatter(self, send: int, recv: int, count: int, wire: str, op: ReduceOp, stream: int) -> None:
        """Member r receives block r (``count`` elements) of the reduction of everyone's ``send``
        (``count * size`` elements)."""
        self._lib.call("ncclReduceScatter", ctypes.c_void_p(send), ctypes.c_void_p(recv), ctypes.c_size_t(count),
                       nccl_dtype(wire), nccl_op(op), self.handle, ctypes.c_void_p(stream))

    def all_gather(self, send: int, recv: int, count: int, wire: str, stream: int) -> None:
        """``recv`` (``count * size`` elements) gets every member's ``send`` in member order."""
        self._lib.call("ncclAllGather", ctypes.c_void_p(send), ctypes.c_void_p(recv), ctypes.c_size_t(count),
                       nccl_dtype(wire), self.handle, ctypes.c_void_p(stream))

    def send(self, buf: int, count: int, wire: str, peer: int, stream: int) -> None:
        self._lib.call("ncclSend", ctypes.c_void_p(buf), ctypes.c_size_t(count), nccl_dtype(wire), peer,
                       self.handle, ctypes.c_void_p(stream))

    def recv(self, buf: int, count: int, wire: str, peer: int, stream: int) -> None:
        self._lib.call("ncclRecv", ctypes.c_void_p(buf), ctypes.c_size_t(count), nccl_dtype(wire), peer,
                       self.handle, ctypes.c_void_p(stream))

    def group_start(self) -> None:
        self._lib.call("ncclGroupStart")

    def group_end(self) -> None:
        self._lib.call("ncclGroupEnd")

    def destroy(self) -> None:
        if self.handle:
            self._lib.call("ncclCommDestroy", self.handle)
            self.handle = ctypes.c_void_p()

    def abort(self) -> None:
        if self.handle:
            self._lib.call("ncclCommAbort", self.handle)
            self.handle = ctypes.c_void_p()


class NcclLibrary:
    """A loaded libnccl."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._cdll = ctypes.CDLL(path)
        except OSError as exc:
            raise NcclUnavailable(f"cannot load {path}: {exc}") from None
        if not hasattr(self._cdll, "ncclGetVersion"):
            raise NcclUnavailable(f"{path} is not NCCL: it has no ncclGetVersion")
        self._cdll.ncclGetErrorString.restype = ctypes.c_char_p
        version = ctypes.c_int()
        self.call("ncclGetVersion", ctypes.byref(version))
        self.version = version.value

    def call(self, name: str, *args: Any) -> None:
        status = getattr(self._cdll, name)(*args)
        if status != 0:
            message = self._cdll.ncclGetErrorString(status).decode(errors="replace")
            raise NcclError(f"{name} failed: {message} (ncclResult_t {status})")

    def version_string(self) -> str:
        """``2.32.3`` from NCCL's integer version."""
        v = self.version
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 10000 else f"{v // 1000}.{v // 100 % 10}.{v % 100}"

    def unique_id(self) -> bytes:
        uid = _UniqueId()
        self.call("ncclGetUniqueId", ctypes.byref(uid))
        return bytes(uid.internal)

    def init_rank(self, size: int, uid: bytes, rank: int) -> NcclComm:
        if len(uid) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        handle = ctypes.c_void_p()
        self.call("ncclCommInitRank", ctypes.byref(handle), size, _UniqueId(uid), rank)
        return NcclComm(self, handle, rank, size)


def load_nccl(candidates: Optional[Sequence[str]] = None) -> NcclLibrary:
    """The first candidate that loads as NCCL; NcclUnavailable saying what was tried and how to install it."""
    tried = []
    for path in library_candidates() if candidates is None else candidates:
        try:
            return NcclLibrary(path)
        except NcclUnavailable as exc:
            tried.append(str(exc))
    detail = "; ".join(tried) if tried else "no libnccl.so was found"
    raise NcclUnavailable(
        f"NCCL is not available ({detail}); install it with `pip install \"spark-hvd[nccl]\"` (the "
        "nvidia-nccl-cu12 wheel) or set SPARK_HVD_NCCL_LIBRARY to a libnccl.so.2"
    )
