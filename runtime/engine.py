"""The background engine: one thread per process that negotiates requests and runs collectives.

Callers enqueue named requests and get handles. The engine thread announces them to the
coordinator (rank 0), receives the agreed, ordered batch of responses, and executes each one over
the transport: fused allreduces through one reusable buffer, the other collectives directly on
the callers' arrays. A lone request is announced the moment it arrives; nothing waits for a timer
unless a cycle time is configured.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import select
import threading
import time
from collections import deque
from typing import Any, Deque, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np

from .errors import CollectiveError, RankMismatchError
from .eager import EagerAnswers
from .execution import Executor
from .handles import Entry, Handle
from .messages import (Announce, Meta, RequestBatch, Response, dump_requests, dump_responses, load_requests,
                       load_responses)
from .autotune import Autotuner
from .negotiation import Coordinator, WorkerSignatures
from .ops import storage_dtype
from .timeline import MEMCPY_OUT, NEGOTIATE, QUEUE, Timeline
from .dataplane import DataPlane, RingDataPlane, hierarchy_of
from .device import DeviceExecutor, NcclDataPlane, device_ops, nccl_status
from .control import ControlLink

__all__ = ["Engine", "DYNAMIC_TIMELINE"]

log = logging.getLogger("spark_hvd.engine")

# Control frame types (first byte).
REQUESTS = b"R"
RESPONSES = b"S"
ABORT = b"A"
BYE = b"X"

DYNAMIC_TIMELINE = "DYNAMIC"
"""Timeline setting (Horovod's) that writes no file until start_timeline() is called."""


_POLL_BUSY = 50e-6
"""Seconds between polls of MPI links while a request waits, when each rank has a core."""
_POLL_BUSY_SHARED = 200e-6
"""The same on an oversubscribed host."""
_POLL_IDLE = 0.005
"""The longest interval between polls of an idle job's MPI links."""
_CALLER_SPIN = 300e-6
"""Seconds a waiting caller polls its links before it blocks in select(): a round trip between
ranks that both have a core takes less, so most answers need no wake-up at all."""
_COALESCE_STEP = 100e-6
_COALESCE_MAX = 0.001
"""Woken for asynchronous requests, the engine thread first sleeps in steps of _COALESCE_STEP
while more keep arriving, for at most _COALESCE_MAX: a caller submitting a burst (the gradients
of a backward pass) keeps the GIL and announces them in one message instead of trading the GIL
with this thread once per request; a caller that starts waiting in the meantime drives them
itself. Horovod's background thread waits a cycle time (1 ms) the same way."""
_DEFER = 0.001
"""An asynchronous request wakes the engine thread only once requests have been queued unannounced
this long (seconds): a burst shorter than that (a small model's gradients) is announced by the
caller that waits for it next, with no thread hand-off at all; a longer one (a large model's
backward pass) is announced in pieces while it runs, so communication overlaps computation."""
_PARKED = 0.005
"""How often a parked engine thread (nothing of its own to wait for, or a caller driving) reads the
control links anyway: aborts and goodbyes of other ranks, and frames that must not pile up."""


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class Engine(Executor):
    """Negotiates and executes this rank's requests on a background thread."""

    def __init__(self, world: Any, config: Any) -> None:
        self.world = world
        self.rank = world.rank
        self.size = world.size
        self.config = config
        self._queue: Deque[Entry] = deque()
        self._local: Dict[Tuple[int, str], Entry] = {}
        # Names submitted and not yet finished. Only single dict operations touch it (atomic in
        # CPython), so callers and the engine thread never wait on each other for it.
        self._in_flight: Dict[Tuple[int, str], Entry] = {}
        self._failure: Optional[CollectiveError] = None
        self._stopping = False
        self._left: Dict[int, str] = {}
        self._fusion: Optional[np.ndarray] = None
        self._timeline: Optional[Timeline] = None
        self._timeline_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._wake_pending = False
        self._queued_since = 0.0  # when the oldest request still in _queue was queued
        self._progress = threading.Lock()  # held by whoever runs a cycle: engine thread or a waiting caller
        self._in_cycle = False
        # True while a waiting caller holds _progress: it reads the links itself, and the engine
        # thread stays off them, so an arriving frame wakes one thread, not two that then trade the
        # GIL (a hand-over costs more than the whole round trip).
        self._driving = False
        # Polling for an answer pays off only while every local rank has a core of its own; on an
        # oversubscribed host it would take the core from the rank that has to answer.
        self._spin_budget = _CALLER_SPIN if world.local_size <= _usable_cpus() else 0.0
        self.process_sets: Dict[int, Tuple[int, ...]] = {0: tuple(range(self.size))}
        world.transport.check = self._check_while_waiting
        world.transport.poll_seconds = _CALLER_SPIN if self._spin_budget else 0.0
        if world.data is not None:
            self.data: DataPlane = world.data  # a backend of its own (MPI)
        else:
            hierarchy = hierarchy_of(world.transport, world.hosts, self._check_while_waiting) \
                if config.hierarchical_allreduce and world.size > 1 else None
            self.data = RingDataPlane(world.transport, config.chunk_bytes, hierarchy)
        self._last_liveness = 0.0
        self._executing: Optional[Tuple[str, Tuple[str, ...]]] = None  # (kind, names) in its data phase
        self._device: Optional[DeviceExecutor] = None  # made when the first device response arrives
        self._data_stall_warned = False
        self._worker_stall_warned: Set[Tuple[int, str]] = set()
        self._last_worker_stall_check = 0.0
        # How often stalls are looked for: a quarter of the shortest stall time, at most a second.
        stall_times = [x for x in (config.stall_check_seconds, config.stall_shutdown_seconds) if x > 0]
        self._stall_period: Optional[float] = min(1.0, min(stall_times) / 4.0) if stall_times else None
        self.coordinator: Optional[Coordinator] = None
        self._signatures = WorkerSignatures()
        self._cycle_time_ms = config.cycle_time_ms
        self.autotuner: Optional[Autotuner] = None
        if self.rank == 0 and config.autotune and self.size > 1:
            self.autotuner = Autotuner(config.fusion_threshold, config.cycle_time_ms, config.autotune_log,
                                       config.autotune_warmup_samples, config.autotune_steps_per_sample,
                                       config.autotune_max_samples)
        if self.rank == 0:
            self.coordinator = Coordinator(self.size, config.cache_capacity, config.fusion_threshold,
                                           config.stall_check_seconds, config.stall_shutdown_seconds,
                                           config.eager_threshold)
        self._eager = EagerAnswers(config.eager_threshold)
        self._links: Dict[int, ControlLink] = dict(world.control)
        # Links without a descriptor to wait on (MPI) are polled: often while a request of this rank
        # waits for an answer, and ever less often (up to _POLL_IDLE) while nothing does, so an idle
        # job takes no core from the training code or from MPI's own progress in other threads.
        self._polled = any(link.fileno() is None for link in self._links.values())
        self._poll_busy = _POLL_BUSY if self._spin_budget else _POLL_BUSY_SHARED
        self._poll_interval: Optional[float] = self._poll_busy if self._polled else None
        if config.timeline and config.timeline != DYNAMIC_TIMELINE and self.rank == 0:
            self.start_timeline(config.timeline, config.timeline_mark_cycles)
        # A world of one has nobody to wait for: requests complete on the caller's thread.
        self._inline_lock: Optional[threading.Lock] = threading.Lock() if self.size == 1 else None
        self._thread: Optional[threading.Thread] = None
        if self._inline_lock is None:
            self._thread = threading.Thread(target=self._run, name="spark-hvd-engine", daemon=True)
            self._thread.start()

    # -- caller side ------------------------------------------------------------------------------
    def submit(self, entries: Sequence[Entry], will_wait: bool = False) -> None:
        """Queue requests. ``will_wait``: the caller blocks on them next and drives the engine
        itself (see :meth:`drive`), so the engine thread need not be woken.

        Raises ValueError, queueing nothing, when a name is already in flight on this rank.
        """
        if self._failure is not None:
            raise copy.copy(self._failure)
        if self._stopping:
            raise CollectiveError("spark-hvd has been shut down on this rank; call init() again to restart")
        in_flight = self._in_flight
        for i, entry in enumerate(entries):
            key = (entry.meta.ps, entry.name)
            if in_flight.setdefault(key, entry) is not entry:
                for taken in entries[:i]:
                    in_flight.pop((taken.meta.ps, taken.name), None)
                raise ValueError(
                    f"a {entry.meta.kind} named {entry.name!r} is already in progress on rank {self.rank}: "
                    "requested an operation with the same name as another one that is still being processed. "
                    "Wait for the first (synchronize its handle) or give the new one a different name."
                )
        now = time.perf_counter()
        for entry in entries:
            entry.submitted = now
        if self._inline_lock is not None:
            with self._inline_lock:
                self._queue.extend(entries)
                try:
                    self._coordinator_cycle()
                except CollectiveError as exc:
                    self._abort(exc)
            return
        queue = self._queue
        if not queue:
            self._queued_since = now
        queue.extend(entries)
        if not will_wait and now - self._queued_since >= _DEFER:
            self._wake()

    def nudge(self) -> None:
        """Someone polls a handle instead of waiting for it: have queued requests announced now."""
        if self._queue and self._thread is not None:
            self._wake()

    def _complete(self, entry: Entry, value: Any) -> None:
        self._in_flight.pop((entry.meta.ps, entry.name), None)  # before the caller can see the result
        entry.handle._set(entry.index, value)

    def _fail(self, entry: Entry, error: BaseException) -> None:
        self._in_flight.pop((entry.meta.ps, entry.name), None)
        entry.handle._fail(error)

    def start_timeline(self, path: str, mark_cycles: bool = False) -> None:
        if self.rank != 0:
            return
        with self._timeline_lock:
            if self._timeline is not None:
                self._timeline.close()
            self._timeline = Timeline(path, mark_cycles)

    def stop_timeline(self) -> None:
        with self._timeline_lock:
            if self._timeline is not None:
                self._timeline.close()
                self._timeline = None

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self.stop_timeline()
        self._fail_all(CollectiveError("spark-hvd has been shut down on this rank"))
        if self._device is not None:
            self._device.plane.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    @property
    def failure(self) -> Optional[CollectiveError]:
        return self._failure

    # -- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping and self._failure is None:
                self._wait_for_work(parked=self._driving or not self._watching())
                if self._stopping or self._failure is not None:
                    break
                if self._queue and not self._driving:
                    self._coalesce()
                if not self._progress.acquire(blocking=False):
                    continue  # a caller runs the cycles; it wakes this thread if it leaves work behind
                try:
                    self._cycle()
                finally:
                    self._progress.release()
        except BaseException as exc:
            self._abort(self._as_collective_error(exc))
        finally:
            if self._stopping and self._failure is None:
                self._say_bye()

    def _coalesce(self) -> None:
        """Sleep while asynchronous requests keep arriving (see ``_COALESCE_STEP``)."""
        deadline = time.perf_counter() + _COALESCE_MAX
        seen = len(self._queue)
        while not self._driving and not self._stopping and time.perf_counter() < deadline:
            time.sleep(_COALESCE_STEP)
            count = len(self._queue)
            if count == seen:
                return
            seen = count

    def _watching(self) -> bool:
        """Whether the engine thread must watch the links: requests of this rank wait on them, or
        (rank 0) requests of other ranks can be answered without one of this rank (a process set
        without rank 0, or all ranks joined). Otherwise nothing that arrives is urgent here: the
        next request reads it, and a parked thread still reads the links every ``_PARKED`` s."""
        if self._queue or self._local:
            return True
        coord = self.coordinator
        if coord is None:
            return False
        return coord.has_work() or (bool(coord.pending) and any(0 not in ranks for ranks in self.process_sets.values()))

    def _cycle(self) -> None:
        if self.coordinator is not None:
            self._coordinator_cycle()
        else:
            self._worker_cycle()

    def _as_collective_error(self, exc: BaseException) -> CollectiveError:
        if isinstance(exc, CollectiveError):
            return exc
        log.exception("spark-hvd engine failed")  # a bug must not leave callers waiting forever
        return CollectiveError(f"the spark-hvd engine on rank {self.rank} failed: {exc!r}")

    def drive(self, handle: Handle, deadline: Optional[float] = None) -> None:
        """Make progress on the caller's thread while it waits for ``handle``, until it is done or
        ``deadline`` (time.perf_counter()) passes.

        Handing work to the engine thread and back costs two thread wake-ups and two GIL hand-overs;
        a waiting caller that finds the engine idle runs the cycles itself: it polls the links for
        a short budget, then blocks in select() on them. Meanwhile the engine thread is parked.
        When another thread runs the cycles, the caller returns at once (and waits on its handle).
        A KeyboardInterrupt (or any other BaseException that is not an Exception) that lands here
        reaches the caller as such; if it cut a cycle short, this rank's part of the job is in an
        unknown state, so the job is aborted too (the other ranks learn why).
        """
        if self._inline_lock is not None or self._failure is not None or self._stopping:
            return
        if not self._progress.acquire(blocking=False):
            self._wake()  # the engine thread or another caller is busy: make sure work is seen
            return
        self._driving = True
        try:
            spin_until = time.perf_counter() + self._spin_budget
            while not handle._done and self._failure is None and not self._stopping:
                self._in_cycle = True
                self._cycle()
                self._in_cycle = False
                if handle._done:
                    break
                now = time.perf_counter()
                if deadline is not None and now >= deadline:
                    break
                if now < spin_until or self._queue:
                    continue
                wait = self._idle_timeout()
                wait = 1.0 if wait is None else wait  # look at the stop flag now and then
                if deadline is not None:
                    wait = min(wait, deadline - now)
                self._wait_for_work(parked=False, timeout=wait)
        except Exception as exc:
            self._in_cycle = False
            self._abort(self._as_collective_error(exc))
        except BaseException as exc:  # KeyboardInterrupt, SystemExit, a test runner's timeout ...
            if self._in_cycle:
                self._in_cycle = False
                self._abort(CollectiveError(
                    f"rank {self.rank} was interrupted ({type(exc).__name__}) in the middle of a collective"))
            raise
        finally:
            self._driving = False
            self._progress.release()
        if self._watching() or any(r.frames for r in self._links.values()):
            self._wake()  # the engine thread takes over what is left

    def _wake(self) -> None:
        if not self._wake_pending:
            self._wake_pending = True
            try:
                os.write(self._wake_w, b"w")
            except OSError:
                pass

    def _wait_for_work(self, parked: bool, timeout: Optional[float] = -1.0) -> None:
        """Block until something may need a cycle: a wake-up, a frame on a control link, or the
        next stall check (``timeout`` -1). ``parked``: watch only the wake-up pipe, for at most
        ``_PARKED`` seconds."""
        if parked:
            fds = [self._wake_r]
            timeout = _PARKED
        else:
            if self._queue or any(r.frames for r in self._links.values()):
                timeout = 0.0
            elif self.coordinator is not None and self.coordinator.has_work():
                timeout = 0.0
            elif timeout is not None and timeout < 0:
                timeout = self._idle_timeout()
            fds = [self._wake_r] + [fd for fd in (link.fileno() for link in self._links.values()) if fd is not None]
            if self._polled:
                waiting = self.coordinator.pending if self.coordinator is not None else self._local
                if waiting or self._queue:
                    self._poll_interval = self._poll_busy
                else:
                    self._poll_interval = min(_POLL_IDLE, (self._poll_interval or self._poll_busy) * 2)
                timeout = self._poll_interval if timeout is None else min(timeout, self._poll_interval)
        try:
            select.select(fds, [], [], timeout)
        except (InterruptedError, ValueError, OSError):
            pass
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        # Only now: a waker that saw the flag still set queued its work before this point, so the
        # cycle that follows takes it. Clearing it before draining could swallow a fresh wake-up
        # byte while leaving the flag set, and every later wake-up would be skipped.
        self._wake_pending = False

    def _idle_timeout(self) -> Optional[float]:
        waiting = self.coordinator.pending if self.coordinator is not None else self._local
        return self._stall_period if waiting else None

    def _take_new(self) -> List[Entry]:
        new = []
        while self._queue:
            entry = self._queue.popleft()
            self._local[(entry.meta.ps, entry.name)] = entry
            new.append(entry)
        return new

    def _pump(self) -> None:
        for reader in self._links.values():
            reader.pump()

    def _lost(self, peer: int) -> CollectiveError:
        if self._left.get(peer) == "shut down":
            return CollectiveError(f"rank {peer} has shut down; collectives that need it cannot complete",
                                   lost_rank=peer)
        reader = self._links.get(peer)
        if reader is not None and reader.error:
            return CollectiveError(f"rank {peer} was lost: {reader.error}", lost_rank=peer)
        return CollectiveError(
            f"rank {peer} was lost: its connection closed (the process exited or was killed)", lost_rank=peer)

    def _worker_cycle(self) -> None:
        new = self._take_new()
        if new:
            items = tuple(Announce(e.name, self._signatures.encode(e.meta), payload)
                          for e, payload in zip(new, self._eager.payloads(new)))
            self._send(0, REQUESTS + dump_requests(RequestBatch(self._signatures.seq, items)))
        self._pump()
        reader = self._links[0]
        while reader.frames:
            frame = reader.frames.popleft()
            kind = frame[:1]
            if kind == RESPONSES:
                batch = load_responses(frame[1:])
                resolver = self._signatures.learn(batch)
                arrived = time.perf_counter()
                for response in batch.responses:
                    self._execute(response, resolver, arrived)
            elif kind == ABORT:
                message, lost = pickle.loads(frame[1:])
                raise CollectiveError(message, lost_rank=lost)
            elif kind == BYE:
                self._left[0] = "shut down"
        if reader.closed or 0 in self._left:
            # Everything rank 0 sent before it went has been executed above.
            raise self._lost(0)
        if self._local:
            self._check_worker_stalls()

    def _check_worker_stalls(self) -> None:
        """Warn about requests rank 0 has not answered for the stall time (it warns about the ranks
        it is waiting for; this catches rank 0 itself stopped), and give up at the shutdown time."""
        now = time.perf_counter()
        if self._stall_period is None or now - self._last_worker_stall_check < self._stall_period:
            return
        self._last_worker_stall_check = now
        check, shutdown = self.config.stall_check_seconds, self.config.stall_shutdown_seconds
        self._worker_stall_warned.intersection_update(self._local)
        lines, overdue = [], []
        for key, entry in self._local.items():
            waited = now - entry.submitted
            if shutdown > 0 and waited >= shutdown:
                overdue.append(f"{entry.meta.kind} {entry.name!r} ({waited:.1f} s)")
            elif check > 0 and waited >= check and key not in self._worker_stall_warned:
                self._worker_stall_warned.add(key)
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

    def _coordinator_cycle(self) -> None:
        coord = self.coordinator
        assert coord is not None
        for entry in self._take_new():
            coord.submit(0, entry.name, entry.meta)
        self._pump()
        for peer, reader in self._links.items():
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
                        self._eager.collect(meta, item.name, peer, item.payload)
                elif kind == ABORT:
                    message, lost = pickle.loads(frame[1:])
                    raise CollectiveError(message, lost_rank=lost)
                elif kind == BYE:
                    self._left[peer] = "shut down"
                    coord.leave(peer)
            if reader.closed and peer not in self._left:
                raise self._lost(peer)  # gone without saying goodbye: it crashed
        if self._left:
            # Requests that need a departed rank can never complete.
            needed = {ps for ps, _ in coord.pending} | {ps for ps, _ in self._local}
            for ps in needed:
                gone = [r for r in self.process_sets.get(ps, ()) if r in self._left]
                if gone:
                    raise self._lost(gone[0])
        if coord.has_work() and self._cycle_allows():
            batch, metas = coord.decide()
            resolve = metas.__getitem__
            responses = self._eager.answer(batch.responses, resolve, self._local, self.process_sets,
                                           coord.joined, self._timeline, alone=self.size == 1)
            if responses is not batch.responses:
                batch = batch._replace(responses=responses)
            if batch.responses or batch.teach or batch.evicted:
                frame = RESPONSES + dump_responses(batch)
                for peer in self._links:
                    if peer not in self._left:
                        self._send(peer, frame)
                arrived = time.perf_counter()
                if self._timeline is not None:
                    self._timeline.cycle(arrived * 1e6)
                for response in batch.responses:
                    self._execute(response, metas, arrived)
                if self.autotuner is not None and not self.autotuner.done:
                    self._autotune(batch.responses, metas)
        lines, shutdown = coord.stalled(time.monotonic())
        if lines:
            log.warning(
                "spark-hvd stall: %d operation(s) are waiting for other ranks (check that every rank "
                "calls the same collectives with the same names):\n  %s", len(lines), "\n  ".join(lines))
        if shutdown:
            raise CollectiveError(
                "stalled operations exceeded SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS="
                f"{self.config.stall_shutdown_seconds}: " + "; ".join(lines))

    def _autotune(self, responses: Sequence[Response], metas: Mapping[int, Meta]) -> None:
        """Feed the autotuner the allreduces just executed; apply the setting it moves to."""
        names: List[str] = []
        nbytes = 0
        for response in responses:
            if response.kind in ("allreduce", "allreduce_eager"):
                names.extend(response.names)
                for sid in response.sids:
                    meta = metas.get(sid)
                    if meta is not None:
                        nbytes += meta.count() * storage_dtype(meta.dtype).itemsize
        if not names:
            return
        assert self.autotuner is not None and self.coordinator is not None
        setting = self.autotuner.observe(names, nbytes)
        if setting is not None:
            self.coordinator.fusion_threshold, self._cycle_time_ms = setting

    def _cycle_allows(self) -> bool:
        """With a cycle time, hold ready requests back until the oldest has waited that long."""
        cycle_ms = self._cycle_time_ms
        if cycle_ms <= 0:
            return True
        coord = self.coordinator
        assert coord is not None
        oldest = min((coord.pending[key].first_seen for key in coord.ready if key in coord.pending), default=0.0)
        if time.monotonic() - oldest >= cycle_ms / 1000.0:
            return True
        time.sleep(min(cycle_ms / 1000.0, 0.001))
        return False

    def _send(self, peer: int, frame: bytes) -> None:
        link = self._links[peer]
        try:
            link.send(frame)
        except OSError as exc:
            # A peer that said goodbye and closed its end in the moment since the links were last
            # read has shut down cleanly: it needs nothing more (its goodbye is handled as usual).
            link.pump()
            if peer in self._left or any(f[:1] == BYE for f in link.frames):
                self._left.setdefault(peer, "shut down")
                return
            raise CollectiveError(f"rank {peer} was lost: sending to it failed ({exc})", lost_rank=peer) from None

    # -- failure ----------------------------------------------------------------------------------
    def _check_while_waiting(self, peers: Sequence[int] = (), idle: float = 0.0) -> None:
        """Called by the transport while a collective waits on ``peers`` (global ranks), nothing
        having moved for ``idle`` seconds: notice aborts announced by others, the loss of a peer
        this collective still needs, and stalls."""
        if self._stopping:
            raise CollectiveError("spark-hvd is shutting down on this rank")
        self._pump()
        for peer, reader in self._links.items():
            for frame in reader.frames:
                if frame[:1] == ABORT:
                    message, lost = pickle.loads(frame[1:])
                    raise CollectiveError(message, lost_rank=lost)
                if frame[:1] == BYE:
                    self._left.setdefault(peer, "shut down")
        for peer in peers:
            reader = self._links.get(peer)
            if peer in self._left or (reader is not None and reader.closed):
                raise self._lost(peer)
        if self.rank != 0 and self._links[0].closed and 0 not in self._left:
            raise self._lost(0)  # the coordinator crashed: nothing can complete
        now = time.monotonic()
        if now - self._last_liveness > 0.2:
            self._last_liveness = now
            for peer in peers:
                channel = self.world.transport.channels.get(peer)
                alive = getattr(channel, "peer_alive", None)
                if alive is not None and not alive():
                    raise CollectiveError(f"rank {peer} was lost: its process is gone", lost_rank=peer)
        self._check_data_stall(peers, idle)

    def _check_data_stall(self, peers: Sequence[int], idle: float) -> None:
        check, shutdown = self.config.stall_check_seconds, self.config.stall_shutdown_seconds
        if idle <= 0 or (check <= 0 and shutdown <= 0):
            return
        kind, names = self._executing or ("collective", ())
        what = f"{kind} {', '.join(repr(n) for n in names[:5])}{' ...' if len(names) > 5 else ''}"
        waited_on = sorted(set(peers))
        if shutdown > 0 and idle >= shutdown:
            raise CollectiveError(
                f"rank {self.rank}: {what} received nothing from rank(s) {waited_on} for {idle:.1f} s, past "
                f"SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS={shutdown}; they may be stopped or hung",
                lost_rank=waited_on[0] if waited_on else None)
        if check > 0 and idle >= check and not self._data_stall_warned:
            self._data_stall_warned = True
            log.warning("spark-hvd stall on rank %d: %s has waited %.1f s for data from rank(s) %s, which may be "
                        "stopped or hung", self.rank, what, idle, waited_on)

    def _abort(self, error: CollectiveError) -> None:
        if self._failure is None:
            self._failure = error
        frame = ABORT + pickle.dumps((str(error), error.lost_rank), protocol=5)
        self._send_quietly(frame, skip=error.lost_rank)
        self._fail_all(error)

    def _say_bye(self) -> None:
        self._send_quietly(BYE)

    def _send_quietly(self, frame: bytes, skip: Optional[int] = None) -> None:
        """Best effort, bounded: the peer may already be gone or stuck."""
        for peer, link in list(self._links.items()):
            if peer not in self._left and peer != skip:
                link.send_quietly(frame)

    def _fail_all(self, error: BaseException) -> None:
        while self._queue:
            self._fail(self._queue.popleft(), error)
        for entry in list(self._local.values()):
            self._fail(entry, error)
        self._local.clear()

    # -- execution --------------------------------------------------------------------------------
    def _execute(self, response: Response, metas: Mapping[int, Meta], arrived: float) -> None:
        kind, names, ps = response.kind, response.names, response.ps
        if kind == "join":
            for key in [k for k, e in self._local.items() if e.meta.kind == "join"]:
                self._complete(self._local.pop(key), response.value)
            return
        members = self.process_sets.get(ps)
        if members is None or self.rank not in members:
            return
        entries = [self._local.pop((ps, name), None) for name in names]
        if kind == "error":
            for entry in entries:
                if entry is not None:
                    self._fail(entry, RankMismatchError(response.error))
            return
        timeline = self._timeline
        if timeline is not None:
            for entry in entries:
                if entry is not None:
                    timeline.span(entry.name, NEGOTIATE, entry.submitted * 1e6, arrived * 1e6)
                    timeline.span(entry.name, QUEUE, arrived * 1e6, time.perf_counter() * 1e6)
        self._executing = (kind, names)
        self._data_stall_warned = False
        try:
            first = metas[response.sids[0]] if response.sids else \
                (metas[response.rank_sids[0][0]] if response.rank_sids else None)
            if first is not None and first.device != "cpu":
                self._device_executor().execute(response, entries, metas, members)
            elif kind == "allreduce":
                self._allreduce(ps, names, entries, [metas[s] for s in response.sids])
            elif kind == "allreduce_eager":
                start = time.perf_counter()
                for entry, sid, result in zip(entries, response.sids, response.results):
                    if entry is None:
                        continue
                    out = np.frombuffer(result, dtype=storage_dtype(metas[sid].dtype))
                    np.copyto(entry.out.reshape(-1), out)
                    self._complete(entry, entry.out)
                    self._span(entry.name, MEMCPY_OUT, start)
            elif kind == "reducescatter":
                for name, entry, sid in zip(names, entries, response.sids):
                    self._reducescatter(ps, name, entry, metas[sid])
            elif kind == "allgather":
                for name, entry, sids in zip(names, entries, response.rank_sids):
                    self._allgather(ps, name, entry, [metas[s] for s in sids])
            elif kind == "alltoall":
                for name, entry, sids in zip(names, entries, response.rank_sids):
                    self._alltoall(ps, name, entry, [metas[s] for s in sids])
            elif kind == "broadcast":
                for name, entry, sid in zip(names, entries, response.sids):
                    self._broadcast(ps, name, entry, metas[sid], members)
            elif kind == "barrier":
                for entry in entries:
                    if entry is not None:
                        self._complete(entry, None)
            elif kind == "add_process_set":
                self._register_process_set(response.value, tuple(metas[response.sids[0]].ranks or ()))
                for entry in entries:
                    if entry is not None:
                        self._complete(entry, response.value)
            else:
                raise CollectiveError(f"unknown response kind {kind!r}")
        except BaseException:
            for entry in entries:
                if entry is not None and not entry.handle.done():
                    self._local[(ps, entry.name)] = entry  # failed with everything else by _abort
            raise
        finally:
            self._executing = None

    def _device_executor(self) -> DeviceExecutor:
        if self._device is None:
            lib, problem = nccl_status()
            if lib is None:
                raise CollectiveError(f"collectives on CUDA tensors need NCCL: {problem}")
            plane = NcclDataPlane(lib, self.data.size, self.data.rank, self.data.broadcast,
                                  hierarchy=getattr(self.data, "hierarchy", None), chunk_bytes=self.config.chunk_bytes)
            self._device = DeviceExecutor(plane, device_ops("cuda"), self._complete)
        return self._device

    def _register_process_set(self, ps_id: int, ranks: Tuple[int, ...]) -> None:
        self.process_sets[ps_id] = ranks
        if self.coordinator is not None:
            self.coordinator.process_sets[ps_id] = ranks
        self.data.add_process_set(ps_id, ranks)
