"""The collective benchmark runs end to end and writes its JSON (numbers are not asserted)."""

import json
import subprocess
import sys
from pathlib import Path

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
