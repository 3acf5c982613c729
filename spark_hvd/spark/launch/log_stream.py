"""The stream of rank output and failures from Spark tasks to the driver of ``run()``.

The driver serves a :class:`LogCollector` on its own address; every task connects a
:class:`LogSender`, proves knowledge of the job secret, and sends JSON frames: one per output line
(``{"rank", "stream", "text"}``) and one per failure (``{"rank", "error": {...}}``). Frames are read
only after authentication and are never unpickled. The collector is one thread around one selector:
handshakes run concurrently through the runtime's acceptor, so strangers neither delay the tasks
nor cost a thread each.
"""

from __future__ import annotations

import json
import logging
import selectors
import socket
import threading
import time
from typing import Any, Dict, List, Mapping, Optional, TextIO

from spark_hvd.runtime.acceptor import Accepted, ServerLoop
from spark_hvd.runtime.errors import AuthenticationError
from spark_hvd.runtime.wire import FrameReader, connect, listen, secret_bytes, send_frame

__all__ = ["LogCollector", "LogSender", "format_line", "write_output", "FRAME_LIMIT"]

log = logging.getLogger("spark_hvd.spark")

# A failure report carries a traceback, the last 100 lines of output and the pickled exception;
# larger frames mean a corrupt stream (senders shorten what would not fit, see _shortened).
FRAME_LIMIT = 64 << 20
# Characters kept of one over-long field: JSON escapes a character into 12 bytes at most, so even
# the three long fields of a failure report stay well inside FRAME_LIMIT.
_FIELD_CHARS = FRAME_LIMIT // 64


def format_line(rank: int, stream: str, text: str) -> str:
    """A rank's output line as the driver prints it: ``[1]<stdout>:text``."""
    return f"[{rank}]<{stream}>:{text}"


def write_output(files: Mapping[str, TextIO], rank: int, frame: Mapping[str, Any]) -> None:
    """Print the output line of one frame of ``rank`` (``stream``, ``text``) to ``files['stdout']``
    or ``files['stderr']``; a closed or broken output file is passed over, as it must not stop the job."""
    stream = "stderr" if frame.get("stream") == "stderr" else "stdout"
    out = files[stream]
    try:
        out.write(format_line(rank, stream, str(frame.get("text", ""))) + "\n")
        out.flush()
    except (OSError, ValueError):
        pass


class LogCollector(ServerLoop):
    """Driver side: accept authenticated task connections, print their lines, keep their failures.

    ``verbose=0`` keeps failures but prints nothing. ``stdout``/``stderr`` receive the lines of the
    ranks' stdout and stderr.
    """

    def __init__(self, bind_host: str, advertised_host: str, secret: str, stdout: TextIO, stderr: TextIO,
                 verbose: int = 1) -> None:
        key = secret_bytes(secret)
        super().__init__(listen(bind_host, 0), key, what="log collector", thread_name="spark-hvd-log-collector")
        self.address = f"{advertised_host}:{self._listener.getsockname()[1]}"
        self._files = {"stdout": stdout, "stderr": stderr}
        self._verbose = verbose
        self._cond = threading.Condition()
        self._open = 0
        self._closed_connections = 0
        self._readers: Dict[socket.socket, FrameReader] = {}
        self.failures: List[Dict[str, Any]] = []
        self.finished: Dict[int, float] = {}  # rank -> when its function's return was reported
        self._start()

    def _shut_down(self) -> None:
        for sock in list(self._readers):
            self._read(sock, 0)  # what already arrived is still printed
            self._drop(sock)

    def _on_handler_error(self, fileobj: object) -> None:
        self._drop(fileobj)  # type: ignore[arg-type]

    def _on_accepted(self, accepted: Accepted) -> None:
        self._readers[accepted.sock] = FrameReader(accepted.sock, FRAME_LIMIT, what=f"task {accepted.peer}")
        self._selector.register(accepted.sock, selectors.EVENT_READ, self._read)
        with self._cond:
            self._open += 1

    def _read(self, sock: socket.socket, _events: int) -> None:
        reader = self._readers.get(sock)
        if reader is None:
            return
        reader.pump()
        while reader.frames:
            try:
                frame = json.loads(reader.frames.popleft())
                self._handle(frame)
            except (ValueError, TypeError, AttributeError) as exc:
                log.warning("log collector: ignored a malformed frame: %s", exc)
        if reader.closed:
            self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        if self._readers.pop(sock, None) is None:
            return
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()
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
        if frame.get("finished"):
            with self._cond:
                self.finished.setdefault(rank, time.monotonic())
            return
        if self._verbose > 0:
            write_output(self._files, rank, frame)

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


def _shortened(frame: Dict[str, Any]) -> Dict[str, Any]:
    """``frame`` with its long text fields cut so that it fits in FRAME_LIMIT."""
    def cut(text: Any, keep_end: bool) -> Any:
        if not isinstance(text, str) or len(text) <= _FIELD_CHARS:
            return text
        note = f" [... {len(text) - _FIELD_CHARS} characters cut ...] "
        return note + text[-_FIELD_CHARS:] if keep_end else text[:_FIELD_CHARS] + note

    short = dict(frame, text=cut(frame["text"], False)) if "text" in frame else dict(frame)
    if isinstance(frame.get("error"), dict):
        # Tracebacks and output end with what matters most; a cut pickle would be useless.
        error = {k: v if k == "exception" else cut(v, k in ("traceback", "output_tail"))
                 for k, v in frame["error"].items()}
        if len(json.dumps(error)) > FRAME_LIMIT // 2:
            error["exception"] = None  # the type, message and traceback still travel
        short["error"] = error
    return short


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
            payload = json.dumps(frame).encode()
            if len(payload) > FRAME_LIMIT:
                payload = json.dumps(_shortened(frame)).encode()
            try:
                send_frame(self._sock, payload)
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

    def finished(self) -> bool:
        """Report that this rank's function returned (the driver names a rank that left early)."""
        return self._send({"rank": self.rank, "finished": True})

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                try:
                    self._sock.close()
                finally:
                    self._sock = None
