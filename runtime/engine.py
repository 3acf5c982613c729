"""The background engine: one thread per process that negotiates requests and runs collectives.

Callers enqueue named requests and get handles. The engine decides when a round of negotiation
runs and on which thread (its own, or a caller's that waits): the round itself is a
:class:`~spark_hvd.runtime.cycles.WorkerCycle` or, on rank 0, a
:class:`~spark_hvd.runtime.cycles.CoordinatorCycle`, and the agreed responses run in the
:class:`~spark_hvd.runtime.execution.CollectiveExecutor`. :func:`build_engine` makes these
collaborators for a world and hands them to :class:`Engine`. A lone request is announced the
moment it arrives; nothing waits for a timer unless a cycle time is configured.
"""

from __future__ import annotations

import copy
import logging
import os
import select
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Union

from .autotune import Autotuner
from .control import ABORT, BYE, ControlLinks
from .cycles import CoordinatorCycle, WorkerCycle
from .dataplane import DataPlane, RingDataPlane, hierarchy_of
from .eager import EagerAnswers
from .errors import CollectiveError
from .execution import CollectiveExecutor
from .handles import Entry, Handle, RequestBook
from .kinds import ALLREDUCE
from .negotiation import STALL_WARNING, Coordinator
from .timeline import TimelineSlot

__all__ = ["Engine", "build_engine", "DYNAMIC_TIMELINE"]

log = logging.getLogger("spark_hvd.engine")

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
"""How often an engine thread parked while a caller drives, or whose links must be polled (MPI),
wakes to look at the control links anyway: aborts and goodbyes of other ranks, and frames that must
not pile up."""
_PARKED_IDLE = 0.05
"""The longest a parked engine thread with nothing to wait for sleeps when it can wait on its
links' descriptors: whatever arrives wakes it at once, so the timeout only bounds how long a stop
may go unseen. Waking every ``_PARKED`` instead cost each rank of a training loop whose gradients
take the program-order path a few percent of its steps (the wake-ups take the GIL from the loop)."""
_LOOK_EVERY = 0.05
"""How often (seconds) a rank whose requests wait for their negotiation looks at the program-order
path (:attr:`Engine.while_negotiating`)."""


def usable_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


Cycle = Union[WorkerCycle, CoordinatorCycle]


def build_engine(world: Any, config: Any) -> "Engine":
    """The engine of ``world``: its data plane, request book, control links, executor and the
    negotiation round of this rank (coordinator on rank 0), wired together."""
    engine_spin = _CALLER_SPIN if world.local_size <= usable_cpus() else 0.0
    book = RequestBook()
    links = ControlLinks(dict(world.control))
    timeline = TimelineSlot()
    process_sets = {0: tuple(range(world.size))}
    stall_times = [x for x in (config.stall_check_seconds, config.stall_shutdown_seconds) if x > 0]
    # How often stalls are looked for: a quarter of the shortest stall time, at most a second.
    stall_period = min(1.0, min(stall_times) / 4.0) if stall_times else None
    coordinator = None
    if world.rank == 0:
        coordinator = Coordinator(world.size, config.cache_capacity, config.fusion_threshold,
                                  config.stall_check_seconds, config.stall_shutdown_seconds, config.eager_threshold)
    engine = Engine(world, config, book=book, links=links, timeline=timeline, process_sets=process_sets,
                    stall_period=stall_period, spin_budget=engine_spin)
    if world.data is not None:
        data: DataPlane = world.data  # a backend of its own (MPI)
    else:
        hierarchy = hierarchy_of(world.transport, world.hosts, engine.check_while_waiting) \
            if config.hierarchical_allreduce and world.size > 1 else None
        data = RingDataPlane(world.transport, config.chunk_bytes, hierarchy)
    executor = CollectiveExecutor(world.rank, data, config, book, timeline, process_sets, coordinator)
    eager = EagerAnswers(config.eager_threshold)
    cycle: Cycle
    if coordinator is not None:
        autotuner = None
        if config.autotune and world.size > 1:
            autotuner = Autotuner(config.fusion_threshold, config.cycle_time_ms, config.autotune_log,
                                  config.autotune_warmup_samples, config.autotune_steps_per_sample,
                                  config.autotune_max_samples)
        cycle = CoordinatorCycle(world.size, book, links, coordinator, eager, executor.execute, process_sets,
                                 timeline, config, autotuner)
    else:
        cycle = WorkerCycle(world.rank, book, links, eager, executor.execute, config, stall_period)
    engine.start(executor, cycle)
    return engine


class Engine:
    """Runs this rank's negotiation rounds and collectives, on a background thread or the caller's."""

    def __init__(self, world: Any, config: Any, *, book: RequestBook, links: ControlLinks, timeline: TimelineSlot,
                 process_sets: dict, stall_period: Optional[float], spin_budget: float) -> None:
        self.world = world
        self.rank = world.rank
        self.size = world.size
        self.config = config
        self.book = book
        self.links = links
        self.timeline = timeline
        self.process_sets = process_sets
        self.executor: Optional[CollectiveExecutor] = None
        self.cycle: Optional[Cycle] = None
        self._failure: Optional[CollectiveError] = None
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._wake_pending = False
        self._queued_since = 0.0  # when the oldest request still queued was queued
        self._progress = threading.Lock()  # held by whoever runs a cycle: engine thread or a waiting caller
        self._in_cycle = False
        # True while a waiting caller holds _progress: it reads the links itself, and the engine
        # thread stays off them, so an arriving frame wakes one thread, not two that then trade the
        # GIL (a hand-over costs more than the whole round trip).
        self._driving = False
        # Polling for an answer pays off only while every local rank has a core of its own; on an
        # oversubscribed host it would take the core from the rank that has to answer.
        self._spin_budget = spin_budget
        world.transport.check = self.check_while_waiting
        world.transport.poll_seconds = _CALLER_SPIN if spin_budget else 0.0
        self._last_liveness = 0.0
        self._data_stall_warned = False
        self._stall_period = stall_period
        # Links without a descriptor to wait on (MPI) are polled: often while a request of this rank
        # waits for an answer, and ever less often (up to _POLL_IDLE) while nothing does, so an idle
        # job takes no core from the training code or from MPI's own progress in other threads.
        self._poll_busy = _POLL_BUSY if spin_budget else _POLL_BUSY_SHARED
        self._poll_interval: Optional[float] = self._poll_busy if links.polled else None
        # A world of one has nobody to wait for: requests complete on the caller's thread.
        self._inline_lock: Optional[threading.Lock] = threading.Lock() if self.size == 1 else None
        self._thread: Optional[threading.Thread] = None
        # While a request of this rank waits for its negotiation: a look at the program-order path
        # (see :mod:`.lockstep`), which declines a step other ranks have waited at for long while
        # this rank negotiates, so that neither waits for the other.
        self.while_negotiating: Optional[Callable[[], None]] = None
        self._next_look = 0.0

    def start(self, executor: CollectiveExecutor, cycle: Cycle) -> None:
        """Take the executor and this rank's round, and start the engine thread (none for a world of one)."""
        self.executor, self.cycle = executor, cycle
        config = self.config
        if config.timeline and config.timeline != DYNAMIC_TIMELINE and self.rank == 0:
            self.start_timeline(config.timeline, config.timeline_mark_cycles)
        if self._inline_lock is None:
            self._thread = threading.Thread(target=self._run, name="spark-hvd-engine", daemon=True)
            self._thread.start()

    @property
    def data(self) -> DataPlane:
        """The data plane collectives run over."""
        assert self.executor is not None
        return self.executor.data

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
        in_flight = self.book.in_flight
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
                self.book.queue.extend(entries)
                try:
                    self._cycle()
                except CollectiveError as exc:
                    self._abort(exc)
            return
        queue = self.book.queue
        if not queue:
            self._queued_since = now
        queue.extend(entries)
        if not will_wait and now - self._queued_since >= _DEFER:
            self._wake()

    def nudge(self) -> None:
        """Someone polls a handle instead of waiting for it: have queued requests announced now."""
        if self.book.queue and self._thread is not None:
            self._wake()

    def start_timeline(self, path: str, mark_cycles: bool = False) -> None:
        if self.rank != 0:
            return
        self.timeline.start(path, mark_cycles)

    def stop_timeline(self) -> None:
        self.timeline.stop()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self.stop_timeline()
        self.book.fail_all(CollectiveError("spark-hvd has been shut down on this rank"))
        if self.executor is not None:
            self.executor.close()
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
                if self.book.queue and not self._driving:
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
        seen = len(self.book.queue)
        while not self._driving and not self._stopping and time.perf_counter() < deadline:
            time.sleep(_COALESCE_STEP)
            count = len(self.book.queue)
            if count == seen:
                return
            seen = count

    def _watching(self) -> bool:
        """Whether the engine thread must watch the links: requests of this rank wait on them, or
        (rank 0) requests of other ranks can be answered without one of this rank (a process set
        without rank 0, or all ranks joined). Otherwise nothing that arrives is urgent here: the
        next request reads it, and a parked thread still reads what arrives (see ``_PARKED_IDLE``)."""
        if self.book.queue or self.book.local:
            return True
        assert self.cycle is not None
        return self.cycle.must_watch(self.process_sets)

    def _cycle(self) -> None:
        assert self.cycle is not None
        self.cycle()
        look = self.while_negotiating
        if look is not None and self.book.local:
            now = time.monotonic()
            if now >= self._next_look:
                self._next_look = now + _LOOK_EVERY
                look()

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
                if now < spin_until or self.book.queue:
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
        if self._watching() or self.links.has_frames():
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
        next stall check (``timeout`` -1). ``parked``: nothing of this rank's to wait for; watch the
        wake-up pipe and the links for at most ``_PARKED_IDLE`` seconds, or, while a caller drives
        (it reads the links) or where links are polled, only the pipe for at most ``_PARKED``."""
        if parked and (self._driving or self.links.polled):
            fds = [self._wake_r]
            timeout = _PARKED
        elif parked:
            fds = [self._wake_r] + self.links.filenos()
            timeout = _PARKED_IDLE
        else:
            assert self.cycle is not None
            if self.book.queue or self.links.has_frames():
                timeout = 0.0
            elif self.cycle.has_work():
                timeout = 0.0
            elif timeout is not None and timeout < 0:
                timeout = self._idle_timeout()
            fds = [self._wake_r] + self.links.filenos()
            if self.while_negotiating is not None and self.book.local:
                timeout = _LOOK_EVERY if timeout is None else min(timeout, _LOOK_EVERY)
            if self.links.polled:
                if self.cycle.waiting() or self.book.queue:
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
        assert self.cycle is not None
        return self._stall_period if self.cycle.waiting() else None

    def check_while_waiting(self, peers: Sequence[int] = (), idle: float = 0.0, what: Optional[str] = None,
                            request: Optional[str] = None) -> None:
        """Called by the transport while a collective waits on ``peers`` (global ranks), nothing
        having moved for ``idle`` seconds: notice aborts announced by others, the loss of a peer
        this collective still needs, and stalls (``request``: see :meth:`_check_data_stall`)."""
        if self._stopping:
            raise CollectiveError("spark-hvd is shutting down on this rank")
        links = self.links
        links.pump()
        for peer, reader in links.items():
            for frame in reader.frames:
                if frame[:1] == ABORT:
                    links.raise_abort(frame)
                if frame[:1] == BYE:
                    links.left.setdefault(peer, "shut down")
        for peer in peers:
            if peer in links.left:
                # A peer that said goodbye had finished every collective, so everything it sent is
                # on its way (a host link can hold the last of it long after the goodbye, which
                # travels on another connection); wait while its channel can still deliver.
                if not self._may_still_deliver(peer):
                    raise links.lost(peer)
                continue
            reader = links.links.get(peer)
            if reader is not None and reader.closed:
                raise links.lost(peer)
        if self.rank != 0 and links[0].closed and 0 not in links.left:
            raise links.lost(0)  # the coordinator crashed: nothing can complete
        now = time.monotonic()
        if now - self._last_liveness > 0.2:
            self._last_liveness = now
            for peer in peers:
                channel = self.world.transport.channels.get(peer)
                alive = getattr(channel, "peer_alive", None)
                if alive is not None and not alive():
                    raise CollectiveError(f"rank {peer} was lost: its process is gone", lost_rank=peer)
        self._check_data_stall(peers, idle, what, request)

    def look_while_waiting(self, peers: Sequence[int], idle: float, what: str, request: Optional[str] = None) -> None:
        """:meth:`check_while_waiting` for a wait outside the engine's own collectives (the
        one-host fast path of :mod:`~spark_hvd.runtime.lockstep`): the engine's recorded failure,
        then, unless a cycle is reading the links right now, aborts, lost peers and stalls. A
        failure found here fails the job on every rank, as one found by a collective does."""
        failure = self._failure
        if failure is not None:
            if failure.lost_rank is not None and failure.lost_rank not in peers \
                    and self.links.left.get(failure.lost_rank) == "shut down":
                # A rank that said goodbye had finished its part of this exchange (it is not among
                # those waited for): the exchange can still end; later requests fail.
                self._check_data_stall(peers, idle, what, request)
                return
            raise copy.copy(failure)
        if not self._progress.acquire(blocking=False):
            return
        try:
            self.check_while_waiting(peers, idle, what, request)
        except CollectiveError as exc:
            self._abort(exc)
            raise
        finally:
            self._progress.release()

    def _may_still_deliver(self, peer: int) -> bool:
        """Whether data ``peer`` sent before it left may still arrive: over TCP until its end of the
        connection closes (which the receive notices); over shared memory while its ring holds
        slots not yet read."""
        channel = self.world.transport.channels.get(peer)
        pending = getattr(channel, "unread", None)
        return pending() > 0 if pending is not None else channel is not None

    def _check_data_stall(self, peers: Sequence[int], idle: float, what: Optional[str] = None,
                          request: Optional[str] = None) -> None:
        """Warn of, or end, a wait for ``peers`` that has lasted ``idle`` seconds. ``request``: the
        name of a blocking allreduce that waits in program order for ranks that have not issued it
        yet, reported in the words of the negotiation's stall inspector (which would have seen it)."""
        check, shutdown = self.config.stall_check_seconds, self.config.stall_shutdown_seconds
        if idle <= 0 or (check <= 0 and shutdown <= 0):
            return
        if request is not None:
            self._check_request_stall(request, sorted(set(peers)), idle, check, shutdown)
            return
        if what is None:
            executing = self.executor.executing if self.executor is not None else None
            kind, names = executing or ("collective", ())
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

    def _check_request_stall(self, request: str, missing: List[int], idle: float, check: float,
                             shutdown: float) -> None:
        line = (f"{ALLREDUCE} {request!r} has waited {idle:.1f} s: submitted by rank(s) "
                f"{[r for r in range(self.size) if r not in missing]}, missing rank(s) {missing}")
        if shutdown > 0 and idle >= shutdown:
            raise CollectiveError(f"stalled operations exceeded SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS={shutdown}: {line}")
        if check > 0 and idle >= check and not self._data_stall_warned:
            self._data_stall_warned = True
            log.warning(STALL_WARNING, 1, line)

    def _abort(self, error: CollectiveError) -> None:
        if error.lost_rank is not None and self.links.left.get(error.lost_rank) == "shut down":
            error = self.links.lost(error.lost_rank)  # its connection closed after a goodbye: it shut down
        if self._failure is None:
            self._failure = error
        self.links.send_quietly(self.links.abort_frame(error), skip=error.lost_rank)
        self.book.fail_all(error)

    def _say_bye(self) -> None:
        self.links.send_quietly(BYE)
