"""Where the estimator's training loop loses against bare loops: the reader and the allreduce, apart and together.

    python benchmarks/training_sources.py [--rows 4M] [--batch 1024] [--repeats 1] [--json PATH] [--quick]

The data is the estimator benchmark's shape (``estimator_scale.py``): 30 float32 features stored as
one binary value of raw float32 per row and a 0/1 label, written with pyarrow into 8 Parquet files
of 250k-row groups (as ``prepare_data`` stores a Vector column). Two ranks start through
``spark_hvd.runner.run`` with one torch thread each and train the 30-64-64-1 MLP with Adam and a
logistic loss for one epoch of their shard, in these modes:

- ``bare, slices``: plain torch over one in-memory matrix of the rank's rows, cut into batches in
  stored order (views, no copy, no shuffle): the floor ``estimator_scale.py`` compares against;
- ``bare, shuffled rows``: the same matrix, each batch gathered from it by a seeded permutation of
  its rows (``np.take``), which is what shuffling every epoch costs on its own;
- ``bare, read then loop``: each rank reads its files (half of them) with pyarrow into one matrix,
  then runs the plain loop over it in stored order, the read timed too: the floor of a fit's first
  epoch;
- ``bare, memory``: plain torch over in-memory batches (the builtin reader's batches, read first);
- ``bare, reader``: plain torch fed by the builtin reader as it reads (``make_reader``, shuffled);
- ``hvd, memory``: ``DistributedOptimizer`` over in-memory batches;
- ``hvd, cache``: ``DistributedOptimizer`` fed by the builtin reader from its decoded shard cache
  (``cache_all=True``; a first epoch fills it, untimed; each rank keeps its row groups, so the timed
  epoch reads no file), which is what ``TorchEstimator.fit`` runs per step once every row group
  it reads is cached;
- ``hvd, reader``: ``DistributedOptimizer`` fed by the reader as it reads, without the cache (what
  the fit runs when its shard does not fit in memory);
- ``hvd, first epoch``: the same with the cache on (``cache_all=True``), the epoch that fills it
  timed: what the fit runs in its first epoch.

Each row gives the rows per second of both ranks together, the ratios to ``bare, memory`` and to
``bare, slices`` of the same run, and for the ``hvd`` modes the allreduce wait (``synchronize()``)
per step: the mean, median and 99th percentile of each rank, in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
DEFAULT_JSON = HERE / "results" / "training_sources.json"
MODES = ("bare, slices", "bare, shuffled rows", "bare, read then loop", "bare, memory", "bare, reader", "hvd, memory", "hvd, cache",
         "hvd, reader", "hvd, first epoch")
FEATURES = 30
FILES = 8


def parse_rows(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1_000, "M": 1_000_000}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def write_data(directory: str, rows: int) -> List[str]:
    """``rows`` rows in ``FILES`` Parquet files of 250k-row groups; the paths."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    paths = []
    per_file = max(1, rows // FILES)
    for i in range(FILES):
        x = rng.standard_normal((per_file, FEATURES), dtype=np.float32)
        offsets = np.arange(per_file + 1, dtype=np.int32) * (FEATURES * 4)
        features = pa.Array.from_buffers(pa.binary(), per_file, [None, pa.py_buffer(offsets), pa.py_buffer(x)])
        label = pa.array((rng.random(per_file) < 0.5).astype(np.float32))
        path = os.path.join(directory, f"part-{i}.parquet")
        # The Spark schema prepare_data's files carry, which marks the column as raw float32 rows.
        spark_schema = json.dumps({"type": "struct", "fields": [
            {"name": "features", "type": "binary", "nullable": True, "metadata": {"spark_hvd_row_bytes": "float32"}},
            {"name": "label", "type": "float", "nullable": True, "metadata": {}}]})
        table = pa.table({"features": features, "label": label}).replace_schema_metadata(
            {"org.apache.spark.sql.parquet.row.metadata": spark_schema})
        pq.write_table(table, path, row_group_size=250_000)
        paths.append(path)
    return paths


def rank_loop(mode: str, paths: List[str], batch: int) -> Dict[str, Any]:
    """One rank's epoch in ``mode``: its rows per second and each step's allreduce wait (s)."""
    import numpy as np
    import torch

    import spark_hvd.torch as hvd
    from spark_hvd.spark.data.reader import make_reader

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    distributed = mode.startswith("hvd")
    if distributed:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    reader = make_reader("builtin", paths, rank=hvd.rank(), size=hvd.size(), batch_size=batch,
                         feature_cols=["features"], label_cols=["label"], shapes={"features": [FEATURES]},
                         cache_all=mode.endswith(("cache", "first epoch")), reshuffle=not mode.endswith("cache"))
    batches: Any
    if mode.endswith("memory"):
        batches = list(reader.iter_epoch(0))
    elif mode.endswith("cache"):
        for _ in reader.iter_epoch(0):  # fills the cache
            pass
        batches = reader.iter_epoch(1)
    elif mode == "bare, read then loop":
        batches = None  # read in the timed part
    elif mode.startswith("bare, s"):
        read = list(reader.iter_epoch(0))
        matrix = np.concatenate([b["features"] for b in read]).reshape(-1, FEATURES)
        labels = np.concatenate([b["label"] for b in read])
        order = np.random.default_rng([0, hvd.rank()]).permutation(len(matrix)) if "shuffled" in mode else None
        batches = _matrix_batches(matrix, labels, batch, order)
    else:
        batches = reader.iter_epoch(0)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    waits: List[float] = []
    rows = 0
    started = time.perf_counter()
    if mode == "bare, read then loop":
        matrix, labels = _read_matrix(paths[hvd.rank()::hvd.size()])
        batches = _matrix_batches(matrix, labels, batch, None)
    for b in batches:
        x = torch.from_numpy(np.asarray(b["features"])).reshape(-1, FEATURES)
        y = torch.from_numpy(np.asarray(b["label"])).reshape(-1, 1)
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        if distributed:
            before = time.perf_counter()
            optimizer.synchronize()
            waits.append(time.perf_counter() - before)
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
        rows += x.shape[0]
    elapsed = time.perf_counter() - started
    reader.close()
    return {"rows_per_s": rows / elapsed, "waits_s": waits}


def _read_matrix(paths: List[str]) -> Any:
    """The features of ``paths`` as one float32 matrix and their labels, read with pyarrow alone: the
    raw rows of each chunk viewed in place, then copied once into the matrix."""
    import numpy as np
    import pyarrow.parquet as pq

    tables = [pq.read_table(p, use_threads=False) for p in paths]
    parts = []
    for table in tables:
        for chunk in table.column("features").chunks:
            # Each binary value holds one row's float32 values back to back.
            start = int(np.frombuffer(chunk.buffers()[1], np.int32)[chunk.offset])
            parts.append(np.frombuffer(chunk.buffers()[2], dtype=np.float32, count=len(chunk) * FEATURES,
                                       offset=start))
    matrix = np.concatenate(parts).reshape(-1, FEATURES)
    labels = np.concatenate([t.column("label").to_numpy() for t in tables])
    return matrix, labels


def _matrix_batches(matrix: Any, labels: Any, batch: int, order: Any) -> Any:
    """Batches of ``matrix``'s rows: slices in stored order, or (with ``order``) rows gathered by it."""
    import numpy as np

    for start in range(0, len(matrix) - batch + 1, batch):
        if order is None:
            yield {"features": matrix[start:start + batch], "label": labels[start:start + batch]}
        else:
            rows = order[start:start + batch]
            yield {"features": np.take(matrix, rows, axis=0), "label": np.take(labels, rows, axis=0)}


def run_mode(mode: str, paths: List[str], batch: int, timeout: float) -> Dict[str, Any]:
    import numpy as np

    from spark_hvd.runner import run

    results = run(rank_loop, args=(mode, paths, batch), np=2, timeout=timeout)
    record: Dict[str, Any] = {"rows_per_s": sum(r["rows_per_s"] for r in results), "ranks": []}
    for r in results:
        waits = np.array(r["waits_s"]) * 1e3
        record["ranks"].append({} if not len(waits) else {
            "mean_ms": float(waits.mean()), "median_ms": float(np.median(waits)),
            "p99_ms": float(np.percentile(waits, 99))})
    return record


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="4M", help="rows in all (default 4M)")
    parser.add_argument("--batch", type=int, default=1024, help="rows per rank per step (default 1024)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode, interleaved; the median counts")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), metavar="MODE",
                        help="the modes to run (default: all); 'bare, memory' and 'bare, slices' always run")
    parser.add_argument("--quick", action="store_true", help="tiny data through every mode (a smoke test)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    rows = 40_000 if args.quick else parse_rows(args.rows)
    if rows < FILES * args.batch * 2:
        raise SystemExit(f"--rows {rows} is too few for --batch {args.batch}: expected at least "
                         f"{FILES * args.batch * 2} (two ranks, {FILES} files)")
    modes = [m for m in MODES if m in args.modes or m in ("bare, memory", "bare, slices")]
    runs: Dict[str, List[Dict[str, Any]]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="spark-hvd-sources-") as scratch:
        paths = write_data(scratch, rows)
        for repeat in range(args.repeats):
            for mode in modes:
                record = run_mode(mode, paths, args.batch, args.timeout)
                runs[mode].append(record)
                print(f"run {repeat + 1}/{args.repeats} {mode}: {record['rows_per_s']:,.0f} rows/s", flush=True)
    medians = {mode: statistics.median(r["rows_per_s"] for r in records) for mode, records in runs.items()}
    floor, slices = medians["bare, memory"], medians["bare, slices"]
    print(f"\n{rows:,} rows, batch {args.batch} per rank, np=2, one torch thread per rank "
          f"(medians of {args.repeats} run(s))")
    print("| mode | rows/s | vs bare, memory | vs bare, slices | allreduce wait per step, ms: mean / median / p99 "
          "per rank |")
    print("|---|---|---|---|---|")
    for mode in modes:
        best = min(runs[mode], key=lambda r: abs(r["rows_per_s"] - medians[mode]))
        waits = "; ".join(f"{r['mean_ms']:.2f} / {r['median_ms']:.2f} / {r['p99_ms']:.2f}"
                          for r in best["ranks"] if r) or "-"
        print(f"| {mode} | {medians[mode]:,.0f} | {medians[mode] / floor:.2f}x | {medians[mode] / slices:.2f}x "
              f"| {waits} |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rows": rows, "batch": args.batch, "python": sys.version.split()[0],
                                     "runs": runs, "medians": medians}, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
