"""One initialized runtime: its world, its engine, and the one path every request takes into it.

The module-level functions of :mod:`spark_hvd.runtime.api` act on the process's current session;
tests build several sessions in one process (over the in-process transport) to run many ranks.
Process sets appear here by id; :class:`spark_hvd.runtime.api.ProcessSet` objects map onto them.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .engine import build_engine, usable_cpus
from .lockstep import LinkLockstep, Lockstep
from .handles import Entry, Handle, Then
from .messages import Meta
from .timeline import REDUCE
from .ops import ReduceOp, adasum, check_op, scale_inplace, storage_dtype, wire_dtype
from .kinds import ADD_PROCESS_SET, ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, JOIN, REDUCESCATTER

__all__ = ["Session", "prepare_array"]


def prepare_array(array: Any, dtype: Optional[str]) -> Tuple[np.ndarray, str]:
    """A C-contiguous view (or copy) of ``array`` and its wire dtype name."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"expected a numpy array, got {type(array).__name__}")
    wire = wire_dtype(array, dtype)
    if dtype is not None and array.dtype != storage_dtype(wire):
        array = array.view(storage_dtype(wire))  # e.g. bfloat16 given as int16 or ml_dtypes storage
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array, wire


def _check_out(out: np.ndarray, array: np.ndarray, what: str) -> np.ndarray:
    if out.shape != array.shape or out.dtype.itemsize != array.dtype.itemsize or not out.flags.c_contiguous:
        raise ValueError(
            f"{what}: out has shape {out.shape} and dtype {out.dtype}, expected a C-contiguous array of shape "
            f"{array.shape} and dtype {array.dtype}"
        )
    return out.view(array.dtype) if out.dtype != array.dtype else out


def _target(raw: np.ndarray, array: np.ndarray, out: Optional[np.ndarray], what: str) -> np.ndarray:
    """Where a result of ``array``'s shape goes: ``raw`` itself when ``out is raw`` (in place)."""
    if out is raw:
        if array is not raw and array.size and not np.may_share_memory(array, raw):
            raise ValueError(f"in-place {what} needs a C-contiguous array; pass np.ascontiguousarray(a)")
        return array
    return _check_out(out, array, what) if out is not None else np.empty_like(array)


_LOCKSTEP_SPIN = 0.002
"""Seconds a one-host fast-path reduction polls (yielding the core) before it sleeps between looks,
when each rank has a core: the ranks of a step usually arrive within this of each other."""


class Session:
    """A rank's runtime between ``init()`` and ``shutdown()``."""

    def __init__(self, world: Any, config: Any) -> None:
        self.world = world
        self.config = config
        self.engine = build_engine(world, config)
        self._counters: Dict[Tuple[str, int], itertools.count] = {}
        self.lockstep: Optional[Union[Lockstep, LinkLockstep]] = None
        boxes = getattr(world, "mailboxes", None)
        links = getattr(world, "order_links", None)
        if boxes:
            spin = _LOCKSTEP_SPIN if world.local_size <= usable_cpus() else 0.0
            self.lockstep = Lockstep(world.rank, boxes, config.lockstep_bytes, spin, self.engine.look_while_waiting)
        elif links:
            self.lockstep = LinkLockstep(world.rank, world.size, links,
                                         min(config.lockstep_bytes * (world.size - 1), config.lockstep_link_bytes),
                                         self.engine.look_while_waiting, world.peer_names.__getitem__)
        # Blocking allreduces take the program-order path too, unless the job tunes the negotiated
        # engine (autotune: a setting every rank shares, so every rank takes the same path).
        self._blocking_in_order = self.lockstep is not None and not config.autotune
        if self.lockstep is not None:
            self.engine.while_negotiating = self.lockstep.while_negotiating

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def size(self) -> int:
        return self.world.size

    def members(self, ps: int) -> Tuple[int, ...]:
        return self.engine.process_sets[ps]

    def shutdown(self) -> None:
        try:
            self.engine.shutdown()
        finally:
            if self.lockstep is not None:
                self.lockstep.forget()  # its views of the mailboxes, which close with the world
            self.world.close()

    def reset_names(self) -> None:
        """Start the per-kind counters of unnamed operations afresh (ranks agree again after join)."""
        self._counters = {}

    def name(self, kind: str, name: Optional[str], ps: int = 0) -> str:
        """``name``, or the next automatic name of ``kind`` in process set ``ps``.

        Counters are kept per kind and per process set: the members of a set issue the same
        unnamed operations on it in the same order, so their names agree, while ranks outside
        it, which issue none of them, stay in step with everyone on the other sets.
        """
        if name is not None:
            if not isinstance(name, str) or not name:
                raise ValueError(f"name={name!r} must be a non-empty string")
            return name
        counter = self._counters.setdefault((kind, ps), itertools.count())
        return f"{kind}.noname.{next(counter)}"

    def _submit(self, kind: str, name: Optional[str], metas_and_data: List[Tuple[Meta, Any, Any]],
                grouped: bool, will_wait: bool, ps: int = 0) -> Handle:
        base = self.name(("grouped_" if grouped else "") + kind, name, ps)
        handle = Handle(base, parts=len(metas_and_data), single=not grouped, engine=self.engine)
        if not metas_and_data:
            handle._finish()
            return handle
        group = (base, len(metas_and_data)) if grouped and len(metas_and_data) > 1 else None
        entries = [
            Entry(f"{base}.{i}" if grouped else base, meta if group is None else meta._replace(group=group),
                  array, out, handle, i)
            for i, (meta, array, out) in enumerate(metas_and_data)
        ]
        self.engine.submit(entries, will_wait)
        return handle

    def lockstep_allreduce(self, array: np.ndarray, *, op: int, name: str, prescale: float, postscale: float,
                           ps: int) -> bool:
        """Reduce ``array`` in place through the one-host mailboxes (see :mod:`.lockstep`); False,
        with ``array`` untouched, when it must take the negotiated path."""
        lockstep = self.lockstep
        if lockstep is None or ps != 0 or not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
            return False
        wire = wire_dtype(array, None)
        if not lockstep.eligible(array, wire, op):
            return False
        return lockstep.allreduce(array, name, wire, op, float(prescale), float(postscale))

    def _in_program_order(self, raw: np.ndarray, op: int, name: str, pre: float, post: float,
                          outs: Optional[Sequence[Optional[np.ndarray]]], dtype: Optional[str]) -> Optional[Handle]:
        """A blocking allreduce through the program-order path (see :mod:`.lockstep`), done; None
        when it takes the negotiated path: not eligible there (the same answer on every rank for
        the same request), or the ranks' requests of this step differ (every rank then negotiates
        its own, as Horovod would have from the start; see :meth:`.lockstep.Lockstep.allreduce`
        for when later requests do too)."""
        lockstep = self.lockstep
        assert lockstep is not None
        if not isinstance(raw, np.ndarray) or not isinstance(op, int) or self.engine.failure is not None \
                or (0, name) in self.engine.book.in_flight:
            return None  # the negotiated path raises what it must
        array, wire = prepare_array(raw, dtype)
        if not lockstep.eligible(array, wire, op):
            return None
        out = _target(raw, array, outs[0] if outs is not None else None, ALLREDUCE)
        if not out.flags.writeable:
            return None  # the negotiated path says why (a rank alone here declines the others' step)
        start = time.perf_counter()
        if out is not array:
            np.copyto(out, array)
        if not lockstep.allreduce(out, name, wire, op, pre, post, strict=False):
            return None
        timeline = self.engine.timeline.current
        if timeline is not None:
            timeline.span(name, REDUCE, start * 1e6, time.perf_counter() * 1e6, {"program_order": True})
        handle = Handle(name)
        handle._set(0, out)
        return handle

    # -- the request kinds ------------------------------------------------------------------------
    def reduce(self, kind: str, arrays: Sequence[np.ndarray], *, op: int, name: Optional[str], prescale: float,
               postscale: float, outs: Optional[Sequence[Optional[np.ndarray]]], dtype: Optional[str], ps: int,
               grouped: bool, will_wait: bool = False) -> Handle:
        """Start an allreduce or reducescatter of each array (one request, or a group)."""
        pre, post = float(prescale), float(postscale)
        if isinstance(op, int) and op == ReduceOp.Adasum:
            return self._adasum(kind, arrays, name, pre, post, outs, dtype, ps, grouped, will_wait)
        if will_wait and kind == ALLREDUCE and not grouped and len(arrays) == 1 and ps == 0 \
                and self._blocking_in_order and self.lockstep.active:
            name = self.name(kind, name, ps)  # drawn once: the negotiated path below takes it as given
            done = self._in_program_order(arrays[0], op, name, pre, post, outs, dtype)
            if done is not None:
                return done
        parts = []
        for i, raw in enumerate(arrays):
            array, wire = prepare_array(raw, dtype)
            reduce_op = check_op(op, wire)
            if (pre != 1.0 or post != 1.0) and wire == "bool":
                raise ValueError("prescale_factor/postscale_factor are not defined for bool arrays")
            if kind == REDUCESCATTER and array.ndim == 0:
                raise ValueError("reducescatter needs an array with at least one dimension to split across ranks")
            out = None
            if kind == ALLREDUCE:
                out = _target(raw, array, outs[i] if outs is not None else None, kind)
            meta = Meta(kind=kind, dtype=wire, shape=tuple(array.shape), op=int(reduce_op), prescale=pre,
                        postscale=post, ps=ps)
            parts.append((meta, array, out))
        return self._submit(kind, name, parts, grouped, will_wait, ps)

    def _adasum(self, kind: str, arrays: Sequence[np.ndarray], name: Optional[str], pre: float, post: float,
                outs: Optional[Sequence[Optional[np.ndarray]]], dtype: Optional[str], ps: int, grouped: bool,
                will_wait: bool) -> Handle:
        """An Adasum allreduce (:func:`.ops.adasum`): each rank gathers every rank's arrays (one
        allgather request, negotiated and carried by whichever path allgathers take: ring,
        hierarchical, shared memory) and combines them in the same order, so every rank computes
        the same bits. Each array of a group is combined on its own, as Horovod does per tensor."""
        if kind != ALLREDUCE:
            # NotImplementedError is a RuntimeError, what Horovod raises for this too.
            raise NotImplementedError(f"op=Adasum is defined for allreduce, not {kind}; use op=Sum or op=Average")
        members = len(self.members(ps))
        if members & (members - 1):
            raise ValueError(f"op=Adasum combines the ranks pairwise and needs a power-of-two number of them, got "
                             f"{members}; run 1, 2, 4, 8, ... ranks (or a process set of that many), or use "
                             "op=Average")
        staged = []
        for i, raw in enumerate(arrays):
            array, wire = prepare_array(raw, dtype)
            check_op(ReduceOp.Adasum, wire)
            out = _target(raw, array, outs[i] if outs is not None else None, kind)
            sent = array.reshape(1, -1)
            if pre != 1.0:
                sent = sent.copy()
                scale_inplace(sent, pre, wire)
            staged.append((sent, wire, out))
        if not staged:
            return self._submit(ALLGATHER, name, [], grouped, will_wait, ps)
        gathered = self.allgather([sent for sent, _, _ in staged], name=self.name("adasum", name, ps),
                                  dtype=dtype, ps=ps, grouped=True,
                                  will_wait=will_wait)

        def combine(rows: List[np.ndarray]) -> Any:
            results = []
            for (_, wire, out), contributions in zip(staged, rows):
                adasum(contributions, wire, out)
                scale_inplace(out, post, wire)
                results.append(out)
            return results if grouped else results[0]

        return Then(gathered.name, gathered, combine)

    def allgather(self, arrays: Sequence[np.ndarray], *, name: Optional[str], dtype: Optional[str], ps: int,
                  grouped: bool, will_wait: bool = False) -> Handle:
        parts = []
        for raw in arrays:
            array, wire = prepare_array(raw, dtype)
            parts.append((Meta(kind=ALLGATHER, dtype=wire, shape=tuple(array.shape), ps=ps), array, None))
        return self._submit(ALLGATHER, name, parts, grouped, will_wait, ps)

    def broadcast(self, array: np.ndarray, root_rank: int, *, name: Optional[str], out: Optional[np.ndarray],
                  dtype: Optional[str], ps: int, will_wait: bool = False) -> Handle:
        members = self.members(ps)
        if root_rank not in members:
            raise ValueError(f"root_rank={root_rank} is not a rank of the job (expected one of {list(members)})")
        array_c, wire = prepare_array(array, dtype)
        target = _target(array, array_c, out, BROADCAST)
        meta = Meta(kind=BROADCAST, dtype=wire, shape=tuple(array_c.shape), root=int(root_rank), ps=ps)
        return self._submit(BROADCAST, name, [(meta, array_c, target)], False, will_wait, ps)

    def alltoall(self, array: np.ndarray, splits: Optional[Sequence[int]], *, name: Optional[str],
                 dtype: Optional[str], ps: int, will_wait: bool = False) -> Handle:
        n = len(self.members(ps))
        array_c, wire = prepare_array(array, dtype)
        if array_c.ndim == 0:
            raise ValueError("alltoall needs an array with at least one dimension")
        if splits is None:
            if array_c.shape[0] % n:
                raise ValueError(
                    f"alltoall without splits needs dim 0 ({array_c.shape[0]}) divisible by the number of ranks "
                    f"({n}); pass splits=[rows for rank 0, rows for rank 1, ...]"
                )
            split_list = [array_c.shape[0] // n] * n
        else:
            split_list = [int(s) for s in np.asarray(splits).reshape(-1)]
            if len(split_list) != n or any(s < 0 for s in split_list) or sum(split_list) != array_c.shape[0]:
                raise ValueError(
                    f"alltoall splits={split_list} must give one non-negative row count per rank ({n}) adding up "
                    f"to dim 0 of the array ({array_c.shape[0]})"
                )
        meta = Meta(kind=ALLTOALL, dtype=wire, shape=tuple(array_c.shape), ps=ps, splits=tuple(split_list))
        return self._submit(ALLTOALL, name, [(meta, array_c, None)], False, will_wait, ps)

    def device(self, kind: str, tensors: Sequence[Any], outs: Sequence[Any], *, wire: str, name: Optional[str],
               ps: int, grouped: bool, op: int = 0, prescale: float = 1.0, postscale: float = 1.0,
               root_rank: int = -1, splits: Optional[Sequence[int]] = None, device: str = "cuda") -> Handle:
        """Start a collective on device tensors (a framework's, moved by NCCL): ``tensors`` expose
        ``shape``; ``outs`` receive allreduce and broadcast results (the tensors themselves in place)."""
        if kind not in (ALLREDUCE, BROADCAST, ALLGATHER, ALLTOALL, REDUCESCATTER):
            raise ValueError(f"kind={kind!r} is not a collective on device tensors")
        if kind in (ALLREDUCE, REDUCESCATTER):
            reduce_op = int(check_op(op, wire))
        else:
            reduce_op = 0
        members = self.members(ps)
        if kind == BROADCAST and root_rank not in members:
            raise ValueError(f"root_rank={root_rank} is not a rank of the job (expected one of {list(members)})")
        parts = []
        for tensor, out in zip(tensors, outs):
            shape = tuple(int(d) for d in tensor.shape)
            if kind in (ALLTOALL, REDUCESCATTER) and not shape:
                raise ValueError(f"{kind} needs a tensor with at least one dimension")
            meta = Meta(kind=kind, dtype=wire, shape=shape, op=reduce_op, root=int(root_rank), prescale=float(prescale),
                        postscale=float(postscale), ps=ps, splits=tuple(splits) if splits is not None else None,
                        device=device)
            parts.append((meta, tensor, out))
        return self._submit(kind, name, parts, grouped, False, ps)

    def barrier(self, *, ps: int, name: Optional[str] = None, will_wait: bool = False) -> Handle:
        return self._submit(BARRIER, name, [(Meta(kind=BARRIER, dtype="", shape=(), ps=ps), None, None)],
                            False, will_wait, ps)

    def join(self) -> Handle:
        if self.lockstep is not None:
            self.lockstep.leave()
        return self._submit(JOIN, f"join.{self.rank}", [(Meta(kind=JOIN, dtype="", shape=()), None, None)],
                            False, False)

    def add_process_set(self, ranks: Tuple[int, ...]) -> Handle:
        for r in ranks:
            if not 0 <= r < self.size:
                raise ValueError(f"process set rank {r} is outside the job of size {self.size}")
        meta = Meta(kind=ADD_PROCESS_SET, dtype="", shape=(), ranks=tuple(ranks))
        return self._submit(ADD_PROCESS_SET, None, [(meta, None, None)], False, False)
