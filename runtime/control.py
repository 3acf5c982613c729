"""Control links: how negotiation messages travel between a worker and the coordinator.

A link delivers whole frames in order. :class:`SocketLink` carries them over an authenticated
socket (TCP, or a Unix socket on one host); the MPI backend has its own link over a communicator
(:mod:`spark_hvd.runtime.mpi`). The engine needs only this protocol.
"""

from __future__ import annotations

import pickle
import socket
from typing import Deque, Dict, Iterable, Iterator, List, Optional, Protocol, Tuple

from .errors import CollectiveError
from .wire import FrameReader, send_frame

__all__ = ["ControlLink", "SocketLink", "ControlLinks", "REQUESTS", "RESPONSES", "ABORT", "BYE"]


class ControlLink(Protocol):
    """One peer's end of the negotiation channel."""

    frames: Deque[bytes]
    """Frames received and not yet taken, oldest first."""
    closed: bool
    """True once the peer's end is gone (its process exited or the stream broke)."""
    error: Optional[str]
    """Why the stream was cut off, when this side cut it (a corrupt or oversize frame)."""

    def pump(self) -> None:
        """Move what has arrived into :attr:`frames` without blocking."""

    def fileno(self) -> Optional[int]:
        """A descriptor that becomes readable when something arrives, or None (then poll)."""

    def send(self, frame: bytes) -> None:
        """Send one frame, blocking until it is handed over; OSError when the peer is gone."""

    def send_quietly(self, frame: bytes) -> None:
        """Best-effort send bounded to about a second, for goodbyes and aborts."""

    def close(self) -> None: ...


class SocketLink:
    """A control link over one connected, authenticated socket."""

    def __init__(self, sock: socket.socket, what: str = "a peer") -> None:
        self.sock = sock
        self._reader = FrameReader(sock, what=what)
        self.frames = self._reader.frames

    @property
    def closed(self) -> bool:
        return self._reader.closed

    @property
    def error(self) -> Optional[str]:
        return self._reader.error

    def pump(self) -> None:
        self._reader.pump()

    def fileno(self) -> Optional[int]:
        return None if self._reader.closed else self.sock.fileno()

    def send(self, frame: bytes) -> None:
        send_frame(self.sock, frame)

    def send_quietly(self, frame: bytes) -> None:
        try:
            self.sock.settimeout(1.0)
            send_frame(self.sock, frame)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


# Control frame types (first byte).
REQUESTS = b"R"
RESPONSES = b"S"
ABORT = b"A"
BYE = b"X"


class ControlLinks:
    """This rank's control links by peer, and what it knows of the peers that left."""

    def __init__(self, links: Dict[int, ControlLink]) -> None:
        self.links = dict(links)
        self.left: Dict[int, str] = {}
        """Peers that said goodbye (and why), by rank."""
        self.polled = any(link.fileno() is None for link in self.links.values())
        """Some links have no descriptor to wait on (MPI): they are polled."""

    def items(self) -> Iterable[Tuple[int, ControlLink]]:
        return self.links.items()

    def __getitem__(self, peer: int) -> ControlLink:
        return self.links[peer]

    def __iter__(self) -> Iterator[int]:
        return iter(self.links)

    def pump(self) -> None:
        """Read what has arrived on every link."""
        for link in self.links.values():
            link.pump()

    def has_frames(self) -> bool:
        return any(link.frames for link in self.links.values())

    def filenos(self) -> List[int]:
        return [fd for fd in (link.fileno() for link in self.links.values()) if fd is not None]

    def lost(self, peer: int) -> CollectiveError:
        """The error for collectives that needed ``peer``, saying how it went."""
        if self.left.get(peer) == "shut down":
            return CollectiveError(f"rank {peer} has shut down; collectives that need it cannot complete",
                                   lost_rank=peer)
        link = self.links.get(peer)
        if link is not None and link.error:
            return CollectiveError(f"rank {peer} was lost: {link.error}", lost_rank=peer)
        return CollectiveError(
            f"rank {peer} was lost: its connection closed (the process exited or was killed)", lost_rank=peer)

    def send(self, peer: int, frame: bytes) -> None:
        """Send ``frame`` to ``peer``; a CollectiveError when the peer is gone without a goodbye."""
        link = self.links[peer]
        try:
            link.send(frame)
        except OSError as exc:
            # A peer that said goodbye and closed its end in the moment since the links were last
            # read has shut down cleanly: it needs nothing more (its goodbye is handled as usual).
            link.pump()
            if peer in self.left or any(f[:1] == BYE for f in link.frames):
                self.left.setdefault(peer, "shut down")
                return
            raise CollectiveError(f"rank {peer} was lost: sending to it failed ({exc})", lost_rank=peer) from None

    def send_quietly(self, frame: bytes, skip: Optional[int] = None) -> None:
        """Best effort, bounded, to every peer still there but ``skip``: the peer may already be gone or stuck."""
        for peer, link in list(self.links.items()):
            if peer not in self.left and peer != skip:
                link.send_quietly(frame)

    def raise_abort(self, frame: bytes) -> None:
        """Raise the CollectiveError another rank's abort frame carries."""
        message, lost = pickle.loads(frame[1:])
        raise CollectiveError(message, lost_rank=lost)

    def abort_frame(self, error: CollectiveError) -> bytes:
        return ABORT + pickle.dumps((str(error), error.lost_rank), protocol=5)
