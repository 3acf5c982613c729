"""An in-process transport for unit tests: ranks are threads, channels are locked byte queues."""

from __future__ import annotations

import socket
import threading
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, TypeVar

from .transport import Op, Sink, Transport

__all__ = ["InprocChannel", "inproc_world", "inproc_worlds", "run_threads"]

T = TypeVar("T")


class _Pipe:
    def __init__(self, chunk: int) -> None:
        self.chunks: Deque[bytes] = deque()
        self.lock = threading.Lock()
        self.chunk = chunk


class _Send(Op):
    def __init__(self, pipe: _Pipe, buf: memoryview) -> None:
        data = bytes(buf.cast("B") if buf.format != "B" else buf)
        with pipe.lock:
            pipe.chunks.append(data)
        self.done = True

    def progress(self) -> bool:
        return False


class _Recv(Op):
    def __init__(self, pipe: _Pipe, nbytes: int, sink: Sink) -> None:
        self.pipe = pipe
        self.total = nbytes
        self.got = 0
        self.sink = sink
        self.done = nbytes == 0

    def progress(self) -> bool:
        if self.done:
            return False
        with self.pipe.lock:
            if not self.pipe.chunks:
                return False
            message = self.pipe.chunks.popleft()
        # Like the shared-memory rings, a receive must match its send's size exactly.
        assert len(message) == self.total, f"received a {len(message)}-byte message where {self.total} were expected"
        view = memoryview(message)
        for start in range(0, self.total, self.pipe.chunk):
            self.sink(start, view[start:start + self.pipe.chunk])
        self.got = self.total
        self.done = True
        return True


class InprocChannel:
    def __init__(self, peer: int, outgoing: _Pipe, incoming: _Pipe) -> None:
        self.peer = peer
        self.outgoing = outgoing
        self.incoming = incoming

    def isend(self, buf: memoryview) -> Op:
        return _Send(self.outgoing, buf)

    def irecv(self, nbytes: int, sink: Sink) -> Op:
        op = _Recv(self.incoming, nbytes, sink)
        op.progress()
        return op

    def close(self) -> None:
        pass


def inproc_world(size: int, chunk_bytes: int = 4096) -> List[Transport]:
    """Transports for ``size`` ranks living in one process (one thread per rank)."""
    pipes: Dict[tuple, _Pipe] = {(s, d): _Pipe(chunk_bytes) for s in range(size) for d in range(size) if s != d}
    return [
        Transport(r, size, {p: InprocChannel(p, pipes[(r, p)], pipes[(p, r)]) for p in range(size) if p != r})
        for r in range(size)
    ]


def run_threads(size: int, fn: Callable[[Transport], T], chunk_bytes: int = 4096,
                timeout: float = 30.0) -> List[T]:
    """Run ``fn(transport)`` on ``size`` in-process ranks; return results in rank order."""
    transports = inproc_world(size, chunk_bytes)
    results: List[Optional[T]] = [None] * size
    errors: List[Optional[BaseException]] = [None] * size

    def body(r: int) -> None:
        try:
            results[r] = fn(transports[r])
        except BaseException as exc:  # reported below with its rank
            errors[r] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"an in-process rank did not finish within {timeout} s")
    for r, err in enumerate(errors):
        if err is not None:
            raise RuntimeError(f"rank {r} failed: {err!r}") from err
    return results  # type: ignore[return-value]


def inproc_worlds(size: int, chunk_bytes: int = 4096) -> list:
    """Whole worlds (data channels and control connections) for ``size`` ranks of one process, so
    that one engine per rank can run on threads: control travels over socket pairs."""
    from .control import SocketLink
    from .world import World

    transports = inproc_world(size, chunk_bytes)
    control: Dict[int, Dict[int, SocketLink]] = {r: {} for r in range(size)}
    for worker in range(1, size):
        coordinator_end, worker_end = socket.socketpair()
        control[0][worker] = SocketLink(coordinator_end, what=f"rank {worker}")
        control[worker][0] = SocketLink(worker_end, what="rank 0")
    return [World(r, size, r, size, 0, 1, transports[r], control[r], hosts=["inproc"] * size) for r in range(size)]
