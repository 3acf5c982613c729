"""Allreduces that ranks run in the same order every step, without negotiation (program order).

A training step of a small model reduces its gradients in one buffer, the same buffer at every
step and in every rank's program order. Negotiating each of them (announce it to the coordinator,
wait for the answer) costs a round trip through every layer of the engine, several times what
moving the bytes does. Two ways carry such a step: shared-memory mailboxes when every rank shares
one host (:class:`Lockstep`, below), and TCP links of their own between the ranks of a world across
hosts (:class:`LinkLockstep`), where each rank sends its buffer to every other rank in one message.

When every rank of the world is on one host, each rank also owns a mailbox
in shared memory: two slots (steps alternate between them) of a header and the data, and a counter
of the steps it has published. Step ``k`` of a rank writes its slot ``k % 2``, publishes ``k``,
waits until every other rank has published ``k``, and sums all slots in rank order, so every rank
computes the same bits. A rank that is at step ``k + 1`` has seen everyone's step ``k``, so nobody
still reads the slot it overwrites.

The header names the request (a hash of its name), its byte count, dtype and op: a rank whose
step ``k`` is not the same request as another's raises :class:`RankMismatchError` on every rank,
instead of reducing unrelated buffers. A rank that joins (``join()``) marks its mailbox; the
others fall back to the negotiated path for the step it did not publish, and every rank stays on
that path from then on, where joined ranks contribute zeros. Waiting follows the engine's rules:
aborts, lost peers and stalls end it with a :class:`CollectiveError`.

The counters are the mailboxes' :class:`~.shm.ShmRing` counters, so a store of a step is a release
and a load of it an acquire on every CPU (:mod:`.ordering`): a rank that reads step ``k`` from a
peer's counter sees that peer's slot as written, and a peer's reads of a slot finish before it
publishes the step after.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import select
import socket
import struct
import threading
import time
from typing import Callable, Dict, Optional, Sequence

import numpy as np

from .errors import CollectiveError, RankMismatchError
from .ops import ReduceOp, average_inplace, combine_into, reduce_into, scale_inplace
from .shm import ShmRing
from .wire import describe_broken

__all__ = ["Lockstep", "LinkLockstep", "combine_parts", "mailbox_tag", "MAILBOX_HEADER", "SLOTS"]

MAILBOX_HEADER = 64
"""Bytes before a slot's data: request hash, byte count, dtype code, op and strictness (int64 each)."""
SLOTS = 2
_WIRES = ("float32", "float64", "float16")
_CHECK_EVERY = 0.001
"""Seconds of waiting between looks at the engine (aborts, lost peers, stalls)."""
_PUBLISHED = 0  # counters index: steps this rank has published
_LEFT = 8  # counters index: 1 once this rank has joined and publishes no more
_STRICT = 4
"""A header's field (after hash, bytes, dtype and op): 1 when the request is in program order by
contract (see :meth:`_ProgramOrder.allreduce`)."""
_DECLINE_OP = -2
"""The op of a declined step's header (see :meth:`_ProgramOrder.while_negotiating`)."""
_DECLINE_AFTER = 0.5
"""Seconds other ranks wait at a step before a rank that negotiates meanwhile declines it."""


def mailbox_tag(key: bytes, generation: int, rank: int) -> bytes:
    """The tag of rank ``rank``'s mailbox in one generation (checked by every rank that maps it)."""
    return hmac.new(key, f"spark-hvd mailbox {generation} {rank}".encode(), hashlib.sha256).digest()


def _request_hash(name: str, shape: tuple) -> int:
    """A header's first field: the request's name and shape (ranks that reduce the same bytes in
    different shapes differ, as the negotiation's shape check says)."""
    text = f"{name} {tuple(shape)}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def combine_parts(flat: np.ndarray, parts: Sequence[np.ndarray], op: int, wire: str, postscale: float) -> None:
    """``flat`` = ``op`` over ``parts`` (one per rank) in rank order, so that every rank computes the
    same bits; averaged over the ranks for Average, then scaled by ``postscale``. ``flat`` may be
    one of the first two parts (combined element by element, both read before ``flat`` is written)."""
    if len(parts) == 1:
        np.copyto(flat, parts[0])
    else:
        combine_into(flat, parts[0], parts[1], op, wire)
    for part in parts[2:]:
        reduce_into(flat, part, op, wire)
    if op == ReduceOp.Average:
        average_inplace(flat, len(parts), wire)
    if postscale != 1.0:
        scale_inplace(flat, postscale, wire)


class _ProgramOrder:
    """What both ways of the program-order path share: the lock, the step count, the switch to the
    negotiated path, which requests may take it, and one step's frame around the way's own
    exchange (:meth:`_reduce`)."""

    def __init__(self, rank: int, size: int, capacity: int, check: Callable[[Sequence[int], float, str], None]) -> None:
        self.rank = rank
        self.size = size
        self.capacity = capacity
        self._check = check
        self._peers = [r for r in range(size) if r != rank]
        self._step = 0
        self.reduced = 0
        """Requests this path has reduced."""
        self._off = False
        self._lock = threading.Lock()
        self._dtype_codes = {wire: i + 1 for i, wire in enumerate(_WIRES)}
        self._plans: Dict[tuple, tuple] = {}
        """Per request (name, shape, bytes, dtype, op, strictness): what its steps reuse."""
        self._awaited_since: Optional[tuple] = None  # (this rank's step, when others were first seen past it)

    def _plan(self, flat: np.ndarray, name: str, shape: tuple, wire: str, op: int, strict: bool) -> tuple:
        """The request's plan (see :meth:`_new_plan`), made at its first step and kept for the next."""
        key = (name, shape, flat.nbytes, wire, op, strict)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= _PLANS:
                self._plans.clear()  # names that keep changing: no reuse to keep
            plan = self._plans[key] = self._new_plan(key, flat)
        return plan

    def _new_plan(self, key: tuple, flat: np.ndarray) -> tuple:  # pragma: no cover - interface
        """What a request of ``key`` (name, shape, bytes, dtype, op, strictness) reuses at every step."""
        raise NotImplementedError

    def forget(self) -> None:
        """Drop what requests reuse from step to step (before the mailboxes or links close)."""
        self._plans.clear()

    @property
    def active(self) -> bool:
        """Whether requests still take this path (False after a join, a mismatch or a failure)."""
        return not self._off

    def eligible(self, array: np.ndarray, wire: str, op: int) -> bool:
        """Whether an allreduce of ``array`` can take this path: the same answer on every rank
        for the same request, so all ranks take the same path."""
        return (not self._off and wire in self._dtype_codes and self._fits(array.nbytes)
                and op in (ReduceOp.Sum, ReduceOp.Average, ReduceOp.Min, ReduceOp.Max))

    def _fits(self, nbytes: int) -> bool:
        return nbytes <= self.capacity

    def allreduce(self, array: np.ndarray, name: str, wire: str, op: int, prescale: float,
                  postscale: float, strict: bool = True) -> bool:
        """Reduce ``array`` (C-contiguous, ``wire`` storage) in place over all ranks; False, with
        ``array`` untouched, when this step must take the negotiated path instead: a rank joined,
        or the ranks' requests differ and not all of them are ``strict``.

        ``strict``: the caller issues this request in program order by contract (a training
        step's gradient buffer), so a rank with a different request is a bug, raised as
        :class:`RankMismatchError` on every rank when all requests of the step are strict. A
        blocking allreduce of the user's takes this path without that contract: ranks may issue
        such requests in other orders (from several threads, say), which Horovod's negotiation
        allows; a differing step then sends every rank's request to the negotiated path (and over
        the links every later one too). Every rank sees every rank's header, so all of them decide
        alike. After a join, every rank stays on the negotiated path."""
        with self._lock:
            if self._off:
                return False
            step = self._step + 1
            try:
                done = self._reduce(array.reshape(-1), name, array.shape, wire, op, prescale, postscale, step,
                                    strict)
            except BaseException:
                self._off = True
                raise
            self._step = step
            self.reduced += done
            return done

    def _reduce(self, flat: np.ndarray, name: str, shape: tuple, wire: str, op: int, prescale: float,
                postscale: float, step: int, strict: bool) -> bool:  # pragma: no cover - interface
        """Step ``step``: ``flat`` reduced in place; False, ``flat`` untouched, when this step goes
        to the negotiated path (a rank joined, or the requests differ and not all are strict)."""
        raise NotImplementedError

    def while_negotiating(self) -> None:
        """Called now and then while a request of this rank waits for its negotiation: when other
        ranks have waited at this rank's next step for ``_DECLINE_AFTER`` seconds, this rank declines
        that step (a header no request has), so they take the negotiated path and stop waiting.

        Without it, a rank that negotiates a request another rank reduces in program order (a
        blocking allreduce on one rank, an asynchronous one on another; a tensor on the host here
        and on a device there) would wait for it while the other waits for this rank's step. A
        rank that declines had no request at that step, so every rank takes the negotiated path
        from that step on, as on a mismatch; the answers stay right either way."""
        if self._off:
            return
        now = time.monotonic()
        if not self._awaited():
            self._awaited_since = None
            return
        if self._awaited_since is None or self._awaited_since[0] != self._step:
            self._awaited_since = (self._step, now)
            return
        if now - self._awaited_since[1] < _DECLINE_AFTER or not self._lock.acquire(blocking=False):
            return  # not yet, or this rank is taking a step itself
        try:
            if not self._off and self._awaited_since[0] == self._step:
                self._off = True
                self._decline(self._step + 1)
        finally:
            self._lock.release()

    _LASTING_MISMATCH = True
    """Whether a step whose requests differ ends the path (its way cannot go on from that step)."""

    def _awaited(self) -> bool:  # pragma: no cover - interface
        """Whether another rank has started a step this rank has not."""
        raise NotImplementedError

    def _decline(self, step: int) -> None:  # pragma: no cover - interface
        """Publish ``step`` with the header no request has."""
        raise NotImplementedError

    def _mismatch(self, name: str, nbytes: int, step: int, header: Sequence[int],
                  others: Dict[int, Sequence[int]]) -> bool:
        """The step's requests differ (``others``: the headers of the ranks whose request is not
        this rank's ``header``): raise :class:`RankMismatchError`, the path off, when every one of
        them is strict; else False (the step goes to the negotiated path, and so do the later ones
        where :attr:`_LASTING_MISMATCH`)."""
        if not all(h[_STRICT] for h in (header, *others.values())):
            self._off = self._off or self._LASTING_MISMATCH
            return False
        self._off = True
        r, theirs = min(others.items())
        raise RankMismatchError(
            f"rank {self.rank} reduced gradients {name!r} ({nbytes} bytes) at step {step} of the program-order "
            f"path while rank {r} reduced a different request ({theirs[1]} bytes): the ranks run different models "
            "or steps; run the same model and loop on every rank, or set SPARK_HVD_LOCKSTEP_BYTES=0 to negotiate "
            "every reduction")


class Lockstep(_ProgramOrder):
    """This rank's side of the mailboxes of a world whose ranks all share one host.

    ``boxes`` holds every rank's mailbox in rank order (this rank's own included); ``check(peers,
    idle, what)`` is the engine's look at aborts, lost peers and stalls while a wait lasts; ``spin``
    is how long a wait polls before it starts to sleep between looks.
    """

    def __init__(self, rank: int, boxes: Sequence[ShmRing], capacity: int, spin: float,
                 check: Callable[[Sequence[int], float, str], None]) -> None:
        super().__init__(rank, len(boxes), capacity, check)
        self.boxes = list(boxes)
        self.spin = spin

    # Every rank reads every header of a step before any rank publishes the step after the next
    # (which overwrites the slot), so the path goes on from a step whose requests differed.
    _LASTING_MISMATCH = False

    def leave(self) -> None:
        """This rank joins: it publishes no more steps, and the others stop waiting for it."""
        with self._lock:
            self._off = True
            self.boxes[self.rank].counters[_LEFT] = 1

    def _reduce(self, flat: np.ndarray, name: str, shape: tuple, wire: str, op: int, prescale: float,
                postscale: float, step: int, strict: bool) -> bool:
        plan = self._plan(flat, name, shape, wire, op, strict)
        header, values, heads, parts = plan
        slot = step % SLOTS
        heads, parts = heads[slot], parts[slot]
        heads[self.rank][:] = values
        data = parts[self.rank]
        np.copyto(data, flat)
        if prescale != 1.0:
            scale_inplace(data, prescale, wire)
        self.boxes[self.rank].counters[_PUBLISHED] = step  # a release (see .ordering): header and data first
        if not self._wait(step, name, strict):
            self._off = True  # a rank joined (or declined): everyone falls back at this step, and stays there
            return False
        others = {}
        for r in self._peers:
            theirs = heads[r].tolist()
            if theirs != header:
                others[r] = theirs
        if others:
            return self._mismatch(name, flat.nbytes, step, header, others)
        if prescale == 1.0 and self.rank < 2:
            # Its own part, still in ``flat`` and in this core's cache: the first combination
            # writes ``flat`` only after reading both operands, element by element.
            parts = list(parts)
            parts[self.rank] = flat
        combine_parts(flat, parts, op, wire, postscale)
        return True

    def _new_plan(self, key: tuple, flat: np.ndarray) -> tuple:
        """What a request of this name, size, dtype and op reuses at every step: its header (as a
        list and as an array) and, for each slot, every rank's header and data there (views)."""
        name, shape, nbytes, wire, op, strict = key
        header = [_request_hash(name, shape), nbytes, self._dtype_codes[wire], int(op), int(strict)]
        heads = [[np.frombuffer(box.slot(slot), dtype=np.int64, count=len(header)) for box in self.boxes]
                 for slot in range(SLOTS)]
        parts = [[np.frombuffer(box.slot(slot), dtype=flat.dtype, count=flat.size, offset=MAILBOX_HEADER)
                  for box in self.boxes] for slot in range(SLOTS)]
        return header, np.array(header, dtype=np.int64), heads, parts

    def _awaited(self) -> bool:
        boxes, step = self.boxes, self._step
        return any(boxes[r].counters[_PUBLISHED] > step for r in self._peers)

    def _decline(self, step: int) -> None:
        mine = self.boxes[self.rank]
        head = mine.slot(step % SLOTS)[:MAILBOX_HEADER].cast("q")
        head[0], head[1], head[2], head[3], head[4] = 0, 0, 0, _DECLINE_OP, 0
        head.release()
        mine.counters[_PUBLISHED] = step  # a release, as a step's: the ranks at this step see a mismatch
        mine.counters[_LEFT] = 1  # and the later steps' waits end as after a join

    def _wait(self, step: int, name: str, strict: bool) -> bool:
        """Until every rank has published ``step``: True; False when one of them joined first."""
        boxes = self.boxes
        waiting = [r for r in self._peers if boxes[r].counters[_PUBLISHED] < step]
        if not waiting:
            return True
        start = time.perf_counter()
        spin_until = start + self.spin
        next_check = start + _CHECK_EVERY
        pause = 0.0
        while True:
            waiting = [r for r in waiting if boxes[r].counters[_PUBLISHED] < step]
            if not waiting:
                return True
            if any(boxes[r].counters[_LEFT] for r in waiting):
                return False
            now = time.perf_counter()
            if now >= next_check:
                next_check = now + _CHECK_EVERY
                try:
                    self._check(waiting, now - start, f"one-host allreduce {name!r} (step {step})",
                                None if strict else name)
                except BaseException:
                    # A rank publishes its step before it can finish and say goodbye: one whose
                    # goodbye the check saw may have published since ``waiting`` was read.
                    if all(boxes[r].counters[_PUBLISHED] >= step for r in waiting):
                        return True
                    self._off = True
                    raise
            if now < spin_until:
                os.sched_yield()  # lets this core's other threads (a reader's) run, without the GIL
            else:
                pause = min(max(pause * 2, 20e-6), 0.001)
                time.sleep(pause)


_LINK_HEADER = struct.Struct("<qqqqq")
"""A message's header on a program-order link: request hash, byte count, dtype code, op and strictness."""
_PLANS = 64
"""Requests whose views a :class:`Lockstep` or :class:`LinkLockstep` keeps at most."""
_LEFT_OP = -1
"""The op of the header a rank sends when it joins: it sends no more steps."""


class LinkLockstep(_ProgramOrder):
    """This rank's side of the program-order path of a world across hosts: a TCP link to every
    other rank (authenticated at start-up like every connection of the world), and at each step the
    same exchange as the mailboxes': every rank sends its buffer with its header to every other rank
    and sums all of them in rank order, so every rank computes the same bits. Only small buffers take
    it (``capacity`` bytes times the other ranks): each rank sends its whole buffer to each other
    rank, one message and one latency, where a ring would cost two per rank.

    A header that differs from this rank's raises :class:`RankMismatchError` naming both requests,
    on every rank (each sees the others' headers); a rank that joins sends a header saying so, and
    the others take the negotiated path from that step on, as with the mailboxes. A link that breaks
    ends the step with :class:`CollectiveError` naming the rank; waiting follows the engine's rules
    (aborts, stalls) through ``check``.
    """

    def __init__(self, rank: int, size: int, links: Dict[int, socket.socket], capacity: int,
                 check: Callable[[Sequence[int], float, str], None], where: Callable[[int], str]) -> None:
        super().__init__(rank, size, capacity, check)
        self.links = dict(links)
        self._where = where
        for sock in self.links.values():
            sock.setblocking(False)
        largest = capacity // max(1, size - 1)  # the largest buffer eligible()
        self._inbox = {r: bytearray(_LINK_HEADER.size + largest) for r in self._peers}
        self._outbox = bytearray(_LINK_HEADER.size + largest)
        self._packed: Optional[tuple] = None

    def _fits(self, nbytes: int) -> bool:
        return nbytes * (self.size - 1) <= self.capacity

    def leave(self) -> None:
        """This rank joins: it tells every other rank that it sends no more steps."""
        with self._lock:
            if self._off:
                return
            self._off = True
            try:
                self._move(memoryview(_LINK_HEADER.pack(0, 0, 0, _LEFT_OP, 0)), None, "join", 0,
                           deadline=time.monotonic() + 5.0)
            except (OSError, CollectiveError):
                pass  # a peer that is gone needs no word

    def _awaited(self) -> bool:
        """A link has bytes to read: a rank sent its step (or its join) while this one took none."""
        try:
            readable, _, _ = select.select(list(self.links.values()), [], [], 0)
        except (OSError, ValueError):
            return False
        return bool(readable)

    def _decline(self, step: int) -> None:
        try:
            self._move(memoryview(_LINK_HEADER.pack(0, 0, 0, _DECLINE_OP, 0)), None, "decline", step,
                       deadline=time.monotonic() + 5.0)
        except (OSError, CollectiveError):
            pass  # a peer that is gone needs no word

    def _reduce(self, flat: np.ndarray, name: str, shape: tuple, wire: str, op: int, prescale: float,
                postscale: float, step: int, strict: bool) -> bool:
        plan = self._plan(flat, name, shape, wire, op, strict)
        header, message, parts = plan
        if self._packed is not plan:  # the outbox holds another request's header
            _LINK_HEADER.pack_into(self._outbox, 0, *header)
            self._packed = plan
        mine = parts[self.rank]
        np.copyto(mine, flat)
        if prescale != 1.0:
            scale_inplace(mine, prescale, wire)
        if self._move(message, header, name, step):
            self._off = True  # a rank joined, or the requests differ: from here on, all negotiated
            return False
        combine_parts(flat, parts, op, wire, postscale)
        return True

    def _new_plan(self, key: tuple, flat: np.ndarray) -> tuple:
        """What a request of this name, size, dtype and op reuses at every step: its header, its
        message (a view of the outbox) and every rank's part (views of the outbox and inboxes)."""
        name, shape, nbytes, wire, op, strict = key
        hashed = _request_hash(name, shape)
        header = (hashed, nbytes, self._dtype_codes[wire], int(op), int(strict))
        size = _LINK_HEADER.size
        parts = [np.frombuffer(self._outbox if r == self.rank else self._inbox[r], dtype=flat.dtype, count=flat.size,
                               offset=size) for r in range(self.size)]
        return header, memoryview(self._outbox)[:size + nbytes], parts

    def _move(self, message: memoryview, expect: Optional[tuple], name: str, step: int,
              deadline: Optional[float] = None) -> bool:
        """Send ``message`` to every other rank and, unless ``expect`` is None, receive a message
        from each (its header must equal ``expect``), all at once without blocking; True when a
        rank has joined, or when a header differs and not every request is strict (see
        :meth:`_mismatch`: every header is read first, so every rank decides alike; to a rank whose
        request differs only this rank's header is sent, the rest of its message is of no use)."""
        links = self.links
        peers = self._peers
        sent = dict.fromkeys(peers, 0)
        got = dict.fromkeys(peers, 0) if expect is not None else {}
        # A message is its header and the bytes it names; one read asks for all of it, and the header
        # is checked once it is in (a peer whose message differs sends no more than its own).
        need = _LINK_HEADER.size + expect[1] if expect is not None else 0
        length = len(message)
        checked = set()
        left = False
        others: Dict[int, tuple] = {}
        start = time.perf_counter()
        next_check = start + _CHECK_EVERY
        while sent or got:
            moved = False
            for r in list(sent):
                try:
                    n = links[r].send(message[sent[r]:] if sent[r] else message)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    raise self._broken(r, name, step, exc) from None
                moved = moved or n > 0
                sent[r] += n
                if sent[r] == length or (r in others and sent[r] >= _LINK_HEADER.size):
                    del sent[r]
            for r in list(got):
                box = self._inbox[r]
                try:
                    n = links[r].recv_into(memoryview(box)[got[r]:need])
                except BlockingIOError:
                    continue
                except OSError as exc:
                    raise self._broken(r, name, step, exc) from None
                if n == 0:
                    raise self._broken(r, name, step, None)
                moved = True
                got[r] += n
                if r not in checked and got[r] >= _LINK_HEADER.size:
                    checked.add(r)
                    theirs = _LINK_HEADER.unpack_from(box, 0)
                    if theirs[3] == _LEFT_OP:
                        # It sends and reads nothing more; the others' messages are exchanged all the same,
                        # so every rank leaves this path at this same step.
                        left = True
                        del got[r]
                        sent.pop(r, None)
                        continue
                    if theirs != expect:
                        others[r] = theirs
                        del got[r]
                        if sent.get(r, length) >= _LINK_HEADER.size:
                            sent.pop(r, None)
                        continue
                if got[r] == need:
                    del got[r]
            if moved or not (sent or got):
                continue
            now = time.perf_counter()
            if deadline is not None and time.monotonic() > deadline:
                raise CollectiveError(f"rank {self.rank} could not send its {name} to ranks {sorted(sent)}")
            if now >= next_check:
                next_check = now + _CHECK_EVERY
                if deadline is None:
                    self._check(sorted(set(sent) | set(got)), now - start,
                                f"program-order allreduce {name!r} (step {step})",
                                None if expect is None or expect[_STRICT] else name)
            select.select([links[r] for r in got], [links[r] for r in sent], [], _CHECK_EVERY)
        if others and not left:
            assert expect is not None
            return not self._mismatch(name, expect[1], step, expect, others)
        return left

    def _broken(self, peer: int, name: str, step: int, exc: Optional[OSError]) -> CollectiveError:
        self._off = True
        where = self._where(peer)
        how = describe_broken(exc, where) if exc is not None else \
            f"{where} closed its connection (the process exited or was killed)"
        return CollectiveError(f"rank {self.rank}: program-order allreduce {name!r} (step {step}) failed: {how}",
                               lost_rank=peer)
