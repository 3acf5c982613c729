"""Handles and entries: what a caller holds for an asynchronous request, and the engine's record of it."""

from __future__ import annotations

import copy
import threading
import time
from typing import TYPE_CHECKING, Any, List, Optional

import numpy as np

from .messages import Meta

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine

__all__ = ["Handle", "Entry"]


class Handle:
    """An asynchronous operation's handle: ``done()`` polls, ``wait()`` blocks for the result."""

    __slots__ = ("name", "_gate", "_done", "_results", "_remaining", "_error", "_single", "_engine")

    def __init__(self, name: str, parts: int = 1, single: bool = True, engine: Optional["Engine"] = None) -> None:
        self.name = name
        self._engine = engine
        # A held lock is the cheapest thing to block on; completion releases it.
        self._gate = threading.Lock()
        self._gate.acquire()
        self._done = False
        self._results: List[Any] = [None] * parts
        self._remaining = parts
        self._error: Optional[BaseException] = None
        self._single = single

    def done(self) -> bool:
        if not self._done and self._engine is not None:
            self._engine.nudge()
        return self._done

    def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._gate.release()
        except RuntimeError:  # finished concurrently by a failure on another thread
            pass

    def _set(self, index: int, value: Any) -> None:
        self._results[index] = value
        self._remaining -= 1
        if self._remaining <= 0:
            self._finish()

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._finish()

    def wait(self, timeout: Optional[float] = None) -> Any:
        if not self._done and self._engine is not None:
            start = time.perf_counter()
            self._engine.drive(self, None if timeout is None else start + timeout)
            if timeout is not None:
                timeout = max(0.0, timeout - (time.perf_counter() - start))
        if not self._done:
            if not self._gate.acquire(timeout=-1 if timeout is None else timeout):
                raise TimeoutError(
                    f"operation {self.name!r} did not complete within {timeout} s; other ranks may not have "
                    "submitted it yet (the stall warning names them)"
                )
            self._gate.release()  # let any other waiter through
        if self._error is not None:
            error = copy.copy(self._error)
            raise error.with_traceback(None)
        return self._results[0] if self._single else list(self._results)


class Entry:
    """One local request: its name, metadata, arrays and where its result goes."""

    __slots__ = ("name", "meta", "array", "out", "handle", "index", "submitted", "responded")

    def __init__(self, name: str, meta: Meta, array: Optional[np.ndarray], out: Optional[np.ndarray],
                 handle: Handle, index: int = 0) -> None:
        self.name = name
        self.meta = meta
        self.array = array
        self.out = out
        self.handle = handle
        self.index = index
        self.submitted = 0.0
        self.responded = 0.0
