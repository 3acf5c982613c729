"""A stand-in for NCCL and for a framework's device tensors, so the device data plane runs on CPU.

``FakeNccl`` has NcclLibrary's interface; its communicators carry out collectives between the
processes of a job through files in a shared folder, reading and writing the buffers through
their addresses, as NCCL does with device pointers. ``NumpyDeviceOps`` plays the framework:
"device tensors" are numpy arrays. Together they exercise everything the runtime does for CUDA
tensors: id exchange, communicators per process set, fusion, scaling, grouped calls, lifecycle.
"""

from __future__ import annotations

import ctypes
import math
import os
import time
from typing import Any, List, Tuple

import numpy as np

from spark_hvd.runtime.ops import ReduceOp, reduce_into, scale_inplace, storage_dtype

__all__ = ["FakeNccl", "NumpyDeviceOps"]

_TIMEOUT_S = 60.0


def _read(ptr: int, nbytes: int) -> bytes:
    return ctypes.string_at(ptr, nbytes) if nbytes else b""


def _write(ptr: int, data: bytes) -> None:
    if data:
        ctypes.memmove(ptr, data, len(data))


def _wait_for(path: str) -> bytes:
    deadline = time.monotonic() + _TIMEOUT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"fake NCCL: {path} never appeared")
        time.sleep(0.001)
    with open(path, "rb") as f:
        return f.read()


def _put(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class FakeComm:
    def __init__(self, lib: "FakeNccl", comm_id: str, size: int, rank: int) -> None:
        self.lib = lib
        self.dir = os.path.join(lib.root, comm_id)
        os.makedirs(self.dir, exist_ok=True)
        self.size = size
        self.rank = rank
        self.seq = 0
        self.group: List[Tuple[Any, ...]] = []
        self.grouped = False
        self.calls: List[str] = []

    def _run(self, op: Tuple[Any, ...]) -> None:
        if self.grouped:
            self.group.append(op)
        else:
            self.seq += 1
            self._do(op, f"{self.seq}")

    def _do(self, op: Tuple[Any, ...], key: str) -> None:
        kind = op[0]
        self.calls.append(kind)
        if kind == "all_reduce":
            _, send, recv, count, wire, red = op
            self._reduce_to(send, recv, count, wire, red, key, root=None)
        elif kind == "reduce":
            _, send, recv, count, wire, red, root = op
            self._reduce_to(send, recv, count, wire, red, key, root=root)
        elif kind == "broadcast":
            _, send, recv, count, wire, root = op
            nbytes = count * storage_dtype(wire).itemsize
            path = os.path.join(self.dir, f"{key}.bcast")
            if self.rank == root:
                _put(path, _read(send, nbytes))
            _write(recv, _wait_for(path))
        elif kind == "reduce_scatter":
            _, send, recv, count, wire, red = op
            item = storage_dtype(wire).itemsize
            block = self._gather_all(send, count * self.size * item, key, wire)
            acc = None
            for part in block:
                part = part[self.rank * count:(self.rank + 1) * count].copy()
                if acc is None:
                    acc = part
                else:
                    reduce_into(acc, part, red, wire)
            _write(recv, acc.tobytes())
        elif kind == "all_gather":
            _, send, recv, count, wire = op
            parts = self._gather_all(send, count * storage_dtype(wire).itemsize, key, wire)
            _write(recv, b"".join(p.tobytes() for p in parts))
        elif kind == "send":
            _, buf, count, wire, peer = op
            _put(os.path.join(self.dir, f"{key}.p2p.{self.rank}.{peer}"), _read(buf, count * storage_dtype(wire).itemsize))
        elif kind == "recv":
            _, buf, count, wire, peer = op
            _write(buf, _wait_for(os.path.join(self.dir, f"{key}.p2p.{peer}.{self.rank}")))
        else:  # pragma: no cover - the test would be wrong
            raise AssertionError(kind)

    def _gather_all(self, send: int, nbytes: int, key: str, wire: str) -> List[np.ndarray]:
        _put(os.path.join(self.dir, f"{key}.{self.rank}"), _read(send, nbytes))
        return [np.frombuffer(_wait_for(os.path.join(self.dir, f"{key}.{r}")), dtype=storage_dtype(wire))
                for r in range(self.size)]

    def _reduce_to(self, send: int, recv: int, count: int, wire: str, red: ReduceOp, key: str, root: Any) -> None:
        dtype = storage_dtype(wire)
        nbytes = count * dtype.itemsize
        _put(os.path.join(self.dir, f"{key}.{self.rank}"), _read(send, nbytes))
        if root is not None and self.rank != root:
            return
        acc = None
        for r in range(self.size):
            part = np.frombuffer(_wait_for(os.path.join(self.dir, f"{key}.{r}")), dtype=dtype).copy()
            if acc is None:
                acc = part
            else:
                reduce_into(acc, part, red, wire)
        _write(recv, acc.tobytes())

    def all_reduce(self, send: int, recv: int, count: int, wire: str, op: ReduceOp, stream: int) -> None:
        self._run(("all_reduce", send, recv, count, wire, ReduceOp(op)))

    def reduce(self, send: int, recv: int, count: int, wire: str, op: ReduceOp, root: int, stream: int) -> None:
        self._run(("reduce", send, recv, count, wire, ReduceOp(op), root))

    def broadcast(self, send: int, recv: int, count: int, wire: str, root: int, stream: int) -> None:
        self._run(("broadcast", send, recv, count, wire, root))

    def reduce_scatter(self, send: int, recv: int, count: int, wire: str, op: ReduceOp, stream: int) -> None:
        self._run(("reduce_scatter", send, recv, count, wire, ReduceOp(op)))

    def all_gather(self, send: int, recv: int, count: int, wire: str, stream: int) -> None:
        self._run(("all_gather", send, recv, count, wire))

    def send(self, buf: int, count: int, wire: str, peer: int, stream: int) -> None:
        self._run(("send", buf, count, wire, peer))

    def recv(self, buf: int, count: int, wire: str, peer: int, stream: int) -> None:
        self._run(("recv", buf, count, wire, peer))

    def group_start(self) -> None:
        self.grouped = True
        self.group = []

    def group_end(self) -> None:
        self.grouped = False
        self.seq += 1
        ops, self.group = self.group, []
        for index, op in enumerate(sorted(ops, key=lambda o: o[0] == "recv")):  # sends before receives
            self._do(op, f"{self.seq}.{index if op[0] not in ('send', 'recv') else 'g'}")

    def destroy(self) -> None:
        self.lib.log.append(("destroy", os.path.basename(self.dir), self.rank))


class FakeNccl:
    """NcclLibrary's interface over a folder shared by the job's processes."""

    version = 23203

    def __init__(self, root: str) -> None:
        self.root = root
        self.log: List[Tuple[Any, ...]] = []

    def version_string(self) -> str:
        return "2.32.3"

    def unique_id(self) -> bytes:
        return os.urandom(128)

    def init_rank(self, size: int, uid: bytes, rank: int) -> FakeComm:
        comm_id = uid[:8].hex()
        self.log.append(("init", comm_id, size, rank))
        return FakeComm(self, comm_id, size, rank)


class NumpyDeviceOps:
    """DeviceOps where the "device tensors" are numpy arrays."""

    def ptr(self, tensor: np.ndarray) -> int:
        return tensor.ctypes.data

    def empty(self, shape: Tuple[int, ...], wire: str, like: Any) -> np.ndarray:
        return np.zeros(shape, dtype=storage_dtype(wire))

    def copy(self, dst: np.ndarray, dst_byte: int, src: np.ndarray, src_byte: int, nbytes: int) -> None:
        dst.reshape(-1).view(np.uint8)[dst_byte:dst_byte + nbytes] = src.reshape(-1).view(np.uint8)[src_byte:src_byte + nbytes]

    def scale(self, tensor: np.ndarray, first: int, count: int, wire: str, factor: float) -> None:
        scale_inplace(tensor.reshape(-1).view(storage_dtype(wire))[first:first + count], factor, wire)

    def view(self, tensor: np.ndarray, first: int, shape: Tuple[int, ...], wire: str) -> np.ndarray:
        return tensor.reshape(-1).view(storage_dtype(wire))[first:first + math.prod(shape)].reshape(shape)

    def stream(self, like: Any) -> int:
        return 0

    def synchronize(self, like: Any) -> None:
        pass

    def activate(self, like: Any) -> None:
        pass

    def to_host(self, tensor: np.ndarray, first: int, count: int, wire: str) -> np.ndarray:
        return tensor.reshape(-1).view(storage_dtype(wire))[first:first + count].copy()

    def from_host(self, tensor: np.ndarray, first: int, array: np.ndarray) -> None:
        tensor.reshape(-1).view(array.dtype)[first:first + array.size] = array
