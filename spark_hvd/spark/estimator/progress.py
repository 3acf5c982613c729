"""Live training progress: rank 0 prints structured lines, the driver turns them into output.

``run()`` streams every line a rank prints to the driver as ``[rank]<stream>:text``. Rank 0's
:class:`ProgressReporter` prints events as ``spark-hvd-progress {json}`` lines; the driver's
:class:`ProgressPrinter`, given to ``run()`` as its stdout, consumes those lines: it prints one
line per epoch (loss, metrics, rows per second) and drives a tqdm bar of the epoch's steps in
consoles and notebooks. Every other line passes through unchanged.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, TextIO

__all__ = ["PROGRESS_PREFIX", "ProgressReporter", "ProgressPrinter", "format_epoch"]

PROGRESS_PREFIX = "spark-hvd-progress "
"""Start of the text of every progress line."""

_LINE_HEAD = "[0]<stdout>:" + PROGRESS_PREFIX


class ProgressReporter:
    """Rank side: emits progress events on ``out`` (rank 0's stdout).

    ``enabled`` is False on the other ranks. Start and epoch events are always sent (the driver
    times fit() by them); step events, at most one per ``interval_s``, only with ``steps``.
    """

    def __init__(self, enabled: bool, steps: bool = True, interval_s: float = 0.5,
                 out: Optional[TextIO] = None) -> None:
        self.enabled = enabled
        self.steps = steps
        self.interval_s = interval_s
        self._out = out
        self._last_step = float("-inf")  # the first step is always due

    def _emit(self, event: Dict[str, Any]) -> None:
        out = self._out if self._out is not None else sys.stdout
        out.write(PROGRESS_PREFIX + json.dumps(event) + "\n")
        out.flush()

    def start(self, *, epochs: int, start_epoch: int, steps: int, val_steps: int, size: int,
              batch_size: int) -> None:
        """Training begins: the totals the driver needs for its bar."""
        if self.enabled:
            self._emit({"event": "start", "epochs": epochs, "start_epoch": start_epoch, "steps": steps,
                        "val_steps": val_steps, "size": size, "batch_size": batch_size, "t": time.time()})

    def due(self, force: bool = False) -> bool:
        """Whether :meth:`step` would report now: callers skip computing its values otherwise."""
        return self.enabled and bool(self.steps) and (force or time.monotonic() - self._last_step >= self.interval_s)

    def step(self, epoch: int, step: int, loss: float, force: bool = False) -> None:
        """Step ``step`` (from 1) of epoch ``epoch`` is done; ``loss`` is the epoch's running mean."""
        if not (self.enabled and self.steps):
            return
        now = time.monotonic()
        if force or now - self._last_step >= self.interval_s:
            self._last_step = now
            self._emit({"event": "step", "epoch": epoch, "step": step, "loss": loss})

    def epoch(self, epoch: int, logs: Mapping[str, float]) -> None:
        """Epoch ``epoch`` (from 0) is done; ``logs`` are its rank-averaged metrics."""
        if self.enabled:
            self._emit({"event": "epoch", "epoch": epoch, "logs": dict(logs), "t": time.time()})


def format_epoch(epoch: int, epochs: int, logs: Mapping[str, Any]) -> str:
    """``epoch 2/5: loss 0.1234, acc 0.9500, val_loss 0.1300, 52,000 rows/s, 1.2 s``."""
    parts = []
    for key, value in logs.items():
        if key in ("epoch", "rows_per_s", "seconds") or not isinstance(value, (int, float)):
            continue
        parts.append(f"{key} {value:.4f}")
    if "rows_per_s" in logs:
        parts.append(f"{logs['rows_per_s']:,.0f} rows/s")
    if "seconds" in logs:
        parts.append(f"{logs['seconds']:.1f} s")
    return f"epoch {epoch + 1}/{epochs}: " + ", ".join(parts)


def _tqdm_factory() -> Optional[Callable[..., Any]]:
    try:
        from tqdm.auto import tqdm
        from tqdm.notebook import tqdm_notebook
    except ImportError:  # the bar is a nicety: epoch lines still print
        return None
    in_notebook = issubclass(tqdm, tqdm_notebook)

    def make(**kwargs: Any) -> Any:
        # A notebook's stderr is no TTY, so leaving tqdm to decide would hide the widget there;
        # in a console the bar shows only on a terminal, keeping logs free of carriage returns.
        return tqdm(disable=False if in_notebook else None, **kwargs)

    return make


class _Stream:
    """A write-only text stream that hands complete lines to ``on_line``."""

    def __init__(self, on_line: Callable[[str], None]) -> None:
        self._on_line = on_line
        self._pending = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            *lines, self._pending = self._pending.split("\n")
        for line in lines:
            self._on_line(line)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


class ProgressPrinter:
    """Driver side: the ``stdout``/``stderr`` given to ``run()`` for a fit.

    ``verbose`` 0 prints nothing; 1 prints a line per epoch, a bar while it runs, and the ranks'
    other output; 2 also prints a line per progress step.
    """

    def __init__(self, verbose: int, out: Optional[TextIO] = None, err: Optional[TextIO] = None,
                 bar: bool = True) -> None:
        self.verbose = verbose
        self._out = out
        self._err = err
        self._make_bar = _tqdm_factory() if bar and verbose > 0 else None
        self._bar: Any = None
        self._bar_epoch = -1
        self._lock = threading.RLock()
        self.epochs = 0
        self.steps = 0
        self.started_at: Optional[float] = None
        """``time.monotonic()`` when rank 0 announced the start of training."""
        self.last_epoch_at: Optional[float] = None
        """``time.monotonic()`` when the last epoch's results arrived."""
        self.rank_started_at: Optional[float] = None
        """Rank 0's ``time.time()`` when training started."""
        self.rank_last_epoch_at: Optional[float] = None
        """Rank 0's ``time.time()`` when its last epoch ended."""
        self.epoch_logs: List[Dict[str, Any]] = []
        self.stdout = _Stream(self._on_stdout)
        self.stderr = _Stream(self._on_stderr)

    # -- outputs -------------------------------------------------------------------------------
    def _print(self, line: str, err: bool = False) -> None:
        if self.verbose <= 0:
            return
        stream = (self._err if err else self._out) or (sys.stderr if err else sys.stdout)
        if self._bar is not None:
            self._bar.write(line, file=stream)
        else:
            stream.write(line + "\n")
            stream.flush()

    def _on_stdout(self, line: str) -> None:
        if line.startswith(_LINE_HEAD):
            try:
                event = json.loads(line[len(_LINE_HEAD):])
            except ValueError:
                event = None
            if isinstance(event, dict):
                with self._lock:
                    self.handle(event)
                return
        with self._lock:
            self._print(line)

    def _on_stderr(self, line: str) -> None:
        with self._lock:
            self._print(line, err=True)

    def note(self, line: str) -> None:
        """Print one line of the driver's own (a retry report), closing any open bar first."""
        with self._lock:
            self._close_bar()
            self._print(line)

    # -- events --------------------------------------------------------------------------------
    def handle(self, event: Mapping[str, Any]) -> None:
        """Act on one progress event (as emitted by :class:`ProgressReporter`)."""
        kind = event.get("event")
        if kind == "start":
            self.started_at = time.monotonic()
            self.rank_started_at = event.get("t") if isinstance(event.get("t"), (int, float)) else None
            self.epochs = int(event.get("epochs", 0))
            self.steps = int(event.get("steps", 0))
        elif kind == "step":
            epoch, step = int(event["epoch"]), int(event["step"])
            self._update_bar(epoch, step, float(event.get("loss", float("nan"))))
            if self.verbose >= 2:
                self._print(f"epoch {epoch + 1}/{self.epochs} step {step}/{self.steps}: "
                            f"loss {float(event.get('loss', float('nan'))):.4f}")
        elif kind == "epoch":
            self.last_epoch_at = time.monotonic()
            self.rank_last_epoch_at = event.get("t") if isinstance(event.get("t"), (int, float)) else None
            logs = dict(event.get("logs", {}))
            self.epoch_logs.append(logs)
            self._close_bar()
            self._print(format_epoch(int(event["epoch"]), self.epochs, logs))

    def _update_bar(self, epoch: int, step: int, loss: float) -> None:
        if self._make_bar is None or self.verbose <= 0:
            return
        if self._bar is None or self._bar_epoch != epoch:
            self._close_bar()
            stream = self._err or sys.stderr
            self._bar = self._make_bar(total=self.steps, desc=f"epoch {epoch + 1}/{self.epochs}", unit="step",
                                       leave=False, file=stream, dynamic_ncols=True)
            self._bar_epoch = epoch
        self._bar.update(max(0, step - self._bar.n))
        self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
            self._bar_epoch = -1

    def close(self) -> None:
        """Close the bar, if one is open."""
        with self._lock:
            self._close_bar()
