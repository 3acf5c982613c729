"""examples/keras_train.py, a Horovod-style Keras script, under spark-hvd-run -np 2 and alone."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "keras_train.py")
LAUNCHER = os.path.join(os.path.dirname(sys.executable), "spark-hvd-run")


def _train(tmp_path, np, *extra):
    result = tmp_path / f"result-np{np}.json"
    command = [sys.executable, EXAMPLE, "--result-json", str(result), *extra]
    if np > 1:
        command = [LAUNCHER, "-np", str(np), *command]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(result.read_text()), done.stdout


def test_two_ranks_reach_single_process_accuracy_and_checkpoint(tmp_path):
    """Two ranks under spark-hvd-run and one process alone both classify the held-out digits at
    least 93% right, within 3 points of each other; rank 0 saved the best model, which loads."""
    checkpoint = tmp_path / "best.keras"
    two, out = _train(tmp_path, 2, "--epochs", "12", "--checkpoint", str(checkpoint))
    one, _ = _train(tmp_path, 1, "--epochs", "12")
    assert two["size"] == 2 and one["size"] == 1
    assert two["accuracy"] >= 0.93 and one["accuracy"] >= 0.93, (two, one)
    assert abs(two["accuracy"] - one["accuracy"]) <= 0.03, (two, one)
    assert "[0]<stdout>:final test accuracy" in out and "[1]<stdout>:final test accuracy" not in out
    import keras

    assert keras.models.load_model(checkpoint).count_params() > 0
