"""Execution of agreed responses: each collective kind over the data plane, fused allreduces included.

:class:`CollectiveExecutor` takes one response every rank agreed on, finds this rank's requests in
the :class:`~spark_hvd.runtime.handles.RequestBook`, and runs the step of the response's kind: one
method per kind, chosen from a table keyed by the kinds of :mod:`spark_hvd.runtime.kinds`. CUDA
tensors go to the device executor (NCCL) made on first use.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from . import algorithms as alg
from .dataplane import DataPlane
from .device import DeviceExecutor, NcclDataPlane, device_ops, nccl_status
from .errors import CollectiveError, RankMismatchError
from .handles import Entry, RequestBook
from .kinds import (ADD_PROCESS_SET, ALLGATHER, ALLREDUCE, ALLREDUCE_EAGER, ALLTOALL, BARRIER, BROADCAST, ERROR, JOIN,
                    REDUCESCATTER)
from .messages import Meta, Response
from .ops import ReduceOp, average_inplace, scale_inplace, storage_dtype
from .timeline import COMMUNICATE, MEMCPY_IN, MEMCPY_OUT, NEGOTIATE, QUEUE, REDUCE, TimelineSlot

__all__ = ["CollectiveExecutor"]

Step = Callable[[Response, List[Optional[Entry]], Mapping[int, Meta], Tuple[int, ...]], None]


class CollectiveExecutor:
    """Runs agreed responses on this rank: the per-kind collective steps over the data plane."""

    def __init__(self, rank: int, data: DataPlane, config: Any, book: RequestBook, timeline: TimelineSlot,
                 process_sets: Dict[int, Tuple[int, ...]], coordinator: Any = None) -> None:
        self.rank = rank
        self.data = data
        self.config = config
        self.book = book
        self.timeline = timeline
        self.process_sets = process_sets
        """Members of each process set this rank knows, by id."""
        self._coordinator = coordinator
        self._fusion: Optional[np.ndarray] = None
        self.device: Optional[DeviceExecutor] = None
        """The device (NCCL) executor, made when the first device response arrives."""
        self.executing: Optional[Tuple[str, Tuple[str, ...]]] = None
        """(kind, names) of the response in its data phase, for stall messages."""
        self._steps: Dict[str, Step] = {
            ALLREDUCE: self._allreduce_response, ALLREDUCE_EAGER: self._eager_response,
            REDUCESCATTER: self._reducescatter_response, ALLGATHER: self._allgather_response,
            ALLTOALL: self._alltoall_response, BROADCAST: self._broadcast_response,
            BARRIER: self._barrier_response, ADD_PROCESS_SET: self._add_process_set_response,
        }

    # -- the front door -----------------------------------------------------------------------------
    def execute(self, response: Response, metas: Mapping[int, Meta], arrived: float) -> None:
        """Run one agreed response: complete (or fail) this rank's requests it names."""
        book = self.book
        kind, names, ps = response.kind, response.names, response.ps
        if kind == JOIN:
            for key in [k for k, e in book.local.items() if e.meta.kind == JOIN]:
                book.complete(book.local.pop(key), response.value)
            return
        members = self.process_sets.get(ps)
        if members is None or self.rank not in members:
            return
        entries = [book.local.pop((ps, name), None) for name in names]
        if kind == ERROR:
            for entry in entries:
                if entry is not None:
                    book.fail(entry, RankMismatchError(response.error))
            return
        timeline = self.timeline.current
        if timeline is not None:
            for entry in entries:
                if entry is not None:
                    timeline.span(entry.name, NEGOTIATE, entry.submitted * 1e6, arrived * 1e6)
                    timeline.span(entry.name, QUEUE, arrived * 1e6, time.perf_counter() * 1e6)
        self.executing = (kind, names)
        try:
            first = metas[response.sids[0]] if response.sids else \
                (metas[response.rank_sids[0][0]] if response.rank_sids else None)
            if first is not None and first.device != "cpu":
                self._device_executor().execute(response, entries, metas, members)
            else:
                step = self._steps.get(kind)
                if step is None:
                    raise CollectiveError(f"unknown response kind {kind!r}")
                step(response, entries, metas, members)
        except BaseException:
            for entry in entries:
                if entry is not None and not entry.handle.done():
                    book.local[(ps, entry.name)] = entry  # failed with everything else when the job aborts
            raise
        finally:
            self.executing = None

    def close(self) -> None:
        if self.device is not None:
            self.device.plane.close()

    def _device_executor(self) -> DeviceExecutor:
        if self.device is None:
            lib, problem = nccl_status()
            if lib is None:
                raise CollectiveError(f"collectives on CUDA tensors need NCCL: {problem}")
            plane = NcclDataPlane(lib, self.data.size, self.data.rank, self.data.broadcast,
                                  hierarchy=getattr(self.data, "hierarchy", None), chunk_bytes=self.config.chunk_bytes)
            self.device = DeviceExecutor(plane, device_ops("cuda"), self.book.complete)
        return self.device

    # -- one step per response kind --------------------------------------------------------------------
    def _allreduce_response(self, response: Response, entries: List[Optional[Entry]], metas: Mapping[int, Meta],
                            members: Tuple[int, ...]) -> None:
        self._allreduce(response.ps, response.names, entries, [metas[s] for s in response.sids])

    def _eager_response(self, response: Response, entries: List[Optional[Entry]], metas: Mapping[int, Meta],
                        members: Tuple[int, ...]) -> None:
        """Allreduces whose results the coordinator computed and sent with the response."""
        start = time.perf_counter()
        for entry, sid, result in zip(entries, response.sids, response.results):
            if entry is None:
                continue
            out = np.frombuffer(result, dtype=storage_dtype(metas[sid].dtype))
            np.copyto(entry.out.reshape(-1), out)
            self.book.complete(entry, entry.out)
            self._span(entry.name, MEMCPY_OUT, start)

    def _reducescatter_response(self, response: Response, entries: List[Optional[Entry]],
                                metas: Mapping[int, Meta], members: Tuple[int, ...]) -> None:
        for name, entry, sid in zip(response.names, entries, response.sids):
            self._reducescatter(response.ps, name, entry, metas[sid])

    def _allgather_response(self, response: Response, entries: List[Optional[Entry]], metas: Mapping[int, Meta],
                            members: Tuple[int, ...]) -> None:
        for name, entry, sids in zip(response.names, entries, response.rank_sids):
            self._allgather(response.ps, name, entry, [metas[s] for s in sids])

    def _alltoall_response(self, response: Response, entries: List[Optional[Entry]], metas: Mapping[int, Meta],
                           members: Tuple[int, ...]) -> None:
        for name, entry, sids in zip(response.names, entries, response.rank_sids):
            self._alltoall(response.ps, name, entry, [metas[s] for s in sids])

    def _broadcast_response(self, response: Response, entries: List[Optional[Entry]], metas: Mapping[int, Meta],
                            members: Tuple[int, ...]) -> None:
        for name, entry, sid in zip(response.names, entries, response.sids):
            self._broadcast(response.ps, name, entry, metas[sid], members)

    def _barrier_response(self, response: Response, entries: List[Optional[Entry]], metas: Mapping[int, Meta],
                          members: Tuple[int, ...]) -> None:
        for entry in entries:
            if entry is not None:
                self.book.complete(entry, None)

    def _add_process_set_response(self, response: Response, entries: List[Optional[Entry]],
                                  metas: Mapping[int, Meta], members: Tuple[int, ...]) -> None:
        ranks = tuple(metas[response.sids[0]].ranks or ())
        self.process_sets[response.value] = ranks
        if self._coordinator is not None:
            self._coordinator.process_sets[response.value] = ranks
        self.data.add_process_set(response.value, ranks)
        for entry in entries:
            if entry is not None:
                self.book.complete(entry, response.value)

    # -- the collectives -------------------------------------------------------------------------------
    def _span(self, name: str, phase: str, start: float) -> float:
        now = time.perf_counter()
        timeline = self.timeline.current
        if timeline is not None:
            timeline.span(name, phase, start * 1e6, now * 1e6)
        return now

    def _finish_scale(self, buf: np.ndarray, meta: Meta, count: int) -> None:
        if meta.op == ReduceOp.Average:
            average_inplace(buf, count, meta.dtype)
        scale_inplace(buf, meta.postscale, meta.dtype)

    def _allreduce(self, ps: int, names: Sequence[str], entries: List[Optional[Entry]],
                   metas: List[Meta]) -> None:
        kinds = {(m.dtype, m.op, m.prescale, m.postscale) for m in metas}
        if len(kinds) > 1:
            # A group may mix dtypes or ops: reduce each compatible part through the fusion buffer.
            for kind in sorted(kinds, key=repr):
                part = [i for i, m in enumerate(metas) if (m.dtype, m.op, m.prescale, m.postscale) == kind]
                self._allreduce(ps, [names[i] for i in part], [entries[i] for i in part], [metas[i] for i in part])
            return
        meta0 = metas[0]
        dtype = storage_dtype(meta0.dtype)
        op = ReduceOp(meta0.op)
        size = self.data.size(ps)
        start = time.perf_counter()
        if len(entries) == 1 and entries[0] is not None and entries[0].out is not None:
            entry = entries[0]
            buf = entry.out.reshape(-1)
            if entry.out is not entry.array:
                np.copyto(buf, entry.array.reshape(-1))
            scale_inplace(buf, meta0.prescale, meta0.dtype)
            t0 = self._span(entry.name, MEMCPY_IN, start)
            self.data.allreduce(ps, buf, op, meta0.dtype)
            t1 = self._span(entry.name, REDUCE, t0)
            self._finish_scale(buf, meta0, size)
            self._span(entry.name, MEMCPY_OUT, t1)
            self.book.complete(entry, entry.out)
            return
        counts = [m.count() for m in metas]
        total = sum(counts)
        fused = self._fusion_view(dtype, total)
        offsets = alg.offsets(counts)
        if all(entry is not None for entry in entries):
            np.concatenate([entry.array.reshape(-1) for entry in entries], out=fused)  # type: ignore[union-attr]
        else:
            for entry, lo, hi in zip(entries, offsets, offsets[1:]):
                if entry is None:
                    fused[lo:hi] = 0
                else:
                    fused[lo:hi] = entry.array.reshape(-1)
        scale_inplace(fused, meta0.prescale, meta0.dtype)
        t0 = time.perf_counter()
        self.data.allreduce(ps, fused, op, meta0.dtype)
        t1 = time.perf_counter()
        # For floats, the average's division and the postscale ride along with the copy out.
        factor = None
        if meta0.dtype in ("float32", "float64"):  # float16 scales in float32 (_finish_scale)
            factor = meta0.postscale / (size if meta0.op == ReduceOp.Average else 1)
        else:
            self._finish_scale(fused, meta0, size)
        for entry, meta, lo, hi in zip(entries, metas, offsets, offsets[1:]):
            if entry is None:
                continue
            out = entry.out if entry.out is not None else np.empty(meta.shape, dtype=dtype)
            if factor is None or factor == 1.0:
                out.reshape(-1)[...] = fused[lo:hi]
            else:
                np.multiply(fused[lo:hi], dtype.type(factor), out=out.reshape(-1))
            self.book.complete(entry, out)
        t2 = time.perf_counter()
        timeline = self.timeline.current
        if timeline is not None:
            for name in names:
                timeline.span(name, MEMCPY_IN, start * 1e6, t0 * 1e6, {"fused": len(names)})
                timeline.span(name, REDUCE, t0 * 1e6, t1 * 1e6)
                timeline.span(name, MEMCPY_OUT, t1 * 1e6, t2 * 1e6)

    def _fusion_view(self, dtype: np.dtype, count: int) -> np.ndarray:
        nbytes = count * dtype.itemsize
        if self._fusion is None or self._fusion.nbytes < nbytes:
            self._fusion = np.empty(max(nbytes, min(self.config.fusion_threshold, 1 << 20)), dtype=np.uint8)
        return self._fusion[:nbytes].view(dtype)

    def _reducescatter(self, ps: int, name: str, entry: Optional[Entry], meta: Meta) -> None:
        dtype = storage_dtype(meta.dtype)
        rows = meta.shape[0] if meta.shape else 1
        row = int(np.prod(meta.shape[1:], dtype=np.int64)) if meta.shape else 1
        size, me = self.data.size(ps), self.data.rank(ps)
        row_counts = alg.split_counts(rows, size)
        counts = [c * row for c in row_counts]
        start = time.perf_counter()
        work = np.empty(sum(counts), dtype=dtype)
        if entry is None:
            work.fill(0)
        else:
            np.copyto(work, entry.array.reshape(-1))
        scale_inplace(work, meta.prescale, meta.dtype)
        t0 = self._span(name, MEMCPY_IN, start)
        self.data.reducescatter(ps, work, counts, ReduceOp(meta.op), meta.dtype)
        t1 = self._span(name, REDUCE, t0)
        lo = sum(counts[:me])
        mine = work[lo:lo + counts[me]]
        self._finish_scale(mine, meta, size)
        if entry is not None:
            result = mine.reshape((row_counts[me],) + tuple(meta.shape[1:]))
            self._span(name, MEMCPY_OUT, t1)
            self.book.complete(entry, result)

    def _allgather(self, ps: int, name: str, entry: Optional[Entry], metas: List[Meta]) -> None:
        dtype = storage_dtype(metas[0].dtype)
        trailing = tuple(metas[0].shape[1:])
        row = int(np.prod(trailing, dtype=np.int64)) if trailing else 1
        first = [m.shape[0] if m.shape else 1 for m in metas]
        counts = [d * row for d in first]
        out = np.empty((sum(first),) + trailing, dtype=dtype)
        flat = out.reshape(-1)
        me = self.data.rank(ps)
        lo = sum(counts[:me])
        start = time.perf_counter()
        if entry is not None and counts[me]:
            np.copyto(flat[lo:lo + counts[me]], entry.array.reshape(-1))
        t0 = self._span(name, MEMCPY_IN, start)
        self.data.allgather(ps, flat, counts)
        self._span(name, COMMUNICATE, t0)
        if entry is not None:
            if not metas[me].shape:
                out = out.reshape(-1)
            self.book.complete(entry, out)

    def _broadcast(self, ps: int, name: str, entry: Optional[Entry], meta: Meta,
                   members: Tuple[int, ...]) -> None:
        dtype = storage_dtype(meta.dtype)
        root = members.index(meta.root)
        if entry is None:
            buf = np.empty(meta.shape, dtype=dtype)
        else:
            buf = entry.out if entry.out is not None else np.empty(meta.shape, dtype=dtype)
            if self.data.rank(ps) == root and buf is not entry.array:
                np.copyto(buf, entry.array)
        start = time.perf_counter()
        self.data.broadcast(ps, buf.reshape(-1), root)
        self._span(name, COMMUNICATE, start)
        if entry is not None:
            self.book.complete(entry, buf)

    def _alltoall(self, ps: int, name: str, entry: Optional[Entry], metas: List[Meta]) -> None:
        dtype = storage_dtype(metas[0].dtype)
        trailing = tuple(metas[0].shape[1:])
        row = int(np.prod(trailing, dtype=np.int64)) if trailing else 1
        me = self.data.rank(ps)
        send_splits = list(metas[me].splits or ())
        recv_splits = [int((m.splits or ())[me]) for m in metas]
        out = np.empty((sum(recv_splits),) + trailing, dtype=dtype)
        send = entry.array if entry is not None else np.empty((0,) + trailing, dtype=dtype)
        start = time.perf_counter()
        self.data.alltoall(ps, np.ascontiguousarray(send).reshape(-1), [s * row for s in send_splits],
                           out.reshape(-1), [s * row for s in recv_splits])
        self._span(name, COMMUNICATE, start)
        if entry is not None:
            self.book.complete(entry, (out, np.asarray(recv_splits, dtype=np.int64)))
