"""Authenticated sockets: HMAC challenge-response with the job secret, then length-framed messages.

Nothing a peer sends is interpreted before it has proved knowledge of the secret; after that,
frames are plain bytes that callers decode. Every reader of frames has a size limit chosen for its
use, and memory grows only with the bytes that actually arrived, never with the size a header
announces.
"""

from __future__ import annotations

import errno
import hmac
import hashlib
import logging
import os
import socket
import struct
import time
from collections import deque
from typing import Deque, Optional, Tuple

from .errors import AuthenticationError, PeerUnreachableError

__all__ = [
    "SMALL_FRAME_LIMIT",
    "CONTROL_FRAME_LIMIT",
    "HANDSHAKE_ATTEMPTS",
    "secret_bytes",
    "ServerHandshake",
    "authenticate_client",
    "authenticate_server",
    "send_frame",
    "recv_frame",
    "recv_exact",
    "peer_name",
    "FrameReader",
    "connect",
    "listen",
    "tune_socket",
    "NETWORK_ERRNOS",
    "is_network_error",
    "describe_broken",
]

log = logging.getLogger("spark_hvd.wire")

_NONCE = 32
_DIGEST = 32
_HEADER = struct.Struct("!Q")
_CLIENT_TAG = b"spark-hvd/1 client"
_SERVER_TAG = b"spark-hvd/1 server"
_CHUNK = 1 << 20

# Start-up messages (a rank's hello, a rendezvous request, a line of output) are a few hundred bytes.
SMALL_FRAME_LIMIT = 1 << 20
# Negotiation messages between ranks and the coordinator: per request about 100-200 bytes of
# metadata (4 MiB for 20,000 tensors) plus, for small allreduces, eager payloads: at most
# SPARK_HVD_EAGER_THRESHOLD bytes (32 KiB by default) in one announcement, and in a response the
# results of the small requests it answers (a fused set of them at most 64 times the threshold).
# The limit exists to recognise a corrupt stream (eight random header bytes announce less than
# 256 MiB with a probability of 2**-36), not to ration trusted peers.
CONTROL_FRAME_LIMIT = 256 << 20
# A client whose handshake the server dropped (an overloaded server sheds the oldest half-open
# connections) tries again this many times in all before it reports an authentication failure.
HANDSHAKE_ATTEMPTS = 3
# One connection attempt waits at most this long for the peer's answer: a SYN lost while a link was
# down is retransmitted only after seconds that double each time, so a fresh attempt notices a path
# that came back sooner.
_ATTEMPT_TIMEOUT_S = 3.0

_PATH_ERRNOS = frozenset({errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN})
"""Errors of a network path that is gone: no route, no answer."""
_RESET_ERRNOS = frozenset({errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE, errno.ENETRESET})
"""Errors of a connection the other end (its host, or something on the way) cut off."""
NETWORK_ERRNOS = _PATH_ERRNOS | _RESET_ERRNOS | {errno.ECONNREFUSED, errno.EADDRNOTAVAIL}
"""Errors of the network rather than of the program: a peer's host or the path to it failed."""


def is_network_error(exc: BaseException) -> bool:
    """Whether ``exc`` says that the network failed (refused, no route, reset, timed out)."""
    return isinstance(exc, (socket.timeout, ConnectionError)) or (
        isinstance(exc, OSError) and exc.errno in NETWORK_ERRNOS)


def describe_broken(exc: OSError, what: str) -> str:
    """Why an established connection to ``what`` broke, in words that tell a lost network path from
    a process that ended."""
    if isinstance(exc, socket.timeout) or exc.errno in _PATH_ERRNOS:
        return (f"the network path to {what} was lost ({exc}): its host stopped answering within "
                "SPARK_HVD_PEER_TIMEOUT, so the host or its link is down")
    if exc.errno in _RESET_ERRNOS:
        return f"the connection to {what} was reset ({exc}): its process was killed or its host restarted"
    return f"the connection to {what} failed ({exc})"


def _unreachable(what: str, addr: object, timeout: float, last: Optional[BaseException]) -> str:
    code = getattr(last, "errno", None)
    if code == errno.ECONNREFUSED or (code == errno.ENOENT and isinstance(addr, str)):
        why = "nothing listened there (the process has not started or has exited)"
    elif isinstance(last, socket.timeout) or code in _PATH_ERRNOS or code is None:
        why = "the network path to its host is down (no route to it, or no answer)"
    else:
        why = "the connections were cut off"
    return (f"could not connect to {what} at {addr} within {timeout:.0f} s: {why} (last error: {last}); "
            "check that the host is up and reachable from this one (firewalls, SPARK_HVD_IFACE), or raise "
            "SPARK_HVD_START_TIMEOUT")


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


class _HandshakeDropped(AuthenticationError):
    """The server closed the connection before the handshake finished (no verdict on our proof)."""


class _HandshakeStalled(AuthenticationError):
    """The handshake got no answer in time, or its network path failed (no verdict on our proof)."""


class ServerHandshake:
    """The server's half of the handshake as bytes in and bytes out, for callers that multiplex.

    Send :attr:`challenge`, read exactly :attr:`REPLY_BYTES` from the client, and pass them to
    :meth:`answer`, which raises AuthenticationError unless the client knows the key and otherwise
    returns the bytes that prove to the client that this server knows it too.
    """

    REPLY_BYTES = _NONCE + _DIGEST

    def __init__(self, key: bytes) -> None:
        self._key = key
        self.challenge = os.urandom(_NONCE)

    def answer(self, reply: bytes, peer: str) -> bytes:
        if len(reply) != self.REPLY_BYTES:
            raise AuthenticationError(f"{peer} sent {len(reply)} handshake bytes; expected {self.REPLY_BYTES}")
        client_nonce, proof = reply[:_NONCE], reply[_NONCE:]
        if not hmac.compare_digest(proof, _digest(self._key, _CLIENT_TAG, self.challenge, client_nonce)):
            raise AuthenticationError(f"connection from {peer} did not prove knowledge of the job secret")
        return _digest(self._key, _SERVER_TAG, client_nonce, self.challenge)


def recv_exact(sock: socket.socket, nbytes: int, deadline: Optional[float] = None) -> bytes:
    """Read exactly ``nbytes`` from a blocking socket, or raise ConnectionError on EOF.

    The buffer grows with what arrives, so a large ``nbytes`` costs memory only once sent.
    """
    buf = bytearray()
    while len(buf) < nbytes:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise socket.timeout(f"timed out after reading {len(buf)} of {nbytes} bytes")
            sock.settimeout(remaining)
        chunk = sock.recv(min(nbytes - len(buf), _CHUNK))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {nbytes} bytes")
        buf += chunk
    return bytes(buf)


def authenticate_client(sock: socket.socket, key: bytes, timeout: float) -> None:
    """Prove knowledge of ``key`` to the server and check that the server knows it too."""
    deadline = time.monotonic() + timeout
    try:
        server_nonce = recv_exact(sock, _NONCE, deadline)
        client_nonce = os.urandom(_NONCE)
        sock.sendall(client_nonce + _digest(key, _CLIENT_TAG, server_nonce, client_nonce))
        answer = recv_exact(sock, _DIGEST, deadline)
    except (socket.timeout, TimeoutError) as exc:
        raise _HandshakeStalled(f"authentication handshake with {peer_name(sock)} got no answer: {exc}") from None
    except OSError as exc:
        if exc.errno in _PATH_ERRNOS:
            raise _HandshakeStalled(f"authentication handshake with {peer_name(sock)} failed: {exc}") from None
        raise _HandshakeDropped(f"authentication handshake with {peer_name(sock)} failed: {exc}") from None
    if not hmac.compare_digest(answer, _digest(key, _SERVER_TAG, client_nonce, server_nonce)):
        raise AuthenticationError(
            f"the server at {peer_name(sock)} does not know the job secret; is it another job's server?"
        )


def authenticate_server(sock: socket.socket, key: bytes, timeout: float) -> None:
    """Challenge a freshly accepted blocking connection; raise AuthenticationError unless it knows ``key``."""
    deadline = time.monotonic() + timeout
    handshake = ServerHandshake(key)
    peer = peer_name(sock)
    try:
        sock.sendall(handshake.challenge)
        reply = recv_exact(sock, handshake.REPLY_BYTES, deadline)
    except (OSError, ConnectionError) as exc:
        raise AuthenticationError(f"authentication handshake with {peer} failed: {exc}") from None
    sock.sendall(handshake.answer(reply, peer))


def peer_name(sock: socket.socket) -> str:
    """The remote address of ``sock`` for messages."""
    try:
        peer = sock.getpeername()
    except OSError:
        return "an unknown peer"
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "a local process"


def _oversize(length: int, limit: int, what: str) -> str:
    fix = ("; if a rank really sent that much, lower SPARK_HVD_EAGER_THRESHOLD so that negotiation messages "
           "carry less" if limit == CONTROL_FRAME_LIMIT else "")
    return (
        f"{what} announced a frame of {length} bytes, more than the {limit} bytes allowed there; the stream "
        f"is corrupt or the peer is not a spark-hvd process of this version, so the connection was closed{fix}"
    )


def send_frame(sock: socket.socket, payload: bytes, limit: Optional[int] = None) -> None:
    """Send one length-prefixed frame on a blocking socket; ValueError if it exceeds ``limit``."""
    if limit is not None and len(payload) > limit:
        raise ValueError(
            f"a message of {len(payload)} bytes is larger than the {limit} bytes its receiver accepts; "
            "send less at once"
        )
    if len(payload) < 65536:
        sock.sendall(_HEADER.pack(len(payload)) + payload)
    else:
        sock.sendall(_HEADER.pack(len(payload)))
        sock.sendall(payload)


def recv_frame(sock: socket.socket, deadline: Optional[float] = None, limit: int = SMALL_FRAME_LIMIT,
               what: str = "the peer") -> bytes:
    """Receive one length-prefixed frame from a blocking socket; ConnectionError if it exceeds ``limit``."""
    (length,) = _HEADER.unpack(recv_exact(sock, _HEADER.size, deadline))
    if length > limit:
        raise ConnectionError(_oversize(length, limit, what))
    return recv_exact(sock, length, deadline)


class FrameReader:
    """Non-blocking, buffered reader of length-prefixed frames from one socket.

    Complete frames collect in :attr:`frames`. A frame announced larger than ``limit`` marks the
    stream corrupt: :attr:`error` says so, :attr:`closed` becomes True and the connection is shut
    down (its owner still closes the socket). With ``exact`` the reader never takes a byte beyond the
    end of the current frame, so whoever reads the socket next finds the stream where it stopped.
    """

    def __init__(self, sock: socket.socket, limit: int = CONTROL_FRAME_LIMIT, exact: bool = False,
                 what: str = "a peer") -> None:
        self.sock = sock
        self.limit = limit
        self.exact = exact
        self.what = what
        self._buf = bytearray()
        self.frames: Deque[bytes] = deque()
        self.closed = False
        self.error: Optional[str] = None

    def pump(self) -> bool:
        """Read what is available without blocking; return False once the peer closed."""
        # A bounded number of reads per call, so one busy peer cannot starve the others of a loop.
        for _ in range(16):
            if self.closed or (self.exact and self.frames):
                break
            want = self._wanted() if self.exact else _CHUNK
            try:
                chunk = self.sock.recv(want, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                # Not a verdict on the stream: why the connection broke, for the owner's message.
                self.error = describe_broken(exc, self.what)
                self.closed = True
                break
            if not chunk:
                self.closed = True
                break
            self._buf += chunk
            self._split()
            if len(chunk) < want:
                break
        return not self.closed

    def _wanted(self) -> int:
        if len(self._buf) < _HEADER.size:
            return _HEADER.size - len(self._buf)
        (length,) = _HEADER.unpack_from(self._buf, 0)
        return min(_HEADER.size + length - len(self._buf), _CHUNK)

    def _split(self) -> None:
        buf = self._buf
        start = 0
        while len(buf) - start >= _HEADER.size:
            (length,) = _HEADER.unpack_from(buf, start)
            if length > self.limit:
                self._corrupt(_oversize(length, self.limit, self.what))
                return
            end = start + _HEADER.size + length
            if len(buf) < end:
                break
            self.frames.append(bytes(buf[start + _HEADER.size:end]))
            start = end
        if start:
            del buf[:start]

    def _corrupt(self, message: str) -> None:
        self.error = message
        self.closed = True
        self._buf = bytearray()
        log.error("%s", message)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


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
    """Connect (retrying until ``timeout``) and authenticate; ``addr`` is (host, port) or a unix name.

    Every network error (refused, no route, reset, timed out) is retried until the deadline, so a
    peer that starts late or a link that is down for a while delays start-up instead of failing it;
    then :class:`~.errors.PeerUnreachableError` (a RendezvousTimeout) says which it was.
    """
    deadline = time.monotonic() + timeout
    delay = 0.01
    last: Optional[BaseException] = None
    dropped = 0
    host = addr if isinstance(addr, str) else addr[0]
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PeerUnreachableError(_unreachable(what, addr, timeout, last), host=None if isinstance(addr, str)
                                       else host)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) if isinstance(addr, str) else None
        try:
            if sock is not None:
                sock.settimeout(min(remaining, _ATTEMPT_TIMEOUT_S))
                sock.connect(addr)
            else:
                sock = socket.create_connection(addr, timeout=min(remaining, _ATTEMPT_TIMEOUT_S))  # type: ignore[arg-type]
        except OSError as exc:
            if sock is not None:
                sock.close()
            transient_name = isinstance(exc, socket.gaierror) and exc.errno == socket.EAI_AGAIN
            if not (is_network_error(exc) or transient_name or exc.errno in (errno.ENOENT, None)):
                raise
            if last is None or getattr(last, "errno", None) != exc.errno:
                log.info("connecting to %s at %s failed (%s); trying again until the start timeout", what, addr, exc)
            last = exc
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)
            continue
        try:
            authenticate_client(sock, key, max(0.1, deadline - time.monotonic()))
        except _HandshakeStalled as exc:
            sock.close()
            last = exc
            continue
        except _HandshakeDropped as exc:
            sock.close()
            dropped += 1
            if dropped >= HANDSHAKE_ATTEMPTS or time.monotonic() >= deadline:
                raise AuthenticationError(
                    f"{what} at {addr} closed the connection during the authentication handshake "
                    f"{dropped} times (last: {exc}); it does not know this job's secret (SPARK_HVD_SECRET), "
                    "or it is not a spark-hvd server"
                ) from None
            last = exc
            continue
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        return sock
