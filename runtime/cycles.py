"""One round of negotiation on a rank: announce new requests, take in what peers sent, execute what
was agreed. A worker's round (:class:`WorkerCycle`) talks to the coordinator; rank 0's
(:class:`CoordinatorCycle`) takes every worker's announcements, decides, and answers everyone.

The engine (:mod:`spark_hvd.runtime.engine`) decides when a round runs and on which thread; a
round raises :class:`~spark_hvd.runtime.errors.CollectiveError` when the job cannot go on.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from .autotune import Autotuner
from .control import ABORT, BYE, REQUESTS, RESPONSES, ControlLinks
from .eager import EagerAnswers
from .errors import CollectiveError
from .handles import RequestBook
from .kinds import ALLREDUCE, ALLREDUCE_EAGER
from .messages import (Announce, Meta, RequestBatch, Response, dump_requests, dump_responses, load_requests,
                       load_responses)
from .negotiation import STALL_WARNING, Coordinator, WorkerSignatures
from .ops import storage_dtype
from .timeline import TimelineSlot

__all__ = ["WorkerCycle", "CoordinatorCycle"]

log = logging.getLogger("spark_hvd.engine")

Execute = Callable[[Response, Mapping[int, Meta], float], None]


class WorkerCycle:
    """A worker's round: announce new requests to rank 0, execute the responses it sent."""

    def __init__(self, rank: int, book: RequestBook, links: ControlLinks, eager: EagerAnswers, execute: Execute,
                 config: Any, stall_period: Optional[float]) -> None:
        self.rank = rank
        self.book = book
        self.links = links
        self.eager = eager
        self.execute = execute
        self.config = config
        self.signatures = WorkerSignatures()
        self._stall_period = stall_period
        self._stall_warned: Set[Tuple[int, str]] = set()
        self._last_stall_check = 0.0

    def waiting(self) -> Dict[Tuple[int, str], Any]:
        """The requests this rank waits on an answer for."""
        return self.book.local

    def has_work(self) -> bool:
        return False

    def must_watch(self, process_sets: Mapping[int, Tuple[int, ...]]) -> bool:
        return False

    def __call__(self) -> None:
        new = self.book.take_new()
        if new:
            items = tuple(Announce(e.name, self.signatures.encode(e.meta), payload)
                          for e, payload in zip(new, self.eager.payloads(new)))
            self.links.send(0, REQUESTS + dump_requests(RequestBatch(self.signatures.seq, items)))
        links = self.links
        links.pump()
        reader = links[0]
        while reader.frames:
            frame = reader.frames.popleft()
            kind = frame[:1]
            if kind == RESPONSES:
                batch = load_responses(frame[1:])
                resolver = self.signatures.learn(batch)
                arrived = time.perf_counter()
                for response in batch.responses:
                    self.execute(response, resolver, arrived)
            elif kind == ABORT:
                links.raise_abort(frame)
            elif kind == BYE:
                links.left[0] = "shut down"
        if reader.closed or 0 in links.left:
            # Everything rank 0 sent before it went has been executed above.
            raise links.lost(0)
        if self.book.local:
            self._check_stalls()

    def _check_stalls(self) -> None:
        """Warn about requests rank 0 has not answered for the stall time (it warns about the ranks
        it is waiting for; this catches rank 0 itself stopped), and give up at the shutdown time."""
        now = time.perf_counter()
        if self._stall_period is None or now - self._last_stall_check < self._stall_period:
            return
        self._last_stall_check = now
        check, shutdown = self.config.stall_check_seconds, self.config.stall_shutdown_seconds
        self._stall_warned.intersection_update(self.book.local)
        lines, overdue = [], []
        for key, entry in self.book.local.items():
            waited = now - entry.submitted
            if shutdown > 0 and waited >= shutdown:
                overdue.append(f"{entry.meta.kind} {entry.name!r} ({waited:.1f} s)")
            elif check > 0 and waited >= check and key not in self._stall_warned:
                self._stall_warned.add(key)
                lines.append(f"{entry.meta.kind} {entry.name!r} has waited {waited:.1f} s")
        if lines:
            log.warning(
                "spark-hvd stall on rank %d: %d operation(s) have no answer from the coordinator (rank 0): "
                "other ranks may not have submitted them (rank 0's stall warning names those), or rank 0 is "
                "stopped or busy:\n  %s", self.rank, len(lines), "\n  ".join(lines))
        if overdue:
            raise CollectiveError(
                f"rank {self.rank}: no answer from the coordinator (rank 0) within "
                f"SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS={shutdown} for: " + "; ".join(overdue), lost_rank=0)


class CoordinatorCycle:
    """Rank 0's round: take every rank's announcements, decide what is ready, answer everyone, execute."""

    def __init__(self, size: int, book: RequestBook, links: ControlLinks, coordinator: Coordinator,
                 eager: EagerAnswers, execute: Execute, process_sets: Dict[int, Tuple[int, ...]],
                 timeline: TimelineSlot, config: Any, autotuner: Optional[Autotuner] = None) -> None:
        self.size = size
        self.book = book
        self.links = links
        self.coordinator = coordinator
        self.eager = eager
        self.execute = execute
        self.process_sets = process_sets
        self.timeline = timeline
        self.config = config
        self.autotuner = autotuner
        self.cycle_time_ms = config.cycle_time_ms

    def waiting(self) -> Dict[Tuple[int, str], Any]:
        """The requests of any rank still waiting for an answer."""
        return self.coordinator.pending

    def has_work(self) -> bool:
        return self.coordinator.has_work()

    def must_watch(self, process_sets: Mapping[int, Tuple[int, ...]]) -> bool:
        """Whether requests of other ranks can be answered without one of this rank (a process set
        without rank 0, or all ranks joined)."""
        coord = self.coordinator
        return coord.has_work() or (bool(coord.pending) and any(0 not in ranks for ranks in process_sets.values()))

    def __call__(self) -> None:
        coord, links = self.coordinator, self.links
        for entry in self.book.take_new():
            coord.submit(0, entry.name, entry.meta)
        links.pump()
        for peer, reader in links.items():
            while reader.frames:
                frame = reader.frames.popleft()
                kind = frame[:1]
                if kind == REQUESTS:
                    requests = load_requests(frame[1:])
                    coord.sigs.ack(peer, requests.seq)
                    for item in requests.items:
                        if isinstance(item.sig, int):
                            coord.submit_id(peer, item.name, item.sig)
                            meta = coord.sigs.resolve(item.sig)
                        else:
                            coord.submit(peer, item.name, item.sig)
                            meta = item.sig
                        self.eager.collect(meta, item.name, peer, item.payload)
                elif kind == ABORT:
                    links.raise_abort(frame)
                elif kind == BYE:
                    links.left[peer] = "shut down"
                    coord.leave(peer)
            if reader.closed and peer not in links.left:
                raise links.lost(peer)  # gone without saying goodbye: it crashed
        if links.left:
            # Requests that need a departed rank can never complete.
            needed = {ps for ps, _ in coord.pending} | {ps for ps, _ in self.book.local}
            for ps in needed:
                gone = [r for r in self.process_sets.get(ps, ()) if r in links.left]
                if gone:
                    raise links.lost(gone[0])
        if coord.has_work() and self._cycle_allows():
            self._answer()
        lines, shutdown = coord.stalled(time.monotonic())
        if lines:
            log.warning(STALL_WARNING, len(lines), "\n  ".join(lines))
        if shutdown:
            raise CollectiveError(
                "stalled operations exceeded SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS="
                f"{self.config.stall_shutdown_seconds}: " + "; ".join(lines))

    def _answer(self) -> None:
        coord, links = self.coordinator, self.links
        batch, metas = coord.decide()
        timeline = self.timeline.current
        responses = self.eager.answer(batch.responses, metas.__getitem__, self.book.local, self.process_sets,
                                      coord.joined, timeline, alone=self.size == 1)
        if responses is not batch.responses:
            batch = batch._replace(responses=responses)
        if not (batch.responses or batch.teach or batch.evicted):
            return
        frame = RESPONSES + dump_responses(batch)
        for peer in links:
            if peer not in links.left:
                links.send(peer, frame)
        arrived = time.perf_counter()
        if timeline is not None:
            timeline.cycle(arrived * 1e6)
        for response in batch.responses:
            self.execute(response, metas, arrived)
        if self.autotuner is not None and not self.autotuner.done:
            self._autotune(batch.responses, metas)

    def _autotune(self, responses: Sequence[Response], metas: Mapping[int, Meta]) -> None:
        """Feed the autotuner the allreduces just executed; apply the setting it moves to."""
        names: List[str] = []
        nbytes = 0
        for response in responses:
            if response.kind in (ALLREDUCE, ALLREDUCE_EAGER):
                names.extend(response.names)
                for sid in response.sids:
                    meta = metas.get(sid)
                    if meta is not None:
                        nbytes += meta.count() * storage_dtype(meta.dtype).itemsize
        if not names:
            return
        assert self.autotuner is not None
        setting = self.autotuner.observe(names, nbytes)
        if setting is not None:
            self.coordinator.fusion_threshold, self.cycle_time_ms = setting

    def _cycle_allows(self) -> bool:
        """With a cycle time, hold ready requests back until the oldest has waited that long."""
        cycle_ms = self.cycle_time_ms
        if cycle_ms <= 0:
            return True
        coord = self.coordinator
        oldest = min((coord.pending[key].first_seen for key in coord.ready if key in coord.pending), default=0.0)
        if time.monotonic() - oldest >= cycle_ms / 1000.0:
            return True
        time.sleep(min(cycle_ms / 1000.0, 0.001))
        return False
