"""The README's main job on the cluster: the fraud-detection Pipeline of examples/fraud_detection.py
(TorchEstimator) and of examples/fraud_detection_keras.py (KerasEstimator), each with num_proc=2 on
a session with one task slot per host, so the two ranks train on different hosts. Each fits with
validation and sample weights, scores the held-out rows, saves the pipeline, loads it and scores
the same."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(900)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name):
    """The example module; its functions and classes travel to the executors by value (the
    executors' Python does not have examples/ on its path)."""
    import cloudpickle

    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    module = importlib.import_module(name)
    cloudpickle.register_pickle_by_value(module)
    return module


def run_example(name, cluster, tmp_path, capsys):
    """main() of the example on the cluster's session (its own local_session() finds it running); what it printed."""
    cluster.use("2x1")
    code = example(name).main(["--rows", "6000", "--epochs", "2", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    cluster.stop_session()  # main() stopped it
    assert code == 0, printed[-3000:]
    return printed


def check_run(printed, framework):
    assert "epoch 1/2: loss " in printed and "epoch 2/2: loss " in printed
    assert "pipeline fitted in" in printed and f"{framework}: " in printed
    found = re.search(r"AUC-PR (\d\.\d+), AUC-ROC (\d\.\d+)", printed)
    assert found is not None, printed[-3000:]
    assert 0.0 <= float(found.group(1)) <= 1.0 and 0.0 <= float(found.group(2)) <= 1.0
    assert "reloaded: the same predictions" in printed
    assert "epochs trained: 2" in printed


def test_the_torch_fraud_pipeline_fits_scores_and_reloads_across_hosts(cluster, hosts, tmp_path, capsys):
    """examples/fraud_detection.py on the cluster: two epochs trained, AUC values in range,
    identical predictions after save and load."""
    check_run(run_example("fraud_detection", cluster, tmp_path, capsys), "TorchEstimator")


def test_the_keras_fraud_pipeline_fits_scores_and_reloads_across_hosts(cluster, hosts, tmp_path, capsys):
    """examples/fraud_detection_keras.py on the cluster: the same checks with KerasEstimator."""
    check_run(run_example("fraud_detection_keras", cluster, tmp_path, capsys), "KerasEstimator")
