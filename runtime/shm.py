"""Shared-memory channels between ranks on one host: one single-producer ring per direction.

Each ring is a file in /dev/shm holding two counters (slots written, slots read; each written by
one side only, on its own cache line) and ``slots`` buffers of ``slot_bytes``. Message lengths are
known to both sides, so slot contents need no headers. The files are unlinked as soon as both
sides have mapped them, so a crash leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from typing import List, Optional

import numpy as np

from .transport import Op, Sink

__all__ = ["ShmRing", "ShmChannel", "shm_available", "ring_name", "remove_job_segments"]

_SHM_DIR = "/dev/shm"
_HEADER = 128  # counters at byte 0 (written) and 64 (read)


def shm_available() -> bool:
    return os.path.isdir(_SHM_DIR) and os.access(_SHM_DIR, os.W_OK)


def job_token(secret: str) -> str:
    """A short name for the job's segments, derived from (not revealing) the secret."""
    return hashlib.sha256(("spark-hvd-shm" + secret).encode()).hexdigest()[:16]


def ring_name(secret: str, src: int, dst: int) -> str:
    return f"spark-hvd-{job_token(secret)}-{src}-{dst}"


def remove_job_segments(secret: str) -> int:
    """Unlink any segments a crashed job left behind (launchers call this when they finish)."""
    prefix = f"spark-hvd-{job_token(secret)}-"
    removed = 0
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(_SHM_DIR, name))
                removed += 1
            except OSError:
                pass
    return removed


class ShmRing:
    """One direction of a shared-memory channel."""

    def __init__(self, name: str, slots: int, slot_bytes: int, create: bool) -> None:
        self.name = name
        self.path = os.path.join(_SHM_DIR, name)
        self.slots = slots
        self.slot_bytes = slot_bytes
        size = _HEADER + slots * slot_bytes
        if create:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, size)
                self.mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        else:
            fd = os.open(self.path, os.O_RDWR)
            try:
                self.mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        self.counters = memoryview(self.mm)[:_HEADER].cast("q")
        self.data = np.frombuffer(self.mm, dtype=np.uint8, offset=_HEADER)
        self.view = memoryview(self.mm)[_HEADER:]

    # counters[0]: slots written by the producer; counters[8]: slots consumed by the consumer.
    @property
    def written(self) -> int:
        return self.counters[0]

    @property
    def consumed(self) -> int:
        return self.counters[8]

    def slot(self, index: int) -> memoryview:
        start = (index % self.slots) * self.slot_bytes
        return self.view[start:start + self.slot_bytes]

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        try:
            self.counters.release()
            self.view.release()
            del self.data
            self.mm.close()
        except (BufferError, AttributeError):
            # A view handed out is still alive; the mapping goes when the process does.
            pass


class _ShmSend(Op):
    def __init__(self, ring: ShmRing, buf: memoryview) -> None:
        self.ring = ring
        self.src = buf.cast("B") if buf.format != "B" else buf
        self.total = len(self.src)
        self.sent = 0
        self.done = self.total == 0

    def progress(self) -> bool:
        ring = self.ring
        counters = ring.counters
        moved = False
        written = counters[0]
        while self.sent < self.total and written - counters[8] < ring.slots:
            n = min(ring.slot_bytes, self.total - self.sent)
            ring.slot(written)[:n] = self.src[self.sent:self.sent + n]
            self.sent += n
            written += 1
            counters[0] = written  # publish after the copy; x86 keeps store order
            moved = True
        self.done = self.sent >= self.total
        return moved


class _ShmRecv(Op):
    def __init__(self, ring: ShmRing, nbytes: int, sink: Sink) -> None:
        self.ring = ring
        self.total = nbytes
        self.got = 0
        self.sink = sink
        self.done = nbytes == 0

    def progress(self) -> bool:
        ring = self.ring
        counters = ring.counters
        moved = False
        consumed = counters[8]
        while self.got < self.total and consumed < counters[0]:
            n = min(ring.slot_bytes, self.total - self.got)
            self.sink(self.got, ring.slot(consumed)[:n])
            self.got += n
            consumed += 1
            counters[8] = consumed
            moved = True
        self.done = self.got >= self.total
        return moved


class ShmChannel:
    """A channel to a peer on the same host: our outgoing ring and the peer's."""

    def __init__(self, peer: int, outgoing: ShmRing, incoming: ShmRing, peer_pid: Optional[int] = None) -> None:
        self.peer = peer
        self.outgoing = outgoing
        self.incoming = incoming
        self.peer_pid = peer_pid

    def isend(self, buf: memoryview) -> Op:
        op = _ShmSend(self.outgoing, buf)
        op.peer = self.peer
        op.progress()
        return op

    def irecv(self, nbytes: int, sink: Sink) -> Op:
        op = _ShmRecv(self.incoming, nbytes, sink)
        op.peer = self.peer
        op.progress()
        return op

    def peer_alive(self) -> bool:
        """False once the peer process is gone (or a zombie): the ring will never move again."""
        if self.peer_pid is None:
            return True
        try:
            with open(f"/proc/{self.peer_pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            return state not in (b"Z", b"X")
        except (OSError, IndexError):
            try:
                os.kill(self.peer_pid, 0)
                return True
            except ProcessLookupError:
                return False
            except PermissionError:
                return True

    def close(self) -> None:
        self.outgoing.close()
        self.incoming.close()


def open_rings(secret: str, rank: int, peers: List[int], slots: int, slot_bytes: int) -> dict:
    """Create this rank's outgoing rings to each local peer."""
    return {p: ShmRing(ring_name(secret, rank, p), slots, slot_bytes, create=True) for p in peers}
