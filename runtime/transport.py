"""Point-to-point transport: non-blocking channel operations and the Transport that waits on them.

A Channel connects this rank with one peer (TCP socket, shared-memory rings, or an in-process
pipe for unit tests). Sends and receives are started as operations that make progress without
blocking; ``Transport.wait`` drives a set of them to completion, so a send and a receive on
different channels overlap in one thread. Received bytes are handed to a *sink* chunk by chunk,
which lets a receiver reduce straight out of the transport's buffers.
"""

from __future__ import annotations

import os
import select
import socket
import time
from typing import Callable, Dict, List, Optional, Protocol, Sequence

import numpy as np

from .errors import CollectiveError
from .wire import describe_broken

__all__ = [
    "Sink",
    "CopySink",
    "ReduceSink",
    "Op",
    "Channel",
    "Transport",
    "TcpChannel",
]


class Sink(Protocol):
    """Consumer of received bytes: called with each chunk's offset and contents, in order."""

    def __call__(self, offset: int, chunk: memoryview) -> None: ...


class CopySink:
    """Copy received bytes into ``target``; transports may receive into it directly."""

    def __init__(self, target: memoryview) -> None:
        self.target = target

    def __call__(self, offset: int, chunk: memoryview) -> None:
        self.target[offset:offset + len(chunk)] = chunk


class ReduceSink:
    """Reduce received elements into ``acc`` (a flat array) with ``reduce(acc_part, incoming)``."""

    target = None

    def __init__(self, acc: np.ndarray, reduce: Callable[[np.ndarray, np.ndarray], None]) -> None:
        self.acc = acc
        self.itemsize = acc.dtype.itemsize
        self.reduce = reduce

    def __call__(self, offset: int, chunk: memoryview) -> None:
        start = offset // self.itemsize
        incoming = np.frombuffer(chunk, dtype=self.acc.dtype)
        self.reduce(self.acc[start:start + incoming.size], incoming)


class Op:
    """A started send or receive; ``progress()`` moves it on without blocking."""

    done: bool = False
    peer: int = -1  # the global rank on the other end
    fileno: Optional[int] = None  # a socket to wait on, when the op waits on one
    waits_for_write: bool = False

    def progress(self) -> bool:  # pragma: no cover - interface
        raise NotImplementedError


class Channel(Protocol):
    peer: int

    def isend(self, buf: memoryview) -> Op: ...

    def irecv(self, nbytes: int, sink: Sink) -> Op: ...

    def close(self) -> None: ...


class _NoOp(Op):
    done = True

    def progress(self) -> bool:
        return False


class _TcpSend(Op):
    waits_for_write = True

    def __init__(self, sock: socket.socket, buf: memoryview, peer: int, what: str) -> None:
        self.sock = sock
        self.view = buf.cast("B") if buf.format != "B" else buf
        self.sent = 0
        self.peer = peer
        self.what = what
        self.fileno = sock.fileno()
        self.done = len(self.view) == 0

    def progress(self) -> bool:
        moved = False
        while self.sent < len(self.view):
            try:
                n = self.sock.send(self.view[self.sent:self.sent + (4 << 20)])
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                raise CollectiveError(f"rank {self.peer} was lost: sending to it failed: "
                                      f"{describe_broken(exc, self.what)}", lost_rank=self.peer) from None
            self.sent += n
            moved = True
        self.done = self.sent >= len(self.view)
        return moved


class _TcpRecv(Op):
    def __init__(self, channel: "TcpChannel", nbytes: int, sink: Sink) -> None:
        self.channel = channel
        self.peer = channel.peer
        self.sock = channel.sock
        self.nbytes = nbytes
        self.sink = sink
        self.got = 0
        self.fileno = self.sock.fileno()
        target = getattr(sink, "target", None)
        self.direct = target.cast("B") if target is not None and target.format != "B" else target
        self.pending = 0  # bytes in the scratch buffer not yet given to the sink
        self.done = nbytes == 0

    def progress(self) -> bool:
        moved = False
        while self.got < self.nbytes:
            if self.direct is not None:
                view = self.direct[self.got:self.nbytes]
            else:
                scratch = self.channel.scratch
                room = min(len(scratch) - self.pending, self.nbytes - self.got)
                view = scratch[self.pending:self.pending + room]
            try:
                n = self.sock.recv_into(view, len(view))
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                raise CollectiveError(f"rank {self.channel.peer} was lost: receiving from it failed: "
                                      f"{describe_broken(exc, self.channel.what)}",
                                      lost_rank=self.channel.peer) from None
            if n == 0:
                raise CollectiveError(
                    f"rank {self.channel.peer} was lost: {self.channel.what} closed its connection in the middle "
                    "of a collective (its process exited or was killed)",
                    lost_rank=self.channel.peer,
                )
            moved = True
            if self.direct is None:
                self.pending += n
                # Hand over whole elements only: the scratch size and message sizes are multiples of 64.
                if self.pending == len(self.channel.scratch) or self.got + n == self.nbytes:
                    offset = self.got + n - self.pending
                    self.sink(offset, self.channel.scratch[:self.pending])
                    self.pending = 0
            self.got += n
        self.done = self.got >= self.nbytes
        return moved


class TcpChannel:
    """A channel over one connected, authenticated socket; ``what`` names the peer in messages
    (``rank 1 on host h2 (10.0.0.2)``)."""

    kind = "tcp"

    def __init__(self, peer: int, sock: socket.socket, chunk_bytes: int, what: Optional[str] = None) -> None:
        self.peer = peer
        self.sock = sock
        self.what = what or f"rank {peer}"
        sock.setblocking(False)
        self.scratch = memoryview(bytearray(chunk_bytes))

    def isend(self, buf: memoryview) -> Op:
        op = _TcpSend(self.sock, buf, self.peer, self.what)
        op.progress()
        return op

    def irecv(self, nbytes: int, sink: Sink) -> Op:
        op = _TcpRecv(self, nbytes, sink)
        op.progress()
        return op

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Transport:
    """This rank's channels to its peers, and the waiting strategy that drives them.

    ``check(peers, idle_seconds)`` is called while waiting (every few milliseconds) with the global
    ranks still owing data and the seconds since anything last moved; it raises CollectiveError
    when the job has failed. The engine uses it to notice lost peers, aborts announced by others,
    and stalls.
    """

    def __init__(self, rank: int, size: int, channels: Dict[int, Channel],
                 check: Optional[Callable[[Sequence[int], float], None]] = None) -> None:
        self.rank = rank
        self.size = size
        self.channels = channels
        self.check = check
        self.poll_seconds = 0.0
        """How long a wait polls without yielding before it yields and naps; the engine sets it when
        every local rank has a core of its own (a peer a few tens of microseconds late then costs
        no nap, which the sleep's granularity would stretch to a hundred)."""

    # -- primitives used by the algorithms -------------------------------------------------------
    def isend(self, peer: int, buf: memoryview) -> Op:
        if len(buf) == 0 or peer == self.rank:
            return _NoOp()
        return self.channels[peer].isend(buf)

    def irecv(self, peer: int, nbytes: int, sink: Sink) -> Op:
        if nbytes == 0 or peer == self.rank:
            return _NoOp()
        return self.channels[peer].irecv(nbytes, sink)

    def send(self, peer: int, buf: memoryview) -> None:
        self.wait([self.isend(peer, buf)])

    def recv(self, peer: int, nbytes: int, sink: Sink) -> None:
        self.wait([self.irecv(peer, nbytes, sink)])

    def sendrecv(self, send_peer: int, send_buf: memoryview, recv_peer: int, nbytes: int, sink: Sink) -> None:
        recv = self.irecv(recv_peer, nbytes, sink)
        send = self.isend(send_peer, send_buf)
        self.wait([send, recv])

    def wait(self, ops: Sequence[Op]) -> None:
        """Drive ``ops`` to completion: poll for ``poll_seconds``, then yield a while, then sleep
        (shared memory, in naps that grow to 1 ms) or select (sockets)."""
        pending: List[Op] = [op for op in ops if not op.done]
        idle = 0
        progressed = False
        last_check = last_moved = idle_since = time.monotonic()
        while pending:
            moved = False
            for op in pending:
                if op.progress():
                    moved = True
            pending = [op for op in pending if not op.done]
            if not pending:
                return
            if moved:
                idle = 0
                progressed = True
                continue
            now = time.monotonic()
            if idle == 0:
                idle_since = now
            if now - last_check > 0.02:
                last_check = now
                if progressed:  # to within one check interval, which is all a stall clock needs
                    last_moved, progressed = now, False
                if self.check is not None:
                    self.check([op.peer for op in pending], now - last_moved)
            if now - idle_since < self.poll_seconds:
                idle = max(idle, 1)
                continue
            idle += 1
            if idle < 50:
                os.sched_yield()
                continue
            rfds = [op.fileno for op in pending if op.fileno is not None and not op.waits_for_write]
            wfds = [op.fileno for op in pending if op.fileno is not None and op.waits_for_write]
            socket_only = len(rfds) + len(wfds) == len(pending)
            timeout = 0.02 if socket_only else min(0.001, 0.00002 * (idle - 49))
            if socket_only:
                try:
                    select.select(rfds, wfds, [], timeout)
                except (InterruptedError, ValueError, OSError):
                    time.sleep(timeout)
            else:
                time.sleep(timeout)

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
