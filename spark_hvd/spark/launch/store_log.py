"""Rank output and failures through the store, for clients the executors cannot reach.

A Spark Connect client (a laptop on Databricks Connect, a notebook on shared compute) is not
reachable from the executors, so ``run()`` cannot serve a socket there. Instead every task
appends its frames (the same JSON frames :mod:`._log_stream` sends) to numbered chunk files in a
directory of the job's store, and the client polls that directory. Each chunk is sealed with an
HMAC of the job secret and its name, so the client reads nothing a stranger wrote, and replaces
nothing: a later chunk has a later number.
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
import threading
import time
from typing import Any, Dict, List, Optional, TextIO

from spark_hvd.runtime.seal import seal, unseal

from spark_hvd.spark.launch.log_stream import write_output

__all__ = ["STORE_CONTEXT", "StoreLogSender", "StoreLogCollector", "FLUSH_INTERVAL_S"]

log = logging.getLogger("spark_hvd.spark")

FLUSH_INTERVAL_S = 0.25
"""How often a task writes its buffered output, and the client looks for new chunks."""

STORE_CONTEXT = b"spark-hvd/1 store frames"
"""Seal context of what a job writes to its store: output chunks, results, elastic state."""
_CHUNK = re.compile(r"^r(\d+)-(\d{8})\.json$")


class StoreLogSender:
    """Task side: buffers this rank's frames and writes them as sealed chunks every
    :data:`FLUSH_INTERVAL_S`; failures, the finish and the close are written at once."""

    def __init__(self, store: Any, directory: str, secret: str, rank: int) -> None:
        self.rank = rank
        self.problem = ""
        self._store = store
        self._directory = directory
        self._secret = secret
        self._pending: List[Dict[str, Any]] = []
        self._seq = 0
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._flush_loop, name="spark-hvd-store-log", daemon=True)
        self._thread.start()

    @property
    def connected(self) -> bool:
        return not self.problem

    def _flush_loop(self) -> None:
        while not self._closed.wait(FLUSH_INTERVAL_S):
            self.flush()

    def flush(self) -> bool:
        """Write what is buffered as the next chunk; False when the store refused it."""
        with self._lock:
            if not self._pending or self.problem:
                return not self.problem
            name = f"r{self.rank}-{self._seq:08d}.json"
            data = json.dumps(self._pending).encode()
            try:
                self._store.write(posixpath.join(self._directory, name), seal(self._secret, STORE_CONTEXT, name, data))
            except Exception as exc:  # any store error: keep output in the executor log instead
                self.problem = f"cannot write output to the store at {self._directory}: {exc}"
                return False
            self._pending = []
            self._seq += 1
            return True

    def _add(self, frame: Dict[str, Any], now: bool = False) -> bool:
        with self._lock:
            if self.problem:
                return False
            self._pending.append(frame)
        return self.flush() if now else True

    def line(self, stream: str, text: str) -> bool:
        """Queue one line of output; False when the store cannot be written."""
        return self._add({"stream": stream, "text": text})

    def failure(self, details: Dict[str, Any]) -> bool:
        """Report this rank's failure (type, message, traceback, output tail)."""
        return self._add({"error": details}, now=True)

    def finished(self) -> bool:
        """Report that this rank's function returned."""
        return self._add({"finished": True}, now=True)

    def close(self) -> None:
        """Write what is left and a final frame, so the client knows nothing more will come."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._add({"closed": True}, now=True)


class StoreLogCollector:
    """Client side: polls the job's directory in the store, prints lines, keeps failures.

    Offers what ``run()`` uses of :class:`._log_stream.LogCollector`: ``failures``,
    ``finished``, :meth:`wait_failure`, :meth:`wait_closed`, :meth:`close`.
    """

    def __init__(self, store: Any, directory: str, secret: str, stdout: TextIO, stderr: TextIO,
                 verbose: int = 1) -> None:
        self.address = directory
        self._store = store
        self._directory = directory
        self._secret = secret
        self._files = {"stdout": stdout, "stderr": stderr}
        self._verbose = verbose
        self._next: Dict[int, int] = {}
        self._closed_ranks: set = set()
        self._cond = threading.Condition()
        self.failures: List[Dict[str, Any]] = []
        self.finished: Dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll_loop, name="spark-hvd-store-log-reader", daemon=True)
        self._thread.start()

    def _poll_loop(self) -> None:
        while not self._stop.wait(FLUSH_INTERVAL_S):
            self.poll()

    def poll(self) -> None:
        """Read and act on every chunk that arrived since the last call, in order per rank."""
        try:
            names = self._store.listdir(self._directory) if self._store.exists(self._directory) else []
        except Exception as exc:  # a flaky listing is retried on the next poll
            log.debug("store log: cannot list %s: %s", self._directory, exc)
            return
        found: Dict[int, set] = {}
        for name in names:
            match = _CHUNK.match(name)
            if match:
                found.setdefault(int(match.group(1)), set()).add(int(match.group(2)))
        for rank, seqs in sorted(found.items()):
            while self._next.get(rank, 0) in seqs:
                seq = self._next.get(rank, 0)
                self._next[rank] = seq + 1
                self._read_chunk(rank, f"r{rank}-{seq:08d}.json")

    def _read_chunk(self, rank: int, name: str) -> None:
        try:
            data = unseal(self._secret, STORE_CONTEXT, name, self._store.read(posixpath.join(self._directory, name)))
            frames = json.loads(data)
        except (OSError, PermissionError, ValueError) as exc:
            log.warning("store log: ignored chunk %s: %s", name, exc)
            return
        for frame in frames if isinstance(frames, list) else []:
            if isinstance(frame, dict):
                self._handle(rank, frame)

    def _handle(self, rank: int, frame: Dict[str, Any]) -> None:
        with self._cond:
            if "error" in frame and isinstance(frame["error"], dict):
                self.failures.append(dict(frame["error"], rank=rank, received=time.monotonic()))
            elif frame.get("finished"):
                self.finished.setdefault(rank, time.monotonic())
            elif frame.get("closed"):
                self._closed_ranks.add(rank)
            self._cond.notify_all()
        if "stream" in frame and self._verbose > 0:
            write_output(self._files, rank, frame)

    def wait_failure(self, timeout: float) -> Optional[Dict[str, Any]]:
        """The first failure reported, waiting up to ``timeout`` seconds for one to arrive."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            with self._cond:
                if self.failures:
                    return min(self.failures, key=lambda f: f["received"])
            if time.monotonic() >= deadline:
                return None
            time.sleep(FLUSH_INTERVAL_S)

    def wait_closed(self, connections: int, timeout: float) -> bool:
        """Wait until ``connections`` ranks have written their final frame; True when they all have."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            with self._cond:
                if len(self._closed_ranks) >= connections:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(FLUSH_INTERVAL_S / 2)

    def close(self) -> None:
        """Stop polling, print what already arrived, and remove the job's directory."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.poll()
        try:
            self._store.delete(self._directory)
        except Exception as exc:  # leftover output files are harmless
            log.debug("store log: cannot remove %s: %s", self._directory, exc)
