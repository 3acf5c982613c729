"""HorovodRunner: Databricks' former entry point (``sparkdl.HorovodRunner``), on spark-hvd.

``HorovodRunner(np=2).run(main, **kwargs)`` calls ``main(**kwargs)`` in ``np`` processes that form
one job (``main`` calls ``hvd.init()`` itself, as it did under HorovodRunner) and returns rank 0's
return value: with ``np > 0`` on that many Spark barrier tasks, with ``np < 0`` as ``-np`` local
processes on the driver (for trying a program on a small machine). Output streams to the driver,
a notebook cell included.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, List

__all__ = ["HorovodRunner"]

_VERBOSITIES = ("all", "log_callback_only")


class _RankZeroOnly:
    """The driver's stdout, passed only rank 0's lines (``driver_log_verbosity='log_callback_only'``)."""

    def __init__(self, out: Any) -> None:
        self._out = out
        self._pending = ""

    def write(self, text: str) -> int:
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            if line.startswith("[0]"):
                self._out.write(line + "\n")
        self._out.flush()
        return len(text)

    def flush(self) -> None:
        self._out.flush()


class HorovodRunner:
    """Runs a Horovod-style training function on ``np`` processes, as ``sparkdl.HorovodRunner`` did.

    ``np > 0``: ``np`` Spark barrier tasks (the cluster must have that many free task slots, or the
    call fails at once naming both numbers); ``np < 0``: ``-np`` processes on the driver.
    ``driver_log_verbosity``: ``'all'`` streams every rank's output to the driver; ``'log_callback_only'``
    (HorovodRunner's default) streams rank 0's, which is where Keras's progress and the metric
    callbacks print.
    """

    def __init__(self, np: int, driver_log_verbosity: str = "log_callback_only") -> None:
        if isinstance(np, bool) or not isinstance(np, int) or np == 0:
            raise ValueError(f"np={np!r} is not valid: expected a positive number of Spark tasks, or a negative one "
                             "for -np processes on the driver; pass e.g. HorovodRunner(np=2)")
        if driver_log_verbosity not in _VERBOSITIES:
            raise ValueError(f"driver_log_verbosity={driver_log_verbosity!r} is not valid: expected one of "
                             f"{', '.join(repr(v) for v in _VERBOSITIES)}")
        self.num_processor = np
        self.driver_log_verbosity = driver_log_verbosity

    def run(self, main: Callable[..., Any], **kwargs: Any) -> Any:
        """``main(**kwargs)`` on every process; rank 0's return value (exceptions of a rank are raised
        as ``RankFailedError`` naming it)."""
        if not callable(main):
            raise TypeError(f"main must be callable, got {type(main).__name__}")
        out = sys.stdout if self.driver_log_verbosity == "all" else _RankZeroOnly(sys.stdout)
        results: List[Any]
        if self.num_processor < 0:
            import contextlib

            from spark_hvd.runner import run as run_local

            with contextlib.redirect_stdout(out):  # the local launcher prints the ranks' lines to sys.stdout
                results = run_local(main, kwargs=kwargs, np=-self.num_processor)
        else:
            from spark_hvd.spark.launch.barrier import run

            results = run(main, kwargs=kwargs, num_proc=self.num_processor, stdout=out)
        return results[0]

    def __repr__(self) -> str:
        return f"HorovodRunner(np={self.num_processor}, driver_log_verbosity={self.driver_log_verbosity!r})"

