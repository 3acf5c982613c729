"""examples/pytorch_train.py, a Horovod-style script, under spark-hvd-run and alone."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "pytorch_train.py")
LAUNCHER = os.path.join(os.path.dirname(sys.executable), "spark-hvd-run")


def _train(tmp_path, np, *extra):
    result = tmp_path / f"result-np{np}.json"
    command = ["python", EXAMPLE, "--result-json", str(result), *extra]
    if np > 1:
        command = [LAUNCHER, "-np", str(np), *command]
    else:
        command[0] = sys.executable
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(result.read_text()), done.stdout


def test_two_ranks_reach_single_process_accuracy(tmp_path):
    """Two ranks under spark-hvd-run and one process alone both classify the held-out digits at
    least 93% right, within 3 points of each other."""
    two, out = _train(tmp_path, 2, "--epochs", "12")
    one, _ = _train(tmp_path, 1, "--epochs", "12")
    assert two["size"] == 2 and one["size"] == 1
    assert two["accuracy"] >= 0.93 and one["accuracy"] >= 0.93, (two, one)
    assert abs(two["accuracy"] - one["accuracy"]) <= 0.03, (two, one)
    assert "[0]<stdout>:final test accuracy" in out


def test_checkpoint_and_resume(tmp_path):
    """Rank 0 checkpoints every epoch; a resumed two-rank run starts from the saved model (same
    test accuracy on every rank's broadcast copy) and trains only the remaining epochs."""
    checkpoint = tmp_path / "model.pt"
    first, _ = _train(tmp_path, 2, "--epochs", "2", "--checkpoint", str(checkpoint))
    assert checkpoint.exists()
    _, out = _train(tmp_path, 2, "--epochs", "3", "--checkpoint", str(checkpoint), "--resume")
    assert f"resumed after epoch 2  test accuracy {first['accuracy']:.4f}" in out
    assert "epoch   3/3" in out and "epoch   1/3" not in out and "epoch   2/3" not in out
