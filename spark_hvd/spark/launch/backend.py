"""Backends: what runs the estimators' training function on its ranks (Horovod's ``backend`` Param).

:class:`SparkBackend` is :func:`spark_hvd.spark.run` with its settings kept: the number of
processes, their environment, output streams and ``run()``'s other options. An estimator given
``backend=SparkBackend(num_proc=4, env={...})`` trains on 4 ranks with that environment.
"""

from __future__ import annotations

import contextlib
import contextvars
from abc import ABC, abstractmethod
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, TextIO

__all__ = ["Backend", "SparkBackend", "run_options"]

_RUN_OPTIONS: "contextvars.ContextVar[Dict[str, Any]]" = contextvars.ContextVar("spark_hvd_run_options", default={})


@contextlib.contextmanager
def run_options(**options: Any) -> Iterator[None]:
    """Within the block, :meth:`SparkBackend.run` passes ``options`` on to
    :func:`spark_hvd.spark.run` too (over the backend's own). The estimators call a backend with
    Horovod's arguments only (``run(fn, args=..., env=...)``), as a backend written for Horovod
    expects, and hand their other settings (output streams, store, session, preload) over this way."""
    token = _RUN_OPTIONS.set(dict(options))
    try:
        yield
    finally:
        _RUN_OPTIONS.reset(token)


class Backend(ABC):
    """Runs a function on every rank of a job."""

    @abstractmethod
    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[Mapping[str, Any]] = None,
            env: Optional[Mapping[str, str]] = None, **options: Any) -> List[Any]:
        """``fn(*args, **kwargs)`` on every rank with ``env`` added to theirs; every result, in rank order."""

    @abstractmethod
    def num_processes(self) -> int:
        """How many ranks :meth:`run` starts."""


class SparkBackend(Backend):
    """Runs functions on Spark barrier tasks with :func:`spark_hvd.spark.run`.

    The arguments are Horovod's: ``num_proc`` (default: the active session's default
    parallelism), ``env`` for every rank, ``stdout``/``stderr`` where the ranks' output goes,
    ``prefix_output_with_timestamp``, ``verbose``, ``nics``; any other ``run()`` keyword
    (``start_timeout``, ``use_gpu``, ``store``, ``spark``) is passed on too.
    """

    def __init__(self, num_proc: Optional[int] = None, env: Optional[Mapping[str, str]] = None,
                 stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None,
                 prefix_output_with_timestamp: bool = False, verbose: int = 1, nics: Optional[Sequence[str]] = None,
                 **options: Any) -> None:
        from spark_hvd.spark.launch.barrier import check_controller, check_nics

        if num_proc is not None and (isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1):
            raise ValueError(f"num_proc={num_proc!r} is not valid: expected an integer >= 1, or None for the "
                             "session's default parallelism")
        for key, value in (env or {}).items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ValueError(f"env[{key!r}]={value!r} is not valid: expected str names and str values")
        check_controller(options.pop("use_mpi", None), options.pop("use_gloo", None), options.pop("extra_mpi_args", None))
        self._num_proc = num_proc
        self.env: Dict[str, str] = dict(env or {})
        self.stdout = stdout
        self.stderr = stderr
        self.prefix_output_with_timestamp = bool(prefix_output_with_timestamp)
        self.verbose = verbose
        self.nics = check_nics(nics)
        self.options = dict(options)

    def num_processes(self) -> int:
        if self._num_proc is not None:
            return self._num_proc
        from spark_hvd.spark.session import active_session, session_info

        return session_info(self.options.get("spark") or active_session("SparkBackend")).default_parallelism

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[Mapping[str, Any]] = None,
            env: Optional[Mapping[str, str]] = None, **options: Any) -> List[Any]:
        from spark_hvd.spark.launch.barrier import run

        settings: Dict[str, Any] = {"stdout": self.stdout, "stderr": self.stderr, "verbose": self.verbose,
                                    "nics": self.nics,
                                    "prefix_output_with_timestamp": self.prefix_output_with_timestamp,
                                    **self.options, **_RUN_OPTIONS.get(), **options}
        return run(fn, args=args, kwargs=kwargs, num_proc=self.num_processes(),
                   env={**self.env, **dict(env or {})}, **settings)

    def __repr__(self) -> str:
        return f"SparkBackend(num_proc={self._num_proc!r}, env={self.env!r})"
