"""A Chrome-trace timeline (opens in Perfetto and chrome://tracing) of each tensor's phases."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Dict, IO, List, Optional

__all__ = ["Timeline", "TimelineSlot", "NEGOTIATE", "QUEUE", "MEMCPY_IN", "REDUCE", "MEMCPY_OUT", "COMMUNICATE"]

NEGOTIATE = "NEGOTIATE"
QUEUE = "QUEUE"
MEMCPY_IN = "MEMCPY_IN_FUSION_BUFFER"
REDUCE = "REDUCE"
COMMUNICATE = "COMMUNICATE"
MEMCPY_OUT = "MEMCPY_OUT_FUSION_BUFFER"


class Timeline:
    """Writes complete ("X") events, one trace process per tensor name, to a JSON array file.

    The file is a valid JSON document once :meth:`close` has run; until then it is a prefix that
    Chrome's viewer also accepts.
    """

    def __init__(self, path: str, mark_cycles: bool = False) -> None:
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise ValueError(f"timeline path {path!r}: directory {directory!r} does not exist; create it first")
        self.path = path
        self.mark_cycles = mark_cycles
        self._file: Optional[IO[str]] = open(path, "w", encoding="utf-8")
        self._file.write("[\n")
        self._first = True
        self._pids: Dict[str, int] = {}
        self._lock = threading.Lock()
        self._pending: List[str] = []
        self._last_flush = time.monotonic()

    @staticmethod
    def now_us() -> float:
        return time.perf_counter() * 1e6

    def _pid(self, name: str) -> int:
        pid = self._pids.get(name)
        if pid is None:
            pid = len(self._pids) + 1
            self._pids[name] = pid
            self._emit({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
            self._emit({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        return pid

    def _emit(self, event: dict) -> None:
        self._pending.append(json.dumps(event, separators=(",", ":")))

    def span(self, tensor: str, phase: str, start_us: float, end_us: float, args: Optional[dict] = None) -> None:
        with self._lock:
            if self._file is None:
                return
            event = {"name": phase, "ph": "X", "pid": self._pid(tensor), "tid": 0,
                     "ts": round(start_us, 3), "dur": round(max(0.0, end_us - start_us), 3)}
            if args:
                event["args"] = args
            self._emit(event)
            self._maybe_flush()

    def cycle(self, ts_us: float) -> None:
        if not self.mark_cycles:
            return
        with self._lock:
            if self._file is None:
                return
            self._emit({"name": "CYCLE_START", "ph": "i", "s": "g", "pid": 0, "tid": 0, "ts": round(ts_us, 3)})
            self._maybe_flush()

    def _maybe_flush(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self._pending or (not force and len(self._pending) < 256 and now - self._last_flush < 1.0):
            return
        assert self._file is not None
        text = ",\n".join(self._pending)
        self._file.write(text if self._first else ",\n" + text)
        self._first = False
        self._pending.clear()
        self._file.flush()
        self._last_flush = now

    def close(self) -> None:
        with self._lock:
            if self._file is None:
                return
            self._maybe_flush(force=True)
            self._file.write("\n]\n")
            self._file.close()
            self._file = None


class TimelineSlot:
    """The timeline a rank writes now, if any: started and stopped while collectives run."""

    def __init__(self) -> None:
        self.current: Optional[Timeline] = None
        self._lock = threading.Lock()

    def start(self, path: str, mark_cycles: bool = False) -> None:
        """Write a new timeline to ``path`` (closing the one before)."""
        with self._lock:
            if self.current is not None:
                self.current.close()
            self.current = Timeline(path, mark_cycles)

    def stop(self) -> None:
        with self._lock:
            if self.current is not None:
                self.current.close()
                self.current = None
