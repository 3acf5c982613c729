"""examples/fraud_detection_keras.py runs end to end on a small data set: the pipeline fits with
sample weights and validation, scores the held-out rows, and scores the same after save and load."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spark_hvd.spark.session import LOCAL_ENVIRONMENT

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "fraud_detection_keras.py"


@pytest.mark.timeout(900)
def test_the_keras_fraud_example_fits_scores_and_reloads(tmp_path):
    """Exit status 0, an epoch line per epoch, AUC values in range, and identical predictions after reload."""
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--rows", "6000", "--epochs", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=850, cwd=str(EXAMPLE.parent.parent),
                          env={**os.environ, **LOCAL_ENVIRONMENT})  # loopback only, workers on this Python
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "epoch 1/2: loss " in out and "epoch 2/2: loss " in out
    assert "pipeline fitted in" in out and "KerasEstimator: validation" in out
    found = re.search(r"AUC-PR (\d\.\d+), AUC-ROC (\d\.\d+)", out)
    assert found is not None, out
    assert 0.0 <= float(found.group(1)) <= 1.0 and 0.0 <= float(found.group(2)) <= 1.0
    assert "reloaded: the same predictions" in out
