"""Materialize a DataFrame as Parquet in a Store, validated, split and sharded for training."""

from __future__ import annotations

import json
import math
import posixpath
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from spark_hvd.spark.data.columns import StoredColumn, is_float, plan_columns, quote, to_arrays, valid_rows
from spark_hvd.spark.data.identity import FORMAT_VERSION, DatasetKey
from spark_hvd.spark.data.layout import ParquetLayout, row_bytes_field, rows_as_bytes, scan_parquet
from spark_hvd.spark.data.store import Store

__all__ = ["ColumnInfo", "PreparedData", "prepare_data"]

_MiB = 1024 * 1024
# Above this, Spark's size estimate means "unknown" (its default is Long.MaxValue).
_UNKNOWN_SIZE = 1 << 60
_MAX_FILES_PER_PROC = 64
# The column (and directory name) telling a written row's split: 1 validation, 0 training.
_SPLIT = "spark_hvd_split"
# The column of each row's content hash while the digest of in-memory data is gathered.
_ROW_HASH = "spark_hvd_row_hash"

@dataclass(frozen=True)
class ColumnInfo:
    """One column of a prepared dataset."""

    name: str
    """Column name in the Parquet files and in reader batches."""
    kind: str
    """'scalar', 'array' or 'vector' (a Spark ML Vector, stored as an array)."""
    shape: Tuple[int, ...]
    """Shape of one row's value: () for scalars, (n,) for arrays and vectors."""
    dtype: str
    """numpy dtype name of the stored values."""
    spark_type: str
    """The column's type in the source DataFrame."""
    encoding: str = "plain"
    """How the Parquet files hold it: 'plain' (a column of its type) or 'row_bytes' (one binary
    value per row, the row's values as little-endian bytes of ``dtype``: array and Vector columns;
    see :mod:`spark_hvd.spark.data.layout`)."""


@dataclass(frozen=True)
class PreparedData:
    """A dataset written by :func:`prepare_data`; also stored as JSON next to the data."""

    key: str
    """Cache key: hash of the DataFrame's plan and of the preparation settings."""
    train_path: str
    """Store path of the training Parquet directory."""
    val_path: Optional[str]
    """Store path of the validation Parquet directory, or None without validation."""
    train_rows: int
    val_rows: int
    train_files: int
    val_files: int
    train_row_groups: int
    val_row_groups: int
    columns: Tuple[ColumnInfo, ...]
    """Feature, label and sample weight columns, in that order."""
    feature_cols: Tuple[str, ...]
    label_cols: Tuple[str, ...]
    sample_weight_col: Optional[str]
    num_proc: int
    """Number of training processes the dataset was sharded for."""
    format_version: int = field(default=FORMAT_VERSION)
    label_ranges: Dict[str, List[Any]] = field(default_factory=dict)
    """Per numeric label column, what its written rows hold: ``[least, greatest, rows with a
    fractional value]`` (array labels: over their elements), so the losses' label checks need no
    pass of their own; empty for datasets written before it was recorded."""
    skipped_rows: int = 0
    """Rows left out with ``skip_invalid`` (a null, NaN or infinite value)."""

    def column(self, name: str) -> ColumnInfo:
        """The :class:`ColumnInfo` named ``name``."""
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(f"column {name!r} is not in the prepared dataset; it has "
                       f"{', '.join(c.name for c in self.columns)}")

    @property
    def shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Per-row shape of every column, for ``make_reader(shapes=...)``."""
        return {c.name: c.shape for c in self.columns}

    @property
    def dtypes(self) -> Dict[str, str]:
        """numpy dtype name of every column."""
        return {c.name: c.dtype for c in self.columns}

    def to_json(self) -> str:
        """The JSON text stored in the Store."""
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: Union[str, bytes]) -> "PreparedData":
        """Inverse of :meth:`to_json`."""
        raw = json.loads(text)
        raw["columns"] = tuple(ColumnInfo(**{**c, "shape": tuple(c["shape"])}) for c in raw["columns"])
        raw["feature_cols"] = tuple(raw["feature_cols"])
        raw["label_cols"] = tuple(raw["label_cols"])
        return cls(**raw)

def _check_args(feature_cols: Sequence[str], label_cols: Sequence[str], sample_weight_col: Optional[str],
                validation: Any, num_proc: int, vector_dtype: str) -> None:
    if isinstance(feature_cols, str) or not feature_cols or not all(isinstance(c, str) for c in feature_cols):
        raise ValueError(f"feature_cols={feature_cols!r} is not valid: expected a non-empty list of column "
                         "names, e.g. ['features']")
    if isinstance(label_cols, str) or not all(isinstance(c, str) for c in label_cols):
        raise ValueError(f"label_cols={label_cols!r} is not valid: expected a list of column names, "
                         "e.g. ['label']")
    if sample_weight_col is not None and not isinstance(sample_weight_col, str):
        raise ValueError(f"sample_weight_col={sample_weight_col!r} is not valid: expected a column name")
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"num_proc={num_proc!r} is not valid: expected an integer >= 1")
    if validation is not None and not isinstance(validation, str):
        if isinstance(validation, bool) or not isinstance(validation, (int, float)) \
                or not 0.0 < float(validation) < 1.0:
            raise ValueError(f"validation={validation!r} is not valid: expected a fraction strictly "
                             "between 0 and 1 (e.g. 0.2), the name of a 0/1 column, or None")
    if vector_dtype not in ("float32", "float64"):
        raise ValueError(f"vector_dtype={vector_dtype!r} is not valid: expected 'float32' or 'float64'")

def _estimated_bytes(df: Any) -> Optional[int]:
    try:
        size = int(str(df._jdf.queryExecution().optimizedPlan().stats().sizeInBytes()))
    except Exception:  # estimates are optional: any failure just means "unknown"
        return None
    return None if size >= _UNKNOWN_SIZE else size


def _num_files(estimate: Optional[int], fraction: float, num_proc: int, target_file_bytes: int,
               files_per_proc: Optional[int]) -> int:
    """A multiple of ``num_proc``: every rank gets at least one file, and more for large data."""
    if files_per_proc is not None:
        return num_proc * files_per_proc
    if estimate is None:
        return num_proc
    per_proc = math.ceil(estimate * fraction / (num_proc * target_file_bytes))
    return num_proc * min(max(per_proc, 1), _MAX_FILES_PER_PROC)


def _partitions(frame: Any) -> Optional[int]:
    """Partitions of ``frame`` as Spark would compute it (planning only, no job); None where the
    session cannot say (Spark Connect)."""
    try:
        return int(frame._jdf.queryExecution().toRdd().getNumPartitions())
    except Exception:  # no JVM handle on Connect: the caller shuffles to be sure
        return None


def _laid_out(frame: Any, num_files: int, num_proc: int, exact: bool) -> Any:
    """``frame`` arranged to be written as about ``num_files`` files, at least one per rank.

    Its own partitions are kept when there are enough of them and not far too many: writing them
    as they are costs no shuffle (Spark's write of the frame is the floor). Fewer than ``num_proc``
    (or an unknown number) are spread by a shuffle; far too many are merged without one. ``exact``
    (``files_per_proc`` given) always shuffles into exactly ``num_files``."""
    parts = None if exact else _partitions(frame)
    if parts is None or parts < num_proc:
        return frame.repartition(num_files)
    if parts > 4 * num_files:
        return frame.coalesce(num_files)
    return frame


def _source_observed(frame: Any, planned: List[StoredColumn], skip_invalid: bool, marker: Optional[str],
                     hashes: Sequence[str]) -> Tuple[Any, Any]:
    """``frame`` (every selected row, before rows are skipped or split) with an Observation of the
    rows ``skip_invalid`` leaves out, of the values of the validation ``marker`` column that are not
    0/1/true/false, and of the content digests (:class:`DatasetKey`) over its ``hashes`` columns;
    (frame, None) when there is nothing to count. The write gathers it."""
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    metrics = []
    if skip_invalid:
        metrics.append(F.sum(F.when(valid_rows(planned), 0).otherwise(1)).alias("skipped"))
    if marker is not None:
        col = F.col(marker)
        bad = col.isNotNull() & ~F.coalesce(col.cast("double").isin(0.0, 1.0), F.lit(False))
        metrics += [F.sum(F.when(bad, 1).otherwise(0)).alias("marks"),
                    F.first(F.when(bad, col.cast("string")), ignorenulls=True).alias("mark")]
    for name in hashes:
        metrics += DatasetKey.metrics(F.col(name), name)
    if not metrics:
        return frame, None
    observation = Observation("spark_hvd_source")
    return frame.observe(observation, *metrics), observation


def _observed(frame: Any, planned: List[StoredColumn], name: str, labels: Sequence[str] = ()) -> Tuple[Any, Any]:
    """``frame`` with an Observation of what the check of the data needs, gathered while it is
    written (no second pass): rows, nulls, rows with a NaN, infinite or null element, the least and
    greatest array length per array column, and the range of every numeric ``labels`` column."""
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    metrics = [F.count(F.lit(1)).alias("rows")]

    def count(condition: Any, alias: str) -> None:
        metrics.append(F.sum(F.when(condition, 1).otherwise(0)).alias(alias))

    fields = {f.name: f.dataType for f in frame.schema.fields}
    for i, c in enumerate(planned):
        col = F.col(quote(c.name))
        count(col.isNull(), f"n{i}")
        if c.kind != "scalar":
            metrics += [F.min(F.size(col)).alias(f"lo{i}"), F.max(F.size(col)).alias(f"hi{i}")]
            bad = F.lit(False)
            if is_float(c):
                # NaN sorts above every number, so a row's greatest element shows a NaN, and its
                # greatest and least the infinities: no per-element function for the usual case.
                top, bottom = F.array_max(col), F.array_min(col)
                bad = F.isnan(top) | (F.abs(top) == F.lit(float("inf"))) | (bottom == F.lit(float("-inf")))
            if getattr(fields.get(c.name), "containsNull", False):
                bad = bad | F.exists(col, lambda x: x.isNull())
            count(bad, f"b{i}")
        elif is_float(c):
            count(F.isnan(col) | (F.abs(col) == F.lit(float("inf"))), f"b{i}")
        if c.name in labels and c.dtype != "bool":
            values = col if c.kind == "scalar" else None
            low = F.array_min(col) if values is None else values
            high = F.array_max(col) if values is None else values
            metrics += [F.min(low).alias(f"lmin{i}"), F.max(high).alias(f"lmax{i}")]
            if values is not None and is_float(c):
                count((values % 1) != 0, f"lfrac{i}")
    observation = Observation(f"spark_hvd_{name}")
    return frame.observe(observation, *metrics), observation


def _as_row_bytes(frame: Any, planned: List[StoredColumn]) -> Any:
    """``frame`` with its array columns as raw rows (see :mod:`spark_hvd.spark.data.layout`),
    converted from Arrow on Spark's Python workers without copying the values."""
    from functools import partial

    from pyspark.sql import types as T

    arrays = {c.name: c.dtype for c in planned if c.kind != "scalar"}
    if not arrays:
        return frame
    schema = T.StructType([row_bytes_field(f.name, arrays[f.name]) if f.name in arrays else f
                           for f in frame.schema.fields])
    return frame.mapInArrow(partial(rows_as_bytes, columns=arrays), schema)


def _write(frame: Any, planned: List[StoredColumn], num_files: int, num_proc: int, exact: bool, url: str,
           row_group_bytes: int, labels: Sequence[str], split: bool) -> Dict[str, Any]:
    """Write ``frame`` as Parquet at ``url`` in one pass, array columns as raw rows, with ``split``
    the training and validation rows in the sub-directories of :func:`_split_path` (one pass for
    both); returns what :func:`_observed` gathered from the rows on their way."""
    observed, observation = _observed(_laid_out(frame, num_files, num_proc, exact), planned, "data", labels)
    writer = (_as_row_bytes(observed, planned).write.mode("overwrite")
              .option("parquet.block.size", str(row_group_bytes)))
    (writer.partitionBy(_SPLIT) if split else writer).parquet(url)
    return dict(observation.get)


def _split_path(path: str, validation: bool) -> str:
    """The directory under ``path`` that one write's training (or ``validation``) rows go to."""
    return posixpath.join(path, f"{_SPLIT}={int(validation)}")


def _label_ranges(observed: List[Dict[str, Any]], planned: List[StoredColumn]) -> Dict[str, List[Any]]:
    """[least, greatest, fractional rows] of each observed label column over every write."""
    ranges: Dict[str, List[Any]] = {}
    for i, c in enumerate(planned):
        if not any(f"lmin{i}" in o for o in observed):
            continue
        lows = [o[f"lmin{i}"] for o in observed if o.get(f"lmin{i}") is not None]
        highs = [o[f"lmax{i}"] for o in observed if o.get(f"lmax{i}") is not None]
        ranges[c.name] = [min(lows) if lows else None, max(highs) if highs else None,
                          sum(int(o.get(f"lfrac{i}") or 0) for o in observed)]
    return ranges


def _check_marks(source: Dict[str, Any], validation: str) -> None:
    """A ValueError when the validation column holds values other than 0/1/true/false."""
    if source.get("marks"):
        raise ValueError(
            f"validation column {validation!r} holds values other than 0/1/true/false in {source['marks']} rows (the "
            f"first: {source['mark']}): expected 1 or true for validation rows and 0 or false for training rows; "
            f"fix: derive it as a 0/1 column, e.g. F.when(F.col({validation!r}) == 'val', 1).otherwise(0), or pass "
            "validation=0.2 to hold out a fraction")


def _lengths(observed: List[Dict[str, Any]], planned: List[StoredColumn]) -> Optional[Dict[str, int]]:
    """The array length of each array column from the writes' observations, or None when a value
    needs a closer look (nulls, NaN, infinities or lengths that differ: :func:`_check_written`)."""
    lengths: Dict[str, int] = {}
    for i, c in enumerate(planned):
        if any(o.get(f"n{i}") or o.get(f"b{i}") for o in observed):
            return None
        if c.kind == "scalar":
            continue
        lows = [o[f"lo{i}"] for o in observed if o.get(f"lo{i}") is not None]
        highs = [o[f"hi{i}"] for o in observed if o.get(f"hi{i}") is not None]
        if lows and min(lows) != max(highs):
            return None
        lengths[c.name] = int(max(highs)) if highs else 0
    return lengths

def _check_frames(frames: List[Any], planned: List[StoredColumn]) -> Dict[str, int]:
    """One Spark job per frame written (as selected, before raw rows): nulls, NaN and infinities, and one
    length per array column.

    Every problem column is named with its counts in one ValueError. Returns the array length of
    each array or vector column."""
    from pyspark.sql import functions as F

    aggs = []

    def count(condition: Any, alias: str) -> None:
        aggs.append(F.sum(F.when(condition, 1).otherwise(0)).alias(alias))

    for i, c in enumerate(planned):
        col = F.col(quote(c.name))
        count(col.isNull(), f"n{i}")
        if c.kind != "scalar":
            aggs.append(F.min(F.size(col)).alias(f"lo{i}"))
            aggs.append(F.max(F.size(col)).alias(f"hi{i}"))
            count(F.exists(col, lambda x: x.isNull()), f"e{i}")
            if is_float(c):
                count(F.exists(col, F.isnan), f"nan{i}")
                count(F.exists(col, lambda x: F.abs(x) == F.lit(float("inf"))), f"inf{i}")
        elif is_float(c):
            count(F.isnan(col), f"nan{i}")
            count(F.abs(col) == F.lit(float("inf")), f"inf{i}")
    row: Dict[str, Any] = {}
    for frame in frames:  # counts add up; lengths keep the least and the greatest
        for key, value in frame.agg(*aggs).collect()[0].asDict().items():
            if value is None or row.get(key) is None:
                row[key] = value if row.get(key) is None else row[key]
            else:
                row[key] = min(row[key], value) if key.startswith("lo") else \
                    max(row[key], value) if key.startswith("hi") else row[key] + value
    problems: List[str] = []
    for i, c in enumerate(planned):
        what = "rows with" if c.kind != "scalar" else ""
        found = [f"{row[key]} {label}" for key, label in ((f"n{i}", "null"), (f"e{i}", "with null elements"),
                                                          (f"nan{i}", f"{what} NaN".strip()),
                                                          (f"inf{i}", f"{what} infinite".strip()))
                 if row.get(key)]
        if found:
            problems.append(f"column {c.name!r}: {', '.join(found)}")
    if problems:
        raise ValueError(
            "the DataFrame has values training cannot use (" + "; ".join(problems) + "): expected a finite number "
            "in every row of every feature, label and weight column; fix: clean them (DataFrame.na.fill, "
            "DataFrame.na.drop, or a filter with pyspark.sql.functions.isnan), or pass invalid_rows='skip' to "
            "leave those rows out of training")
    lengths: Dict[str, int] = {}
    for i, c in enumerate(planned):
        if c.kind == "scalar":
            continue
        lo, hi = row[f"lo{i}"], row[f"hi{i}"]
        if lo is not None and lo != hi:
            raise ValueError(f"column {c.name!r} has rows of different lengths ({lo} to {hi}): expected "
                             "the same length in every row; fix: pad or truncate the arrays")
        lengths[c.name] = int(hi or 0)
    return lengths

def prepare_data(df: Any, store: Store, feature_cols: Sequence[str], label_cols: Sequence[str] = (),
                 sample_weight_col: Optional[str] = None, validation: Union[None, float, str] = None,
                 num_proc: int = 1, *, seed: int = 0, vector_dtype: str = "float64",
                 target_file_bytes: int = 128 * _MiB, row_group_bytes: int = 32 * _MiB,
                 files_per_proc: Optional[int] = None, reuse_cached: bool = True,
                 skip_invalid: bool = False) -> PreparedData:
    """Write the columns of ``df`` needed for training as Parquet in ``store``.

    Checks columns and types before running any Spark job; turns Spark ML Vectors into arrays;
    splits off validation rows (a fraction, drawn per row with ``seed``, or a 0/1 or boolean column
    whose true rows are validation); writes a multiple of ``num_proc`` files, so every rank has at
    least one row group; records row counts, shapes and dtypes as JSON in the store. One Spark job
    reads the DataFrame once and writes both splits (the two sub-directories of the key's training
    data path that :attr:`PreparedData.train_path` and :attr:`PreparedData.val_path` name; the
    validation rows move to the store's ``val_path`` where it sets one), checking
    the values and, for data held in memory, hashing the rows for the cache key on the way. A
    DataFrame already prepared with the same settings (same cache key) is not written again unless
    ``reuse_cached=False``; the key is the same in every session and process (see
    :func:`dataset_key`). Nulls, NaN and infinities in the columns are refused with their counts
    per column, or, with ``skip_invalid=True``, the rows holding them are left out. Note the key
    follows the DataFrame's plan, not its source files: after rewriting the files a plan reads,
    pass ``reuse_cached=False``.
    """
    from pyspark.sql import functions as F

    feature_cols = list(feature_cols) if not isinstance(feature_cols, str) else feature_cols
    label_cols = list(label_cols) if not isinstance(label_cols, str) else label_cols
    _check_args(feature_cols, label_cols, sample_weight_col, validation, num_proc, vector_dtype)
    if files_per_proc is not None and (not isinstance(files_per_proc, int) or files_per_proc < 1):
        raise ValueError(f"files_per_proc={files_per_proc!r} is not valid: expected an integer >= 1 or None")
    planned = plan_columns(df, feature_cols, label_cols, sample_weight_col, validation, vector_dtype)

    settings = {"features": feature_cols, "labels": label_cols, "weight": sample_weight_col,
                "validation": validation, "num_proc": num_proc, "seed": seed, "vector_dtype": vector_dtype,
                "target_file_bytes": target_file_bytes, "row_group_bytes": row_group_bytes,
                "files_per_proc": files_per_proc, "skip_invalid": skip_invalid}
    needed = list(dict.fromkeys([*feature_cols, *label_cols, *([sample_weight_col] if sample_weight_col else []),
                                 *([validation] if isinstance(validation, str) else [])]))
    key = DatasetKey(df, settings, needed)
    # Data held in memory is keyed by a digest of its rows. Unless this session has it already, the
    # write gathers it (no pass of its own): the data goes to a pending directory, renamed to the
    # key's once the key is known. The fit's fingerprint hashes the rows without the validation
    # column, so that digest is gathered on the same pass.
    digests = [key]
    if key.pending and isinstance(validation, str):
        digests.append(DatasetKey(df, {}, [c for c in needed if c != validation]))
    digests = [d for d in digests if d.pending]
    if not key.pending:
        cached = _cached(store, key.value) if reuse_cached else None
        if cached is not None:
            return cached

    exprs = to_arrays(df, planned, vector_dtype)
    hashes = [d.row_hash().alias(f"{_ROW_HASH}{i}") for i, d in enumerate(digests)]
    hash_names = [f"{_ROW_HASH}{i}" for i in range(len(digests))]
    estimate = _estimated_bytes(df)
    if isinstance(validation, str):
        is_val = F.coalesce(F.col(quote(validation)).cast("boolean"), F.lit(False))
        selected = df.select(*exprs, *hashes, is_val.cast("int").alias(_SPLIT),
                             F.col(quote(validation)).alias("__spark_hvd_mark"))
        selected, source = _source_observed(selected, planned, skip_invalid, "__spark_hvd_mark", hash_names)
        selected = selected.drop("__spark_hvd_mark")
        fraction = 1.0  # unknown split: size the files for the whole frame
    else:
        selected, source = _source_observed(df.select(*exprs, *hashes), planned, skip_invalid, None, hash_names)
        fraction = 1.0 if validation is None else 1.0 - float(validation)
    if hashes:
        selected = selected.drop(*hash_names)
    if skip_invalid:
        selected = selected.filter(valid_rows(planned))
    split = validation is not None
    if split and not isinstance(validation, str):
        # One draw per row, in the same pass as the write: about `validation` of the rows.
        selected = selected.withColumn(_SPLIT, (F.rand(seed) < float(validation)).cast("int"))

    path = store.get_train_data_path(key.value if not key.pending else f"pending-{uuid.uuid4().hex[:12]}")
    exact = files_per_proc is not None
    written = [path]
    try:
        observed = [_write(selected, planned, _num_files(estimate, fraction, num_proc, target_file_bytes,
                                                         files_per_proc), num_proc, exact, store.spark_url(path),
                           row_group_bytes, label_cols, split)]
        counted = dict(source.get) if source is not None else {}
        if isinstance(validation, str):
            _check_marks(counted, validation)
        if digests:
            for d, name in zip(digests, hash_names):
                d.observed(counted, name)
            cached = _cached(store, key.value) if reuse_cached else None
            if cached is not None:  # written before, in another session
                store.delete(path)
                return cached
            final = store.get_train_data_path(key.value)
            store.delete(final)
            store.move(path, final)
            written, path = [final], final
        if not any(o.get("rows") for o in observed):
            raise ValueError("the DataFrame has no rows: expected at least one row to train on; check the "
                             "filters that produced it")
        lengths = _lengths(observed, planned)
        if lengths is None:  # something to report: name it with its counts
            lengths = _check_frames([selected], planned)
        train_path = _split_path(path, False) if split else path
        val_path = _split_path(path, True) if split else None
        if val_path is not None and store.val_path is not None and store.exists(val_path):
            # The store names a place of its own for validation data (Horovod's val_path).
            target = store.get_val_data_path(key.value)
            store.delete(target)
            store.move(val_path, target)
            written.append(target)
            val_path = target
        train = _scan(store, train_path)
        if train.num_rows == 0:
            raise ValueError(f"the training split is empty: validation={validation!r} marked every row; "
                             "expected some rows with 0/false")
        val = _scan(store, val_path) if val_path is not None else None
        if val is not None and val.num_rows == 0:
            raise ValueError(f"the validation split is empty with validation={validation!r}; fix: use a "
                             "larger fraction, mark some rows, or pass validation=None")
    except BaseException:
        for written_path in written:
            store.delete(written_path)
        raise

    columns = tuple(ColumnInfo(c.name, c.kind, (lengths[c.name],) if c.kind != "scalar" else (), c.dtype,
                               c.spark_type, "row_bytes" if c.kind != "scalar" else "plain") for c in planned)
    info = PreparedData(
        key=key.value, train_path=train_path, val_path=val_path,
        train_rows=train.num_rows, val_rows=val.num_rows if val else 0,
        train_files=len(train.files), val_files=len(val.files) if val else 0,
        train_row_groups=len(train.row_groups), val_row_groups=len(val.row_groups) if val else 0,
        columns=columns, feature_cols=tuple(feature_cols), label_cols=tuple(label_cols),
        sample_weight_col=sample_weight_col, num_proc=num_proc, label_ranges=_label_ranges(observed, planned),
        skipped_rows=int(counted.get("skipped") or 0))
    # Written last: its presence is what marks the dataset complete for later calls.
    store.write(store.get_data_metadata_path(key.value), info.to_json().encode())
    return info


def _cached(store: Store, key: str) -> Optional[PreparedData]:
    """The dataset prepared before under ``key``, when it was written to the end."""
    metadata_path = store.get_data_metadata_path(key)
    if not store.exists(metadata_path):
        return None
    cached = PreparedData.from_json(store.read(metadata_path))
    if all(store.exists(p) for p in (cached.train_path, cached.val_path) if p is not None):
        return cached
    return None


def _scan(store: Store, path: str) -> ParquetLayout:
    """The written files under ``path``; none where a split got no rows (no directory)."""
    if not store.exists(path):
        return ParquetLayout((), (), (), {})
    return scan_parquet(store.url(path), store.storage_options)
