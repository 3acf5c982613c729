"""The identity of a DataFrame's data: the cache key of its prepared dataset and the data part
of a run's fingerprint, the same in every session and process."""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

from spark_hvd.spark.data.columns import quote

__all__ = ["FORMAT_VERSION", "dataset_key", "data_identity", "normalize_ids"]

FORMAT_VERSION = 2
"""Bumped when the written layout changes, so older cached datasets are not reused (2: array and Vector
columns written as raw rows, see :mod:`spark_hvd.spark.data.layout`)."""


def dataset_key(df: Any, settings: Dict[str, Any], columns: Optional[Sequence[str]] = None) -> str:
    """Cache key of ``df`` prepared with ``settings``: equal for the same data read the same way,
    in any session or process (a fit re-run after a crash finds what the first one wrote), and
    different for other data or settings.

    The key hashes the schema, the analyzed plan with Spark's session-specific expression ids
    renumbered, and the files the plan reads (its text does not name them). A plan over data held in memory (``createDataFrame`` from local rows or pandas, an
    RDD) does not show that data, so for such plans the key also hashes the content of ``columns``
    (default every column), counted and hashed row by row in one Spark job (once per DataFrame
    and session: the digest is remembered).
    """
    raw = _plan_text(df)
    plan = normalize_ids(raw)
    parts: Dict[str, Any] = {"settings": settings, "format": FORMAT_VERSION, "schema": df.schema.json(),
                             "plan": plan, "files": _input_files(df)}
    if _IN_MEMORY_SOURCE.search(plan):
        parts["content"] = _content_digest(df, raw, list(columns) if columns else list(df.columns))
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
    return digest[:20]


def data_identity(df: Any, columns: Sequence[str]) -> Optional[str]:
    """A hash of ``df``'s plan, files and (for in-memory data) rows of ``columns``, the same in
    every session and process; None when the session cannot show the plan."""
    if not _plan_text(df):
        return None
    return dataset_key(df, {}, [c for c in columns if c])


# Leaf nodes whose rows the plan's text does not show.
_IN_MEMORY_SOURCE = re.compile(r"\b(LogicalRDD|LocalRelation|ExternalRDD|ExistingRDD|LocalTableScan)\b")
_EXPR_ID = re.compile(r"#(\d+)")


def normalize_ids(text: str) -> str:
    """``text`` with expression ids (``x#123``) renumbered by first appearance: the same plan built
    in another session reads the same, while distinct ids (a self-join's sides) stay distinct."""
    seen: Dict[str, int] = {}

    def renumber(found: "re.Match[str]") -> str:
        return "#" + str(seen.setdefault(found.group(1), len(seen)))

    return _EXPR_ID.sub(renumber, text)


def _plan_text(df: Any) -> str:
    """The DataFrame's analyzed logical plan as text, with the session's own expression ids
    (:func:`normalize_ids` makes it the same in every session for the same plan).

    Classic sessions ask the JVM; Connect clients ask the server for the extended explanation
    and keep its analyzed section.
    """
    jdf = getattr(df, "_jdf", None)
    if jdf is not None:
        return str(jdf.queryExecution().analyzed().toString())
    explain = getattr(df, "_explain_string", None)
    if explain is None:
        return ""
    text = str(explain(extended=True))
    analyzed = text.split("== Analyzed Logical Plan ==", 1)[-1].split("== Optimized Logical Plan ==", 1)[0]
    return analyzed.strip()


def _input_files(df: Any) -> List[str]:
    try:
        return sorted(str(f) for f in df.inputFiles())
    except Exception:  # sources without files (JDBC, in-memory) have none to list
        return []


_digests: "OrderedDict[Tuple[str, str, Tuple[str, ...]], List[Any]]" = OrderedDict()
_DIGESTS_KEPT = 256


def _session_id(df: Any) -> str:
    session = getattr(df, "sparkSession", None)
    try:
        return str(getattr(session, "session_id", None) or session.sparkContext.applicationId)
    except Exception:  # no way to tell sessions apart: the plan text alone must do
        return ""


def _content_digest(df: Any, raw_plan: str, columns: Sequence[str]) -> List[Any]:
    """Row count, and sum and xor of per-row 64-bit hashes of ``columns``: independent of the
    rows' order and partitioning, so equal for equal data in any session.

    Remembered by the session and the plan with its session-unique expression ids, which name
    this DataFrame (and those derived the same way from it) only.
    """
    memo = (_session_id(df), raw_plan, tuple(columns))
    if memo in _digests:
        _digests.move_to_end(memo)
        return _digests[memo]
    digest = _compute_digest(df, columns)
    _digests[memo] = digest
    while len(_digests) > _DIGESTS_KEPT:
        _digests.popitem(last=False)
    return digest


def _compute_digest(df: Any, columns: Sequence[str]) -> List[Any]:
    from pyspark.sql import functions as F

    hashed = F.xxhash64(*[F.col(quote(c)) for c in columns])
    row = df.select(hashed.alias("h")).agg(
        F.count(F.lit(1)).alias("n"), F.sum(F.col("h").cast("decimal(38,0)")).alias("s"),
        F.expr("bit_xor(h)").alias("x")).collect()[0]
    return [int(row["n"]), str(row["s"]), int(row["x"] or 0)]
