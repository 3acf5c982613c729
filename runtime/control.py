"""Control links: how negotiation messages travel between a worker and the coordinator.

A link delivers whole frames in order. :class:`SocketLink` carries them over an authenticated
socket (TCP, or a Unix socket on one host); the MPI backend has its own link over a communicator
(:mod:`spark_hvd.runtime.mpi`). The engine needs only this protocol.
"""

from __future__ import annotations

import socket
from typing import Deque, Optional, Protocol

from .wire import FrameReader, send_frame

__all__ = ["ControlLink", "SocketLink"]


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
