"""Negotiation: rank 0 learns which named requests every rank has submitted and fixes one order.

Workers announce requests to the coordinator (rank 0). A request becomes ready when every member
of its process set (less the ranks that have joined) has announced it; the coordinator then checks
that the ranks agree (shape, dtype, op, root ...), packs ready allreduces of one kind into fused
responses up to the fusion threshold, and sends the same ordered batch of responses to everyone.

Signatures (a request's metadata) get integer ids. The coordinator teaches workers ids, and a
rank then announces a request seen before by its id alone, so steady-state training steps
exchange a few bytes per tensor (the response cache). The cache holds at most ``capacity`` ids,
least recently used ones are evicted, and capacity 0 turns it off.

Eviction keeps one invariant by construction: every id a rank may still send, or a response may
still use, resolves. An id is forgotten only when (1) no pending request carries it, and (2) every
worker has acknowledged the batch that announced its eviction (a worker's announcements name the
last batch it had processed, and it stops using an id once it has processed that id's eviction).
Ids are never reused.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Set, Tuple

from .messages import Meta, Response, ResponseBatch
from .ops import ReduceOp
from .kinds import ADD_PROCESS_SET, ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, ERROR, JOIN, KINDS

__all__ = ["Coordinator", "SignatureTable", "WorkerSignatures", "STALL_WARNING"]

STALL_WARNING = ("spark-hvd stall: %d operation(s) are waiting for other ranks (check that every rank calls the "
                 "same collectives with the same names):\n  %s")
"""The stall inspector's warning: how many operations wait, then a line per operation."""


_COMPARED = {name: info.compared for name, info in KINDS.items()}
_LABELS = {"trailing": "shapes after the first dimension", "shape": "shapes", "dtype": "dtypes",
           "op": "reduction ops", "root": "root ranks", "group": "groups", "splits_len": "numbers of splits",
           "ranks": "process set ranks", "prescale": "prescale factors", "postscale": "postscale factors",
           "device": "devices (CPU tensors on some ranks, GPU tensors on others)"}
# Kinds that cannot stand in for a joined rank: it has no rows to give and may be the root.
_NOT_WITH_JOINED = tuple(name for name, info in KINDS.items() if not info.with_joined)


def _attr(meta: Meta, name: str):
    if name == "trailing":
        return tuple(meta.shape[1:])
    if name == "splits_len":
        return len(meta.splits or ())
    return getattr(meta, name)


class SignatureTable:
    """The coordinator's ids: which metas they stand for, which workers hold, which may go."""

    def __init__(self, capacity: int, workers: Iterable[int]) -> None:
        self.capacity = capacity
        self.persist = capacity > 0
        self._meta: Dict[int, Meta] = {}  # every id that may still be announced or used
        self._by_meta: Dict[Meta, int] = {}  # the id new requests with this meta get
        self._live: "OrderedDict[int, None]" = OrderedDict()  # those ids, least recently used first
        self._known: Set[int] = set()  # ids every worker holds (taught, not evicted)
        self._retiring: Dict[int, int] = {}  # evicted id -> seq of the batch that announced it
        self._refs: Dict[int, int] = {}  # id -> pending requests carrying it
        self._acks: Dict[int, int] = {w: 0 for w in workers}
        self._next = 0

    def __len__(self) -> int:
        """Ids still resolvable."""
        return len(self._meta)

    @property
    def live(self) -> int:
        """Ids new requests can be matched to (at most the capacity, plus ids in use)."""
        return len(self._live)

    def intern(self, meta: Meta) -> int:
        sid = self._by_meta.get(meta)
        if sid is None:
            sid = self._next
            self._next += 1
            self._by_meta[meta] = sid
            self._meta[sid] = meta
            self._live[sid] = None
        else:
            self._live.move_to_end(sid)
        return sid

    def resolve(self, sid: int) -> Meta:
        return self._meta[sid]

    def touch(self, sid: int) -> None:
        if sid in self._live:
            self._live.move_to_end(sid)

    def hold(self, sid: int) -> None:
        refs = self._refs
        refs[sid] = refs.get(sid, 0) + 1

    def release(self, sid: int) -> None:
        left = self._refs[sid] - 1
        if left:
            self._refs[sid] = left
        else:
            del self._refs[sid]
            if sid not in self._live and sid not in self._known:
                self._maybe_forget(sid)

    def ack(self, worker: int, seq: int) -> None:
        """``worker`` has processed every batch up to ``seq``."""
        if seq <= self._acks.get(worker, 0):
            return
        self._acks[worker] = seq
        self._sweep()

    def leave(self, worker: int) -> None:
        """``worker`` is gone and will announce nothing more."""
        self._acks.pop(worker, None)
        self._sweep()

    def _floor(self) -> float:
        return min(self._acks.values()) if self._acks else float("inf")

    def _sweep(self) -> None:
        if self._retiring:
            floor = self._floor()
            for sid in [s for s, seq in self._retiring.items() if seq <= floor and s not in self._refs]:
                del self._retiring[sid]
                del self._meta[sid]

    def _maybe_forget(self, sid: int) -> None:
        if sid not in self._meta or sid in self._refs or sid in self._live or sid in self._known:
            return
        seq = self._retiring.get(sid)
        if seq is None or seq <= self._floor():
            self._retiring.pop(sid, None)
            del self._meta[sid]

    def lesson(self, used: Set[int], seq: int) -> Tuple[Tuple[Tuple[int, Meta], ...], Tuple[Tuple[int, Meta], ...],
                                                         Tuple[int, ...]]:
        """What batch ``seq`` teaches, resolves for itself alone, and evicts; ``used`` ids are its own."""
        evicted = []
        limit = self.capacity if self.persist else 0
        excess = len(self._live) - limit
        if excess > 0:
            for sid in list(self._live):
                if excess <= 0:
                    break
                if sid in self._refs or sid in used:
                    continue
                del self._live[sid]
                del self._by_meta[self._meta[sid]]
                excess -= 1
                if sid in self._known:
                    self._known.discard(sid)
                    self._retiring[sid] = seq
                    evicted.append(sid)
                else:
                    self._maybe_forget(sid)
        teach = []
        if self.persist and len(self._known) < len(self._live):
            for sid in self._live:
                if sid not in self._known:
                    self._known.add(sid)
                    teach.append((sid, self._meta[sid]))
        resolve = tuple((sid, self._meta[sid]) for sid in sorted(used) if sid not in self._known)
        return tuple(teach), resolve, tuple(evicted)


@dataclass
class _Pending:
    kind: str
    ps: int
    first_seen: float
    ids: Dict[int, int] = field(default_factory=dict)  # rank -> signature id


class Coordinator:
    """Rank 0's view of every rank's outstanding requests."""

    def __init__(self, size: int, cache_capacity: int, fusion_threshold: int, stall_check_seconds: float,
                 stall_shutdown_seconds: float, eager_threshold: int = 0) -> None:
        self.size = size
        self.eager_threshold = eager_threshold
        self.fusion_threshold = fusion_threshold
        self.stall_check_seconds = stall_check_seconds
        self.stall_shutdown_seconds = stall_shutdown_seconds
        self.sigs = SignatureTable(cache_capacity, range(1, size))
        self.pending: "OrderedDict[Tuple[int, str], _Pending]" = OrderedDict()
        self.ready: List[Tuple[int, str]] = []
        self._ready_set: Set[Tuple[int, str]] = set()
        self.process_sets: Dict[int, Tuple[int, ...]] = {0: tuple(range(size))}
        self.next_ps = 1
        self.joined: List[int] = []
        self.seq = 0
        self._last_stall_check = time.monotonic()
        self._stall_warned: Set[Tuple[int, str]] = set()

    # -- input ------------------------------------------------------------------------------------
    def submit(self, rank: int, name: str, meta: Meta) -> None:
        self._add(rank, name, self.sigs.intern(meta), meta)

    def submit_id(self, rank: int, name: str, sid: int) -> None:
        self.sigs.touch(sid)
        self._add(rank, name, sid, self.sigs.resolve(sid))

    def _add(self, rank: int, name: str, sid: int, meta: Meta) -> None:
        if meta.kind == JOIN:
            if rank not in self.joined:
                self.joined.append(rank)
            self._recheck_all()
            return
        key = (meta.ps, name)
        entry = self.pending.get(key)
        if entry is None:
            entry = self.pending[key] = _Pending(meta.kind, meta.ps, time.monotonic())
        previous = entry.ids.get(rank)
        entry.ids[rank] = sid
        self.sigs.hold(sid)
        if previous is not None:
            self.sigs.release(previous)
        self._check_ready(key, entry)

    def _check_ready(self, key: Tuple[int, str], entry: _Pending) -> None:
        if key in self._ready_set:
            return
        members = self.process_sets[entry.ps]
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

    def leave(self, rank: int) -> None:
        """A worker has shut down: it announces nothing more."""
        self.sigs.leave(rank)

    # -- output -----------------------------------------------------------------------------------
    def decide(self) -> Tuple[ResponseBatch, Dict[int, Meta]]:
        """The batch answering everything ready, and the metas of the ids it uses (for rank 0)."""
        responses: List[object] = []  # Responses, and fused allreduces still open: [names, sids, ps, bytes]
        fused: Dict[tuple, list] = {}  # fusion key -> its open fused allreduce
        groups: Dict[Tuple[int, str], list] = {}
        finished: List[_Pending] = []
        for key in self.ready:
            entry = self.pending[key]
            ps, name = key
            error, sample = self._check(name, entry)
            if error is not None:
                responses.append(Response(kind=ERROR, names=(name,), ps=ps, error=error))
                finished.append(self.pending.pop(key))
                continue
            if sample.group is not None:
                members = groups.setdefault((ps, sample.group[0]), [])
                members.append((name, entry, sample))
                if len(members) < sample.group[1]:
                    continue  # wait until the whole group is ready everywhere
                del groups[(ps, sample.group[0])]
                responses.append(self._group_response(ps, members))
                finished.extend(self.pending.pop((ps, n)) for n, _, _ in members)
                continue
            finished.append(self.pending.pop(key))
            sid = next(iter(entry.ids.values()))
            if sample.kind == ALLREDUCE and self.fusion_threshold > 0:
                size = sample.nbytes()
                # Small requests that can travel inside the messages are fused only among themselves.
                eager = size <= self.eager_threshold and sample.device == "cpu"
                fkey = (ps, sample.device, sample.dtype, sample.op, sample.prescale, sample.postscale, eager)
                limit = min(self.fusion_threshold, 64 * self.eager_threshold) if eager else self.fusion_threshold
                bucket = fused.get(fkey)
                if bucket is not None and bucket[3] + size <= limit:
                    bucket[0].append(name)
                    bucket[1].append(sid)
                    bucket[3] += size
                    continue
                bucket = fused[fkey] = [[name], [sid], ps, size]
                responses.append(bucket)
                continue
            responses.append(self._single_response(name, entry, sample))
        # Group members still waiting for their siblings stay ready for the next decision.
        self.ready = [(ps, name) for (ps, _), members in groups.items() for name, _, _ in members]
        self._ready_set = set(self.ready)
        responses = [r if isinstance(r, Response) else
                     Response(kind=ALLREDUCE, names=tuple(r[0]), ps=r[2], sids=tuple(r[1])) for r in responses]
        if self.joined and len(self.joined) == self.size:
            responses.append(Response(kind=JOIN, names=(), ps=0, value=self.joined[-1]))
            self.joined = []
        self.seq += 1
        used = _used_ids(responses)
        metas = {sid: self.sigs.resolve(sid) for sid in used}
        teach, resolve, evicted = self.sigs.lesson(used, self.seq)
        for entry in finished:  # only now: a retired id this batch uses must resolve until here
            for sid in entry.ids.values():
                self.sigs.release(sid)
        return ResponseBatch(seq=self.seq, responses=tuple(responses), teach=teach, resolve=resolve,
                             evicted=evicted), metas

    def _check(self, name: str, entry: _Pending) -> Tuple[Optional[str], Meta]:
        """An error message if the ranks disagree (or the request cannot run now), and a sample meta."""
        ids = set(entry.ids.values())
        if len(ids) == 1 and entry.kind not in (BROADCAST, ALLTOALL):
            sample = self.sigs.resolve(next(iter(ids)))  # one signature on every rank: nothing can disagree
            error = None
        else:
            metas = {r: self.sigs.resolve(sid) for r, sid in entry.ids.items()}
            sample = next(iter(metas.values()))
            error = self._mismatch(name, entry, metas)
        if error is None and entry.kind in _NOT_WITH_JOINED:
            missing = [r for r in self.process_sets[entry.ps] if r not in entry.ids]
            if missing:
                error = (f"{entry.kind} {name!r} cannot run while rank(s) {missing} have joined: only allreduce "
                         "and barrier take a joined rank's place. Call join() after the last such operation.")
        return error, sample

    def _single_response(self, name: str, entry: _Pending, sample: Meta) -> Response:
        ps = entry.ps
        if sample.kind in (ALLGATHER, ALLTOALL):
            per_rank = tuple(entry.ids[r] for r in self.process_sets[ps])
            return Response(kind=sample.kind, names=(name,), ps=ps, rank_sids=(per_rank,))
        sid = next(iter(entry.ids.values()))
        if sample.kind == ADD_PROCESS_SET:
            new_id = self.next_ps
            self.next_ps += 1
            self.process_sets[new_id] = tuple(sample.ranks or ())
            return Response(kind=ADD_PROCESS_SET, names=(name,), ps=ps, sids=(sid,), value=new_id)
        return Response(kind=sample.kind, names=(name,), ps=ps, sids=(sid,))

    def _group_response(self, ps: int, members: list) -> Response:
        kind = members[0][2].kind
        names = tuple(m[0] for m in members)
        if kind in (ALLGATHER, ALLTOALL):
            order = self.process_sets[ps]
            return Response(kind=kind, names=names, ps=ps,
                            rank_sids=tuple(tuple(e.ids[r] for r in order) for _, e, _ in members))
        return Response(kind=kind, names=names, ps=ps, sids=tuple(next(iter(e.ids.values())) for _, e, _ in members))

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
                label = _LABELS.get(attr, attr + "s")
                shown = {r: (ReduceOp(v).name if attr == "op" else v) for r, v in values.items()}
                listing = "; ".join(f"rank {r}: {v}" for r, v in sorted(shown.items()))
                return (f"mismatched {kind} {name!r}: {label} differ across ranks: {listing}. "
                        f"Every rank must pass the same {label} for the same named operation.")
        members = self.process_sets[entry.ps]
        if kind == BROADCAST:
            root = next(iter(metas.values())).root
            if root not in members:
                return f"broadcast {name!r}: root_rank={root} is not a member of the process set {members}"
        if kind == ALLTOALL:
            for r, m in metas.items():
                if len(m.splits or ()) != len(members):
                    return (f"alltoall {name!r}: rank {r} gave {len(m.splits or ())} splits; expected one per rank "
                            f"of the process set ({len(members)})")
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
        threshold = self.stall_check_seconds if self.stall_check_seconds > 0 else self.stall_shutdown_seconds
        for key, entry in self.pending.items():
            waited = now - entry.first_seen
            if waited < threshold:
                continue
            missing = [r for r in self.process_sets[entry.ps] if r not in entry.ids and r not in self.joined]
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


def _used_ids(responses: Iterable[Response]) -> Set[int]:
    used: Set[int] = set()
    for response in responses:
        used.update(response.sids)
        for per_rank in response.rank_sids:
            used.update(per_rank)
    return used


class WorkerSignatures:
    """A worker's copy of the ids the coordinator has taught it."""

    def __init__(self) -> None:
        self.ids: Dict[Meta, int] = {}
        self.metas: Dict[int, Meta] = {}
        self.seq = 0

    def encode(self, meta: Meta):
        """The id to announce ``meta`` by, or the meta itself when no id is held."""
        return self.ids.get(meta, meta)

    def learn(self, batch: ResponseBatch) -> Dict[int, Meta]:
        """Take in a batch's lessons; return the resolver for its responses."""
        for sid, meta in batch.teach:
            self.metas[sid] = meta
            self.ids[meta] = sid
        for sid in batch.evicted:
            meta = self.metas.pop(sid, None)
            if meta is not None and self.ids.get(meta) == sid:
                del self.ids[meta]
        self.seq = batch.seq
        if not batch.resolve:
            return self.metas
        scoped = dict(self.metas)
        scoped.update(batch.resolve)
        return scoped
