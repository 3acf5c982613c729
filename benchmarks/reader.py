"""What rows cost to reach a batch: the builtin reader against pyarrow's own decode and a memcpy, per Parquet layout.

    python benchmarks/reader.py [--rows 1M] [--batch 1024] [--repeats 3] [--json PATH] [--quick]

One process, one thread; every figure is CPU time (``time.process_time``), the best of
``--repeats``. The data is the estimator benchmark's: 30 float32 features and a 0/1 label, written
with pyarrow in row groups of 250k rows (snappy, no dictionary) in each layout of the features:

- ``list<float>``: one list column, what ``prepare_data`` wrote for a Vector column before its
  format 2 (``vector_dtype="float32"``);
- ``list<double>``: the same in float64 (``prepare_data``'s default ``vector_dtype``);
- ``30 float columns``: one float32 column per feature;
- ``fixed_size_binary(120)``: one row's 30 float32 values as 120 raw bytes;
- ``binary, 120 bytes each``: the same bytes in a plain ``binary`` column (Spark's BinaryType, which
  Spark can write), read as a matrix straight from the column's data once its offsets are checked:
  the raw rows ``prepare_data`` writes for array and Vector columns (its format 2), marked as such in
  the Spark schema of the footer as Spark writes it.

For each layout the table gives the CPU per batch of ``--batch`` rows of:

- ``decode``: ``ParquetFile.read_row_group`` of every row group into Arrow (pyarrow's own decode);
- ``to numpy``: decode plus turning the features into one ``(rows, 30)`` float32 matrix (a view
  where the layout allows one, else the least copying that numpy offers);
- ``reader``: the builtin reader (``make_reader(..., shuffle=False)``) over the same files, every
  batch drawn; ``reader, shuffled``: with its default 10,000-row shuffle buffer; ``reader, cached``:
  the second epoch of ``cache_all=True``, shuffled. The reader reads list columns and raw rows; a
  layout it cannot read shows ``-``.

and, as the floor, ``memcpy``: copying one batch of features out of a contiguous matrix into a
preallocated one (``np.take`` by a random index, what a shuffled batch from a decoded cache costs).
Ratios are to that floor.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

HERE = Path(__file__).resolve().parent
DEFAULT_JSON = HERE / "results" / "reader.json"
FEATURES = 30
ROW_GROUP = 250_000
LAYOUTS = ("list<float>", "list<double>", "30 float columns", "fixed_size_binary(120)", "binary, 120 bytes each")
READABLE = ("list<float>", "list<double>", "binary, 120 bytes each")
"""Layouts the builtin reader reads."""
READS = ("decode", "to numpy", "reader", "reader, shuffled", "reader, cached")


def parse_rows(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1_000, "M": 1_000_000}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def features_table(x: Any, label: Any, layout: str) -> Any:
    """The Arrow table of ``x`` (rows, 30) float32 and ``label`` in ``layout``."""
    import numpy as np
    import pyarrow as pa

    flat = pa.array(x.reshape(-1))
    if layout == "list<float>":
        columns = {"features": pa.FixedSizeListArray.from_arrays(flat, FEATURES).cast(pa.list_(pa.float32()))}
    elif layout == "list<double>":
        columns = {"features": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1).astype(np.float64)),
                                                                 FEATURES).cast(pa.list_(pa.float64()))}
    elif layout == "30 float columns":
        columns = {f"f{i}": pa.array(np.ascontiguousarray(x[:, i])) for i in range(FEATURES)}
    elif layout == "fixed_size_binary(120)":
        raw = np.ascontiguousarray(x).view(np.uint8).reshape(-1)
        columns = {"features": pa.FixedSizeBinaryArray.from_buffers(
            pa.binary(4 * FEATURES), len(x), [None, pa.py_buffer(raw)])}
    elif layout == "binary, 120 bytes each":
        raw = np.ascontiguousarray(x).view(np.uint8).reshape(-1)
        offsets = np.arange(0, len(x) * 4 * FEATURES + 1, 4 * FEATURES, dtype=np.int32)
        columns = {"features": pa.BinaryArray.from_buffers(pa.binary(), len(x),
                                                           [None, pa.py_buffer(offsets), pa.py_buffer(raw)])}
    else:
        raise ValueError(f"layout={layout!r} is not known: expected one of {LAYOUTS}")
    table = pa.table({**columns, "label": pa.array(label)})
    if layout == "binary, 120 bytes each":  # marked as prepare_data's Spark write marks raw rows
        from spark_hvd.spark.data.layout import ROW_BYTES_KEY

        spark_schema = {"type": "struct", "fields": [
            {"name": "features", "type": "binary", "nullable": True, "metadata": {ROW_BYTES_KEY: "float32"}},
            {"name": "label", "type": "float", "nullable": True, "metadata": {}}]}
        table = table.replace_schema_metadata({"org.apache.spark.sql.parquet.row.metadata": json.dumps(spark_schema)})
    return table


def write_layout(directory: str, layout: str, rows: int) -> str:
    """``rows`` rows (seed 0) in ``layout``, one Parquet file; its path."""
    import numpy as np
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, FEATURES), dtype=np.float32)
    label = (rng.random(rows) < 0.5).astype(np.float32)
    path = os.path.join(directory, layout.replace("<", "_").replace(">", "").replace(" ", "_")
                        .replace("(", "_").replace(")", "") + ".parquet")
    pq.write_table(features_table(x, label, layout), path, row_group_size=ROW_GROUP, compression="snappy",
                   use_dictionary=False)
    return path


def to_matrix(table: Any, layout: str) -> Any:
    """The features of ``table`` as one (rows, 30) float32 matrix."""
    import numpy as np

    if layout == "30 float columns":
        out = np.empty((table.num_rows, FEATURES), np.float32)
        for i in range(FEATURES):
            out[:, i] = table.column(f"f{i}").to_numpy()
        return out
    column = table.column("features").combine_chunks()
    if layout == "fixed_size_binary(120)":
        data = column.buffers()[1]
        offset = column.offset * 4 * FEATURES
        return np.frombuffer(data, np.float32, count=len(column) * FEATURES,
                             offset=offset).reshape(len(column), FEATURES)
    if layout == "binary, 120 bytes each":
        offsets = np.frombuffer(column.buffers()[1], np.int32, count=len(column) + 1, offset=column.offset * 4)
        if len(column) and np.any(np.diff(offsets) != 4 * FEATURES):
            raise ValueError("a row of the binary column is not 120 bytes long")
        return np.frombuffer(column.buffers()[2], np.float32, count=len(column) * FEATURES,
                             offset=int(offsets[0])).reshape(len(column), FEATURES)
    values = column.flatten().to_numpy()
    return values.reshape(len(column), FEATURES).astype(np.float32, copy=False)


def cpu(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def measure(path: str, layout: str, rows: int, batch: int, repeats: int) -> Dict[str, Optional[float]]:
    """CPU seconds per batch of each read of ``path``."""
    import pyarrow.parquet as pq

    from spark_hvd.spark.data.reader import make_reader

    file = pq.ParquetFile(path)
    groups = range(file.num_row_groups)
    batches = rows / batch

    def decode() -> None:
        for g in groups:
            file.read_row_group(g)

    def numpy() -> None:
        for g in groups:
            to_matrix(file.read_row_group(g), layout)

    out: Dict[str, Optional[float]] = {"decode": cpu(decode, repeats) / batches,
                                       "to numpy": cpu(numpy, repeats) / batches}
    if layout not in READABLE:
        out.update({"reader": None, "reader, shuffled": None, "reader, cached": None})
        return out
    shapes = {"features": (FEATURES,)}

    def read(shuffle: bool, cache_all: bool = False) -> float:
        """CPU seconds of the reader's last epoch: the first, or with ``cache_all`` the second."""
        best = float("inf")
        for _ in range(repeats):
            with make_reader("builtin", path, rank=0, size=1, batch_size=batch, feature_cols=["features"],
                             label_cols=["label"], shuffle=shuffle, cache_all=cache_all, shapes=shapes) as reader:
                if cache_all:
                    for _ in reader.iter_epoch(0):
                        pass
                start = time.process_time()
                for _ in reader.iter_epoch(1 if cache_all else 0):
                    pass
                best = min(best, time.process_time() - start)
        return best

    out["reader"] = read(False) / batches
    out["reader, shuffled"] = read(True) / batches
    out["reader, cached"] = read(True, cache_all=True) / batches
    return out


def memcpy_floor(batch: int, repeats: int) -> float:
    """CPU seconds to gather one shuffled batch of features out of a contiguous matrix."""
    import numpy as np

    rng = np.random.default_rng(1)
    matrix = rng.standard_normal((ROW_GROUP, FEATURES), dtype=np.float32)
    into = np.empty((batch, FEATURES), np.float32)
    orders = [rng.integers(0, ROW_GROUP, batch) for _ in range(64)]
    reps = 2000

    def gather() -> None:
        for i in range(reps):
            np.take(matrix, orders[i % 64], axis=0, out=into)

    return cpu(gather, repeats) / reps


def table(results: Dict[str, Any]) -> str:
    floor = results["memcpy_s"]
    lines = [f"floor: memcpy of one shuffled batch of {results['batch']} x {FEATURES} float32: "
             f"{floor * 1e6:.1f} us", "",
             "| layout | " + " | ".join(f"{r} (us/batch, x memcpy)" for r in READS) + " |",
             "|---|" + "---|" * len(READS)]
    for layout in LAYOUTS:
        cells = []
        for r in READS:
            value = results["layouts"][layout][r]
            cells.append("-" if value is None else f"{value * 1e6:.0f} ({value / floor:.1f}x)")
        lines.append(f"| {layout} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=parse_rows, default=parse_rows("1M"))
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--quick", action="store_true", help="250k rows, one repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.repeats = ROW_GROUP, 1
    if args.rows < args.batch or args.batch < 1:
        parser.error(f"--rows {args.rows} and --batch {args.batch}: expected 1 <= batch <= rows")
    results: Dict[str, Any] = {"rows": args.rows, "batch": args.batch, "repeats": args.repeats,
                               "memcpy_s": memcpy_floor(args.batch, args.repeats), "layouts": {}}
    with tempfile.TemporaryDirectory(prefix="spark-hvd-reader-bench-") as directory:
        for layout in LAYOUTS:
            path = write_layout(directory, layout, args.rows)
            results["layouts"][layout] = measure(path, layout, args.rows, args.batch, args.repeats)
            os.unlink(path)
    print(f"{args.rows:,} rows, batch {args.batch}, CPU time of one thread, best of {args.repeats}")
    print(table(results))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
