"""Accepting authenticated connections: many handshakes at once, so no stranger can delay a peer.

An :class:`Acceptor` takes connections from its listening sockets and runs the server side of the
job-secret handshake for all of them at the same time, without threads and without ever blocking.
Until a connection has proved knowledge of the secret nothing but the fixed-size handshake reply is
read from it, and it may stay for :data:`AUTH_TIMEOUT_S` seconds at most; when more than
``max_pending`` connections are still unauthenticated, the oldest is dropped. A peer that has
proved itself is trusted: it can no longer be dropped to make room, and when the acceptor was asked
for a hello it has :data:`HELLO_TIMEOUT_S` seconds to send that first frame.

The acceptor runs on a ``selectors`` selector: its own (call :meth:`Acceptor.poll`), or one shared
with the caller's loop, where every registration's ``data`` is a handler ``handler(fileobj, events)``
and the loop calls :meth:`Acceptor.service` after each round of events. :class:`ServerLoop` is such
a loop on a thread of its own, for servers that outlive a call.
"""

from __future__ import annotations

import errno
import functools
import logging
import selectors
import socket
import threading
import time
from collections import OrderedDict
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

from .errors import AuthenticationError
from .wire import FrameReader, ServerHandshake, peer_name

__all__ = ["Accepted", "Acceptor", "ServerLoop", "AUTH_TIMEOUT_S", "HELLO_TIMEOUT_S", "MAX_PENDING"]

log = logging.getLogger("spark_hvd.acceptor")

# A peer of the job answers the challenge within milliseconds; strangers get no longer than this.
AUTH_TIMEOUT_S = 2.0
# An authenticated rank sends its hello right after the handshake; a loaded host may be slow.
HELLO_TIMEOUT_S = 10.0
# Unauthenticated connections held at once. Peers of the job finish their handshake in one round
# trip, so only a flood of this many new connections within that round trip could push one out
# (and its client then tries again, see wire.HANDSHAKE_ATTEMPTS).
MAX_PENDING = 64
# After accept() fails (out of file descriptors, for example) the listener rests this long, so a
# condition that persists costs a few log lines a second instead of a busy loop.
ACCEPT_BACKOFF_S = 0.25
# Connections taken from one listener per readiness event, so other sockets get their turn.
_ACCEPTS_PER_EVENT = 32

class Accepted(NamedTuple):
    """A connection that proved knowledge of the job secret (non-blocking, owned by the caller)."""

    sock: socket.socket
    peer: str
    hello: Optional[bytes]


class _Pending:
    __slots__ = ("sock", "peer", "deadline", "handshake", "reply", "reader")

    def __init__(self, sock: socket.socket, peer: str, deadline: float, handshake: ServerHandshake) -> None:
        self.sock = sock
        self.peer = peer
        self.deadline = deadline
        self.handshake = handshake
        self.reply = bytearray()
        self.reader: Optional[FrameReader] = None  # set once authenticated, while its hello is awaited


class Acceptor:
    """Authenticate connections from ``listeners`` concurrently; see the module docstring.

    ``on_accepted`` receives each authenticated connection; without it they collect for
    :meth:`poll`. With ``hello_limit`` a connection is handed over only with its first frame (at
    most that many bytes), read without taking a byte past it. The acceptor never closes the
    listeners; :meth:`close` drops the connections still in progress.
    """

    def __init__(
        self,
        listeners: Sequence[socket.socket],
        key: bytes,
        *,
        selector: Optional[selectors.BaseSelector] = None,
        on_accepted: Optional[Callable[[Accepted], None]] = None,
        hello_limit: Optional[int] = None,
        auth_timeout: float = AUTH_TIMEOUT_S,
        hello_timeout: float = HELLO_TIMEOUT_S,
        max_pending: int = MAX_PENDING,
        what: str = "spark-hvd",
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending} is invalid: expected at least 1 connection")
        if auth_timeout <= 0 or hello_timeout <= 0:
            raise ValueError(f"auth_timeout={auth_timeout} and hello_timeout={hello_timeout} must be > 0 seconds")
        self._key = key
        self._own_selector = selector is None
        self._selector = selectors.DefaultSelector() if selector is None else selector
        self._on_accepted = on_accepted
        self._hello_limit = hello_limit
        self._auth_timeout = auth_timeout
        self._hello_timeout = hello_timeout
        self._max_pending = max_pending
        self._what = what
        self._listeners = list(listeners)
        # Insertion order is age order, and every entry of one dict has the same timeout, so the
        # first entry always has the earliest deadline.
        self._pending: "OrderedDict[int, _Pending]" = OrderedDict()
        self._greeting: "OrderedDict[int, _Pending]" = OrderedDict()
        self._resting: Dict[socket.socket, float] = {}  # listener -> when it listens again
        self._ready: List[Accepted] = []
        self.rejected = 0
        self.closed = False
        for listener in self._listeners:
            listener.setblocking(False)
            self._selector.register(listener, selectors.EVENT_READ, self._on_listener)

    @property
    def waiting(self) -> int:
        """Connections accepted by the socket and not yet authenticated (or refused)."""
        return len(self._pending) + len(self._greeting)

    # -- driving ----------------------------------------------------------------------------------
    def poll(self, timeout: float) -> List[Accepted]:
        """Run the acceptor's own selector until a connection is ready or ``timeout`` passes."""
        if not self._own_selector:
            raise RuntimeError("poll() needs the acceptor's own selector; drive a shared one from its loop")
        deadline = time.monotonic() + timeout
        while not self._ready:
            now = time.monotonic()
            if now >= deadline:
                break
            wake = self.next_deadline()
            wait = deadline - now if wake is None else min(deadline, wake) - now
            for key, events in self._selector.select(max(0.0, wait)):
                key.data(key.fileobj, events)
            self.service(time.monotonic())
        ready, self._ready = self._ready, []
        return ready

    def next_deadline(self) -> Optional[float]:
        """When :meth:`service` next has something to do (a timeout or a listener to resume)."""
        times = [entries[next(iter(entries))].deadline for entries in (self._pending, self._greeting) if entries]
        times += list(self._resting.values())
        return min(times) if times else None

    def service(self, now: float) -> None:
        """Drop connections past their deadline and resume listeners whose rest is over."""
        for entries, stage in ((self._pending, "authenticate"), (self._greeting, "send its hello")):
            while entries:
                pending = entries[next(iter(entries))]
                if pending.deadline > now:
                    break
                self._reject(pending, f"{pending.peer} did not {stage} in time", logging.INFO)
        for listener, until in list(self._resting.items()):
            if until <= now:
                del self._resting[listener]
                if not self.closed and listener.fileno() >= 0:
                    self._selector.register(listener, selectors.EVENT_READ, self._on_listener)

    def close(self) -> None:
        """Drop every connection still in progress and stop watching the listeners."""
        if self.closed:
            return
        self.closed = True
        for entries in (self._pending, self._greeting):
            for pending in list(entries.values()):
                self._reject(pending, f"{pending.peer} was still in progress when the acceptor closed", logging.DEBUG)
        for listener in self._listeners:
            if listener not in self._resting:
                try:
                    self._selector.unregister(listener)
                except (KeyError, ValueError):
                    pass
        self._resting.clear()
        for accepted in self._ready:
            accepted.sock.close()
        self._ready = []
        if self._own_selector:
            self._selector.close()

    # -- events -----------------------------------------------------------------------------------
    def _on_listener(self, listener: socket.socket, _events: int) -> None:
        for _ in range(_ACCEPTS_PER_EVENT):
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # the client gave up while queued; nothing to do
            except OSError as exc:
                self._rest(listener, exc)
                return
            self._start(sock)

    def _rest(self, listener: socket.socket, exc: OSError) -> None:
        hint = ""
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            hint = "; this process is out of file descriptors: raise the limit (ulimit -n) or run fewer connections"
        log.warning("%s: accepting a connection failed (%s)%s; trying again in %.2f s",
                    self._what, exc, hint, ACCEPT_BACKOFF_S)
        self._selector.unregister(listener)
        self._resting[listener] = time.monotonic() + ACCEPT_BACKOFF_S

    def _start(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        handshake = ServerHandshake(self._key)
        pending = _Pending(sock, peer_name(sock), time.monotonic() + self._auth_timeout, handshake)
        try:
            # A new socket's send buffer is empty: the 32-byte challenge always fits.
            sent = sock.send(handshake.challenge)
        except OSError as exc:
            self.rejected += 1
            log.info("%s: dropped %s before its handshake: %s", self._what, pending.peer, exc)
            sock.close()
            return
        if sent != len(handshake.challenge):
            self.rejected += 1
            sock.close()
            return
        self._pending[sock.fileno()] = pending
        self._selector.register(sock, selectors.EVENT_READ, functools.partial(self._on_pending, pending))
        while len(self._pending) > self._max_pending:
            oldest = self._pending[next(iter(self._pending))]
            self._reject(oldest, f"{oldest.peer} was dropped: more than {self._max_pending} connections were "
                                 "waiting to authenticate", logging.INFO)

    def _on_pending(self, pending: _Pending, _sock: object, _events: int) -> None:
        if pending.sock.fileno() < 0:
            return  # dropped earlier in this round of events (pushed out by a newer connection)
        if pending.reader is None:
            self._read_reply(pending)
        if pending.reader is not None:
            self._read_hello(pending)

    def _read_reply(self, pending: _Pending) -> None:
        want = pending.handshake.REPLY_BYTES - len(pending.reply)
        try:
            # Never more than the reply: whatever follows it is payload, read only after the proof.
            chunk = pending.sock.recv(want)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._reject(pending, f"{pending.peer} failed during the handshake: {exc}", logging.INFO)
            return
        if not chunk:
            self._reject(pending, f"{pending.peer} closed the connection during the handshake", logging.INFO)
            return
        pending.reply += chunk
        if len(pending.reply) < pending.handshake.REPLY_BYTES:
            return
        try:
            answer = pending.handshake.answer(bytes(pending.reply), pending.peer)
            if pending.sock.send(answer) != len(answer):
                raise AuthenticationError(f"{pending.peer} did not take the handshake's answer")
        except (AuthenticationError, OSError) as exc:
            self._reject(pending, str(exc), logging.WARNING)
            return
        del self._pending[pending.sock.fileno()]
        if self._hello_limit is None:
            self._hand_over(pending, None)
            return
        pending.reader = FrameReader(pending.sock, self._hello_limit, exact=True, what=f"{pending.peer}'s hello")
        pending.deadline = time.monotonic() + self._hello_timeout
        self._greeting[pending.sock.fileno()] = pending

    def _read_hello(self, pending: _Pending) -> None:
        reader = pending.reader
        assert reader is not None
        reader.pump()
        if reader.frames:
            del self._greeting[pending.sock.fileno()]
            self._hand_over(pending, reader.frames.popleft())
        elif reader.error:
            self._reject(pending, reader.error, logging.DEBUG)  # the reader has logged it
        elif reader.closed:
            self._reject(pending, f"{pending.peer} closed the connection before its hello", logging.WARNING)

    def _hand_over(self, pending: _Pending, hello: Optional[bytes]) -> None:
        self._selector.unregister(pending.sock)
        accepted = Accepted(pending.sock, pending.peer, hello)
        if self._on_accepted is not None:
            self._on_accepted(accepted)
        else:
            self._ready.append(accepted)

    def _reject(self, pending: _Pending, reason: str, level: int) -> None:
        fd = pending.sock.fileno()
        self._pending.pop(fd, None)
        self._greeting.pop(fd, None)
        self.rejected += 1
        log.log(level, "%s: rejected a connection: %s", self._what, reason)
        try:
            self._selector.unregister(pending.sock)
        except (KeyError, ValueError):
            pass
        pending.sock.close()



class ServerLoop:
    """One thread around one selector: an :class:`Acceptor` on ``listener`` and the connections
    it hands over.

    A subclass sets up its state, then calls :meth:`_start`; it registers its connections on
    ``self._selector`` with a handler as ``data`` and overrides the hooks below. Nothing that goes
    wrong in one round of events stops the thread; :meth:`close` does, closing the listener too.
    """

    def __init__(self, listener: socket.socket, key: bytes, *, what: str, thread_name: str,
                 auth_timeout: float = AUTH_TIMEOUT_S) -> None:
        self._what = what
        self._listener = listener
        self._closing = False
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._on_wake)
        self._acceptor = Acceptor([listener], key, selector=self._selector, on_accepted=self._on_accepted,
                                  auth_timeout=auth_timeout, what=what)
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    @property
    def rejected(self) -> int:
        """Connections turned away because they did not authenticate (in time)."""
        return self._acceptor.rejected

    @property
    def waiting(self) -> int:
        """Connections that have not authenticated yet (idle strangers among them)."""
        return self._acceptor.waiting

    def close(self) -> None:
        """Stop the thread: :meth:`_shut_down` runs on it, then every socket of the loop is closed."""
        self._closing = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(10.0)
        if self._thread.is_alive():
            log.error("%s: its thread did not stop within 10 s", self._what)

    # -- hooks ------------------------------------------------------------------------------------
    def _on_accepted(self, accepted: Accepted) -> None:
        """Take over an authenticated connection."""
        raise NotImplementedError

    def _next_deadline(self) -> Optional[float]:
        """When :meth:`_tick` next has work, beyond the acceptor's own deadlines."""
        return None

    def _tick(self, now: float) -> None:
        """Runs after every round of events."""

    def _on_handler_error(self, fileobj: object) -> None:
        """A handler raised for ``fileobj``; typically drop that connection."""

    def _shut_down(self) -> None:
        """Runs on the thread when it stops, before the loop's sockets are closed."""

    # -- the loop ---------------------------------------------------------------------------------
    def _start(self) -> None:
        self._thread.start()

    def _on_wake(self, sock: socket.socket, _events: int) -> None:
        try:
            sock.recv(64)
        except OSError:
            pass

    def _run(self) -> None:
        try:
            while not self._closing:
                try:
                    self._round()
                except Exception:
                    # The server must outlive any one bad event; the next round starts afresh.
                    log.exception("%s: unexpected error in its loop", self._what)
                    time.sleep(0.05)
        finally:
            try:
                self._shut_down()
            finally:
                self._acceptor.close()
                for sock in (self._listener, self._wake_r, self._wake_w):
                    sock.close()
                self._selector.close()

    def _round(self) -> None:
        wakes = [t for t in (self._acceptor.next_deadline(), self._next_deadline()) if t is not None]
        timeout = max(0.0, min(wakes) - time.monotonic()) if wakes else None
        for key, events in self._selector.select(timeout):
            try:
                key.data(key.fileobj, events)
            except Exception:
                log.exception("%s: error while serving a connection", self._what)
                self._on_handler_error(key.fileobj)
        now = time.monotonic()
        self._acceptor.service(now)
        self._tick(now)
