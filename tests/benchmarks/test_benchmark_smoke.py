"""The collective benchmark runs end to end and writes its JSON (numbers are not asserted)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_collectives_benchmark_quick_run_writes_results(tmp_path):
    """A one-size spark-hvd run with gloo as peer produces a table row, ratios and a JSON record."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "collectives.py"), "--quick", "--frameworks", "spark-hvd",
         "gloo", "--sizes", "4", "64K", "--no-async", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "busbw/gloo" in proc.stdout and "== targets ==" in proc.stdout
    record = json.loads(out.read_text())
    ours = record["results"]["2"]["spark-hvd"]
    assert ours["status"] == "ok"
    assert set(ours["sizes"]) == {"4", "65536"}
    assert all(size["median_s"] > 0 for size in ours["sizes"].values())
    assert record["results"]["2"]["gloo"]["status"] == "ok"


def test_gpu_check_says_there_is_nothing_to_check_without_cuda():
    """On a machine without CUDA the GPU check exits 0 and says why it checked nothing."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no CUDA device visible" in proc.stdout


def test_step_breakdown_times_every_phase_of_each_mode(tmp_path):
    """A short run of three modes (spark-hvd, DDP over gloo, the sleep control) prints their rows
    and writes every phase of every mode, with the sleep showing up in the phase after the step."""
    out = tmp_path / "breakdown.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "step_breakdown.py"), "--steps", "40", "--warmup", "5",
         "--repeats", "1", "--pause-us", "2000", "--modes", "spark-hvd", "ddp-gloo", "x2 + sleep", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "spark-hvd" in proc.stdout and "ddp-gloo" in proc.stdout and "x2 + sleep" in proc.stdout
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"spark-hvd", "ddp-gloo", "x2 + sleep"}
    for mode in results.values():
        assert set(mode["phases_us"]) == {"zero_grad", "forward", "backward", "opt.step", "after"}
        assert mode["step_us"] > 0 and all(v >= 0 for v in mode["phases_us"].values())
    assert results["x2 + sleep"]["phases_us"]["after"] >= 2000
    assert results["spark-hvd"]["phases_us"]["after"] < 2000


def test_step_breakdown_refuses_bad_arguments():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_breakdown.py"), "--steps", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--steps 0 must be at least 1" in proc.stderr


@pytest.mark.spark
def test_estimator_scale_benchmark_quick_run_prints_every_floor(tmp_path):
    """A tiny TorchEstimator run prints the step profile of both ranks, the bare loops, the Parquet
    write, the pyarrow read, the TorchDistributor peer and the transform floor, and writes every ratio
    to its JSON."""
    out = tmp_path / "scale.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "estimator_scale.py"), "--quick", "--frameworks", "torch",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for fragment in ("Spark's parquet write", "bare loops", "| rank | wait |", "pyarrow reads", "constant pandas UDF",
                     "TorchDistributor + DDP (gloo)", "first epoch vs reading with pyarrow then the bare loops",
                     "| target |"):
        assert fragment in proc.stdout, fragment
    record = json.loads(out.read_text())
    fit = record["results"][0]["fits"][0]
    assert fit["framework"] == "torch" and len(fit["profile"]) == 2
    assert all(rank["step"] > 0 and rank["peak_rss_mib"] > 0 for rank in fit["profile"])
    assert fit["bare"]["rows_per_s"] > 0 and record["results"][0]["transform"]["floor_rows_per_s"] > 0
    assert set(record["ratios"]) >= {"torch training vs bare loops, batch 1024", "transform vs the constant pandas UDF",
                                     "torch training vs TorchDistributor + DDP",
                                     "torch first epoch vs reading then bare loops, batch 1024",
                                     "torch first epoch vs ONE bare loop, batch 1024"}
    assert fit["ratio_vs_read_then_bare"] > 0
    peer = fit["torch_distributor"]
    assert peer["rows_per_s"] > 0 and peer["total_s"] > 0


def test_training_sources_runs_every_mode_and_times_the_allreduce(tmp_path):
    """A quick run prints each mode's row and records the allreduce waits of the distributed modes
    only, for both ranks."""
    out = tmp_path / "sources.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "training_sources.py"), "--quick", "--batch", "256",
                           "--json", str(out)], capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    for mode in ("bare, slices", "bare, shuffled rows", "bare, read then loop", "bare, memory", "bare, reader",
                 "hvd, memory", "hvd, cache", "hvd, reader", "hvd, first epoch"):
        assert f"| {mode} |" in proc.stdout
        (run,) = record["runs"][mode]
        assert run["rows_per_s"] > 0 and len(run["ranks"]) == 2
        assert all(bool(rank) == mode.startswith("hvd") for rank in run["ranks"])
    for mode in ("hvd, cache", "hvd, reader", "hvd, first epoch"):
        assert all(rank["median_ms"] > 0 for rank in record["runs"][mode][0]["ranks"])


def test_fraud_floor_runs_two_bare_loops_of_the_demos_model():
    """The fraud benchmark's floor: both bare loops train the example's model on their rows."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fraud_before_after", ROOT / "benchmarks" / "fraud_before_after.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    one = module.bare_fraud_loop(str(ROOT / "examples" / "fraud_detection.py"), 1000, 256, 0)
    assert one["rows"] == 768 and one["seconds"] > 0  # three whole batches of 256
    assert module.bare_fraud_loop(str(ROOT / "examples" / "fraud_detection.py"), 1000, 256, 0, 2)["rows"] == 1536
    assert module.floor_rate(ROOT, rows=2048) > 0


def _reader_benchmark():
    import importlib.util

    spec = importlib.util.spec_from_file_location("reader_benchmark", ROOT / "benchmarks" / "reader.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reader_benchmark_layouts_hold_the_same_matrix(tmp_path):
    """Every layout the reader benchmark compares stores the features it was given: written to
    Parquet, read back and turned into a matrix, each gives back the same float32 values."""
    import numpy as np
    import pyarrow.parquet as pq

    bench = _reader_benchmark()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1000, bench.FEATURES), dtype=np.float32)
    label = (rng.random(1000) < 0.5).astype(np.float32)
    for layout in bench.LAYOUTS:
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.parquet"
        pq.write_table(bench.features_table(x, label, layout), path, row_group_size=300)
        file = pq.ParquetFile(path)
        got = np.concatenate([bench.to_matrix(file.read_row_group(g), layout) for g in range(file.num_row_groups)])
        assert got.dtype == np.float32 and got.shape == x.shape, layout
        np.testing.assert_array_equal(got, x, err_msg=layout)


def test_reader_benchmark_quick_run_prints_every_layout(tmp_path):
    """A quick run prints a row per layout, the reader's figures for the layouts it reads (list columns
    and raw rows) and '-' for the others, and writes them as JSON."""
    out = tmp_path / "reader.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "reader.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    bench = _reader_benchmark()
    assert record["memcpy_s"] > 0
    for layout in bench.LAYOUTS:
        assert f"| {layout} |" in proc.stdout
        reads = record["layouts"][layout]
        assert reads["decode"] > 0 and reads["to numpy"] > 0
        assert all((reads[r] is not None) == (layout in bench.READABLE) for r in bench.READS[2:]), (layout, reads)


def test_repeat_fits_report_names_each_target():
    """The repeat-fit benchmark's report: a row per fit, the first fit's preparation against Spark's
    writes, and each repeat's ratio to its training phase and its launch."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import repeat_fits
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    fits = [{"fit": 1, "wall_s": 9.0, "validation_s": 1.0, "materialization_s": 3.0, "launch_s": 2.0,
             "training_s": 2.0, "collection_s": 0.1},
            {"fit": 2, "wall_s": 4.0, "validation_s": 0.1, "materialization_s": 0.0, "launch_s": 0.4,
             "training_s": 2.0, "collection_s": 0.1}]
    lines = repeat_fits.report({"fits": fits, "spark_write_s": [4.0, 2.0]})
    assert "| 2 | 4.00 | 0.10 | 0.00 | 0.40 | 2.00 | 0.10 |" in lines
    assert any("1.00x its first write in the session, 2.00x its fastest" in line for line in lines)
    assert any("the Pipeline's wall 2.00x its training phase, the estimator's phases 1.30x" in line
               and "launch 0.40 s" in line for line in lines)
    with pytest.raises(SystemExit):
        repeat_fits.main(["--fits", "1"])
