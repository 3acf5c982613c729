"""TorchEstimator.fit and TorchModel.transform end to end on tiny frames, on a classic and a Spark
Connect local[2] session: checks before any job, training with progress, checkpoints and resume,
validation columns and sample weights, Spark ML prediction columns and evaluators, save/load,
Pipeline persistence and CrossValidator."""

from __future__ import annotations

import json

import os

import numpy as np
import pandas as pd
import pytest
import torch
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import BinaryClassificationEvaluator, MulticlassClassificationEvaluator
from pyspark.ml.feature import StandardScaler, VectorAssembler
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder
from pyspark.sql import functions as F

from spark_helpers import nothing_materialized, spark_jobs
from spark_hvd.spark import Store
from spark_hvd.spark.torch import TorchEstimator, TorchModel
from spark_hvd.spark.torch.training import load_checkpoint

SESSION_KINDS = ("classic", "connect")
ROWS = 96


def accuracy(out, lab):
    return ((out > 0).float() == lab).float().mean()


@pytest.fixture(scope="module")
def frame(spark):
    """x1..x3, a 0/1 label y, weight w, validation marker is_val, a string, a nested array, and the
    assembled Vector 'features'."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 3))
    pdf = pd.DataFrame(x, columns=["x1", "x2", "x3"])
    pdf["y"] = (x @ np.array([1.5, -2.0, 0.5]) > 0).astype(np.float64)
    pdf["w"] = 0.0
    pdf["is_val"] = (np.arange(ROWS) % 4 == 0).astype(np.int32)
    pdf["name"] = "row"
    df = spark.createDataFrame(pdf).withColumn("nested", F.array(F.array(F.col("x1"))))
    return VectorAssembler(inputCols=["x1", "x2", "x3"], outputCol="features").transform(df).cache()


def make_estimator(tmp_path, **overrides):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    params = dict(num_proc=2, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.05),
                  loss=torch.nn.BCEWithLogitsLoss(), feature_cols=["features"], label_cols=["y"], batch_size=8,
                  epochs=1, store=Store.create(str(tmp_path / "store")), random_seed=3, verbose=0)
    params.update(overrides)
    return TorchEstimator(**params)


def local_predictions(model, rows):
    features = torch.tensor(np.array([r["features"].toArray() for r in rows]), dtype=torch.float32)
    with torch.no_grad():
        return model(features).reshape(-1).numpy()


# -- checks before any Spark job ---------------------------------------------------------------

BAD_FITS = [
    ({"feature_cols": ["nope"]}, r"column 'nope' is not in the DataFrame; available columns: x1, x2"),
    ({"feature_cols": ["name"], "model": torch.nn.Linear(1, 1)}, r"column 'name' has type string.*StringIndexer"),
    ({"feature_cols": ["nested"], "model": torch.nn.Linear(1, 1)}, r"column 'nested' has type array<array<double>>, "
                                                                   r"a nested array.*flatten"),
    ({"num_proc": 3}, r"num_proc=3 but the cluster has 2 task slots.*local\[3\]"),
    ({"feature_cols": ["features", "x1"]}, r"gives 2 input\(s\) but Sequential.forward takes 1.*VectorAssembler"),
    ({"model": torch.nn.Linear(5, 1)}, r"cannot take the features: Linear\(\(2, 3\)\)"),
    ({"optimizer": None}, r"optimizer=None is not valid.*torch.optim.Adam"),
    ({"label_cols": ["y", "x1"]}, r"returned 1 output\(s\) for 2 label column"),
    ({"sample_weight_col": "missing"}, r"column 'missing' is not in the DataFrame"),
    ({"validation": "missing"}, r"validation column 'missing' is not in the DataFrame"),
    ({"model": torch.nn.Linear(3, 2), "task": "none"},
     r"the loss would compare tensors of different shapes: BCEWithLogitsLoss got the model's output of shape "
     r"\(2, 2\) and label 'y' of shape \(2,\)"),
    ({"model": torch.nn.Linear(3, 2)}, r"task='binary' needs one output value per row, but the model returns 2"),
    ({"model": torch.nn.Linear(3, 2), "loss": torch.nn.MSELoss()}, r"task='regression' needs one output value per row"),
    ({"model": "raises"}, r"the model's forward\(\) raised KeyError: 'oops' \(at .*test_estimator_fit.py.*this is an "
                          r"error in Broken.forward, not in the data"),
    ({"store": "/proc/spark-hvd-store"}, r"store '/proc/spark-hvd-store' cannot be written \(.*\): expected a "
                                         r"directory.*writable path"),
    ({"early_stopping": {"monitor": "val_loss"}}, r"early_stopping monitors 'val_loss', which this fit's history "
                                                  r"will not have; it needs validation set"),
    ({"early_stopping": {"monitor": "val_accuracy"}, "validation": 0.25},
     r"early_stopping monitors 'val_accuracy'.*expected one of \['loss', 'val_loss'\]"),
    ({"lr_scheduler_fn": lambda opt: 3}, r"lr_scheduler_fn returned 3: expected a torch.optim.lr_scheduler"),
]


class Broken(torch.nn.Module):
    """A model whose forward has a bug unrelated to its inputs."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)

    def forward(self, x):
        return {"a": self.linear(x)}["oops"]


def expect_error(est, frame, message):
    def call():
        with pytest.raises(ValueError, match=message):
            est.fit(frame)
    return call


@pytest.mark.parametrize("overrides, message", BAD_FITS)
def test_fit_refuses_bad_input_before_any_spark_job(spark, frame, tmp_path, overrides, message):
    """Each mistake raises a ValueError naming the value and the fix, and no Spark job ran."""
    if overrides.get("model") == "raises":
        overrides = dict(overrides, model=Broken())
    if isinstance(overrides.get("store"), str):
        overrides = dict(overrides, store=Store.create(overrides["store"]))
    est = make_estimator(tmp_path, **overrides)
    if "model" in overrides and overrides["model"] is not None and "optimizer" not in overrides:
        est.setOptimizer(torch.optim.SGD(overrides["model"].parameters(), lr=0.1))
    assert spark_jobs(spark, expect_error(est, frame, message)) in ([], None)
    assert nothing_materialized(est)


def test_fit_refuses_an_empty_frame(spark, frame, tmp_path):
    """An empty DataFrame fails with a message saying there are no rows (found by a Spark job,
    which the job-group probe of the test above does see)."""
    jobs = spark_jobs(spark, expect_error(make_estimator(tmp_path), frame.filter("x1 > 100"),
                                          r"the DataFrame has no rows"))
    assert jobs is None or jobs != []


# -- fit, transform, save, load ----------------------------------------------------------------


@pytest.fixture(scope="module")
def basic_fit(frame, tmp_path_factory):
    """Three epochs on two ranks with validation, a metric and epoch lines, under run_id 'basic':
    the estimator, the model and what the fit printed."""
    import contextlib
    import io

    est = make_estimator(tmp_path_factory.mktemp("basic"), epochs=3, validation=0.25, metrics=[accuracy], verbose=1,
                         run_id="basic")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        model = est.fit(frame)
    return {"est": est, "model": model, "printed": printed.getvalue()}


def test_fit_trains_reports_progress_and_the_model_transforms_saves_and_loads(frame, basic_fit, tmp_path):
    """Two ranks train with live epoch lines; the model adds Spark ML's rawPrediction, probability
    and prediction columns (inferred from BCEWithLogitsLoss) that agree with a local forward pass
    and that BinaryClassificationEvaluator and MulticlassClassificationEvaluator read as they are;
    it predicts the same after save and load; task='none' gives the raw y__output column."""
    est, model, printed = basic_fit["est"], basic_fit["model"], basic_fit["printed"]
    for epoch in (1, 2, 3):
        assert f"epoch {epoch}/3: loss " in printed
    assert "val_accuracy" in printed and "rows/s" in printed and "spark-hvd-progress" not in printed

    history = model.getHistory()
    assert [h["epoch"] for h in history] == [1, 2, 3]
    assert {"loss", "accuracy", "val_loss", "val_accuracy", "rows_per_s"} <= set(history[0])
    assert history[-1]["loss"] < history[0]["loss"]
    assert set(model.fit_timings) == {"validation", "materialization", "launch", "training", "collection"}
    assert model.getRunId() == "basic" and model.getInputShapes() == [[3]] and model.getTask() == "binary"
    frame_history = model.history_frame()
    assert list(frame_history.index) == [1, 2, 3] and frame_history["loss"].iloc[-1] == history[-1]["loss"]
    checkpoint = load_checkpoint(est.getStore().read(est.getStore().get_checkpoint_path("basic")))
    assert checkpoint["epoch"] == 3 and set(checkpoint["fingerprint"]) == {"model architecture", "optimizer", "loss",
                                                                           "data"}
    assert torch.equal(checkpoint["model"]["2.weight"], model.getModel()[2].weight.detach())
    assert not torch.equal(est.getModel()[2].weight, model.getModel()[2].weight)  # the driver's model is untouched

    out = model.transform(frame)
    assert out.columns == frame.columns + ["rawPrediction", "probability", "prediction"]
    types = dict(out.dtypes)
    assert (types["rawPrediction"], types["probability"], types["prediction"]) == ("vector", "vector", "double")
    rows = out.orderBy("x1").collect()
    assert len(rows) == ROWS
    logits = local_predictions(model.getModel(), rows)
    np.testing.assert_allclose([r["rawPrediction"][1] for r in rows], logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose([r["probability"][1] for r in rows], 1 / (1 + np.exp(-logits)), rtol=1e-5, atol=1e-6)
    assert [r["prediction"] for r in rows] == [float(v > 0) for v in logits]
    auc = BinaryClassificationEvaluator(labelCol="y").evaluate(out)
    accuracy_value = MulticlassClassificationEvaluator(labelCol="y", metricName="accuracy").evaluate(out)
    assert 0.5 < auc <= 1.0 and 0.5 < accuracy_value <= 1.0

    path = str(tmp_path / "saved-model")
    model.write().overwrite().save(path)
    loaded = TorchModel.load(path)
    assert loaded.uid == model.uid and loaded.getHistory() == history and loaded.getLabelCols() == ["y"]
    again = loaded.setPredictionCol("p").transform(frame).orderBy("x1").collect()
    assert [r["p"] for r in again] == [r["prediction"] for r in rows]
    assert [r["probability"] for r in again] == [r["probability"] for r in rows]
    with pytest.raises(ValueError, match=r"output column\(s\) \['rawPrediction', 'probability', 'prediction'\] "
                                         r"already exist.*setPredictionCol"):
        model.transform(out)
    raw = model.copy().setTask("none").transform(frame).orderBy("x1").collect()
    np.testing.assert_allclose([r["y__output"] for r in raw], logits, rtol=1e-5, atol=1e-6)


def test_same_run_id_resumes_after_the_last_completed_epoch_and_refuses_a_changed_model(frame, tmp_path):
    """A run_id whose checkpoint trained another architecture or optimizer is refused, naming what
    changed and the fix; a second fit of the same model continues the epoch count from the
    checkpoint; a run that is complete is not trained again; overwrite_run=True starts a changed
    model over."""
    est = make_estimator(tmp_path, run_id="resumable", epochs=1)
    assert est._load_checkpoint("resumable") is None
    first = est.fit(frame)
    loaded = est._load_checkpoint("resumable")  # the step Horovod's own restore test watches
    assert loaded.epoch == 1 and loaded.history == first.getHistory()

    torch.manual_seed(1)
    wider = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    changed = make_estimator(tmp_path, run_id="resumable", model=wider,
                             optimizer=torch.optim.Adam(wider.parameters(), lr=0.05))
    with pytest.raises(ValueError, match=r"run_id='resumable' already holds a checkpoint \(1 epoch\(s\) done\) of a "
                                         r"different model architecture: .*overwrite_run=True"):
        changed.fit(frame)
    same_model = make_estimator(tmp_path, run_id="resumable")
    same_model.setOptimizer(torch.optim.Adam(same_model.getModel().parameters(), lr=0.5))
    with pytest.raises(ValueError, match=r"of a different optimizer"):
        same_model.fit(frame)

    second = est.setEpochs(2).fit(frame)
    assert [h["epoch"] for h in second.getHistory()] == [1, 2]
    assert second.getHistory()[0] == first.getHistory()[0]
    assert not torch.equal(first.getModel()[0].weight, second.getModel()[0].weight)
    third = est.fit(frame)
    assert third.getHistory() == second.getHistory() and "launch" not in third.fit_timings
    assert torch.equal(third.getModel()[0].weight, second.getModel()[0].weight)

    restarted = changed.setOverwriteRun(True).fit(frame)
    assert [h["epoch"] for h in restarted.getHistory()] == [1] and restarted.getModel()[0].out_features == 16


# Validation splits and sample weights are DataFrame operations and rank code that do not depend
# on the kind of session; the Connect paths (progress, results, persistence) are tested above.
@pytest.mark.session_kinds("classic")
class StepCounter:
    """A TorchEstimator callback that appends each training batch's step to a file per rank."""

    def __init__(self, folder):
        self.folder = folder

    def on_batch_end(self, step, logs, state):
        with open(os.path.join(self.folder, f"steps.{os.getpid()}"), "a") as out:
            out.write(f"{step}\n")


def test_validation_column_and_zero_sample_weights(frame, tmp_path):
    """Rows marked by the validation column are validated on, and weights of zero zero the loss
    (so Adam leaves the weights where they were). With backward_passes_per_step=4 each epoch runs
    whole optimizer steps: 72 training rows on 2 ranks of batch 8 are 5 batches, rounded up to 8."""
    counts = tmp_path / "counts"
    counts.mkdir()
    est = make_estimator(tmp_path, validation="is_val", sample_weight_col="w", epochs=2, backward_passes_per_step=4,
                         callbacks=[StepCounter(str(counts))])
    model = est.fit(frame)
    per_rank = [path.read_text().split() for path in counts.iterdir()]
    assert len(per_rank) == 2 and all(len(steps) == 2 * 8 for steps in per_rank)
    # Without a run_id every fit is a run of its own, under a fresh name.
    assert est.getRunId() is None and model.getRunId().startswith("torch-")
    assert est.getStore().listdir(est.getStore().get_runs_path()) == [model.getRunId()]
    history = model.getHistory()
    assert [h["loss"] for h in history] == [0.0, 0.0]
    assert [h["val_loss"] for h in history] == [0.0, 0.0]
    for before, after in zip(est.getModel().parameters(), model.getModel().parameters()):
        assert torch.equal(before, after)


# -- feature columns stacked into one input ---------------------------------------------------------


@pytest.mark.session_kinds("classic")
def test_several_numeric_columns_are_stacked_for_a_model_of_one_input(frame, tmp_path):
    """feature_cols=['x1', 'x2', 'x3'] for a model whose forward takes one tensor trains on the
    (rows, 3) stack of the columns in that order, the same model as on the assembled Vector; the
    fitted model keeps the three names, scores a frame that has only them, and saves and loads."""
    by_columns = make_estimator(tmp_path, num_proc=1, feature_cols=["x1", "x2", "x3"]).fit(frame)
    by_vector = make_estimator(tmp_path, num_proc=1).fit(frame)
    for a, b in zip(by_columns.getModel().parameters(), by_vector.getModel().parameters()):
        torch.testing.assert_close(a, b)
    assert by_columns.getFeatureCols() == ["x1", "x2", "x3"] and by_columns.getInputShapes() == [[3]]
    plain = frame.select("x1", "x2", "x3", "y")
    scored = by_columns.transform(plain)
    assert scored.columns == ["x1", "x2", "x3", "y", "rawPrediction", "probability", "prediction"]
    rows = frame.orderBy("x1").collect()
    expected = torch.sigmoid(torch.tensor(local_predictions(by_columns.getModel(), rows)))
    got = [r["probability"][1] for r in scored.orderBy("x1").collect()]
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-6)
    path = str(tmp_path / "stacked")
    by_columns.write().overwrite().save(path)
    assert [r["probability"] for r in TorchModel.load(path).transform(plain).orderBy("x1").collect()] == \
        [r["probability"] for r in scored.orderBy("x1").collect()]


@pytest.mark.session_kinds("classic")
def test_fit_on_parquet_trains_on_the_stores_files_as_horovod(frame, tmp_path):
    """Horovod's fit_on_parquet: Parquet written at store.get_train_data_path(idx) and
    get_val_data_path(idx) trains a model validated on the second; without the store's files it
    says where it looked."""
    est = make_estimator(tmp_path, num_proc=1, epochs=1)
    store = est.getStore()
    with pytest.raises(ValueError, match=r"fit_on_parquet found no training data at .*intermediate_train_data.mine "
                                         r"\(dataset_idx='mine'\)"):
        est.fit_on_parquet(dataset_idx="mine")
    columns = frame.select("features", "y")
    columns.filter("is_val = 0").write.parquet(store.spark_url(store.get_train_data_path("mine")))
    columns.filter("is_val = 1").write.parquet(store.spark_url(store.get_val_data_path("mine")))
    model = est.fit_on_parquet(params={est.epochs: 2}, dataset_idx="mine")
    assert len(model.getHistory()) == 2 and all("val_loss" in h for h in model.getHistory())
    assert est.getEpochs() == 1 and est.getValidation() is None
    assert model.transform(frame).count() == ROWS


# -- early stopping and learning-rate schedules --------------------------------------------------


@pytest.mark.session_kinds("classic")
def test_early_stopping_and_lr_schedule_survive_a_resume(frame, tmp_path):
    """A StepLR schedule halves the rate every epoch (history's lr, as given, before scale_lr), and a
    run resumed from its checkpoint goes on with the schedule's state. Early stopping watching loss
    in 'max' mode (a falling loss never improves) stops after epoch 2 with patience 0 and returns
    epoch 1's weights, those of a one-epoch fit; fitting the stopped run again trains nothing."""
    def halving(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    scheduled = make_estimator(tmp_path, epochs=2, run_id="scheduled", lr_scheduler_fn=halving)
    assert [h["lr"] for h in scheduled.fit(frame).getHistory()] == pytest.approx([0.05, 0.025])
    resumed = scheduled.setEpochs(4).fit(frame).getHistory()
    assert [h["epoch"] for h in resumed] == [1, 2, 3, 4]
    assert [h["lr"] for h in resumed] == pytest.approx([0.05, 0.025, 0.0125, 0.00625])

    stopping = make_estimator(tmp_path, epochs=5, run_id="stopping",
                              early_stopping={"monitor": "loss", "mode": "max", "patience": 0})
    stopped = stopping.fit(frame)
    assert [h["epoch"] for h in stopped.getHistory()] == [1, 2]
    one_epoch = make_estimator(tmp_path, epochs=1).fit(frame)
    for a, b in zip(stopped.getModel().parameters(), one_epoch.getModel().parameters()):
        torch.testing.assert_close(a, b)
    again = stopping.fit(frame)
    assert again.fit_timings.get("launch") is None and len(again.getHistory()) == 2
    for a, b in zip(stopped.getModel().parameters(), again.getModel().parameters()):
        torch.testing.assert_close(a, b)


# -- Pipeline and CrossValidator ---------------------------------------------------------------


def test_pipeline_on_real_data_fits_evaluates_saves_and_loads(spark, tmp_path):
    """Pipeline([VectorAssembler, StandardScaler, TorchEstimator]) on the bundled digits (1,797 real
    8x8 images, 10 classes): CrossEntropyLoss makes it a multiclass model whose prediction column
    MulticlassClassificationEvaluator scores on held-out rows as it is; PipelineModel.save and
    load round-trip it with identical predictions; the estimator saves and loads too."""
    from spark_hvd.datasets import load_digits

    images, labels = load_digits()
    pixels = [f"p{i}" for i in range(images.shape[1])]
    pdf = pd.DataFrame(images.astype(np.float64), columns=pixels)
    pdf["label"] = labels
    train, test = spark.createDataFrame(pdf).randomSplit([0.8, 0.2], seed=5)
    test = test.withColumn("row_id", F.monotonically_increasing_id())
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    est = TorchEstimator(num_proc=2, model=net, optimizer=torch.optim.Adam(net.parameters(), lr=0.005),
                         loss=torch.nn.CrossEntropyLoss(), feature_cols=["scaled"], label_cols=["label"],
                         batch_size=32, epochs=4, store=Store.create(str(tmp_path / "store")), random_seed=0,
                         verbose=0)
    pipeline = Pipeline(stages=[VectorAssembler(inputCols=pixels, outputCol="features"),
                                StandardScaler(inputCol="features", outputCol="scaled"), est])
    fitted = pipeline.fit(train)
    scored = fitted.transform(test)
    assert fitted.stages[-1].getTask() == "multiclass"
    accuracy_value = MulticlassClassificationEvaluator(labelCol="label", metricName="accuracy").evaluate(scored)
    assert accuracy_value > 0.85, accuracy_value

    path = str(tmp_path / "pipeline")
    fitted.write().overwrite().save(path)
    loaded = PipelineModel.load(path)
    assert isinstance(loaded.stages[-1], TorchModel)
    before = [(r["prediction"], r["probability"]) for r in scored.orderBy("row_id").collect()]
    after = [(r["prediction"], r["probability"]) for r in loaded.transform(test).orderBy("row_id").collect()]
    assert before == after

    est_path = str(tmp_path / "estimator")
    est.write().overwrite().save(est_path)
    reloaded = TorchEstimator.load(est_path)
    assert reloaded.getFeatureCols() == ["scaled"] and reloaded.getEpochs() == 4
    assert isinstance(reloaded.getOptimizer(), torch.optim.Adam)
    assert reloaded.getOptimizer().param_groups[0]["params"][0] is next(reloaded.getModel().parameters())


def test_cross_validator_with_a_parameter_grid(frame, tmp_path):
    """CrossValidator fits one model per fold and grid point (two at a time) and picks the best."""
    est = make_estimator(tmp_path, num_proc=1, epochs=1)
    grid = ParamGridBuilder().addGrid(est.getParam("batch_size"), [8, 32]).build()
    evaluator = BinaryClassificationEvaluator(labelCol="y")
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid, evaluator=evaluator, numFolds=2, parallelism=2,
                        seed=1)
    cv_model = cv.fit(frame)
    assert len(cv_model.avgMetrics) == 2 and all(0.0 <= m <= 1.0 for m in cv_model.avgMetrics)
    best = cv_model.bestModel
    assert isinstance(best, TorchModel)
    # The batch size the grid chose is the estimator's; the model's own is for inference only.
    assert best.getInferenceBatchSize() == 1024 and not best.hasParam("batch_size")
    assert best.transform(frame).count() == ROWS


@pytest.mark.session_kinds("classic")
def test_cross_validator_tunes_learning_rate_saves_and_logs_child_runs(frame, tmp_path, monkeypatch):
    """A grid over the learning_rate Param, on a Pipeline, inside an active MLflow run: the sub-model
    fitted with 0.0 keeps the initial weights (the optimizer's own 0.05 is replaced), the one with
    0.05 moves them; each fold's fit (on pyspark's worker threads, two at a time) is a child run of
    the active run with its learning rate and per-epoch loss, and so is each fit of fitMultiple. The
    CrossValidatorModel saves and loads with identical predictions. A grid over optimizer objects is
    refused when the CrossValidator is saved, naming the Param and learning_rate, before anything is
    written."""
    import mlflow
    from pyspark.ml.tuning import CrossValidatorModel

    est = make_estimator(tmp_path, num_proc=1, epochs=1)
    initial = [p.detach().clone() for p in est.getModel().parameters()]
    grid = ParamGridBuilder().addGrid(est.learning_rate, [0.0, 0.05]).build()
    cv = CrossValidator(estimator=Pipeline(stages=[est]), estimatorParamMaps=grid,
                        evaluator=BinaryClassificationEvaluator(labelCol="y"), numFolds=2, seed=1, parallelism=2,
                        collectSubModels=True)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri((tmp_path / "mlruns").as_uri())
    try:
        with mlflow.start_run() as parent:
            cv_model = cv.fit(frame)
            fitted = [model for _, model in est.fitMultiple(frame, grid)]
        runs = mlflow.search_runs(experiment_ids=[parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    finally:
        mlflow.set_tracking_uri("")
    assert len(runs) == 2 * 2 + 2
    assert sorted(runs["params.learning_rate"]) == ["0.0"] * 3 + ["0.05"] * 3
    assert runs["metrics.loss"].notna().all() and runs["metrics.train_rows"].notna().all()
    assert {m.mlflow_run_id for m in fitted} <= set(runs["run_id"])
    for fold in cv_model.subModels:
        still, moved = (m.stages[-1] for m in fold)
        assert all(torch.equal(a, b) for a, b in zip(initial, still.getModel().parameters()))
        assert not all(torch.equal(a, b) for a, b in zip(initial, moved.getModel().parameters()))
    assert cv_model.bestModel.stages[-1].getHistory()[-1]["loss"] > 0

    path = str(tmp_path / "cv")
    cv_model.write().overwrite().save(path)
    loaded = CrossValidatorModel.load(path)
    assert [m[est.learning_rate] for m in loaded.getEstimatorParamMaps()] == [0.0, 0.05]
    before = [r["probability"] for r in cv_model.transform(frame).collect()]
    assert before == [r["probability"] for r in loaded.transform(frame).collect()]

    model = est.getModel()
    objects = ParamGridBuilder().addGrid(est.optimizer, [torch.optim.SGD(model.parameters(), lr=lr)
                                                         for lr in (0.01, 0.1)]).build()
    unfitted = CrossValidator(estimator=est, estimatorParamMaps=objects,
                              evaluator=BinaryClassificationEvaluator(labelCol="y"))
    with pytest.raises(TypeError, match=r"CrossValidator cannot be saved: estimatorParamMaps\[0\] sets optimizer=<a torch.optim.sgd.SGD>"
                                        r".*tune learning_rate instead"):
        unfitted.write().overwrite().save(str(tmp_path / "unsaved"))
    assert not (tmp_path / "unsaved").exists()


# -- bad data: counted, named, never silent ------------------------------------------------------


# The counts are one DataFrame aggregation, the same on both kinds of session.
@pytest.mark.session_kinds("classic")
def test_nan_and_infinite_values_are_refused_naming_columns_and_counts_or_skipped(spark, frame, tmp_path, capsys):
    """NaN in an array feature and infinities in the label fail the fit with each column's count;
    invalid_rows='skip' trains on the remaining rows instead."""
    bad = (frame.withColumn("arr", F.array(F.when(F.col("x1") > 1.0, F.lit(float("nan"))).otherwise(F.col("x1")),
                                           "x2", "x3"))
           .withColumn("y", F.when(F.col("x2") > 1.2, F.lit(float("inf"))).otherwise(F.col("y"))))
    counts = bad.select(F.sum((F.col("x1") > 1.0).cast("int")).alias("nan"),
                        F.sum((F.col("x2") > 1.2).cast("int")).alias("inf"),
                        F.sum(((F.col("x1") > 1.0) | (F.col("x2") > 1.2)).cast("int")).alias("either")).first()
    assert counts["nan"] > 0 and counts["inf"] > 0
    est = make_estimator(tmp_path, feature_cols=["arr"])
    with pytest.raises(ValueError, match=rf"column 'arr': {counts['nan']} rows with NaN; column 'y': {counts['inf']} "
                                         r"infinite\): expected a finite number.*invalid_rows='skip'"):
        est.fit(bad)
    model = est.setInvalidRows("skip").setVerbose(1).fit(bad)
    assert np.isfinite(model.getHistory()[0]["loss"])
    store = est.getStore()
    metadata = [n for n in store.listdir(store.prefix) if n.startswith("intermediate_data_metadata")]
    rows = {json.loads(store.read(store.join(n)))["train_rows"] for n in metadata}
    assert ROWS - counts["either"] in rows
    assert model.fit_summary == {"train_rows": ROWS - counts["either"], "val_rows": 0, "skipped_rows": counts["either"]}
    assert (f"invalid_rows='skip' left out {counts['either']} rows with a null, NaN or infinite value; training on "
            f"{ROWS - counts['either']} rows") in capsys.readouterr().out


@pytest.mark.session_kinds("classic")
def test_labels_a_loss_cannot_take_are_refused_before_any_rank_starts(spark, frame, tmp_path):
    """0/2 labels with BCEWithLogitsLoss, a class 3 for CrossEntropyLoss over 3 outputs, a 1.5 for a
    class index and a validation column holding 2: each fails fit naming the column, the count, the
    first value and the fix, and no rank ever ran (no checkpoint). Labels the driver's probe batch
    holds are named before the data is written; those past it, from the ranges the write observed.
    With the labels fixed the same data trains, and a bool label passes BCE."""
    # Past the probe: its 8 rows (batch_size) are the first rows of the first partition.
    late = F.monotonically_increasing_id() >= 8
    twos = frame.withColumn("y", F.when(late, F.col("y") * 2).otherwise(F.col("y"))).cache()
    est = make_estimator(tmp_path, run_id="labels")
    store = est.getStore()
    with pytest.raises(ValueError, match=rf"label column 'y' holds values outside \[0, 1\] in "
                                         rf"{twos.filter('y = 2').count()} rows \(the first: 2.0\), but "
                                         r"BCEWithLogitsLoss takes labels in \[0, 1\].*fix: map them to 0 and 1"):
        est.fit(twos)
    assert not nothing_materialized(est)  # found by the write's ranges
    assert not store.exists(store.get_checkpoint_path("labels"))

    classes = frame.withColumn("k", (F.col("x1") > 1.0).cast("int") * 3)  # 0, or 3 past the last class
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    multiclass = make_estimator(tmp_path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                loss=torch.nn.CrossEntropyLoss(), label_cols=["k"], run_id="classes")
    with pytest.raises(ValueError, match=rf"label column 'k' holds {frame.filter('x1 > 1.0').count()} rows that are "
                                         r"not class indices 0 to 2 \(the first: 3\), but CrossEntropyLoss over the "
                                         r"model's 3 outputs takes an integer class index in \[0, 3\).*StringIndexer"):
        multiclass.fit(classes)
    with pytest.raises(ValueError, match=r"label column 'k' holds \d+ rows that are not class indices 0 to 2 "
                                         r"\(the first: 1.5\)"):
        multiclass.fit(frame.withColumn("k", F.when(F.col("x1") > 1.0, 1.5).otherwise(1.0)))
    assert not store.exists(store.get_checkpoint_path("classes"))

    marked = frame.withColumn("is_val", F.col("is_val") * 2)
    with pytest.raises(ValueError, match=rf"validation column 'is_val' holds values other than 0/1/true/false in "
                                         rf"{frame.filter('is_val = 1').count()} rows \(the first: 2\)"):
        make_estimator(tmp_path, validation="is_val").fit(marked)

    fixed = classes.withColumn("k", (F.col("k") > 0).cast("long") * 2)
    assert multiclass.fit(fixed).getHistory()[-1]["loss"] > 0
    assert make_estimator(tmp_path).fit(frame.withColumn("y", F.col("y") > 0)).getHistory()[-1]["loss"] > 0


def test_null_vectors_are_named_in_fit_and_in_transform(spark, frame, basic_fit, tmp_path):
    """Rows whose Vector is null: fit says which column and how many; transform fails naming the
    column, without a JVM stack (Spark's own Vector conversion would fail the job from the JVM)."""
    holes = frame.withColumn("features", F.when(F.col("x1") > 1.0, F.lit(None)).otherwise(F.col("features")))
    nulls = holes.filter(F.col("features").isNull()).count()
    assert nulls > 0
    with pytest.raises(ValueError, match=rf"column 'features': {nulls} null\): expected a finite number"):
        make_estimator(tmp_path).fit(holes)
    model = basic_fit["model"]
    with pytest.raises(Exception) as info:
        model.transform(holes).collect()
    text = str(info.value)
    assert "feature column 'features' has null values" in text and "fillna" in text
    assert "Py4JJavaError" not in text and "at org.apache.spark" not in text


# The checks run in the prediction UDF and the skip/keep conditions are DataFrame expressions: one
# code path for both kinds of session.
@pytest.mark.session_kinds("classic")
def test_transform_names_rows_it_cannot_score_or_skips_or_keeps_them(spark, frame, basic_fit):
    """NaN, infinite and null features and Vectors of the wrong length: invalid_rows='error' (the
    default) fails naming the column, the rows and the fix (the wrong length also the expected one);
    'skip' scores only the usable rows, with the predictions of the clean frame; 'keep' returns every
    row, with null prediction columns in the unusable ones."""
    from pyspark.ml.functions import array_to_vector
    from pyspark.ml.linalg import Vectors, VectorUDT

    model = basic_fit["model"]
    short = F.udf(lambda v: Vectors.dense(v.toArray()[:2]), VectorUDT())
    ids = frame.withColumn("row_id", F.monotonically_increasing_id()).cache()
    kinds = {"nan": F.array(F.lit(float("nan")), "x2", "x3"), "inf": F.array("x1", F.lit(float("inf")), "x3")}
    bad = ids.withColumn("features", F.when(F.col("row_id") % 10 == 1, array_to_vector(kinds["nan"]))
                         .when(F.col("row_id") % 10 == 2, array_to_vector(kinds["inf"]))
                         .when(F.col("row_id") % 10 == 3, F.lit(None))
                         .when(F.col("row_id") % 10 == 4, short("features"))
                         .otherwise(F.col("features")))
    usable = ~(F.col("row_id") % 10).isin(1, 2, 3, 4)
    for rows, message in ((bad.filter(F.col("row_id") % 10 == 1), r"has NaN or infinite values in \d+ rows"),
                          (bad.filter(F.col("row_id") % 10 == 3), r"has null values in \d+ rows"),
                          (bad.filter(F.col("row_id") % 10 == 4), r"has \d+ rows of a batch with 2 values where the "
                                                                  r"model takes 3 per row")):
        with pytest.raises(Exception, match=r"feature column 'features' " + message + r".*invalid_rows='skip'"):
            model.transform(rows).collect()

    expected = {r["row_id"]: r["probability"] for r in model.transform(ids).collect()}
    skipped = model.copy().setInvalidRows("skip").transform(bad).collect()
    assert sorted(r["row_id"] for r in skipped) == sorted(r["row_id"] for r in ids.filter(usable).collect())
    # The same rows in other batches: equal up to the summation order of a batch's matrix product.
    assert all(np.allclose(r["probability"].toArray(), expected[r["row_id"]].toArray()) for r in skipped)
    kept = model.copy().setInvalidRows("keep").transform(bad).collect()
    assert len(kept) == ROWS
    for r in kept:
        if r["row_id"] % 10 in (1, 2, 3, 4):
            assert r["prediction"] is None and r["probability"] is None and r["rawPrediction"] is None
        else:
            assert np.allclose(r["probability"].toArray(), expected[r["row_id"]].toArray())


def test_a_label_the_loss_would_broadcast_fails_after_one_probe_batch_before_materialization(spark, frame, tmp_path):
    """A label of 3 values per row against an output of 1 with MSELoss (which torch broadcasts with
    only a warning) fails with both shapes named, before any data is written."""
    three = frame.withColumn("y3", F.array("x1", "x2", "x3"))
    est = make_estimator(tmp_path, label_cols=["y3"], loss=torch.nn.MSELoss())
    with pytest.raises(ValueError, match=r"loss would compare tensors of different shapes: MSELoss got the model's "
                                         r"output of shape \(8, 1\) and label 'y3' of shape \(8, 3\).*3 value\(s\) per row"):
        est.fit(three)
    assert nothing_materialized(est)


# MLflow logging happens on the driver after the fit and does not touch the session.
@pytest.mark.session_kinds("classic")
def test_mlflow_gets_params_metrics_with_steps_timings_and_a_scorable_model(spark, frame, tmp_path, monkeypatch):
    """Inside an active MLflow run (a local file store), fit logs the Params, each epoch's metrics
    with the epoch as step, the phase timings, and a model mlflow.pyfunc.load_model scores."""
    import mlflow
    import mlflow.pyfunc

    # MLflow 3 keeps the file store in maintenance mode; it needs no server or database.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri((tmp_path / "mlruns").as_uri())
    with mlflow.start_run() as run:
        model = make_estimator(tmp_path, epochs=2, validation=0.25).fit(frame)
    assert model.mlflow_run_id == run.info.run_id
    client = mlflow.tracking.MlflowClient()
    logged = client.get_run(run.info.run_id).data
    assert logged.params["batch_size"] == "8" and logged.params["task"] == "binary"
    assert logged.params["loss"].startswith("[BCEWithLogitsLoss()")
    history = client.get_metric_history(run.info.run_id, "val_loss")
    assert [(m.step, m.value) for m in history] == [(h["epoch"], h["val_loss"]) for h in model.getHistory()]
    assert {"fit_materialization_s", "fit_training_s"} <= set(logged.metrics)
    scorer = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model")
    rows = frame.orderBy("x1").limit(5).collect()
    features = np.array([r["features"].toArray() for r in rows], dtype=np.float32)  # the logged signature's type
    scored = np.asarray(scorer.predict(features)).reshape(-1)
    np.testing.assert_allclose(scored, local_predictions(model.getModel(), rows), rtol=1e-5, atol=1e-6)
    mlflow.set_tracking_uri("")
