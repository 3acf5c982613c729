"""TorchEstimator.fit and TorchModel.transform end to end on tiny frames, on the module's local[2]
session: checks before any job, training with progress, checkpoints and resume, validation
columns and sample weights, save/load, Pipeline persistence and CrossValidator."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import BinaryClassificationEvaluator
from pyspark.ml.feature import StandardScaler, VectorAssembler
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder
from pyspark.sql import functions as F

from spark_hvd.spark import Store
from spark_hvd.spark.torch import TorchEstimator, TorchModel
from spark_hvd.spark.torch.training import load_checkpoint

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
]


@pytest.mark.parametrize("overrides, message", BAD_FITS)
def test_fit_refuses_bad_input_before_any_spark_job(spark, frame, tmp_path, overrides, message):
    """Each mistake raises a ValueError naming the value and the fix, and no Spark job ran."""
    est = make_estimator(tmp_path, **overrides)
    if "model" in overrides and overrides["model"] is not None and "optimizer" not in overrides:
        est.setOptimizer(torch.optim.SGD(overrides["model"].parameters(), lr=0.1))
    sc = spark.sparkContext
    group = f"checks-{abs(hash(message))}"
    sc.setJobGroup(group, "fit checks")
    try:
        with pytest.raises(ValueError, match=message):
            est.fit(frame)
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    assert list(sc.statusTracker().getJobIdsForGroup(group)) == []


def test_fit_refuses_an_empty_frame(spark, frame, tmp_path):
    """An empty DataFrame fails with a message saying there are no rows (found by a Spark job,
    which the job-group probe of the test above does see)."""
    sc = spark.sparkContext
    sc.setJobGroup("checks-empty", "fit checks")
    try:
        with pytest.raises(ValueError, match=r"the DataFrame has no rows"):
            make_estimator(tmp_path).fit(frame.filter("x1 > 100"))
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    assert list(sc.statusTracker().getJobIdsForGroup("checks-empty")) != []


# -- fit, transform, save, load ----------------------------------------------------------------


def test_fit_trains_reports_progress_and_the_model_transforms_saves_and_loads(frame, tmp_path, capsys):
    """Two ranks train with live epoch lines; the model predicts like a local forward pass, adds
    y__output as doubles, keeps the other columns, and predicts the same after save and load."""
    est = make_estimator(tmp_path, epochs=3, validation=0.25, metrics=[accuracy], verbose=1, run_id="basic")
    model = est.fit(frame)
    printed = capsys.readouterr().out
    for epoch in (1, 2, 3):
        assert f"epoch {epoch}/3: loss " in printed
    assert "val_accuracy" in printed and "rows/s" in printed and "spark-hvd-progress" not in printed

    history = model.getHistory()
    assert [h["epoch"] for h in history] == [1, 2, 3]
    assert {"loss", "accuracy", "val_loss", "val_accuracy", "rows_per_s"} <= set(history[0])
    assert history[-1]["loss"] < history[0]["loss"]
    assert set(model.fit_timings) == {"validation", "materialization", "launch", "training", "collection"}
    assert model.getRunId() == "basic" and model.getInputShapes() == [[3]]
    checkpoint = load_checkpoint(est.getStore().read(est.getStore().get_checkpoint_path("basic")))
    assert checkpoint["epoch"] == 3
    assert torch.equal(checkpoint["model"]["2.weight"], model.getModel()[2].weight.detach())
    assert not torch.equal(est.getModel()[2].weight, model.getModel()[2].weight)  # the driver's model is untouched

    out = model.transform(frame)
    assert out.columns == frame.columns + ["y__output"]
    assert dict(out.dtypes)["y__output"] == "double" and dict(out.dtypes)["features"] == "vector"
    rows = out.orderBy("x1").collect()
    assert len(rows) == ROWS
    predicted = np.array([r["y__output"] for r in rows])
    np.testing.assert_allclose(predicted, local_predictions(model.getModel(), rows), rtol=1e-5, atol=1e-6)

    path = str(tmp_path / "saved-model")
    model.write().overwrite().save(path)
    loaded = TorchModel.load(path)
    assert loaded.uid == model.uid and loaded.getHistory() == history and loaded.getLabelCols() == ["y"]
    again = np.array([r["y__output"] for r in loaded.setOutputCols(["p"]).transform(frame).orderBy("x1")
                      .select(F.col("p").alias("y__output")).collect()])
    np.testing.assert_array_equal(again, predicted)
    with pytest.raises(ValueError, match=r"output column\(s\) \['y__output'\] already exist"):
        model.transform(out)


def test_same_run_id_resumes_after_the_last_completed_epoch(frame, tmp_path):
    """A second fit with the run_id continues the epoch count from the checkpoint; a run that is
    complete is not trained again."""
    est = make_estimator(tmp_path, run_id="resumable", epochs=1)
    first = est.fit(frame)
    second = est.setEpochs(2).fit(frame)
    assert [h["epoch"] for h in second.getHistory()] == [1, 2]
    assert second.getHistory()[0] == first.getHistory()[0]
    assert not torch.equal(first.getModel()[0].weight, second.getModel()[0].weight)
    third = est.fit(frame)
    assert third.getHistory() == second.getHistory() and "launch" not in third.fit_timings
    assert torch.equal(third.getModel()[0].weight, second.getModel()[0].weight)


def test_validation_column_and_zero_sample_weights(frame, tmp_path):
    """Rows marked by the validation column are validated on, and weights of zero zero the loss
    (so Adam leaves the weights where they were)."""
    est = make_estimator(tmp_path, validation="is_val", sample_weight_col="w", epochs=2)
    model = est.fit(frame)
    history = model.getHistory()
    assert [h["loss"] for h in history] == [0.0, 0.0]
    assert [h["val_loss"] for h in history] == [0.0, 0.0]
    for before, after in zip(est.getModel().parameters(), model.getModel().parameters()):
        assert torch.equal(before, after)


# -- Pipeline and CrossValidator ---------------------------------------------------------------


def test_pipeline_fits_saves_and_loads(frame, tmp_path):
    """Pipeline([VectorAssembler, StandardScaler, TorchEstimator]) fits; PipelineModel.save and
    PipelineModel.load round-trip it with identical predictions; the estimator saves too."""
    raw = frame.drop("features")
    est = make_estimator(tmp_path, feature_cols=["scaled"], epochs=2)
    pipeline = Pipeline(stages=[VectorAssembler(inputCols=["x1", "x2", "x3"], outputCol="features"),
                                StandardScaler(inputCol="features", outputCol="scaled"), est])
    fitted = pipeline.fit(raw)
    path = str(tmp_path / "pipeline")
    fitted.write().overwrite().save(path)
    loaded = PipelineModel.load(path)
    assert isinstance(loaded.stages[-1], TorchModel)
    before = [r["y__output"] for r in fitted.transform(raw).orderBy("x1").collect()]
    after = [r["y__output"] for r in loaded.transform(raw).orderBy("x1").collect()]
    assert before == after

    est_path = str(tmp_path / "estimator")
    est.write().overwrite().save(est_path)
    reloaded = TorchEstimator.load(est_path)
    assert reloaded.getFeatureCols() == ["scaled"] and reloaded.getEpochs() == 2
    assert isinstance(reloaded.getOptimizer(), torch.optim.Adam)
    assert reloaded.getOptimizer().param_groups[0]["params"][0] is next(reloaded.getModel().parameters())


def test_cross_validator_with_a_parameter_grid(frame, tmp_path):
    """CrossValidator fits one model per fold and grid point (two at a time) and picks the best."""
    est = make_estimator(tmp_path, num_proc=1, epochs=1)
    grid = ParamGridBuilder().addGrid(est.getParam("batch_size"), [8, 32]).build()
    evaluator = BinaryClassificationEvaluator(rawPredictionCol="y__output", labelCol="y")
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid, evaluator=evaluator, numFolds=2, parallelism=2,
                        seed=1)
    cv_model = cv.fit(frame)
    assert len(cv_model.avgMetrics) == 2 and all(0.0 <= m <= 1.0 for m in cv_model.avgMetrics)
    best = cv_model.bestModel
    assert isinstance(best, TorchModel)
    assert best.transform(frame).count() == ROWS
