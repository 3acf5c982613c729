"""Where TorchEstimator.fit() and KerasEstimator.fit() spend their wall time, and how fast their models' transform() predicts.

    python benchmarks/estimator.py [--fits 3] [--rows 256] [--transform-rows 200000] [--json PATH]
                                   [--frameworks torch keras] [--compare-cold]

Runs on an embedded local[2] Spark. fit() on a small frame (256 rows by default, as in the
Horovod measurement of about 80 s) is split into validation, materialization (Parquet in the
store), launch (barrier tasks until rank 0 starts training), training and collection (from the
last epoch to the returned model); the first fit pays the cold start of Spark's jobs, the others
are warm (each on a new DataFrame, so materialization is measured every time). transform() is
timed on a larger frame against a row-by-row baseline on the same model: an RDD pass that calls
the model once per row, the way Horovod's TorchModel predicts. Targets: fit() overhead beyond
the training loop under 10 s; transform at least 100x the row-by-row baseline. KerasEstimator
gets the same fits and the same batched transform timing, with the same MLP in Keras (its ranks
import TensorFlow, so its launch phase is longer); the row-by-row baseline is timed for torch.
``--compare-cold`` also times the same torch fits with ranks started as fresh interpreters instead
of forked from the Python workers' warm processes, in the same session, side by side.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import numpy as np

HERE = Path(__file__).resolve().parent
DEFAULT_JSON = HERE / "results" / "estimator.json"
PHASES = ("validation", "materialization", "launch", "training", "collection")
FIT_OVERHEAD_TARGET_S = 10.0
TRANSFORM_SPEEDUP_TARGET = 100.0
HOROVOD_FIT_S = 80.0
FEATURES = 16
FRAMEWORKS = ("torch", "keras")
STEP_RATIO_TARGET = 1.25


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fits", type=int, default=3, help="fits to time (the first is cold)")
    parser.add_argument("--rows", type=int, default=256, help="rows of the fit() frame")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--transform-rows", type=int, default=200_000, help="rows for transform()")
    parser.add_argument("--baseline-rows", type=int, default=20_000, help="rows for the row-by-row baseline")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where the results go")
    parser.add_argument("--step-rows", type=int, default=200_000,
                        help="rows for the per-step comparison of TorchEstimator with the bare training loop "
                             "(0 skips it)")
    parser.add_argument("--step-batch", type=int, default=32, help="batch size of the per-step comparison")
    parser.add_argument("--compare-cold", action="store_true",
                        help="also time the same fits with ranks started as fresh interpreters (no warm process), "
                             "in the same session, and print repeat fits side by side")
    parser.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS),
                        help="estimators to time (torch is always timed: the baseline compares against it)")
    return parser


def make_model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 1))


def make_keras_model() -> Any:
    """The same MLP as :func:`make_model`, in Keras 3."""
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)])


def make_estimator(framework: str, args: argparse.Namespace, store_dir: str, run_id: str, batch_size: int = 32) -> Any:
    """A TorchEstimator or KerasEstimator of the benchmark's MLP with the same settings."""
    from spark_hvd.spark import Store

    common = dict(num_proc=2, feature_cols=["features"], label_cols=["label"], batch_size=batch_size, epochs=args.epochs,
                  store=Store.create(store_dir), run_id=run_id, verbose=0)
    if framework == "keras":
        import keras

        from spark_hvd.spark.keras import KerasEstimator

        return KerasEstimator(model=make_keras_model(), optimizer=keras.optimizers.Adam(1e-3),
                              loss=keras.losses.BinaryCrossentropy(from_logits=True), **common)
    import torch

    from spark_hvd.spark.torch import TorchEstimator

    model = make_model()
    return TorchEstimator(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
                          loss=torch.nn.BCEWithLogitsLoss(), **common)


def make_frame(spark: Any, rows: int, seed: int) -> Any:
    """A DataFrame with a Vector column 'features' and a 0/1 'label'."""
    import pandas as pd
    from pyspark.ml.feature import VectorAssembler

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES))
    pdf = pd.DataFrame(x, columns=[f"x{i}" for i in range(FEATURES)])
    pdf["label"] = (x[:, 0] - x[:, 1] > 0).astype(np.float64)
    df = spark.createDataFrame(pdf)
    return VectorAssembler(inputCols=list(pdf.columns[:-1]), outputCol="features").transform(df) \
        .select("features", "label")


def time_fits(spark: Any, args: argparse.Namespace, store_dir: str, framework: str = "torch",
              cold: bool = False) -> List[Dict[str, float]]:
    """``args.fits`` fits, each on a new frame; ``cold``: ranks start as fresh interpreters (the
    estimator preloads nothing), as every rank did before warm starts."""
    results = []
    for i in range(args.fits):
        df = make_frame(spark, args.rows, seed=i)
        est = make_estimator(framework, args, store_dir, run_id=f"bench-{framework}-{i}-{cold}-{int(time.time())}")
        if cold:
            est.rank_preload = ()
        started = time.monotonic()
        fitted = est.fit(df)
        total = time.monotonic() - started
        row = {phase: fitted.fit_timings.get(phase, 0.0) for phase in PHASES}
        row["total"] = total
        row["overhead"] = total - row["training"]
        results.append(row)
        print(f"{framework}{' (cold ranks)' if cold else ''} fit {i + 1}/{args.fits}: {total:.1f} s "
              f"({', '.join(f'{p} {row[p]:.2f}' for p in PHASES)})", flush=True)
    return results


def _bare_loop(steps: int, batch: int, seed: int) -> float:
    """One rank of the bare loop: the benchmark's MLP and optimizer under DistributedOptimizer,
    stepping through batches sliced from tensors built beforehand; seconds per step."""
    import torch

    import spark_hvd.torch as hvd

    hvd.init()
    try:
        torch.set_num_threads(1)
        model = make_model()
        optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3 * hvd.size()),
                                             named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        loss_fn = torch.nn.BCEWithLogitsLoss()
        generator = torch.Generator().manual_seed(seed + hvd.rank())
        x = torch.randn(steps * batch, FEATURES, generator=generator)
        y = (x[:, :1] - x[:, 1:2] > 0).float()
        warmup = min(50, steps // 10)
        for i in range(steps):
            if i == warmup:
                hvd.barrier()
                started = time.perf_counter()
            optimizer.zero_grad()
            loss = loss_fn(model(x[i * batch:(i + 1) * batch]), y[i * batch:(i + 1) * batch])
            loss.backward()
            optimizer.step()
        return (time.perf_counter() - started) / (steps - warmup)
    finally:
        hvd.shutdown()


def time_steps(spark: Any, args: argparse.Namespace, store_dir: str) -> Dict[str, Any]:
    """TorchEstimator's training time per step (from its history: the epoch's rows per second)
    next to the bare loop's at the same batch and num_proc, on the same MLP."""
    from spark_hvd.runner import run

    batch, num_proc = args.step_batch, 2
    df = make_frame(spark, args.step_rows, seed=100).cache()
    df.count()
    step_args = argparse.Namespace(**{**vars(args), "epochs": 2})
    est = make_estimator("torch", step_args, store_dir, run_id=f"bench-steps-{int(time.time())}", batch_size=batch)
    fitted = est.fit(df)
    df.unpersist()
    last = fitted.getHistory()[-1]  # the second epoch: readers and engine warm
    estimator_s = batch * num_proc / last["rows_per_s"]
    steps = max(200, args.step_rows // (batch * num_proc))
    bare = run(_bare_loop, args=(steps, batch, 0), np=num_proc)
    bare_s = max(bare)
    result = {"rows": args.step_rows, "batch": batch, "num_proc": num_proc, "estimator_step_s": estimator_s,
              "bare_step_s": bare_s, "ratio": estimator_s / bare_s, "estimator_rows_per_s": last["rows_per_s"],
              "bare_rows_per_s": batch * num_proc / bare_s}
    print(f"per step at batch {batch}, num_proc={num_proc}: TorchEstimator {estimator_s * 1e3:.3f} ms, "
          f"bare loop {bare_s * 1e3:.3f} ms ({result['ratio']:.2f}x)", flush=True)
    return result


def print_step_table(steps: Dict[str, Any]) -> None:
    print()
    print(f"training step of the {FEATURES}-feature MLP, batch {steps['batch']} per rank, num_proc={steps['num_proc']}")
    print(f"| {'loop':<52} | {'ms/step':>8} | {'rows/s':>11} |")
    print(f"|{'-' * 54}|{'-' * 10}|{'-' * 13}|")
    print(f"| {'TorchEstimator.fit (Parquet reader, epoch 2 of 2)':<52} | {steps['estimator_step_s'] * 1e3:>8.3f} | "
          f"{steps['estimator_rows_per_s']:>11,.0f} |")
    print(f"| {'bare loop (tensors in memory, DistributedOptimizer)':<52} | {steps['bare_step_s'] * 1e3:>8.3f} | "
          f"{steps['bare_rows_per_s']:>11,.0f} |")
    verdict = "meets" if steps["ratio"] <= STEP_RATIO_TARGET else "MISSES"
    print(f"estimator/bare {steps['ratio']:.2f}x {verdict} the target of <= {STEP_RATIO_TARGET}x")


def row_by_row(model_bytes: bytes, rows: Iterator[Any]) -> Iterator[Any]:
    """Horovod's TorchModel way: the model loaded once per partition, then for each row a dict of
    its fields, one tensor per feature, one forward pass, and a new Row with the prediction."""
    import cloudpickle
    import torch
    from pyspark.sql import Row

    model = cloudpickle.loads(model_bytes)
    model.eval()
    for row in rows:
        fields = row.asDict().copy()
        features = torch.tensor([row["features"]]).float().reshape(-1, FEATURES)
        with torch.no_grad():
            prediction = model(features)
        fields["label__output"] = float(prediction.item())
        yield Row(*fields.values())


def time_transform(spark: Any, args: argparse.Namespace) -> Dict[str, Any]:
    import cloudpickle
    from pyspark.sql.types import DoubleType, StructField, StructType

    from spark_hvd.spark.torch import TorchModel

    model = make_model()
    torch_model = TorchModel(model=model, feature_cols=["features"], label_cols=["label"])
    big = make_frame(spark, args.transform_rows, seed=100).repartition(2).cache()
    small = make_frame(spark, args.baseline_rows, seed=101).repartition(2).cache()
    big.count()
    small.count()

    def run_batched(frame: Any) -> float:
        started = time.monotonic()
        torch_model.transform(frame).write.format("noop").mode("overwrite").save()
        return time.monotonic() - started

    run_batched(small)  # warm-up: Python workers, broadcast, model load
    batched_s = min(run_batched(big) for _ in range(3))
    payload = spark.sparkContext.broadcast(cloudpickle.dumps(model))
    schema = StructType(list(small.schema.fields) + [StructField("label__output", DoubleType())])

    def run_baseline() -> float:
        started = time.monotonic()
        predicted = small.rdd.mapPartitions(lambda rows: row_by_row(payload.value, rows))
        spark.createDataFrame(predicted, schema).write.format("noop").mode("overwrite").save()
        return time.monotonic() - started

    run_baseline()
    baseline_s = min(run_baseline() for _ in range(3))
    batched_rate = args.transform_rows / batched_s
    baseline_rate = args.baseline_rows / baseline_s
    return {"batched_rows": args.transform_rows, "batched_s": batched_s, "batched_rows_per_s": batched_rate,
            "baseline_rows": args.baseline_rows, "baseline_s": baseline_s, "baseline_rows_per_s": baseline_rate,
            "speedup": batched_rate / baseline_rate}


def time_keras_transform(spark: Any, args: argparse.Namespace) -> Dict[str, Any]:
    """KerasModel.transform of the Keras MLP on the same frames: warm-up, then the best of three."""
    from spark_hvd.spark.keras import KerasModel

    keras_model = KerasModel(model=make_keras_model(), feature_cols=["features"], label_cols=["label"])
    big = make_frame(spark, args.transform_rows, seed=100).repartition(2).cache()
    small = make_frame(spark, args.baseline_rows, seed=101).repartition(2).cache()
    big.count()
    small.count()

    def run_batched(frame: Any) -> float:
        started = time.monotonic()
        keras_model.transform(frame).write.format("noop").mode("overwrite").save()
        return time.monotonic() - started

    run_batched(small)  # warm-up: Python workers import TensorFlow and load the model
    batched_s = min(run_batched(big) for _ in range(3))
    return {"batched_rows": args.transform_rows, "batched_s": batched_s,
            "batched_rows_per_s": args.transform_rows / batched_s}


def print_fit_table(fits: List[Dict[str, float]], rows: int, estimator: str) -> None:
    warm = fits[1:] or fits
    print()
    print(f"{estimator}.fit() on {rows} rows, local[2], num_proc=2 (seconds)")
    print(f"| {'phase':<30} | {'cold (fit 1)':>12} | {'warm median':>12} |")
    print(f"|{'-' * 32}|{'-' * 14}|{'-' * 14}|")
    for key in PHASES + ("total", "overhead"):
        label = {"overhead": "overhead beyond training", "total": "total wall"}.get(key, key)
        print(f"| {label:<30} | {fits[0][key]:>12.2f} | {statistics.median(r[key] for r in warm):>12.2f} |")
    overhead = statistics.median(r["overhead"] for r in warm)
    verdict = "meets" if overhead < FIT_OVERHEAD_TARGET_S else "MISSES"
    print(f"warm overhead {overhead:.1f} s {verdict} the target of < {FIT_OVERHEAD_TARGET_S:.0f} s "
          f"(Horovod 0.28.1: about {HOROVOD_FIT_S:.0f} s for the whole fit here)")


def print_cold_table(fits: List[Dict[str, float]], cold_fits: List[Dict[str, float]], rows: int) -> None:
    """Repeat fits (all but the first of each kind) with warm rank starts against fresh interpreters."""
    warm, cold = fits[1:] or fits, cold_fits[1:] or cold_fits
    print()
    print(f"TorchEstimator repeat fits on {rows} rows, same session: ranks forked from the warm process "
          "vs fresh interpreters (medians, seconds)")
    print(f"| {'phase':<30} | {'warm ranks':>12} | {'fresh ranks':>12} | {'fresh/warm':>10} |")
    print(f"|{'-' * 32}|{'-' * 14}|{'-' * 14}|{'-' * 12}|")
    for key in PHASES + ("total",):
        w, c = statistics.median(r[key] for r in warm), statistics.median(r[key] for r in cold)
        ratio = f"{c / w:.2f}x" if w > 0 else "-"
        print(f"| {'total wall' if key == 'total' else key:<30} | {w:>12.2f} | {c:>12.2f} | {ratio:>10} |")


def print_tables(fits: List[Dict[str, float]], transform: Dict[str, Any], rows: int,
                 keras_result: Optional[Dict[str, Any]] = None) -> None:
    print_fit_table(fits, rows, "TorchEstimator")
    if keras_result is not None:
        print_fit_table(keras_result["fits"], rows, "KerasEstimator")
    print()
    print(f"transform() of a {FEATURES}-feature MLP (rows per second)")
    print(f"| {'method':<52} | {'rows':>8} | {'seconds':>8} | {'rows/s':>11} |")
    print(f"|{'-' * 54}|{'-' * 10}|{'-' * 10}|{'-' * 13}|")
    print(f"| {'TorchModel.transform (Arrow, batches of 1024)':<52} | {transform['batched_rows']:>8} | "
          f"{transform['batched_s']:>8.2f} | {transform['batched_rows_per_s']:>11,.0f} |")
    if keras_result is not None:
        keras_transform = keras_result["transform"]
        print(f"| {'KerasModel.transform (Arrow, batches of 1024)':<52} | {keras_transform['batched_rows']:>8} | "
              f"{keras_transform['batched_s']:>8.2f} | {keras_transform['batched_rows_per_s']:>11,.0f} |")
    print(f"| {'row by row (Row in, forward, Row out: Horovod)':<52} | {transform['baseline_rows']:>8} | "
          f"{transform['baseline_s']:>8.2f} | {transform['baseline_rows_per_s']:>11,.0f} |")
    verdict = "meets" if transform["speedup"] >= TRANSFORM_SPEEDUP_TARGET else "MISSES"
    print(f"speedup {transform['speedup']:.0f}x {verdict} the target of >= {TRANSFORM_SPEEDUP_TARGET:.0f}x")


def _versions() -> Dict[str, Optional[str]]:
    found: Dict[str, Optional[str]] = {}
    for name in ("spark-hvd", "torch", "keras", "tensorflow", "tensorflow-cpu", "pyspark", "pyarrow", "numpy"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.fits < 1:
        raise SystemExit("--fits must be at least 1")
    from spark_hvd.spark.session import LOCAL_ENVIRONMENT, local_session

    os.environ.update(LOCAL_ENVIRONMENT)  # read by the Spark JVM when it starts
    spark = local_session("spark-hvd-benchmark-estimator")
    spark.sparkContext.setLogLevel("ERROR")
    keras_result: Optional[Dict[str, Any]] = None
    try:
        with tempfile.TemporaryDirectory(prefix="spark-hvd-bench-") as store_dir:
            fits = time_fits(spark, args, store_dir)
            cold_fits = time_fits(spark, args, store_dir, cold=True) if args.compare_cold else None
            steps = time_steps(spark, args, store_dir) if args.step_rows > 0 else None
            if "keras" in args.frameworks:
                keras_fits = time_fits(spark, args, store_dir, "keras")
        transform = time_transform(spark, args)
        if "keras" in args.frameworks:
            keras_warm = keras_fits[1:] or keras_fits
            keras_result = {"fits": keras_fits,
                            "fit_warm_median": {k: statistics.median(r[k] for r in keras_warm) for k in keras_fits[0]},
                            "transform": time_keras_transform(spark, args)}
    finally:
        spark.stop()
    print_tables(fits, transform, args.rows, keras_result)
    if cold_fits is not None:
        print_cold_table(fits, cold_fits, args.rows)
    if steps is not None:
        print_step_table(steps)
    warm = fits[1:] or fits
    result = {
        "benchmark": "estimator",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count(), "load_average": list(os.getloadavg())},
        "versions": _versions(),
        "settings": {"rows": args.rows, "epochs": args.epochs, "num_proc": 2, "master": "local[2]",
                     "transform_rows": args.transform_rows, "baseline_rows": args.baseline_rows},
        "fits": fits,
        "fit_warm_median": {k: statistics.median(r[k] for r in warm) for k in fits[0]},
        "transform": transform,
        "steps": steps,
        "keras": keras_result,
        "cold_fits": cold_fits,
        "targets": {"fit_overhead_s": FIT_OVERHEAD_TARGET_S, "transform_speedup": TRANSFORM_SPEEDUP_TARGET,
                    "horovod_fit_s": HOROVOD_FIT_S, "estimator_step_ratio": STEP_RATIO_TARGET},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(f"\nresults written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
