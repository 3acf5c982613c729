"""Spark ML tuning with the estimators: saving grids, and MLflow runs for the fits tuning makes.

pyspark's ``CrossValidator`` and ``TrainValidationSplit`` (and their models) store each grid value
as JSON, so a grid over objects (an optimizer per learning rate, a model per width) fails only
when the tuning object is saved, after the whole tuning run, with Python's bare
``TypeError: Object of type Adam is not JSON serializable``. :func:`install` makes that save fail
first, before anything is written, with a message naming the Param and the plain-valued Param to
tune instead (``learning_rate`` for optimizers). It also carries the MLflow run active where tuning
begins to the worker threads its fits run on, so each fit is logged as a child run of it.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Callable, List

from spark_hvd.spark.estimator.mlflow_log import active_run_id, under_tuning_run

__all__ = ["install", "check_grid_saves", "GRID_ALTERNATIVES"]

GRID_ALTERNATIVES = {
    "optimizer": "tune learning_rate instead: ParamGridBuilder().addGrid(estimator.learning_rate, [1e-3, 1e-2])",
    "loss": "fit one tuning run per loss, or give the model one loss and tune plain Params (learning_rate, epochs, "
            "batch_size)",
    "model": "fit one tuning run per model, or build the model from a plain Param in a Pipeline stage before it",
}
"""What to grid instead of an object-valued Param, by Param name."""


def check_grid_saves(instance: Any) -> None:
    """A TypeError naming the first grid value of ``instance`` (a CrossValidator, TrainValidationSplit
    or their model) that pyspark cannot store as JSON, with what to tune instead; nothing otherwise."""
    from pyspark.ml import Estimator, Transformer
    from pyspark.ml.evaluation import Evaluator

    for i, param_map in enumerate(instance.getEstimatorParamMaps()):
        for param, value in param_map.items():
            if isinstance(value, (Estimator, Transformer, Evaluator)):
                continue  # pyspark saves these as stages of their own
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                fix = GRID_ALTERNATIVES.get(param.name, "grid over plain values (numbers, strings, booleans, lists)")
                text = repr(value)
                if "\n" in text or len(text) > 80:
                    text = f"<a {type(value).__module__}.{type(value).__qualname__}>"
                raise TypeError(
                    f"{type(instance).__name__} cannot be saved: estimatorParamMaps[{i}] sets {param.name}={text}, "
                    "which pyspark's tuning persistence cannot store (it writes every grid value as JSON): expected "
                    f"numbers, strings, booleans or lists of them; fix: {fix}") from None


def _checked(save: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(save)
    def save_impl(path: str, instance: Any, *args: Any, **kwargs: Any) -> Any:
        check_grid_saves(instance)
        return save(path, instance, *args, **kwargs)

    save_impl.spark_hvd_checked = True  # type: ignore[attr-defined]
    return save_impl


def _logged_under_caller(make_tasks: Callable[..., List[Callable[[], Any]]]) -> Callable[..., Any]:
    @functools.wraps(make_tasks)
    def parallel_fit_tasks(*args: Any, **kwargs: Any) -> List[Callable[[], Any]]:
        tasks = make_tasks(*args, **kwargs)
        parent = active_run_id()  # this is tuning's own thread; the tasks run on pool threads
        if parent is None:
            return tasks
        return [functools.partial(under_tuning_run, parent, task) for task in tasks]

    parallel_fit_tasks.spark_hvd_checked = True  # type: ignore[attr-defined]
    return parallel_fit_tasks


def install() -> None:
    """Check grids before pyspark's tuning writers save them, and carry the caller's MLflow run to
    the fits of ``CrossValidator`` and ``TrainValidationSplit`` (idempotent)."""
    from pyspark.ml import tuning

    shared = getattr(tuning, "_ValidatorSharedReadWrite", None)
    save = getattr(shared, "saveImpl", None)
    if save is not None and not getattr(save, "spark_hvd_checked", False):
        shared.saveImpl = staticmethod(_checked(save))
    make_tasks = getattr(tuning, "_parallelFitTasks", None)
    if make_tasks is not None and not getattr(make_tasks, "spark_hvd_checked", False):
        setattr(tuning, "_parallelFitTasks", _logged_under_caller(make_tasks))
