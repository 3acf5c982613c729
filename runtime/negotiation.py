"""Negotiation: rank 0 learns which named requests every rank has submitted and fixes one order.

Workers announce requests to the coordinator (rank 0). A request becomes ready when every member
of its process set (less the ranks that have joined) has announced it; the coordinator then checks
that the ranks agree (shape, dtype, op, root ...), packs ready allreduces of one kind into fused
responses up to the fusion threshold, and sends the same ordered list of responses to everyone.

Signatures (a request's metadata) get small integer ids that workers learn from the responses; a
rank then announces a request seen before with its id alone, so steady-state training steps
exchange a few bytes per tensor (the response cache). Its capacity is bounded, least recently used
ids are evicted, and capacity 0 turns it off.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Set, Tuple


from .ops import ReduceOp, storage_dtype

__all__ = ["Meta", "Coordinator", "WorkerSignatures", "Response"]

log = logging.getLogger("spark_hvd.negotiation")


class Meta(NamedTuple):
    """What a rank says about one request; equal metas on all ranks mean the request agrees."""

    kind: str  # allreduce, allgather, broadcast, alltoall, reducescatter, barrier, join, add_process_set
    dtype: str
    shape: Tuple[int, ...]
    op: int = 0
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    ps: int = 0
    group: Optional[Tuple[str, int]] = None  # (group name, number of members)
    extra: Optional[Tuple[int, ...]] = None  # alltoall splits; process-set ranks

    def count(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    def nbytes(self) -> int:
        return math.prod(self.shape) * storage_dtype(self.dtype).itemsize if self.dtype else 0


# A response, identical on every rank: kind, names, process set, and per-name signature ids
# (one id, or one per rank for allgather/alltoall), plus kind-specific details.
Response = Tuple


_FIELDS = ("dtype", "shape", "op", "root", "prescale", "postscale", "group", "extra")
_COMPARED = {
    "allreduce": ("dtype", "shape", "op", "prescale", "postscale", "group"),
    "reducescatter": ("dtype", "shape", "op", "prescale", "postscale", "group"),
    "broadcast": ("dtype", "shape", "root"),
    "allgather": ("dtype", "trailing", "group"),
    "alltoall": ("dtype", "trailing", "splits_len"),
    "barrier": (),
    "join": (),
    "add_process_set": ("extra",),
}
_FUSABLE = ("allreduce",)


def _attr(meta: Meta, name: str):
    if name == "trailing":
        return tuple(meta.shape[1:]) if meta.shape else ()
    if name == "splits_len":
        return len(meta.extra or ())
    return getattr(meta, name)


@dataclass
class _Pending:
    kind: str
    ps: int
    first_seen: float
    ids: Dict[int, int] = field(default_factory=dict)  # rank -> signature id
    order: int = 0


class _Signatures:
    """The coordinator's id <-> signature table with LRU eviction."""

    def __init__(self, capacity: int, workers: List[int]) -> None:
        self.capacity = capacity
        self.persist = capacity > 0
        self.by_meta: Dict[Meta, int] = {}
        self.by_id: "OrderedDict[int, Meta]" = OrderedDict()
        self.next_id = 0
        self.announced: Set[int] = set()  # ids every worker knows
        self.retired: Dict[int, Tuple[Meta, int]] = {}  # id -> (meta, response seq of its eviction)
        self.acks: Dict[int, int] = {w: 0 for w in workers}

    def intern(self, meta: Meta) -> int:
        sid = self.by_meta.get(meta)
        if sid is None:
            sid = self.next_id
            self.next_id += 1
            self.by_meta[meta] = sid
            self.by_id[sid] = meta
        else:
            self.by_id.move_to_end(sid)
        return sid

    def lookup(self, sid: int) -> Meta:
        meta = self.by_id.get(sid)
        if meta is not None:
            self.by_id.move_to_end(sid)
            return meta
        return self.retired[sid][0]

    def ack(self, worker: int, seq: int) -> None:
        self.acks[worker] = max(self.acks.get(worker, 0), seq)
        if self.retired:
            floor = min(self.acks.values()) if self.acks else seq
            for sid in [s for s, (_, evicted_at) in self.retired.items() if evicted_at <= floor]:
                del self.retired[sid]

    def evict(self, in_use: Set[int], seq: int) -> List[int]:
        """Drop ids beyond capacity (all unused ids when the cache is off)."""
        limit = self.capacity if self.persist else 0
        evicted = []
        for sid in list(self.by_id):
            if len(self.by_id) <= limit:
                break
            if sid in in_use:
                continue
            meta = self.by_id.pop(sid)
            del self.by_meta[meta]
            if sid in self.announced:
                self.announced.discard(sid)
                self.retired[sid] = (meta, seq)
                evicted.append(sid)
        return evicted


class Coordinator:
    """Rank 0's view of every rank's outstanding requests."""

    def __init__(self, size: int, cache_capacity: int, fusion_threshold: int,
                 stall_check_seconds: float, stall_shutdown_seconds: float, eager_threshold: int = 0) -> None:
        self.size = size
        self.eager_threshold = eager_threshold
        self.fusion_threshold = fusion_threshold
        self.stall_check_seconds = stall_check_seconds
        self.stall_shutdown_seconds = stall_shutdown_seconds
        self.sigs = _Signatures(cache_capacity, list(range(1, size)))
        self.pending: "OrderedDict[Tuple[int, str], _Pending]" = OrderedDict()
        self.ready: List[Tuple[int, str]] = []
        self._ready_set: Set[Tuple[int, str]] = set()
        self.process_sets: Dict[int, Tuple[int, ...]] = {0: tuple(range(size))}
        self.next_ps = 1
        self.joined: List[int] = []
        self.seq = 0
        self._counter = 0
        self._last_stall_check = time.monotonic()
        self._stall_warned: Set[Tuple[int, str]] = set()

    # -- input ------------------------------------------------------------------------------------
    def submit(self, rank: int, name: str, meta: Meta) -> None:
        self.submit_id(rank, name, self.sigs.intern(meta))

    def submit_id(self, rank: int, name: str, sid: int) -> None:
        meta = self.sigs.lookup(sid)
        if meta.kind == "join":
            if rank not in self.joined:
                self.joined.append(rank)
            self._recheck_all()
            return
        key = (meta.ps, name)
        entry = self.pending.get(key)
        if entry is None:
            self._counter += 1
            entry = self.pending[key] = _Pending(meta.kind, meta.ps, time.monotonic(), order=self._counter)
        entry.ids[rank] = sid
        self._check_ready(key, entry)

    def _members(self, ps: int) -> Tuple[int, ...]:
        return self.process_sets[ps]

    def _check_ready(self, key: Tuple[int, str], entry: _Pending) -> None:
        if key in self._ready_set:
            return
        members = self._members(entry.ps)
        if len(entry.ids) < len(members):
            if entry.ps != 0 or not self.joined:
                return
            if not all(r in entry.ids or r in self.joined for r in members):
                return
        self.ready.append(key)
        self._ready_set.add(key)

    def _recheck_all(self) -> None:
        for key, entry in self.pending.items():
            self._check_ready(key, entry)

    def has_work(self) -> bool:
        """Whether decide() would produce something: ready requests, or every rank has joined."""
        return bool(self.ready) or (bool(self.joined) and len(self.joined) == self.size)

    # -- output -----------------------------------------------------------------------------------
    def decide(self) -> Tuple[List[Response], List[Tuple[int, Meta]], List[int], int]:
        """Responses for everything ready, the id definitions workers need, evictions, and seq."""
        responses: List[Response] = []
        fused: Dict[tuple, list] = {}
        groups: Dict[Tuple[int, str], list] = {}
        for key in self.ready:
            entry = self.pending[key]
            ps, name = key
            ids = set(entry.ids.values())
            if len(ids) == 1 and entry.kind not in ("broadcast", "alltoall"):
                # One signature on every rank: nothing can disagree.
                metas = {self._any_rank(entry): self.sigs.lookup(next(iter(ids)))}
                error = None
            else:
                metas = {r: self.sigs.lookup(sid) for r, sid in entry.ids.items()}
                error = self._mismatch(name, entry, metas)
            if error is not None:
                responses.append(("error", (name,), ps, error))
                del self.pending[key]
                continue
            sample = next(iter(metas.values()))
            if sample.group is not None:
                members = groups.setdefault((ps, sample.group[0]), [])
                members.append((name, entry, sample))
                if len(members) < sample.group[1]:
                    continue  # wait until the whole group is ready everywhere
                del groups[(ps, sample.group[0])]
                responses.append(self._group_response(ps, members))
                for member_name, _, _ in members:
                    del self.pending[(ps, member_name)]
                continue
            del self.pending[key]
            if sample.kind in _FUSABLE and self.fusion_threshold > 0:
                size = sample.nbytes()
                # Small requests that can travel inside the messages are fused only among themselves.
                eager = size <= self.eager_threshold
                fkey = (ps, sample.dtype, sample.op, sample.prescale, sample.postscale, eager)
                bucket = fused.get(fkey)
                limit = min(self.fusion_threshold, 64 * self.eager_threshold) if eager else self.fusion_threshold
                if bucket is not None and bucket[1] + size <= limit:
                    bucket[0][1].append(name)
                    bucket[0][3].append(entry.ids[self._any_rank(entry)])
                    bucket[1] += size
                    continue
                response = ["allreduce", [name], ps, [entry.ids[self._any_rank(entry)]]]
                fused[fkey] = [response, size]
                responses.append(response)
                continue
            responses.append(self._single_response(name, entry, sample, metas))
        # Group members still waiting for their siblings stay ready for the next decision.
        self.ready = [(ps, name) for (ps, _), members in groups.items() for name, _, _ in members]
        self._ready_set = set(self.ready)
        responses = [tuple(tuple(x) if isinstance(x, list) else x for x in r) for r in responses]
        if self.joined and len(self.joined) == self.size:
            responses.append(("join", (), 0, self.joined[-1]))
            self.joined = []
        self.seq += 1
        used = _used_ids(responses)
        defs = [(sid, self.sigs.lookup(sid)) for sid in sorted(used) if sid not in self.sigs.announced]
        if self.sigs.persist:
            # Also teach workers ids interned since the last message, so they can use them next time.
            for sid in list(self.sigs.by_id):
                if sid not in self.sigs.announced and sid not in used:
                    defs.append((sid, self.sigs.by_id[sid]))
            self.sigs.announced.update(sid for sid, _ in defs)
        # Ids used by this message stay until the next one, so every rank can still resolve them.
        in_use = {sid for entry in self.pending.values() for sid in entry.ids.values()} | used
        evicted = self.sigs.evict(in_use, self.seq)
        return responses, defs, evicted, self.seq

    @staticmethod
    def _any_rank(entry: _Pending) -> int:
        return next(iter(entry.ids))

    def _single_response(self, name: str, entry: _Pending, sample: Meta, metas: Dict[int, Meta]) -> Response:
        ps = entry.ps
        if sample.kind in ("allgather", "alltoall"):
            members = self._members(ps)
            per_rank = []
            for r in members:
                if r in entry.ids:
                    per_rank.append(entry.ids[r])
                else:  # a joined rank contributes no rows
                    shape = (0,) + tuple(sample.shape[1:])
                    extra = tuple(0 for _ in members) if sample.kind == "alltoall" else None
                    per_rank.append(self.sigs.intern(sample._replace(shape=shape, extra=extra)))
            return (sample.kind, (name,), ps, (tuple(per_rank),))
        if sample.kind == "add_process_set":
            new_id = self.next_ps
            self.next_ps += 1
            self.process_sets[new_id] = tuple(sample.extra or ())
            return ("add_process_set", (name,), ps, (entry.ids[self._any_rank(entry)],), new_id)
        return (sample.kind, (name,), ps, (entry.ids[self._any_rank(entry)],))

    def _group_response(self, ps: int, members: list) -> Response:
        kind = members[0][2].kind
        names = tuple(m[0] for m in members)
        if kind in ("allgather", "alltoall"):
            ids = tuple(self._single_response(n, e, s, {})[3][0] for n, e, s in members)
        else:
            ids = tuple(e.ids[self._any_rank(e)] for _, e, _ in members)
        return (kind, names, ps, ids)

    def _mismatch(self, name: str, entry: _Pending, metas: Dict[int, Meta]) -> Optional[str]:
        kinds = {m.kind for m in metas.values()}
        if len(kinds) > 1:
            listing = "; ".join(f"rank {r}: {m.kind}" for r, m in sorted(metas.items()))
            return (f"ranks submitted different operations under the name {name!r}: {listing}. "
                    "Give each collective call a name used for that call alone, on every rank.")
        kind = kinds.pop()
        for attr in _COMPARED.get(kind, ()):
            values = {r: _attr(m, attr) for r, m in metas.items()}
            if len(set(values.values())) > 1:
                label = {"trailing": "shapes after the first dimension", "shape": "shapes", "dtype": "dtypes",
                         "op": "reduction ops", "root": "root ranks", "group": "groups",
                         "splits_len": "numbers of splits"}.get(attr, attr + "s")
                shown = {r: (ReduceOp(v).name if attr == "op" else v) for r, v in values.items()}
                listing = "; ".join(f"rank {r}: {v}" for r, v in sorted(shown.items()))
                return (f"mismatched {kind} {name!r}: {label} differ across ranks: {listing}. "
                        f"Every rank must pass the same {label} for the same named operation.")
        if kind == "broadcast":
            root = next(iter(metas.values())).root
            if root not in self._members(entry.ps):
                return f"broadcast {name!r}: root_rank={root} is not a member of the process set {self._members(entry.ps)}"
            if entry.ps == 0 and root in self.joined and root not in entry.ids:
                return f"broadcast {name!r}: root rank {root} has already joined and cannot send"
        if kind == "alltoall":
            size = len(self._members(entry.ps))
            for r, m in metas.items():
                if len(m.extra or ()) != size:
                    return (f"alltoall {name!r}: rank {r} gave {len(m.extra or ())} splits; expected one per rank "
                            f"of the process set ({size})")
        return None

    # -- stalls -----------------------------------------------------------------------------------
    def stalled(self, now: float) -> Tuple[List[str], bool]:
        """Warnings about requests waiting for other ranks, and whether to shut the job down."""
        if self.stall_check_seconds <= 0 and self.stall_shutdown_seconds <= 0:
            return [], False
        interval = min(x for x in (self.stall_check_seconds, self.stall_shutdown_seconds) if x > 0)
        if now - self._last_stall_check < min(interval / 4.0, 1.0):
            return [], False
        self._last_stall_check = now
        lines = []
        shutdown = False
        self._stall_warned.intersection_update(self.pending)
        for key, entry in self.pending.items():
            waited = now - entry.first_seen
            threshold = self.stall_check_seconds if self.stall_check_seconds > 0 else self.stall_shutdown_seconds
            if waited < threshold:
                continue
            members = self._members(entry.ps)
            missing = [r for r in members if r not in entry.ids and r not in self.joined]
            if self.stall_shutdown_seconds > 0 and waited >= self.stall_shutdown_seconds:
                shutdown = True
            if key in self._stall_warned and not shutdown:
                continue
            self._stall_warned.add(key)
            lines.append(
                f"{entry.kind} {key[1]!r} has waited {waited:.1f} s: submitted by rank(s) {sorted(entry.ids)}, "
                f"missing rank(s) {missing}"
            )
        return lines, shutdown


def _used_ids(responses: List[Response]) -> Set[int]:
    used: Set[int] = set()
    for response in responses:
        if response[0] in ("error", "join"):
            continue
        for item in response[3]:
            if isinstance(item, tuple):
                used.update(item)
            else:
                used.add(item)
    return used


class WorkerSignatures:
    """A worker's copy of the ids the coordinator has taught it."""

    def __init__(self) -> None:
        self.ids: Dict[Meta, int] = {}
        self.metas: Dict[int, Meta] = {}
        self.seq = 0

    def encode(self, name: str, meta: Meta):
        sid = self.ids.get(meta)
        return (name, sid) if sid is not None else (name, meta)

    def learn(self, defs: List[Tuple[int, Meta]], evicted: List[int], seq: int, persist: bool) -> None:
        if not persist:
            self.metas = {}
        for sid, meta in defs:
            meta = Meta(*meta)
            self.metas[sid] = meta
            if persist:
                self.ids[meta] = sid
        for sid in evicted:
            meta = self.metas.pop(sid, None)
            if meta is not None and self.ids.get(meta) == sid:
                del self.ids[meta]
        self.seq = seq

    def meta(self, sid: int) -> Meta:
        return self.metas[sid]
