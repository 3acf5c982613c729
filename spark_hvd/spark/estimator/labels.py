"""The labels a loss can take, checked on the driver before any rank starts.

A binary cross-entropy takes labels in [0, 1]: given 0/2 it trains without a word toward nonsense.
A class-index loss (``CrossEntropyLoss``, ``sparse_categorical_crossentropy``) takes integers in
[0, classes): given a label 3 against 3 outputs it fails only inside training, on a rank, naming no
column. :class:`LabelRule` says which a label column must hold; :func:`check_labels` reads the
ranges the materialization observed while writing (no pass of its own) and, only when one breaks a
rule, counts the offending rows in one Spark job to name them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from spark_hvd.spark.data.columns import inspect_column, is_float, quote, to_arrays, valid_rows

__all__ = ["LabelRule", "BINARY_LOSSES", "CLASS_INDEX_LOSSES", "rule_for_loss", "rule_for_task", "probe_breaks",
           "check_labels"]

BINARY_LOSSES = frozenset({
    "BCEWithLogitsLoss", "BCELoss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
    "BinaryCrossentropy", "binary_crossentropy", "BinaryFocalCrossentropy", "binary_focal_crossentropy",
})
"""Names of losses (torch modules and functions, Keras classes and functions) that take labels in [0, 1]."""

CLASS_INDEX_LOSSES = frozenset({
    "CrossEntropyLoss", "NLLLoss", "cross_entropy", "nll_loss",
    "SparseCategoricalCrossentropy", "sparse_categorical_crossentropy",
})
"""Names of losses that take a class index per row (given one scalar label per row)."""


@dataclass(frozen=True)
class LabelRule:
    """What one label column must hold."""

    column: str
    kind: str
    """'binary' (every value in [0, 1]) or 'classes' (an integer in [0, classes))."""
    why: str
    """What asks for it, for messages: the loss's name, or the task."""
    classes: int = 0
    """Number of classes (the model's outputs for the label) for kind 'classes'."""


def _classes(output_shape: Optional[Tuple[int, ...]]) -> int:
    return int(output_shape[-1]) if output_shape else 1


def rule_for_loss(column: str, loss_name: str, output_shape: Optional[Tuple[int, ...]],
                  scalar: bool) -> Optional[LabelRule]:
    """The rule the loss named ``loss_name`` sets on ``column`` (``scalar``: one value per row), or None."""
    if loss_name in BINARY_LOSSES:
        return LabelRule(column, "binary", loss_name)
    if loss_name in CLASS_INDEX_LOSSES and scalar:  # an array label there holds class probabilities
        return LabelRule(column, "classes", loss_name, _classes(output_shape))
    return None


def rule_for_task(column: str, task: str, output_shape: Optional[Tuple[int, ...]], scalar: bool) -> Optional[LabelRule]:
    """The rule a declared ``task`` sets on its label ``column``, or None."""
    if task in ("binary", "binary_probability"):
        return LabelRule(column, "binary", f"task={task!r}")
    if task.startswith("multiclass") and scalar:
        return LabelRule(column, "classes", f"task={task!r}", _classes(output_shape))
    return None


def _broken(rule: LabelRule, observed: Optional[Sequence[Any]]) -> bool:
    """Whether the observed [least, greatest, fractional rows] may break ``rule`` (unknown: maybe)."""
    if observed is None:
        return True
    low, high, fractional = observed
    if low is None:  # no rows
        return False
    if rule.kind == "binary":
        return low < 0 or high > 1
    return low < 0 or high >= rule.classes or bool(fractional)


def _bad(rule: LabelRule, column: Any, kind: str, dtype: str) -> Any:
    """A Spark condition true for rows of ``column`` that break ``rule``."""
    from pyspark.sql import functions as F

    if rule.kind == "binary":
        if kind != "scalar":
            return (F.array_min(column) < 0) | (F.array_max(column) > 1)
        return (column < 0) | (column > 1)
    bad = (column < 0) | (column >= rule.classes)
    return bad | ((column % 1) != 0) if dtype in ("float32", "float64") else bad


def probe_breaks(batch: Mapping[str, Any], rules: Iterable[LabelRule]) -> bool:
    """Whether the labels of a probe ``batch`` (numpy arrays by column) break one of ``rules``."""
    for rule in rules:
        values = np.asarray(batch.get(rule.column, ()))
        if values.dtype == np.bool_ or values.size == 0:
            continue
        values = values[np.isfinite(values)] if values.dtype.kind == "f" else values
        low, high = values.min(initial=0), values.max(initial=0)
        fractional = values.dtype.kind == "f" and bool(np.any(values % 1))
        if _broken(rule, [low, high, fractional]):
            return True
    return False


def check_labels(df: Any, rules: Iterable[LabelRule], ranges: Mapping[str, Sequence[Any]], columns: Sequence[str],
                 vector_dtype: str, skip_invalid: bool = False) -> None:
    """A ValueError naming each label column of ``df`` whose values its rule refuses: the rows that
    hold them, the first such value, what asks for the rule and the fix. ``ranges`` are what the
    materialization observed per label column (see ``PreparedData.label_ranges``); a Spark job over
    ``df``'s ``columns`` (features, labels, weight: the rows training reads, less those
    ``skip_invalid`` leaves out) counts the rows only when one may break a rule (a column missing
    from ``ranges`` may)."""
    from pyspark.sql import functions as F

    fields = {f.name: f.dataType for f in df.schema.fields}
    suspects: List[Tuple[LabelRule, Any]] = []
    for rule in rules:
        stored = inspect_column(rule.column, fields[rule.column], vector_dtype)
        if stored.dtype == "bool" and (rule.kind == "binary" or rule.classes >= 2):
            continue
        if _broken(rule, ranges.get(rule.column)):
            suspects.append((rule, stored))
    if not suspects:
        return
    planned = [inspect_column(c, fields[c], vector_dtype) for c in dict.fromkeys(columns)]
    frame = df.select(*to_arrays(df, planned, vector_dtype))
    if skip_invalid:
        frame = frame.filter(valid_rows(planned))
    aggs = []
    for i, (rule, stored) in enumerate(suspects):
        column = F.col(quote(rule.column))
        if stored.dtype == "bool":
            column = column.cast("int")
        bad = _bad(rule, column, stored.kind, stored.dtype)
        if is_float(stored) and stored.kind == "scalar":
            bad = bad & ~F.isnan(column)
        aggs += [F.sum(F.when(bad, 1).otherwise(0)).alias(f"n{i}"),
                 F.first(F.when(bad, column.cast("string")), ignorenulls=True).alias(f"v{i}")]
    found: Dict[str, Any] = frame.agg(*aggs).collect()[0].asDict()
    problems = []
    for i, (rule, _) in enumerate(suspects):
        rows, first = found.get(f"n{i}") or 0, found.get(f"v{i}")
        if not rows:
            continue
        col = rule.column
        if rule.kind == "binary":
            problems.append(
                f"label column {col!r} holds values outside [0, 1] in {rows} rows (the first: {first}), but {rule.why} "
                f"takes labels in [0, 1] (0/1, or a probability); fix: map them to 0 and 1, e.g. "
                f"df.withColumn({col!r}, (F.col({col!r}) > 0).cast('double')), or use a loss made for these values")
        else:
            problems.append(
                f"label column {col!r} holds {rows} rows that are not class indices 0 to {rule.classes - 1} (the first: "
                f"{first}), but {rule.why} over the model's {rule.classes} outputs takes an integer class index in "
                f"[0, {rule.classes}); fix: number the classes from 0 (pyspark.ml.feature.StringIndexer), or give the "
                "model one output per class")
    if problems:
        raise ValueError("; ".join(problems))
