"""Collectives on device (GPU) buffers through NCCL: the data plane for requests made on CUDA tensors.

Negotiation, fusion decisions, the response cache, the timeline and error handling are the
engine's as for host arrays; only the bytes move differently. A framework binding registers
:class:`DeviceOps` (how to allocate, copy, scale and find the stream of its device tensors) and
submits requests whose ``Meta.device`` is ``"cuda"``. Fusion buffers live on the device, every
operation is queued on the framework's current stream, and nothing is copied through the host.
NCCL communicators are made per process set on first use, their unique id sent from the set's
first rank over the host data plane, and destroyed when the world ends.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from . import algorithms as alg
from .algorithms import split_counts
from .dataplane import Hierarchy
from .messages import Meta
from .nccl import UNIQUE_ID_BYTES, NcclComm, NcclLibrary, NcclUnavailable, load_nccl
from .ops import ReduceOp, reduce_into, storage_dtype
from .kinds import ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, REDUCESCATTER

__all__ = ["DeviceOps", "NcclDataPlane", "register_device_ops", "device_ops", "nccl_status", "DeviceExecutor"]


class DeviceOps(Protocol):
    """What the runtime needs to know of a framework's device tensors (spark_hvd.torch supplies it)."""

    def ptr(self, tensor: Any) -> int:
        """The device address of a contiguous tensor's first byte."""

    def empty(self, shape: Tuple[int, ...], wire: str, like: Any) -> Any:
        """A new contiguous tensor of that shape and wire dtype on ``like``'s device."""

    def copy(self, dst: Any, dst_byte: int, src: Any, src_byte: int, nbytes: int) -> None:
        """Copy bytes between device tensors, queued on the current stream."""

    def scale(self, tensor: Any, first: int, count: int, wire: str, factor: float) -> None:
        """Multiply elements ``first .. first+count`` by ``factor`` in place (float16 and bfloat16 in
        float32; integers truncated toward zero), queued on the current stream."""

    def view(self, tensor: Any, first: int, shape: Tuple[int, ...], wire: str) -> Any:
        """A tensor of ``shape`` over ``tensor``'s elements from ``first`` on."""

    def stream(self, like: Any) -> int:
        """The current CUDA stream of ``like``'s device, as an integer handle."""

    def synchronize(self, like: Any) -> None:
        """Wait until everything queued on that stream has run."""

    def activate(self, like: Any) -> None:
        """Make ``like``'s device the calling thread's current device (communicators are bound to
        the device current when they are made, and the engine thread starts on device 0)."""

    def to_host(self, tensor: Any, first: int, count: int, wire: str) -> np.ndarray:
        """Elements ``first .. first+count`` copied into a new host array (storage dtype of
        ``wire``), after the work queued before."""

    def from_host(self, tensor: Any, first: int, array: np.ndarray) -> None:
        """Copy a host array into ``tensor`` from element ``first`` on."""


_registry: Dict[str, DeviceOps] = {}
_registry_lock = threading.Lock()


def register_device_ops(kind: str, ops: DeviceOps) -> None:
    """Make ``ops`` the handler of device tensors of ``kind`` (e.g. ``"cuda"``)."""
    with _registry_lock:
        _registry[kind] = ops


def device_ops(kind: str) -> DeviceOps:
    ops = _registry.get(kind)
    if ops is None:
        raise NcclUnavailable(f"no framework registered {kind!r} tensors with the runtime")
    return ops


_nccl: Optional[NcclLibrary] = None
_nccl_problem: Optional[str] = None


def nccl_status() -> Tuple[Optional[NcclLibrary], Optional[str]]:
    """The loaded NCCL library, or None and why not (tried once per process)."""
    global _nccl, _nccl_problem
    if _nccl is None and _nccl_problem is None:
        from .config import read_setting

        explicit = read_setting("nccl_library")
        try:
            _nccl = load_nccl(None if explicit is None else [explicit])
        except NcclUnavailable as exc:
            _nccl_problem = str(exc)
    return _nccl, _nccl_problem


class NcclDataPlane:
    """NCCL communicators per process set over the members' device buffers; with a
    :class:`~spark_hvd.runtime.dataplane.Hierarchy` (hierarchical allreduce on several hosts), also
    one communicator among the ranks of this host, and the host ring across hosts."""

    def __init__(self, lib: Any, host_size: Callable[[int], int], host_rank: Callable[[int], int],
                 host_broadcast: Callable[[int, np.ndarray, int], None], hierarchy: Optional[Hierarchy] = None,
                 chunk_bytes: int = 1 << 19) -> None:
        self.lib = lib
        self._size = host_size
        self._rank = host_rank
        self._broadcast = host_broadcast
        self.hierarchy = hierarchy
        self.chunk_bytes = chunk_bytes
        self.comms: Dict[Any, NcclComm] = {}

    def local_comm(self) -> NcclComm:
        """The communicator among this host's ranks (hierarchical allreduce only); its id goes
        from the host's first rank to the others over the host's shared-memory ring."""
        comm = self.comms.get("local")
        if comm is None:
            assert self.hierarchy is not None
            local = self.hierarchy.local
            uid = np.frombuffer(self.lib.unique_id(), dtype=np.uint8).copy() if local.rank == 0 \
                else np.zeros(UNIQUE_ID_BYTES, dtype=np.uint8)
            alg.chain_broadcast(local, uid, 0, self.chunk_bytes)
            comm = self.comms["local"] = self.lib.init_rank(local.size, uid.tobytes(), local.rank)
        return comm

    def cross_allreduce(self, flat: np.ndarray, op: ReduceOp, wire: str) -> None:
        """In place over the host ring among the ranks of equal local rank on every host."""
        assert self.hierarchy is not None
        alg.ring_allreduce(self.hierarchy.cross, flat, lambda acc, incoming: reduce_into(acc, incoming, op, wire))

    def comm(self, ps: int) -> NcclComm:
        """This set's communicator, made on first use: every member reaches this point in the
        same response, so the id's broadcast is collective."""
        comm = self.comms.get(ps)
        if comm is None:
            me, size = self._rank(ps), self._size(ps)
            uid = np.frombuffer(self.lib.unique_id(), dtype=np.uint8).copy() if me == 0 \
                else np.zeros(UNIQUE_ID_BYTES, dtype=np.uint8)
            self._broadcast(ps, uid, 0)
            comm = self.comms[ps] = self.lib.init_rank(size, uid.tobytes(), me)
        return comm

    def close(self) -> None:
        for comm in self.comms.values():
            try:
                comm.destroy()
            except Exception:  # the world is ending; a communicator that cannot be destroyed is dropped
                pass
        self.comms = {}


def _count(meta: Meta) -> int:
    return int(np.prod(meta.shape, dtype=np.int64)) if meta.shape else 1


class DeviceExecutor:
    """The per-kind steps for device requests, over one :class:`NcclDataPlane`."""

    def __init__(self, plane: NcclDataPlane, ops: DeviceOps, complete: Callable[[Any, Any], None]) -> None:
        self.plane = plane
        self.ops = ops
        self.complete = complete
        self._fusion: Dict[Any, Any] = {}

    def execute(self, response: Any, entries: Sequence[Any], metas: Any, members: Tuple[int, ...]) -> None:
        """One agreed response whose tensors live on the device."""
        kind, ps = response.kind, response.ps
        first = next((e for e in entries if e is not None), None)
        if first is not None:
            self.ops.activate(first.array)
        if kind == ALLREDUCE:
            self.allreduce(ps, entries, [metas[s] for s in response.sids])
            return
        for i, entry in enumerate(entries):
            if entry is None:
                raise RuntimeError(f"{kind} on device tensors needs this rank's tensor; none was submitted")
            if kind == BROADCAST:
                meta = metas[response.sids[i]]
                self.broadcast(ps, entry, meta, members.index(meta.root))
            elif kind == ALLGATHER:
                self.allgather(ps, entry, [metas[s] for s in response.rank_sids[i]])
            elif kind == ALLTOALL:
                self.alltoall(ps, entry, [metas[s] for s in response.rank_sids[i]])
            elif kind == REDUCESCATTER:
                meta = metas[response.sids[i]]
                rows = meta.shape[0] if meta.shape else 1
                self.reducescatter(ps, entry, meta, split_counts(rows, self.plane._size(ps)))
            else:
                raise RuntimeError(f"{kind} is not done on device tensors")

    def _fusion_buffer(self, like: Any, nbytes: int) -> Any:
        key = str(getattr(like, "device", ""))
        held = self._fusion.get(key)
        if held is None or held[1] < nbytes:
            size = max(nbytes, 1 << 20)
            held = self._fusion[key] = (self.ops.empty((size,), "uint8", like), size)
        return held[0]

    def allreduce(self, ps: int, entries: Sequence[Any], metas: Sequence[Meta]) -> None:
        meta0 = metas[0]
        op = ReduceOp(meta0.op)
        nccl_op = ReduceOp.Sum if op == ReduceOp.Average else op
        size = self.plane._size(ps)
        item = storage_dtype(meta0.dtype).itemsize
        post = meta0.postscale / (size if op == ReduceOp.Average else 1)
        like = next(e.array for e in entries if e is not None)
        stream = self.ops.stream(like)
        hierarchical = ps == 0 and self.plane.hierarchy is not None
        if len(entries) == 1 and entries[0] is not None and not hierarchical:
            entry = entries[0]
            count = _count(metas[0])
            if entry.out is not entry.array:
                self.ops.copy(entry.out, 0, entry.array, 0, count * item)
            self._scale(entry.out, 0, count, meta0.dtype, meta0.prescale)
            ptr = self.ops.ptr(entry.out)
            self.plane.comm(ps).all_reduce(ptr, ptr, count, meta0.dtype, nccl_op, stream)
            self._scale(entry.out, 0, count, meta0.dtype, post)
            self.ops.synchronize(like)
            self.complete(entry, entry.out)
            return
        counts = [_count(m) for m in metas]
        total = sum(counts)
        local_size = self.plane.hierarchy.local.size if hierarchical else 1
        block = -(-total // local_size)
        fused = self._fusion_buffer(like, block * local_size * item)
        offset = 0
        for entry, count in zip(entries, counts):
            if entry is not None:
                self.ops.copy(fused, offset * item, entry.array, 0, count * item)
            offset += count
        self._scale(fused, 0, total, meta0.dtype, meta0.prescale)
        if hierarchical:
            self._hierarchical(fused, block, meta0.dtype, nccl_op, stream, like)
        else:
            self.plane.comm(ps).all_reduce(self.ops.ptr(fused), self.ops.ptr(fused), total, meta0.dtype, nccl_op, stream)
        self._scale(fused, 0, total, meta0.dtype, post)
        offset = 0
        for entry, count in zip(entries, counts):
            if entry is not None:
                self.ops.copy(entry.out, 0, fused, offset * item, count * item)
            offset += count
        self.ops.synchronize(like)
        for entry in entries:
            if entry is not None:
                self.complete(entry, entry.out)

    def _hierarchical(self, fused: Any, block: int, wire: str, op: ReduceOp, stream: int, like: Any) -> None:
        """NCCL reduce-scatter among this host's ranks (block i to local rank i), this rank's
        block allreduced across hosts by the host ring, NCCL allgather back within the host."""
        local = self.plane.local_comm()
        me = self.plane.hierarchy.local.rank
        item = storage_dtype(wire).itemsize
        base = self.ops.ptr(fused)
        mine = base + me * block * item
        if block == 0:
            return
        local.reduce_scatter(base, mine, block, wire, op, stream)
        host = self.ops.to_host(fused, me * block, block, wire)
        self.plane.cross_allreduce(host, op, wire)
        self.ops.from_host(fused, me * block, host)
        local.all_gather(mine, base, block, wire, stream)

    def _scale(self, tensor: Any, first: int, count: int, wire: str, factor: float) -> None:
        if factor != 1.0 and count:
            self.ops.scale(tensor, first, count, wire, factor)

    def broadcast(self, ps: int, entry: Any, meta: Meta, root: int) -> None:
        count = _count(meta)
        if entry.out is not entry.array and self.plane._rank(ps) == root:
            self.ops.copy(entry.out, 0, entry.array, 0, count * storage_dtype(meta.dtype).itemsize)
        if count:
            ptr = self.ops.ptr(entry.out)
            self.plane.comm(ps).broadcast(ptr, ptr, count, meta.dtype, root, self.ops.stream(entry.array))
        self.ops.synchronize(entry.array)
        self.complete(entry, entry.out)

    def allgather(self, ps: int, entry: Any, metas: Sequence[Meta]) -> None:
        """Every member's rows, in order: one NCCL broadcast per member inside a group, so first
        dimensions may differ."""
        comm = self.plane.comm(ps)
        trailing = tuple(metas[0].shape[1:])
        row = int(np.prod(trailing, dtype=np.int64)) if trailing else 1
        rows = [m.shape[0] if m.shape else 1 for m in metas]
        wire = metas[0].dtype
        item = storage_dtype(wire).itemsize
        out = self.ops.empty((sum(rows),) + trailing, wire, entry.array)
        stream = self.ops.stream(entry.array)
        me = self.plane._rank(ps)
        base = self.ops.ptr(out)
        comm.group_start()
        try:
            offset = 0
            for r, n in enumerate(rows):
                if n:
                    send = self.ops.ptr(entry.array) if r == me else 0
                    comm.broadcast(send, base + offset * row * item, n * row, wire, r, stream)
                offset += n
        finally:
            comm.group_end()
        self.ops.synchronize(entry.array)
        if not metas[me].shape:
            out = self.ops.view(out, 0, (sum(rows),), wire)
        self.complete(entry, out)

    def alltoall(self, ps: int, entry: Any, metas: Sequence[Meta]) -> None:
        comm = self.plane.comm(ps)
        me = self.plane._rank(ps)
        trailing = tuple(metas[0].shape[1:])
        row = int(np.prod(trailing, dtype=np.int64)) if trailing else 1
        wire = metas[0].dtype
        item = storage_dtype(wire).itemsize
        send_splits = list(metas[me].splits or ())
        recv_splits = [int((m.splits or ())[me]) for m in metas]
        out = self.ops.empty((sum(recv_splits),) + trailing, wire, entry.array)
        stream = self.ops.stream(entry.array)
        send_base, recv_base = self.ops.ptr(entry.array), self.ops.ptr(out)
        send_at = np.cumsum([0] + send_splits)
        recv_at = np.cumsum([0] + recv_splits)
        comm.group_start()
        try:
            for peer in range(len(metas)):
                if send_splits[peer]:
                    comm.send(send_base + int(send_at[peer]) * row * item, send_splits[peer] * row, wire, peer, stream)
                if recv_splits[peer]:
                    comm.recv(recv_base + int(recv_at[peer]) * row * item, recv_splits[peer] * row, wire, peer, stream)
        finally:
            comm.group_end()
        self.ops.synchronize(entry.array)
        self.complete(entry, (out, np.asarray(recv_splits, dtype=np.int64)))

    def reducescatter(self, ps: int, entry: Any, meta: Meta, counts_rows: List[int]) -> None:
        """Block r of the reduction lands on member r: one NCCL reduce per member inside a group,
        so blocks may differ in size."""
        comm = self.plane.comm(ps)
        me, size = self.plane._rank(ps), self.plane._size(ps)
        op = ReduceOp(meta.op)
        nccl_op = ReduceOp.Sum if op == ReduceOp.Average else op
        trailing = tuple(meta.shape[1:])
        row = int(np.prod(trailing, dtype=np.int64)) if trailing else 1
        wire = meta.dtype
        item = storage_dtype(wire).itemsize
        work = self.ops.empty(tuple(meta.shape), wire, entry.array)
        self.ops.copy(work, 0, entry.array, 0, _count(meta) * item)
        self._scale(work, 0, _count(meta), wire, meta.prescale)
        stream = self.ops.stream(entry.array)
        base = self.ops.ptr(work)
        comm.group_start()
        try:
            start = 0
            for r, n in enumerate(counts_rows):
                if n:
                    ptr = base + start * row * item
                    comm.reduce(ptr, ptr, n * row, wire, nccl_op, r, stream)
                start += n
        finally:
            comm.group_end()
        first = sum(counts_rows[:me]) * row
        mine = counts_rows[me] * row
        self._scale(work, first, mine, wire, meta.postscale / (size if op == ReduceOp.Average else 1))
        self.ops.synchronize(entry.array)
        self.complete(entry, self.ops.view(work, first, (counts_rows[me],) + trailing, wire))
