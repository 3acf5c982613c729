"""examples/lightning_train.py, a LightningModule on SparkHvdStrategy, under spark-hvd-run and alone."""

import json
import math
import os
import subprocess
import sys

import torch

from spark_hvd.datasets import DIGITS_ROWS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "lightning_train.py")
LAUNCHER = os.path.join(os.path.dirname(sys.executable), "spark-hvd-run")


def _train(tmp_path, np, *extra):
    result = tmp_path / f"result-np{np}.json"
    command = [sys.executable, EXAMPLE, "--result-json", str(result), *extra]
    if np > 1:
        command = [LAUNCHER, "-np", str(np), *command]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(result.read_text()), done.stdout


def test_two_ranks_reach_single_process_accuracy(tmp_path):
    """Two ranks under spark-hvd-run and one process alone both classify the held-out digits at
    least 93% right, within 3 points of each other; each of the two ranks steps through its half
    of the training rows only, rank 0 alone prints, and rank 0 leaves one last checkpoint."""
    checkpoints = tmp_path / "checkpoints"
    two, out = _train(tmp_path, 2, "--epochs", "12", "--checkpoint-dir", str(checkpoints))
    one, _ = _train(tmp_path, 1, "--epochs", "12")
    assert two["size"] == 2 and one["size"] == 1
    assert two["accuracy"] >= 0.93 and one["accuracy"] >= 0.93, (two, one)
    assert abs(two["accuracy"] - one["accuracy"]) <= 0.03, (two, one)
    train_rows = int(0.8 * DIGITS_ROWS)
    for result in (one, two):
        per_rank = math.ceil(train_rows / result["size"])
        assert result["steps"] == 12 * math.ceil(per_rank / 32), result
    assert "[0]<stdout>:final test accuracy" in out and "[1]<stdout>:" not in out, out[-2000:]
    assert os.listdir(checkpoints) == ["last.ckpt"]
    state = torch.load(checkpoints / "last.ckpt", weights_only=False)
    assert state["epoch"] == 12 and state["global_step"] == two["steps"], (state["epoch"], state["global_step"])
