"""Spark ML's prediction columns from a model's raw outputs: what a task is, and how its columns are made.

A classifier in Spark ML adds ``rawPrediction`` (a Vector of per-class scores), ``probability``
(a Vector of per-class probabilities) and ``prediction`` (the class index as a double); a
regressor adds ``prediction``. ``BinaryClassificationEvaluator``, ``MulticlassClassificationEvaluator``
and ``RegressionEvaluator`` read those names by default. The task says how to turn the model's
raw output into them; it is inferred from the loss unless given.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

__all__ = ["TASKS", "ONE_VALUE_TASKS", "infer_task", "check_task", "standard_columns", "spark_columns", "column_kinds"]

TASKS = ("auto", "binary", "binary_probability", "multiclass", "multiclass_log_probability", "multiclass_probability",
         "regression", "none")
"""Values of the ``task`` Param.

- ``binary``: one logit per row (``BCEWithLogitsLoss``).
- ``binary_probability``: one probability per row (``BCELoss``, a model ending in a sigmoid).
- ``multiclass``: one logit per class (``CrossEntropyLoss``).
- ``multiclass_log_probability``: one log-probability per class (``NLLLoss`` after ``log_softmax``).
- ``multiclass_probability``: one probability per class (a Keras model ending in a softmax).
- ``regression``: one value per row (``MSELoss``, ``L1Loss``, ``SmoothL1Loss``, ``HuberLoss``).
- ``none``: only the raw output columns (``<label>__output``).
- ``auto``: inferred from the loss of a single label column; ``none`` when it cannot be.
"""

ONE_VALUE_TASKS = ("binary", "binary_probability", "regression")
"""Tasks whose columns all follow from one value per row: ``transform`` takes that value from the
model and builds the columns in Spark (:func:`spark_columns`), instead of shipping them from Python."""

_BY_LOSS = {
    "BCEWithLogitsLoss": "binary",
    "BCELoss": "binary_probability",
    "CrossEntropyLoss": "multiclass",
    "NLLLoss": "multiclass_log_probability",
    "MSELoss": "regression",
    "L1Loss": "regression",
    "SmoothL1Loss": "regression",
    "HuberLoss": "regression",
    "binary_cross_entropy_with_logits": "binary",
    "binary_cross_entropy": "binary_probability",
    "cross_entropy": "multiclass",
    "nll_loss": "multiclass_log_probability",
    "mse_loss": "regression",
    "l1_loss": "regression",
    "smooth_l1_loss": "regression",
    "huber_loss": "regression",
}


def infer_task(task: str, losses: Sequence[Any], label_cols: Sequence[str]) -> str:
    """The concrete task: ``task`` unless it is 'auto', else the one the single label's loss implies."""
    if task != "auto":
        return task
    if len(label_cols) != 1 or not losses:
        return "none"
    name = getattr(losses[0], "__name__", None) or type(losses[0]).__name__  # functions, then loss modules
    return _BY_LOSS.get(name, "none")


def check_task(task: str, row_shapes: Sequence[Tuple[int, ...]]) -> None:
    """ValueError when the model's outputs (per-row shapes) cannot carry ``task``'s columns."""
    if task == "none":
        return
    if len(row_shapes) != 1:
        raise ValueError(f"task={task!r} needs a model with one output, but it returns {len(row_shapes)}: expected "
                         "one label column; fix: task='none' for raw output columns")
    width = int(np.prod(row_shapes[0])) if row_shapes[0] else 1
    if task in ("binary", "binary_probability", "regression") and width != 1:
        raise ValueError(f"task={task!r} needs one output value per row, but the model returns {width}: fix: "
                         f"task='multiclass' for one score per class, or task='none' for the raw output")
    if task.startswith("multiclass") and width < 2:
        raise ValueError(f"task={task!r} needs one output value per class (at least 2), but the model returns "
                         f"{width}: fix: task='binary' for one logit per row")


def column_kinds(task: str) -> List[Tuple[str, str]]:
    """(role, kind) of each column the task adds, kind 'double' or 'vector'; roles are
    'prediction', 'probability' and 'raw_prediction'."""
    if task == "regression":
        return [("prediction", "double")]
    if task == "none":
        return []
    return [("raw_prediction", "vector"), ("probability", "vector"), ("prediction", "double")]


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # stable for large |z|


def _softmax(scores: np.ndarray) -> np.ndarray:
    shifted = np.exp(scores - scores.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def standard_columns(task: str, values: np.ndarray) -> Dict[str, np.ndarray]:
    """The task's columns for raw outputs ``values`` of shape (rows, width), by role."""
    if task == "regression":
        return {"prediction": values[:, 0]}
    if task in ("binary", "binary_probability"):
        column = values[:, 0]
        p = _sigmoid(column) if task == "binary" else np.clip(column, 0.0, 1.0)
        raw = np.stack([-column, column], axis=1) if task == "binary" else np.stack([1.0 - p, p], axis=1)
        return {"raw_prediction": raw, "probability": np.stack([1.0 - p, p], axis=1),
                "prediction": np.where(np.isnan(p), np.nan, (p > 0.5).astype(np.float64))}
    if task == "multiclass_probability":
        clipped = np.clip(values, 0.0, None)
        total = clipped.sum(axis=1, keepdims=True)
        probability = np.divide(clipped, total, out=np.full_like(clipped, 1.0 / max(1, clipped.shape[1])),
                                where=total > 0)
        probability[np.isnan(total[:, 0])] = np.nan  # a NaN output is no distribution
        return {"raw_prediction": values, "probability": probability, "prediction": _predicted_class(probability)}
    probability = _softmax(values)  # log-probabilities give the same distribution back
    return {"raw_prediction": values, "probability": probability, "prediction": _predicted_class(probability)}


def _predicted_class(probability: np.ndarray) -> np.ndarray:
    """The most probable class of each row as a double; NaN for a row whose probabilities hold a
    NaN (a NaN input never gets a class)."""
    classes = probability.argmax(axis=1).astype(np.float64) if probability.shape[1] else \
        np.zeros(len(probability))
    return np.where(np.isnan(probability).any(axis=1), np.nan, classes)


def spark_columns(task: str, value: Any) -> Dict[str, Any]:
    """The columns of a task in :data:`ONE_VALUE_TASKS` as Spark expressions over ``value``, a
    double column of the model's raw output; the same numbers as :func:`standard_columns`, with
    Vectors (rawPrediction, probability) made in the JVM from two doubles each."""
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    if task == "regression":
        return {"prediction": value}
    if task == "binary":
        p = F.lit(0.5) * (F.lit(1.0) + F.tanh(value * F.lit(0.5)))
        raw = F.array(-value, value)
    elif task == "binary_probability":
        # NaN stays NaN, as with np.clip (Spark orders NaN above every number).
        p = F.when(F.isnan(value), value).otherwise(F.least(F.greatest(value, F.lit(0.0)), F.lit(1.0)))
        raw = F.array(F.lit(1.0) - p, p)
    else:
        raise ValueError(f"task={task!r} is not one of {ONE_VALUE_TASKS}")
    # A NaN probability predicts no class (Spark would order NaN above 0.5).
    prediction = F.when(F.isnan(p), F.lit(float("nan"))).when(p > F.lit(0.5), F.lit(1.0)).otherwise(F.lit(0.0))
    return {"raw_prediction": array_to_vector(raw), "probability": array_to_vector(F.array(F.lit(1.0) - p, p)),
            "prediction": prediction}
