"""The stream of rank output and failures from Spark tasks to the driver of ``run()``.

The driver serves a :class:`LogCollector` on its own address; every task connects a
:class:`LogSender`, proves knowledge of the job secret, and sends JSON frames: one per output line
(``{"rank", "stream", "text"}``) and one per failure (``{"rank", "error": {...}}``). Frames are read
only after authentication and are never unpickled.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from typing import Any, Dict, List, Optional, TextIO

from spark_hvd.runtime.errors import AuthenticationError
from spark_hvd.runtime.wire import authenticate_server, connect, listen, recv_frame, secret_bytes, send_frame

__all__ = ["LogCollector", "LogSender", "format_line"]

log = logging.getLogger("spark_hvd.spark")

_AUTH_TIMEOUT_S = 10.0


def format_line(rank: int, stream: str, text: str) -> str:
    """A rank's output line as the driver prints it: ``[1]<stdout>:text``."""
    return f"[{rank}]<{stream}>:{text}"


class LogCollector:
    """Driver side: accept authenticated task connections, print their lines, keep their failures.

    ``verbose=0`` keeps failures but prints nothing. ``stdout``/``stderr`` receive the lines of the
    ranks' stdout and stderr.
    """

    def __init__(self, bind_host: str, advertised_host: str, secret: str, stdout: TextIO, stderr: TextIO,
                 verbose: int = 1) -> None:
        self._key = secret_bytes(secret)
        self._sock = listen(bind_host, 0)
        self.address = f"{advertised_host}:{self._sock.getsockname()[1]}"
        self._files = {"stdout": stdout, "stderr": stderr}
        self._verbose = verbose
        self._print_lock = threading.Lock()
        self._cond = threading.Condition()
        self._open = 0
        self._closed_connections = 0
        self._conns: List[socket.socket] = []
        self.failures: List[Dict[str, Any]] = []
        self._stopping = False
        self._acceptor = threading.Thread(target=self._accept_loop, name="spark-hvd-log-collector", daemon=True)
        self._acceptor.start()

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="spark-hvd-log-reader", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            authenticate_server(conn, self._key, _AUTH_TIMEOUT_S)
        except AuthenticationError as exc:
            log.warning("log collector: rejected a connection: %s", exc)
            conn.close()
            return
        conn.settimeout(None)
        with self._cond:
            self._open += 1
            self._conns.append(conn)
        try:
            while True:
                try:
                    frame = json.loads(recv_frame(conn))
                except (ConnectionError, OSError, ValueError):
                    return
                self._handle(frame)
        finally:
            conn.close()
            with self._cond:
                self._open -= 1
                self._closed_connections += 1
                self._cond.notify_all()

    def _handle(self, frame: Dict[str, Any]) -> None:
        rank = int(frame.get("rank", -1))
        if "error" in frame:
            with self._cond:
                self.failures.append(dict(frame["error"], rank=rank, received=time.monotonic()))
                self._cond.notify_all()
            return
        stream = "stderr" if frame.get("stream") == "stderr" else "stdout"
        if self._verbose <= 0:
            return
        out = self._files[stream]
        with self._print_lock:
            try:
                out.write(format_line(rank, stream, str(frame.get("text", ""))) + "\n")
                out.flush()
            except (OSError, ValueError):
                pass  # a closed or broken output file must not stop the job

    def wait_closed(self, connections: int, timeout: float) -> bool:
        """Wait until ``connections`` task connections have closed; True when they all have."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._closed_connections < connections:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def wait_failure(self, timeout: float) -> Optional[Dict[str, Any]]:
        """The first failure reported, waiting up to ``timeout`` seconds for one to arrive."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self.failures:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self._open == 0 and self._closed_connections > 0):
                    break
                self._cond.wait(min(remaining, 0.1))
            return min(self.failures, key=lambda f: f["received"]) if self.failures else None

    def close(self) -> None:
        self._stopping = True
        try:
            self._sock.close()
        except OSError:
            pass
        with self._cond:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class LogSender:
    """Task side: one authenticated connection to the driver's :class:`LogCollector`.

    A driver that cannot be reached is not fatal: :attr:`connected` is False and callers keep
    the output in the executor's log instead.
    """

    def __init__(self, address: str, secret: str, rank: int, timeout: float) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        self.problem = ""
        host, _, port = address.rpartition(":")
        try:
            self._sock = connect((host.strip("[]"), int(port)), secret_bytes(secret), timeout,
                                 "the driver's log collector")
        except (OSError, TimeoutError, AuthenticationError) as exc:
            self.problem = str(exc)

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def _send(self, frame: Dict[str, Any]) -> bool:
        with self._lock:
            if self._sock is None:
                return False
            try:
                send_frame(self._sock, json.dumps(frame).encode())
                return True
            except OSError as exc:
                self.problem = f"lost the connection to the driver's log collector: {exc}"
                self._sock.close()
                self._sock = None
                return False

    def line(self, stream: str, text: str) -> bool:
        """Send one line of output; False when it could not be sent."""
        return self._send({"rank": self.rank, "stream": stream, "text": text})

    def failure(self, details: Dict[str, str]) -> bool:
        """Report this rank's failure (type, message, traceback, output tail)."""
        return self._send({"rank": self.rank, "error": details})

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                try:
                    self._sock.close()
                finally:
                    self._sock = None
