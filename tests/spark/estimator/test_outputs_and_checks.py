"""Pure checks without Spark: Spark ML columns per task, the dry runs through forward and the
loss, run fingerprints, slots from settings, store write checks and volume paths, and the
sealed output channel through a store."""

from __future__ import annotations

import io
import os
import sys

import numpy as np
import pytest
import torch

from spark_hvd.runtime.seal import seal, unseal
from spark_hvd.spark.launch.store_log import STORE_CONTEXT, StoreLogCollector, StoreLogSender
from spark_hvd.spark.estimator.outputs import check_task, column_kinds, infer_task, standard_columns
from spark_hvd.spark.session import slots_from_conf
from spark_hvd.spark.data.store import LocalStore, Store, VolumeStore
from spark_hvd.spark.torch import checks
from spark_hvd.spark.torch.batches import LossFunction
from spark_hvd.spark.torch.fingerprint import changed_parts, run_fingerprint
from spark_hvd.spark.torch.training import OptimizerSpec


@pytest.mark.parametrize("loss, labels, expected", [
    (torch.nn.BCEWithLogitsLoss(), ["y"], "binary"),
    (torch.nn.BCELoss(), ["y"], "binary_probability"),
    (torch.nn.CrossEntropyLoss(), ["y"], "multiclass"),
    (torch.nn.NLLLoss(), ["y"], "multiclass_log_probability"),
    (torch.nn.MSELoss(), ["y"], "regression"),
    (torch.nn.functional.mse_loss, ["y"], "regression"),
    (lambda out, lab: (out - lab).abs().mean(), ["y"], "none"),   # unknown: raw outputs only
    (torch.nn.MSELoss(), ["a", "b"], "none"),                     # several labels: raw outputs only
])
def test_task_is_inferred_from_the_loss(loss, labels, expected):
    """'auto' becomes the task the single label's loss implies; an explicit task is kept."""
    assert infer_task("auto", [loss], labels) == expected
    assert infer_task("regression", [loss], labels) == "regression"


def test_standard_columns_follow_spark_ml():
    """Binary logits give [-z, z] raw scores, sigmoid probabilities and 0/1 predictions; class
    scores give softmax probabilities and the argmax; regression gives the value."""
    z = np.array([[-2.0], [0.0], [3.0]])
    binary = standard_columns("binary", z)
    np.testing.assert_allclose(binary["raw_prediction"], np.hstack([-z, z]))
    np.testing.assert_allclose(binary["probability"][:, 1], 1 / (1 + np.exp(-z[:, 0])))
    np.testing.assert_allclose(binary["probability"].sum(axis=1), 1.0)
    assert binary["prediction"].tolist() == [0.0, 0.0, 1.0]
    scores = np.array([[1.0, 2.0, 0.5], [3.0, -1.0, 0.0]])
    multi = standard_columns("multiclass", scores)
    np.testing.assert_allclose(multi["probability"], np.exp(scores) / np.exp(scores).sum(axis=1, keepdims=True))
    assert multi["prediction"].tolist() == [1.0, 0.0]
    logp = np.log(multi["probability"])
    np.testing.assert_allclose(standard_columns("multiclass_log_probability", logp)["probability"], multi["probability"])
    assert standard_columns("regression", np.array([[1.5], [2.5]]))["prediction"].tolist() == [1.5, 2.5]
    assert [role for role, _ in column_kinds("binary")] == ["raw_prediction", "probability", "prediction"]
    assert column_kinds("regression") == [("prediction", "double")] and column_kinds("none") == []


def test_a_nan_output_predicts_no_class():
    """A NaN output (from a NaN input) gives NaN probabilities and a NaN prediction for that row,
    never a class beside a NaN probability; the other rows are unaffected."""
    nan = float("nan")
    for task in ("binary", "binary_probability"):
        got = standard_columns(task, np.array([[nan], [3.0]]))
        assert np.isnan(got["probability"][0]).all() and np.isnan(got["prediction"][0]), task
        assert got["prediction"][1] == 1.0, task
    for task in ("multiclass", "multiclass_probability"):
        got = standard_columns(task, np.array([[nan, 1.0, 0.0], [0.0, 2.0, 1.0]]))
        assert np.isnan(got["prediction"][0]) and got["prediction"][1] == 1.0, task


@pytest.mark.parametrize("task, shapes, message", [
    ("binary", [(2,)], r"task='binary' needs one output value per row, but the model returns 2"),
    ("multiclass", [(1,)], r"needs one output value per class \(at least 2\), but the model returns 1"),
    ("regression", [(1,), (1,)], r"needs a model with one output, but it returns 2"),
])
def test_task_and_output_shapes_must_agree(task, shapes, message):
    """A task the model's outputs cannot carry is refused with the numbers and the fix."""
    with pytest.raises(ValueError, match=message):
        check_task(task, shapes)
    check_task("none", shapes)


def _batch(label):
    return {"x": np.ones((4, 3), np.float32), "y": label}


@pytest.mark.parametrize("loss, label, message", [
    # torch broadcasts these with a warning only: (4, 1) against (4, 3) averages 12 pairs.
    (torch.nn.MSELoss(), np.ones((4, 3), np.float32), r"MSELoss got the model's output of shape \(4, 1\) and label "
                                                     r"'y' of shape \(4, 3\)"),
    (torch.nn.L1Loss(), np.ones((4, 2), np.float64), r"different shapes: L1Loss"),
    (torch.nn.BCEWithLogitsLoss(), np.ones((4, 3), np.float32), r"BCEWithLogitsLoss got .* \(4, 1\) .* \(4, 3\)"),
    (torch.nn.functional.mse_loss, np.ones((4, 3), np.float32), r"broadcast the label against the output: mse_loss"),
    (torch.nn.CrossEntropyLoss(), np.ones((4, 3), np.float32), r"the loss failed on a real batch: CrossEntropyLoss"),
])
def test_a_real_batch_through_forward_and_the_loss_names_both_shapes(loss, label, message):
    """Shape mismatches between output and label fail on the driver with both shapes named."""
    model = torch.nn.Linear(3, 1)
    with pytest.raises(ValueError, match=message):
        checks.dry_run_batch(model, LossFunction([loss], [1.0]), _batch(label), ["x"], ["y"], [(3,)], torch.float32)


def test_matching_shapes_and_class_labels_pass_the_batch_dry_run():
    """A (rows,) label against a (rows, 1) output, and class ids for CrossEntropyLoss, are fine."""
    checks.dry_run_batch(torch.nn.Linear(3, 1), LossFunction([torch.nn.MSELoss()], [1.0]),
                         _batch(np.ones(4, np.float64)), ["x"], ["y"], [(3,)], torch.float32)
    checks.dry_run_batch(torch.nn.Linear(3, 4), LossFunction([torch.nn.CrossEntropyLoss()], [1.0]),
                         _batch(np.array([0, 3, 1, 2], np.int64)), ["x"], ["y"], [(3,)], torch.float32)


class _Bug(torch.nn.Module):
    def forward(self, x):
        return x.does_not_exist


def test_a_forward_bug_is_not_reported_as_an_input_size_problem():
    """An AttributeError in forward is named as a bug in forward with its line; a size mismatch
    is named as an input-size problem."""
    with pytest.raises(ValueError, match=r"forward\(\) raised AttributeError.*does_not_exist.*error in _Bug.forward, "
                                         r"not in the data"):
        checks.dry_run(_Bug(), [(3,)], 1, torch.float32)
    with pytest.raises(ValueError, match=r"cannot take the features: Linear\(\(2, 3\)\).*fix: match the model's input"):
        checks.dry_run(torch.nn.Linear(5, 1), [(3,)], 1, torch.float32)


class _Schema:
    def __init__(self, fields):
        self.fields = fields


class _Frame:
    """Just enough of a DataFrame for a fingerprint."""

    def __init__(self, semantic=7):
        from pyspark.sql import types as T

        self.schema = _Schema([T.StructField("x", T.DoubleType()), T.StructField("y", T.DoubleType())])
        self._semantic = semantic

    def semanticHash(self):
        return self._semantic


def _fingerprint(model, lr=0.1, loss=None, frame=None):
    optimizer = OptimizerSpec.of(torch.optim.SGD(model.parameters(), lr=lr), model)
    return run_fingerprint(model, optimizer, [loss or torch.nn.MSELoss()], [1.0], frame or _Frame(), ["x", "y"], None)


def test_fingerprints_name_what_changed_and_ignore_weights():
    """Fresh weights of the same architecture match; another width, lr, loss or data does not."""
    base = _fingerprint(torch.nn.Linear(1, 1))
    assert changed_parts(base, _fingerprint(torch.nn.Linear(1, 1))) == []
    assert changed_parts(base, _fingerprint(torch.nn.Linear(1, 2))) == ["model architecture"]
    assert changed_parts(base, _fingerprint(torch.nn.Linear(1, 1), lr=0.5)) == ["optimizer"]
    assert changed_parts(base, _fingerprint(torch.nn.Linear(1, 1), loss=torch.nn.L1Loss())) == ["loss"]
    assert changed_parts(base, _fingerprint(torch.nn.Linear(1, 1), frame=_Frame(8))) == ["data"]
    assert changed_parts(None, base) == ["model architecture", "optimizer", "loss", "data"]


@pytest.mark.parametrize("master, conf, expected", [
    ("local[3]", {}, 3), ("local", {}, 1), ("local[2,4]", {}, 2),
    ("local-cluster[2,2,1024]", {}, 4), ("local-cluster[2,2,1024]", {"spark.task.cpus": "2"}, 2),
    ("spark://h:7077", {"spark.executor.instances": "3", "spark.executor.cores": "4"}, 12),
    ("yarn", {"spark.executor.instances": "3", "spark.executor.cores": "4",
              "spark.dynamicAllocation.enabled": "true"}, None),
    ("sc://remote", {}, None),
])
def test_slots_are_read_from_settings_without_a_jvm(master, conf, expected):
    """Connect sessions learn the task slots from the master URL and executor settings, or not at all."""
    assert slots_from_conf(master, conf.get) == expected


def test_store_write_check_and_volume_paths(tmp_path):
    """A writable store passes and leaves nothing; an unwritable one names itself and the fix;
    volume paths become VolumeStores that give Spark the path itself."""
    store = Store.create(str(tmp_path / "ok"))
    store.check_writable()
    assert store.listdir(store.prefix) == []
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.raises(ValueError, match=r"store '.*file/sub' cannot be written \(.*\): expected a directory"):
        LocalStore(str(blocked / "sub")).check_writable()
    volume = Store.create("/Volumes/main/default/ml/spark-hvd")
    assert isinstance(volume, VolumeStore) and isinstance(Store.create("dbfs:/Volumes/main/default/ml/x"), VolumeStore)
    assert volume.spark_url(volume.join("runs")) == "/Volumes/main/default/ml/spark-hvd/runs"
    with pytest.raises(ValueError, match=r"not a path inside a volume.*'/Volumes/<catalog>/<schema>/<volume>"):
        Store.create("/Volumes/main")


def test_output_through_a_store_arrives_in_order_and_rejects_forgeries(tmp_path):
    """Lines, a failure and the finish written by a task's sender reach the collector in order,
    prefixed by rank; a chunk not sealed with the job secret is ignored."""
    store = Store.create(str(tmp_path / "store"))
    directory = store.join("jobs", "j1")
    out, err = io.StringIO(), io.StringIO()
    collector = StoreLogCollector(store, directory, "ab" * 32, out, err)
    sender = StoreLogSender(store, directory, "ab" * 32, 1)
    for i in range(5):
        sender.line("stdout", f"line {i}")
    sender.line("stderr", "careful")
    store.write(store.join("jobs", "j1", "r0-00000000.json"), seal("cd" * 32, STORE_CONTEXT, "r0-00000000.json", b'[{"stream": '
                                                                   b'"stdout", "text": "forged"}]'))
    sender.failure({"type": "ValueError", "message": "bad"})
    sender.finished()
    sender.close()
    assert collector.wait_closed(1, 10.0)
    assert collector.wait_failure(1.0)["message"] == "bad" and 1 in collector.finished
    collector.close()
    assert out.getvalue().splitlines() == [f"[1]<stdout>:line {i}" for i in range(5)]
    assert err.getvalue() == "[1]<stderr>:careful\n"
    assert not store.exists(directory)
    with pytest.raises(PermissionError):
        unseal("ab" * 32, STORE_CONTEXT, "other-name", seal("ab" * 32, STORE_CONTEXT, "name", b"x"))
    silent = StoreLogCollector(store, store.join("jobs", "none"), "ab" * 32, out, err)
    assert silent.wait_closed(1, 0.3) is False and silent.wait_failure(0.3) is None
    silent.close()


def test_transform_runs_on_the_gpu_spark_assigned_to_the_task(monkeypatch):
    """A task that Spark gave GPU 3 predicts on cuda:3; without an assignment, or without CUDA, on the CPU."""
    import pyspark
    import torch

    from spark_hvd.spark.torch.predictor import TorchPredictor

    class Gpus:
        def __init__(self, addresses):
            self.addresses = addresses

    class Context:
        def __init__(self, resources):
            self._resources = resources

        def resources(self):
            return self._resources

    context = {"now": Context({"gpu": Gpus(["3"])})}
    monkeypatch.setattr(pyspark.TaskContext, "get", classmethod(lambda cls: context["now"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    predictor = TorchPredictor()
    assert predictor.device() == "cuda:3"
    context["now"] = Context({})
    assert predictor.device() == "cpu"
    context["now"] = None
    assert predictor.device() == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    context["now"] = Context({"gpu": Gpus(["0"])})
    assert predictor.device() == "cpu"


def test_plot_history_saves_whole_labels_and_whole_epochs(tmp_path):
    """A saved history plot keeps its x-axis label inside the figure, and its ticks are whole epochs."""
    import matplotlib

    matplotlib.use("Agg")
    from spark_hvd.spark.torch import TorchModel

    model = TorchModel(model=torch.nn.Linear(1, 1), history=[{"epoch": 1, "loss": 0.9, "val_loss": 1.0},
                                                              {"epoch": 2, "loss": 0.5, "val_loss": 0.7},
                                                              {"epoch": 3, "loss": 0.4, "val_loss": 0.6}])
    ax = model.plot_history()
    figure = ax.figure
    figure.savefig(tmp_path / "history.png")
    renderer = figure.canvas.get_renderer()
    label = ax.xaxis.label.get_window_extent(renderer)
    whole = figure.bbox
    assert label.y0 >= whole.y0 and label.x0 >= whole.x0 and label.x1 <= whole.x1
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


@pytest.mark.parametrize("module, name", [("spark_hvd.spark.torch", "TorchEstimator"),
                                          ("spark_hvd.spark.lightning", "LightningEstimator"),
                                          ("spark_hvd.spark.keras", "KerasEstimator")])
def test_each_estimators_warm_process_imports_what_its_ranks_import(module, name, tmp_path):
    """The warm process of an estimator's ranks imports the framework, its rank-side code and the
    data modules (so a repeat fit's ranks import none of them), and can still fork: none of those
    imports starts a thread."""
    import importlib

    from spark_hvd.runner import warm
    from spark_hvd.spark.estimator.base import RANK_DATA_MODULES

    preload = getattr(importlib.import_module(module), name)()._preload()
    assert preload[-len(RANK_DATA_MODULES):] == RANK_DATA_MODULES
    assert f"{module}.training" in preload
    # The modules are the warm process's arguments: its command line must not read as a rank's.
    assert "spark_hvd.runner.worker" not in preload
    starter = warm.WarmStarter(sys.executable, preload, dict(os.environ), cwd=str(tmp_path))
    try:
        assert starter.alive
    finally:
        starter.close()
