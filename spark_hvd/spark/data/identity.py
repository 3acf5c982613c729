"""The identity of a DataFrame's data: the cache key of its prepared dataset and the data part
of a run's fingerprint, the same in every session and process."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

from spark_hvd.spark.data.columns import quote

__all__ = ["FORMAT_VERSION", "DatasetKey", "dataset_key", "data_identity", "normalize_ids"]

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
    and session: the digest is remembered; :class:`DatasetKey` lets a write gather it instead).
    """
    key = DatasetKey(df, settings, columns)
    if key.pending:
        key.count_rows()
    return key.value


class DatasetKey:
    """The cache key of :func:`dataset_key`, built without running a Spark job.

    For a plan over in-memory rows whose digest this session has not computed yet the key is
    ``pending``: its content digest comes either from a job of its own (:meth:`count_rows`) or
    from a pass that runs anyway, such as the write of the prepared data: add
    :meth:`row_hash` as a column, aggregate it with :meth:`metrics` in an Observation of that
    pass, and give the observed values to :meth:`observed`. The digest is remembered for the
    session either way, so later keys and identities of the same DataFrame need no job.
    """

    def __init__(self, df: Any, settings: Dict[str, Any], columns: Optional[Sequence[str]] = None) -> None:
        raw = _plan_text(df)
        plan = normalize_ids(raw)
        self._df = df
        self._columns = list(columns) if columns else list(df.columns)
        self._parts: Dict[str, Any] = {"settings": settings, "format": FORMAT_VERSION, "schema": df.schema.json(),
                                       "plan": plan, "files": _input_files(df)}
        self._memo: Optional[Tuple[str, str, Tuple[str, ...]]] = None
        if _IN_MEMORY_SOURCE.search(plan):
            self._memo = (_session_id(df), raw, tuple(self._columns))
            known = _remembered(self._memo)
            if known is not None:
                self._parts["content"] = known

    @property
    def pending(self) -> bool:
        """Whether the key still needs the rows' digest."""
        return self._memo is not None and "content" not in self._parts

    def row_hash(self) -> Any:
        """A column expression: the 64-bit hash of one row's ``columns`` that the digest sums."""
        from pyspark.sql import functions as F

        return F.xxhash64(*[F.col(quote(c)) for c in self._columns])

    @staticmethod
    def metrics(hashed: Any, prefix: str) -> List[Any]:
        """The digest's aggregates over the ``hashed`` column (named ``prefix`` + n, s, x)."""
        from pyspark.sql import functions as F

        return [F.count(F.lit(1)).alias(prefix + "n"), F.sum(hashed.cast("decimal(38,0)")).alias(prefix + "s"),
                F.bit_xor(hashed).alias(prefix + "x")]

    def observed(self, values: Dict[str, Any], prefix: str) -> None:
        """Complete the key from the :meth:`metrics` a pass over every row of the DataFrame gathered."""
        self._remember([int(values[prefix + "n"]), str(values[prefix + "s"]), int(values[prefix + "x"] or 0)])

    def count_rows(self) -> None:
        """Complete the key with a Spark job of its own over the rows."""
        from pyspark.sql import functions as F

        row = self._df.select(self.row_hash().alias("h")).agg(*self.metrics(F.col("h"), "")).collect()[0]
        self.observed(row.asDict(), "")

    def _remember(self, digest: List[Any]) -> None:
        assert self._memo is not None, "only a plan over in-memory rows has a content digest"
        self._parts["content"] = digest
        with _digests_lock:
            _digests[self._memo] = digest
            while len(_digests) > _DIGESTS_KEPT:
                _digests.popitem(last=False)

    @property
    def value(self) -> str:
        """The key (20 hex digits)."""
        if self.pending:
            raise RuntimeError("the dataset key still needs the rows' digest: call count_rows() or observed() first")
        return hashlib.sha256(json.dumps(self._parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


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
_digests_lock = threading.Lock()


def _session_id(df: Any) -> str:
    session = getattr(df, "sparkSession", None)
    try:
        return str(getattr(session, "session_id", None) or session.sparkContext.applicationId)
    except Exception:  # no way to tell sessions apart: the plan text alone must do
        return ""


def _remembered(memo: Tuple[str, str, Tuple[str, ...]]) -> Optional[List[Any]]:
    """The content digest this session computed for the DataFrame and columns of ``memo`` (its
    session, its plan with its session-unique expression ids, which name this DataFrame and those
    derived the same way from it only, and the columns), or None."""
    with _digests_lock:
        found = _digests.get(memo)
        if found is not None:
            _digests.move_to_end(memo)
        return found
