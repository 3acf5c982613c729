"""examples/fraud_detection_lightning.py, the LightningEstimator pipeline, end to end on a Spark Connect session."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
EXAMPLE = os.path.join(ROOT, "examples", "fraud_detection_lightning.py")


# A whole program: a Spark Connect server, a materialization and two ranks that import Lightning;
# on a busy two-core machine that can pass the suite's 300 s default.
@pytest.mark.timeout(600)
def test_the_lightning_fraud_example_trains_scores_and_reloads_on_spark_connect(tmp_path):
    """On a small set (4,000 transactions, 5% fraud) over Spark Connect: two epochs on two ranks,
    a held-out AUC-ROC above 0.9, and a reloaded pipeline with the same predictions."""
    done = subprocess.run([sys.executable, EXAMPLE, "--rows", "4000", "--fraud-rate", "0.05", "--epochs", "2",
                           "--out", str(tmp_path), "--connect"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=500)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "epoch 2/2: loss" in out and "reloaded: the same predictions" in out, out[-3000:]
    roc = float(re.search(r"AUC-ROC (\d\.\d+)", out).group(1))
    assert roc > 0.9, out[-2000:]
