"""MLflow logging of a fit (optional): Params, per-epoch metrics with their step, timings, the model.

MLflow is an optional dependency. A fit logs when a run is active (MLflow imported and a run
started in this process), or when the estimator's ``log_to_mlflow`` Param is True (a run is then
started and ended around the logging); ``log_to_mlflow=False`` never logs. Framework-neutral: the estimator hands a
function that logs its model flavor.

Fits made for tuning (``CrossValidator``, ``TrainValidationSplit``, ``fitMultiple``) run on
pyspark's worker threads, where MLflow's active run (kept per thread) is not set: the run active
where tuning began is carried to them (:func:`under_tuning_run`), and each such fit is logged as a
nested child run of it.
"""

from __future__ import annotations

import contextvars
import logging
import numbers
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, TypeVar

__all__ = ["MLflowLogger", "start_logging", "params_for_logging", "PARAM_VALUE_CHARS", "active_run_id",
           "under_tuning_run"]

T = TypeVar("T")

_TUNING_RUN: "contextvars.ContextVar[Optional[str]]" = contextvars.ContextVar("spark_hvd_tuning_run", default=None)
"""The MLflow run a tuning fit logs its child run under, where one was active when tuning began."""


def active_run_id() -> Optional[str]:
    """The MLflow run active in this thread, or None (MLflow is not imported for the question)."""
    mlflow = sys.modules.get("mlflow")
    run = mlflow.active_run() if mlflow is not None else None
    return run.info.run_id if run is not None else None


def under_tuning_run(parent: Optional[str], fn: Callable[[], T]) -> T:
    """``fn()``, with fits inside it logged as child runs of MLflow run ``parent`` (None: as usual)."""
    token = _TUNING_RUN.set(parent)
    try:
        return fn()
    finally:
        _TUNING_RUN.reset(token)

log = logging.getLogger("spark_hvd.spark")

PARAM_VALUE_CHARS = 500
"""Longest Param value logged (MLflow refuses values above its own limit; long reprs say little)."""

_INSTALL = 'pip install "mlflow-skinny>=2.10"  (or mlflow)'


def _import_mlflow(required: bool) -> Any:
    if not required and "mlflow" not in sys.modules:
        # A run can only be active where MLflow was imported: a fit that merely may log does not
        # pay MLflow's import (about a second) to learn that none is.
        return None
    try:
        import mlflow
    except ImportError:
        if required:
            raise ImportError(f"log_to_mlflow=True needs MLflow: {_INSTALL}") from None
        return None
    return mlflow


class MLflowLogger:
    """Logs one fit into the active MLflow run (or one it started)."""

    def __init__(self, mlflow: Any, started_run: bool) -> None:
        self.mlflow = mlflow
        self._started_run = started_run
        self.run_id: str = mlflow.active_run().info.run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Each Param as text, cut to :data:`PARAM_VALUE_CHARS`."""
        self.mlflow.log_params({name: str(value)[:PARAM_VALUE_CHARS] for name, value in params.items()
                                if value is not None})

    def log_history(self, history: List[Mapping[str, Any]]) -> None:
        """Every numeric entry of every epoch, with the epoch as the step."""
        for entry in history:
            step = int(entry.get("epoch", 0))
            metrics = {key: float(value) for key, value in entry.items()
                       if key != "epoch" and isinstance(value, numbers.Real) and not isinstance(value, bool)}
            if metrics:
                self.mlflow.log_metrics(metrics, step=step)

    def log_timings(self, timings: Mapping[str, float]) -> None:
        """Seconds per fit phase as metrics ``fit_<phase>_s``."""
        if timings:
            self.mlflow.log_metrics({f"fit_{phase}_s": float(seconds) for phase, seconds in timings.items()})

    def log_summary(self, summary: Mapping[str, int]) -> None:
        """The rows a fit trained, validated and left out (``fit_summary``), as metrics."""
        if summary:
            self.mlflow.log_metrics({key: float(value) for key, value in summary.items()})

    def log_model(self, log_flavor: Callable[[Any], Any]) -> None:
        """Log the model through ``log_flavor(mlflow)``, e.g. ``mlflow.pytorch.log_model``."""
        log_flavor(self.mlflow)

    def close(self) -> None:
        """End the run when this logger started it."""
        if self._started_run:
            self.mlflow.end_run()


def start_logging(setting: Optional[bool]) -> Optional[MLflowLogger]:
    """A logger for this fit, or None: ``setting`` None logs into an active run only, True starts
    a run when none is active (and needs MLflow installed), False never logs. A fit made for
    tuning under an active run (see :func:`under_tuning_run`) gets a child run of it."""
    if setting is False:
        return None
    mlflow = _import_mlflow(required=setting is True)
    if mlflow is None:
        return None
    parent = _TUNING_RUN.get()
    if parent is not None:
        if mlflow.active_run() is not None:
            mlflow.start_run(nested=True)
        else:  # a pyspark worker thread: MLflow's active run is per thread
            experiment = mlflow.tracking.MlflowClient().get_run(parent).info.experiment_id
            mlflow.start_run(experiment_id=experiment, tags={"mlflow.parentRunId": parent})
        return MLflowLogger(mlflow, started_run=True)
    if mlflow.active_run() is not None:
        return MLflowLogger(mlflow, started_run=False)
    if setting is True:
        mlflow.start_run()
        return MLflowLogger(mlflow, started_run=True)
    return None


def params_for_logging(json_params: Mapping[str, Any], objects: Mapping[str, Any]) -> Dict[str, Any]:
    """The Params to log: JSON values as they are, objects (model, optimizer, loss) by description."""
    logged: Dict[str, Any] = dict(json_params)
    for name, value in objects.items():
        if value is None:
            continue
        logged[name] = type(value).__name__ if name == "model" else repr(value)
    return logged
