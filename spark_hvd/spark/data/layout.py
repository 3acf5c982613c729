"""How prepared Parquet is laid out and read back: row groups, their dealing, Arrow to numpy.

Files and row groups are scanned from the footers and dealt to ranks; Arrow columns become numpy
arrays, including the raw-row encoding ``prepare_data`` writes.

Array and Vector columns are materialized as raw rows: one ``binary`` value per row holding the
row's values as little-endian bytes of one numpy dtype, named in the column's Spark metadata
(:data:`ROW_BYTES_KEY`). Spark writes them from Arrow without a copy of the values, and a reader
turns a decoded column into a ``(rows, n)`` matrix as a view of the column's data, where a
``list<float>`` column costs a pass over every element and its offsets.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = [
    "ROW_BYTES_KEY",
    "RowGroup",
    "ParquetLayout",
    "open_filesystem",
    "scan_parquet",
    "deal_row_groups",
    "arrow_to_numpy",
    "rows_as_bytes",
    "encode_row_bytes",
    "row_bytes_field",
]

ROW_BYTES_KEY = "spark_hvd_row_bytes"
"""Key of a column's Spark metadata that marks it as raw rows; its value is the values' numpy dtype."""

_SPARK_SCHEMA_KEY = b"org.apache.spark.sql.parquet.row.metadata"
_MAX_BATCH_BYTES = 1 << 30
"""Most bytes of one raw-row column in one Arrow batch (Spark's binary offsets are 32-bit)."""


@dataclass(frozen=True)
class RowGroup:
    """One Parquet row group: the unit of sharding between ranks."""

    file: str
    """Path of the Parquet file, in its filesystem's syntax."""
    index: int
    """Index of the row group within the file."""
    num_rows: int
    """Rows in the row group."""
    byte_size: int = 0
    """Bytes of its column data, uncompressed (the footer's ``total_byte_size``; 0: not known)."""


@dataclass(frozen=True)
class ParquetLayout:
    """The Parquet files and row groups of one prepared dataset, in a fixed order."""

    files: Tuple[str, ...]
    """Data files, sorted by name."""
    row_groups: Tuple[RowGroup, ...]
    """Every row group, ordered by file then index: the same order on every rank."""
    column_names: Tuple[str, ...] = ()
    """Columns of the first file's schema."""
    row_bytes: Mapping[str, str] = field(default_factory=dict)
    """Columns stored as raw rows (see :func:`rows_as_bytes`): column name to the numpy dtype of
    their values, from the Spark schema in the first file's footer."""

    @property
    def num_rows(self) -> int:
        """Rows in the whole dataset."""
        return sum(rg.num_rows for rg in self.row_groups)


def open_filesystem(url: str, storage_options: Optional[Mapping[str, Any]]) -> Tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path in it."""
    import fsspec.core

    return fsspec.core.url_to_fs(url, **dict(storage_options or {}))


def _is_data_file(name: str) -> bool:
    # Spark leaves _SUCCESS and .crc side files next to the data; neither is Parquet.
    return not name.startswith(("_", ".")) and not name.endswith(".crc")


def scan_parquet(urls: Union[str, Sequence[str]],
                 storage_options: Optional[Mapping[str, Any]] = None) -> ParquetLayout:
    """Read the footers of every Parquet file under ``urls`` (directories or files).

    Only metadata is read: no column data.
    """
    import pyarrow.parquet as pq

    if isinstance(urls, str):
        urls = [urls]
    files: List[str] = []
    fs = None
    for url in urls:
        fs, path = open_filesystem(url, storage_options)
        if fs.isdir(path):
            found = [p for p in fs.find(path) if _is_data_file(posixpath.basename(p))]
            files.extend(sorted(found))
        elif fs.exists(path):
            files.append(path)
        else:
            raise ValueError(f"no Parquet data at {url!r}: the path does not exist; prepare the data "
                             "first (spark_hvd.spark.prepare_data) or check the store prefix")
    row_groups: List[RowGroup] = []
    names: Tuple[str, ...] = ()
    row_bytes: Dict[str, str] = {}
    for file in files:
        with fs.open(file, "rb") as f:
            meta = pq.ParquetFile(f).metadata
            if not names:
                names = tuple(meta.schema.to_arrow_schema().names)
                row_bytes = _row_bytes_columns(meta.metadata or {})
            for i in range(meta.num_row_groups):
                group = meta.row_group(i)
                row_groups.append(RowGroup(file, i, group.num_rows, group.total_byte_size))
    return ParquetLayout(tuple(files), tuple(row_groups), names, row_bytes)


def deal_row_groups(groups: Sequence[RowGroup], size: int, epoch: Optional[int], seed: int) -> List[List[int]]:
    """Indices of ``groups`` each of ``size`` ranks reads: with ``epoch`` None, row group ``i`` to
    rank ``i % size`` (fixed sharding); else a seeded permutation for that epoch, each group in turn
    to the rank with the fewest rows so far, so every rank gets about the same number of rows and,
    over the epochs, every rank sees all of the data. The same on every rank (a function of the
    layout, the seed and the epoch only). A rank left without a group borrows one."""
    shards: List[List[int]] = [[] for _ in range(size)]
    if epoch is None:
        for i in range(len(groups)):
            shards[i % size].append(i)
    else:
        rows = [0] * size
        for i in np.random.default_rng([seed, epoch, 2]).permutation(len(groups)):
            rank = min(range(size), key=lambda r: (rows[r], r))
            shards[rank].append(int(i))
            rows[rank] += groups[int(i)].num_rows
    for rank, shard in enumerate(shards):
        if not shard and groups:
            shard.append(rank % len(groups))
    return shards


def arrow_to_numpy(column: Any, shape: Optional[Tuple[int, ...]], name: str,
                   row_dtype: Optional[str] = None) -> np.ndarray:
    """An Arrow column as an ndarray of ``(rows, *shape)``; list columns become matrices, and a
    column of raw rows (``row_dtype`` given: see :func:`rows_as_bytes`) a view of its bytes."""
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    n = len(column)
    if row_dtype is not None:
        return _bytes_to_numpy(column, shape, name, row_dtype)
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type) \
            or pa.types.is_fixed_size_list(column.type):
        offsets = column.offsets.to_numpy() if not pa.types.is_fixed_size_list(column.type) else None
        values = np.asarray(column.flatten().to_numpy(zero_copy_only=False))
        if offsets is not None and n:
            lengths = np.diff(offsets)
            if lengths.min() != lengths.max():
                raise ValueError(
                    f"column {name!r} has rows of different lengths ({lengths.min()} to {lengths.max()}): "
                    "expected one length per column; prepare the data with prepare_data, which checks this")
        array = values.reshape(n, -1) if n else values.reshape(0, 0)
    else:
        array = np.asarray(column.to_numpy(zero_copy_only=False))
    if shape is not None and (n or -1 not in shape):
        array = array.reshape((n,) + tuple(shape))
    return array


def _row_bytes_columns(footer: Mapping[bytes, bytes]) -> Dict[str, str]:
    """Columns marked as raw rows in the Spark schema a Parquet footer carries, with their dtypes."""
    text = footer.get(_SPARK_SCHEMA_KEY)
    if not text:
        return {}
    try:
        fields = json.loads(text).get("fields", [])
    except ValueError:  # not Spark's JSON: no marked columns
        return {}
    return {f["name"]: f["metadata"][ROW_BYTES_KEY] for f in fields
            if isinstance(f.get("metadata"), dict) and ROW_BYTES_KEY in f["metadata"]}


def _bytes_to_numpy(column: Any, shape: Optional[Tuple[int, ...]], name: str, row_dtype: str) -> np.ndarray:
    """A binary column of raw rows as a ``(rows, *shape)`` view of its data (``(rows, n)`` without a
    shape); a ValueError naming the column when rows differ in length or one is null."""
    import pyarrow as pa

    dtype = np.dtype(row_dtype).newbyteorder("<")
    n = len(column)
    if not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
        raise ValueError(f"column {name!r} has type {column.type}: expected binary raw rows of {row_dtype}, as "
                         "its metadata says; the files were not written by prepare_data")
    if column.null_count:
        raise ValueError(f"column {name!r} has {column.null_count} null rows: expected a value in every row; "
                         "prepare the data with prepare_data, which checks this")
    offset_type = np.int64 if pa.types.is_large_binary(column.type) else np.int32
    offsets = np.frombuffer(column.buffers()[1], dtype=offset_type)[column.offset:column.offset + n + 1]
    per_row = int(np.prod(shape)) * dtype.itemsize if shape is not None and -1 not in shape else None
    if n:
        lengths = np.diff(offsets)
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo != hi or (per_row is not None and lo != per_row) or lo % dtype.itemsize:
            expected = f"{per_row} bytes ({per_row // dtype.itemsize} values)" if per_row is not None else \
                f"one length, a multiple of {dtype.itemsize} bytes"
            raise ValueError(f"column {name!r} has raw rows of {lo} to {hi} bytes: expected {expected} of "
                             f"{row_dtype} in every row; check the shapes given for it")
        per_row = lo
    width = (per_row or 0) // dtype.itemsize
    data = column.buffers()[2]
    start = int(offsets[0]) if n else 0
    values = np.frombuffer(data, dtype=np.uint8, count=n * width * dtype.itemsize, offset=start) \
        if data is not None and n * width else np.empty(0, dtype=np.uint8)
    array = values.view(dtype).reshape(n, width)
    if shape is not None and (n or -1 not in shape):
        array = array.reshape((n,) + tuple(shape))
    return array


def encode_row_bytes(column: Any, dtype: str) -> Any:
    """A ``list`` (or ``large_list``) Arrow column as a ``binary`` column of raw rows: each row's
    values as little-endian ``dtype`` bytes, the values themselves not copied where they already
    are ``dtype``. A null row stays null (and its values, like those behind a null element, are
    whatever they are: the data is checked before it is used)."""
    import pyarrow as pa

    target = np.dtype(dtype).newbyteorder("<")
    # flatten() leaves out what lies behind a null row, and a null row counts 0 values below.
    values = np.asarray(column.flatten().to_numpy(zero_copy_only=False))
    if values.dtype != target:
        values = values.astype(target)
    lengths = np.asarray(column.value_lengths().fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
    offsets = np.zeros(len(column) + 1, dtype=np.int64)
    np.cumsum(lengths * target.itemsize, out=offsets[1:])
    if offsets[-1] >= (1 << 31):
        raise ValueError(f"a row of {int(lengths.max())} values of {dtype} is over 2 GiB: expected rows Spark "
                         "can hold in one binary value; split the column")
    validity = None
    if column.null_count:
        validity = pa.array(column.is_valid().to_numpy(zero_copy_only=False)).buffers()[1]
    return pa.Array.from_buffers(pa.binary(), len(column), [validity, pa.py_buffer(offsets.astype(np.int32)),
                                                            pa.py_buffer(values.view(np.uint8))])


def rows_as_bytes(batches: Iterator[Any], columns: Mapping[str, str]) -> Iterator[Any]:
    """Arrow record batches with each of ``columns`` (name to numpy dtype) as raw rows
    (:func:`encode_row_bytes`), the other columns as they are; a batch whose raw rows would pass
    :data:`_MAX_BATCH_BYTES` leaves in slices. The function ``prepare_data`` maps over the
    DataFrame (``mapInArrow``) on Spark's Python workers."""
    import pyarrow as pa

    for batch in batches:
        if not batch.num_rows:
            continue
        sizes = [batch.column(name).value_lengths().fill_null(0) for name in columns]
        widest = max((int(np.asarray(s.to_numpy(zero_copy_only=False)).max()) * np.dtype(dtype).itemsize
                      for s, dtype in zip(sizes, columns.values())), default=0)
        step = max(1, _MAX_BATCH_BYTES // max(widest, 1))
        for start in range(0, batch.num_rows, step):
            part = batch.slice(start, step) if step < batch.num_rows else batch
            arrays = [encode_row_bytes(part.column(i), columns[name]) if name in columns else part.column(i)
                      for i, name in enumerate(part.schema.names)]
            yield pa.RecordBatch.from_arrays(arrays, names=part.schema.names)


def row_bytes_field(name: str, dtype: str) -> Any:
    """The Spark field of a raw-row column: ``binary``, marked with its values' dtype."""
    from pyspark.sql import types as T

    return T.StructField(name, T.BinaryType(), True, {ROW_BYTES_KEY: dtype})
