"""Authenticated sockets: HMAC challenge-response with the job secret, then length-framed messages.

Nothing a peer sends is interpreted before it has proved knowledge of the secret; after that,
frames are plain bytes that callers decode.
"""

from __future__ import annotations

import errno
import hmac
import hashlib
import os
import select
import socket
import struct
import time
from collections import deque
from typing import Deque, List, Optional, Tuple

from .errors import AuthenticationError, CollectiveError, RendezvousTimeout

__all__ = [
    "secret_bytes",
    "authenticate_client",
    "authenticate_server",
    "send_frame",
    "recv_frame",
    "recv_exact",
    "FrameReader",
    "connect",
    "listen",
    "tune_socket",
]

_NONCE = 32
_HEADER = struct.Struct("!Q")
_CLIENT_TAG = b"spark-hvd/1 client"
_SERVER_TAG = b"spark-hvd/1 server"
MAX_FRAME = 1 << 40


def secret_bytes(secret_hex: str) -> bytes:
    """The job secret as bytes; a clear error when it is not hex."""
    try:
        key = bytes.fromhex(secret_hex)
    except ValueError:
        raise ValueError(
            f"the job secret must be hex text (as made by new_secret()), got {len(secret_hex)} characters "
            "that are not hex; set SPARK_HVD_SECRET from spark_hvd.runtime.config.new_secret()"
        ) from None
    if len(key) < 16:
        raise ValueError(f"the job secret has {len(key)} bytes; expected at least 16 for HMAC authentication")
    return key


def _digest(key: bytes, tag: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, tag + first + second, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, nbytes: int, deadline: Optional[float] = None) -> bytes:
    """Read exactly ``nbytes`` from a blocking socket, or raise ConnectionError on EOF."""
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise socket.timeout(f"timed out reading {nbytes} bytes")
            sock.settimeout(remaining)
        n = sock.recv_into(view[got:], nbytes - got)
        if n == 0:
            raise ConnectionError(f"connection closed after {got} of {nbytes} bytes")
        got += n
    return bytes(buf)


def authenticate_client(sock: socket.socket, key: bytes, timeout: float) -> None:
    """Prove knowledge of ``key`` to the server and check that the server knows it too."""
    deadline = time.monotonic() + timeout
    try:
        server_nonce = recv_exact(sock, _NONCE, deadline)
        client_nonce = os.urandom(_NONCE)
        sock.sendall(client_nonce + _digest(key, _CLIENT_TAG, server_nonce, client_nonce))
        answer = recv_exact(sock, 32, deadline)
    except (OSError, ConnectionError) as exc:
        raise AuthenticationError(f"authentication handshake with {_peer(sock)} failed: {exc}") from None
    if not hmac.compare_digest(answer, _digest(key, _SERVER_TAG, client_nonce, server_nonce)):
        raise AuthenticationError(
            f"the server at {_peer(sock)} does not know the job secret; is it another job's server?"
        )


def authenticate_server(sock: socket.socket, key: bytes, timeout: float) -> None:
    """Challenge a freshly accepted connection; raise AuthenticationError unless it knows ``key``."""
    deadline = time.monotonic() + timeout
    server_nonce = os.urandom(_NONCE)
    try:
        sock.sendall(server_nonce)
        reply = recv_exact(sock, _NONCE + 32, deadline)
    except (OSError, ConnectionError) as exc:
        raise AuthenticationError(f"authentication handshake with {_peer(sock)} failed: {exc}") from None
    client_nonce, proof = reply[:_NONCE], reply[_NONCE:]
    if not hmac.compare_digest(proof, _digest(key, _CLIENT_TAG, server_nonce, client_nonce)):
        raise AuthenticationError(f"connection from {_peer(sock)} did not prove knowledge of the job secret")
    sock.sendall(_digest(key, _SERVER_TAG, client_nonce, server_nonce))


def _peer(sock: socket.socket) -> str:
    try:
        peer = sock.getpeername()
    except OSError:
        return "an unknown peer"
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else (repr(peer) if peer else "a local peer")


def send_frame(sock: socket.socket, payload: bytes) -> None:
    """Send one length-prefixed frame on a blocking socket."""
    sock.sendall(_HEADER.pack(len(payload)) + payload if len(payload) < 65536 else _HEADER.pack(len(payload)))
    if len(payload) >= 65536:
        sock.sendall(payload)


def recv_frame(sock: socket.socket, deadline: Optional[float] = None) -> bytes:
    """Receive one length-prefixed frame from a blocking socket."""
    (length,) = _HEADER.unpack(recv_exact(sock, _HEADER.size, deadline))
    if length > MAX_FRAME:
        raise ConnectionError(f"frame of {length} bytes announced; the stream is corrupt")
    return recv_exact(sock, length, deadline)


class FrameReader:
    """Non-blocking, buffered reader of length-prefixed frames from one socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()
        self.frames: Deque[bytes] = deque()
        self.closed = False

    def pump(self) -> bool:
        """Read what is available without blocking; return False once the peer closed."""
        if self.closed:
            return False
        while True:
            try:
                chunk = self.sock.recv(1 << 20, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.closed = True
                break
            if not chunk:
                self.closed = True
                break
            self._buf += chunk
            if len(chunk) < (1 << 20):
                break
        self._split()
        return not self.closed

    def _split(self) -> None:
        buf = self._buf
        start = 0
        while len(buf) - start >= _HEADER.size:
            (length,) = _HEADER.unpack_from(buf, start)
            end = start + _HEADER.size + length
            if len(buf) < end:
                break
            self.frames.append(bytes(buf[start + _HEADER.size:end]))
            start = end
        if start:
            del buf[:start]


def tune_socket(sock: socket.socket, peer_timeout: float) -> None:
    """Low latency, and a dead remote host noticed within about ``peer_timeout`` seconds."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        idle = max(1, int(peer_timeout / 2))
        interval = max(1, int(peer_timeout / 6))
        for opt, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, opt):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(peer_timeout * 1000))
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
        except OSError:
            pass


def listen(host: str, port: int = 0, backlog: int = 128) -> socket.socket:
    """A listening TCP socket on exactly ``host`` (never all interfaces unless asked)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise OSError(
            exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}; set SPARK_HVD_HOSTNAME to an address "
            "of this machine"
        ) from None
    sock.listen(backlog)
    return sock


def connect(addr: Tuple[str, int] | str, key: bytes, timeout: float, what: str) -> socket.socket:
    """Connect (retrying until ``timeout``) and authenticate; ``addr`` is (host, port) or a unix name."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    last: Optional[BaseException] = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RendezvousTimeout(
                f"could not connect to {what} at {addr} within {timeout:.0f} s (last error: {last}); "
                "check that the address is reachable, or raise SPARK_HVD_START_TIMEOUT"
            )
        try:
            if isinstance(addr, str):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(remaining)
                sock.connect(addr)
            else:
                sock = socket.create_connection(addr, timeout=remaining)
        except OSError as exc:
            last = exc
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.ETIMEDOUT, errno.ECONNRESET, None):
                if not isinstance(exc, (ConnectionError, socket.timeout)):
                    raise
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)
            continue
        try:
            authenticate_client(sock, key, max(0.1, deadline - time.monotonic()))
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        return sock


def wait_readable(socks: List[socket.socket], timeout: Optional[float]) -> List[socket.socket]:
    """The subset of ``socks`` that can be read now or within ``timeout`` seconds."""
    if not socks:
        if timeout:
            time.sleep(timeout)
        return []
    try:
        ready, _, _ = select.select(socks, [], [], timeout)
    except InterruptedError:
        return []
    return ready


def raise_lost(rank: int, what: str) -> None:
    raise CollectiveError(f"rank {rank} was lost: {what}", lost_rank=rank)
