"""Shared-memory channels between ranks on one host: one single-producer ring per direction.

Each ring is an anonymous memory file (``memfd_create``) holding two counters (slots written,
slots read; each written by one side only, on its own cache line), a tag, and ``slots`` buffers
of ``slot_bytes``. Message lengths are known to both sides, so slot contents need no headers.
The file never has a name: the peer maps it through ``/proc/<creator pid>/fd/<fd>`` while the
creator holds it open, and the memory goes away with the last process that maps it. However a
job ends, nothing is left in /dev/shm.

The tag, an HMAC of the job secret and the ring's direction, lets the peer check that the file it
opened is the ring it expected and not whatever a recycled pid or fd number points to now.

The counters are read and written through :mod:`.ordering`: a counter's store publishes the slot
bytes written before it (a release), and a load of it makes them visible to the reader (an
acquire), on every CPU, not only on those that keep plain stores in order.
"""

from __future__ import annotations

import hashlib
import hmac
import mmap
import os
from typing import Optional

from .ordering import ordered_counters, ordering_available
from .transport import Op, Sink

__all__ = ["ShmRing", "ShmChannel", "shm_available", "ring_tag"]

_HEADER = 128  # counters at byte 0 (written) and 64 (read); the tag at byte 96
_TAG_AT = 96
_TAG_BYTES = 32


def shm_available(ordering: str = "auto") -> bool:
    """Whether this system can create anonymous memory files, reopen them through /proc, and
    publish their counters in order (see :mod:`.ordering`)."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd") and ordering_available(ordering)


def ring_tag(key: bytes, generation: int, src: int, dst: int) -> bytes:
    """The tag of the ring carrying data from rank ``src`` to rank ``dst`` in one generation."""
    return hmac.new(key, f"spark-hvd ring {generation} {src}->{dst}".encode(), hashlib.sha256).digest()


class ShmRing:
    """One direction of a shared-memory channel."""

    def __init__(self, mm: mmap.mmap, slots: int, slot_bytes: int, fd: Optional[int] = None,
                 ordering: str = "auto") -> None:
        self.mm = mm
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._fd = fd
        self.counters = ordered_counters(mm, _HEADER // 8, ordering)
        self.view = memoryview(mm)[_HEADER:]

    @classmethod
    def create(cls, slots: int, slot_bytes: int, tag: bytes, ordering: str = "auto") -> "ShmRing":
        """A new ring; :attr:`fd` stays open until :meth:`release_fd`, so the peer can open it."""
        size = _HEADER + slots * slot_bytes
        fd = os.memfd_create("spark-hvd-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        mm[_TAG_AT:_TAG_AT + _TAG_BYTES] = tag
        try:
            return cls(mm, slots, slot_bytes, fd, ordering)
        except BaseException:
            mm.close()
            os.close(fd)
            raise

    @classmethod
    def open_peer(cls, pid: int, fd: int, slots: int, slot_bytes: int, tag: bytes,
                  ordering: str = "auto") -> "ShmRing":
        """Map the ring that process ``pid`` created as its descriptor ``fd``; check its tag."""
        size = _HEADER + slots * slot_bytes
        path = f"/proc/{pid}/fd/{fd}"
        local = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            if os.fstat(local).st_size != size:
                raise OSError(f"{path} is not a ring of {size} bytes")
            mm = mmap.mmap(local, size)
        finally:
            os.close(local)
        if not hmac.compare_digest(bytes(mm[_TAG_AT:_TAG_AT + _TAG_BYTES]), tag):
            mm.close()
            raise OSError(f"{path} does not carry the expected ring tag")
        return cls(mm, slots, slot_bytes, ordering=ordering)

    @property
    def fd(self) -> int:
        assert self._fd is not None, "only the creator of a ring holds its descriptor"
        return self._fd

    def release_fd(self) -> None:
        """Close the creator's descriptor: the mapping stays, the file is now reachable by no one."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

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

    def close(self) -> None:
        self.release_fd()
        try:
            self.counters.release()
            self.view.release()
            self.mm.close()
        except BufferError:
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
            counters[0] = written  # a release: the slot's bytes are visible before the new count
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
        while self.got < self.total and consumed < counters[0]:  # an acquire: the slots it counts are visible
            n = min(ring.slot_bytes, self.total - self.got)
            self.sink(self.got, ring.slot(consumed)[:n])
            self.got += n
            consumed += 1
            counters[8] = consumed  # a release: this slot is read before the producer may reuse it
            moved = True
        self.done = self.got >= self.total
        return moved


class ShmChannel:
    """A channel to a peer on the same host: our outgoing ring and the peer's."""

    kind = "shm"

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

    def unread(self) -> int:
        """Slots the peer has published that this rank has not read yet."""
        counters = self.incoming.counters
        return counters[0] - counters[8]

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
