"""Handles and entries: what a caller holds for an asynchronous request, the engine's record of it, and
the book of a rank's requests between submission and answer."""

from __future__ import annotations

import copy
import threading
import time
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Protocol, Tuple

import numpy as np

from .messages import Meta

__all__ = ["Handle", "Then", "Entry", "RequestBook", "Driver"]


class Driver(Protocol):
    """What a handle needs of the engine that answers it (the engine is one): a nudge when its
    caller polls, and progress on the caller's thread while it waits."""

    def nudge(self) -> None: ...

    def drive(self, handle: "Handle", deadline: Optional[float] = None) -> None: ...


class Handle:
    """An asynchronous operation's handle: ``done()`` polls, ``wait()`` blocks for the result."""

    __slots__ = ("name", "_gate", "_done", "_results", "_remaining", "_error", "_single", "_engine")

    def __init__(self, name: str, parts: int = 1, single: bool = True, engine: Optional[Driver] = None) -> None:
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

    @classmethod
    def completed(cls, name: str, result: Any) -> "Handle":
        """A handle whose operation is already done with ``result`` (nothing ever waits on its gate)."""
        handle = cls.__new__(cls)
        handle.name = name
        handle._engine = None
        handle._gate = None
        handle._done = True
        handle._results = [result]
        handle._remaining = 0
        handle._error = None
        handle._single = True
        return handle

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


class Then(Handle):
    """An operation built on another: finished with ``then(result)`` once ``inner`` has finished
    (computed by whichever caller first sees it done, once)."""

    __slots__ = ("_inner", "_then", "_settling")

    def __init__(self, name: str, inner: Handle, then: Any) -> None:
        super().__init__(name)
        self._inner, self._then = inner, then
        self._settling = threading.Lock()

    def _settle(self, timeout: Optional[float]) -> None:
        with self._settling:
            if self._done:
                return
            try:
                value = self._inner.wait(timeout)
            except TimeoutError:
                raise
            except BaseException as exc:  # the inner operation's failure is this one's
                self._fail(exc)
                return
            try:
                self._set(0, self._then(value))
            except BaseException as exc:
                self._fail(exc)

    def done(self) -> bool:
        if not self._done and self._inner.done():
            self._settle(0.0)
        return self._done

    def wait(self, timeout: Optional[float] = None) -> Any:
        self._settle(timeout)
        return super().wait(0.0)


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


class RequestBook:
    """This rank's requests between submission and answer.

    ``queue`` holds requests submitted and not yet announced, ``local`` those announced and not yet
    answered (by (process set, name)), ``in_flight`` every one not finished, which callers read
    to refuse a second request of the same name. Only single dict and deque operations touch
    ``in_flight`` and ``queue`` (atomic in CPython), so callers and the engine thread never wait on
    each other for them.
    """

    def __init__(self) -> None:
        self.queue: Deque[Entry] = deque()
        self.local: Dict[Tuple[int, str], Entry] = {}
        self.in_flight: Dict[Tuple[int, str], Entry] = {}

    def take_new(self) -> List[Entry]:
        """The queued requests, now announced: they move to ``local``."""
        new = []
        while self.queue:
            entry = self.queue.popleft()
            self.local[(entry.meta.ps, entry.name)] = entry
            new.append(entry)
        return new

    def complete(self, entry: Entry, value: Any) -> None:
        self.in_flight.pop((entry.meta.ps, entry.name), None)  # before the caller can see the result
        entry.handle._set(entry.index, value)

    def fail(self, entry: Entry, error: BaseException) -> None:
        self.in_flight.pop((entry.meta.ps, entry.name), None)
        entry.handle._fail(error)

    def fail_all(self, error: BaseException) -> None:
        """Fail every request not yet answered."""
        while self.queue:
            self.fail(self.queue.popleft(), error)
        for entry in list(self.local.values()):
            self.fail(entry, error)
        self.local.clear()
