"""KerasEstimator.fit and KerasModel.transform end to end on a local[2] session: checks before any
job, training on two ranks with progress and checkpoints, resume by run_id, Spark ML prediction
columns and evaluators, save/load of the estimator, the model and a PipelineModel, and a
CrossValidator."""

from __future__ import annotations

import os
import signal

import keras
import numpy as np
import pandas as pd
import pytest
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import BinaryClassificationEvaluator, MulticlassClassificationEvaluator
from pyspark.ml.feature import VectorAssembler
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder
from pyspark.sql import functions as F

from spark_helpers import nothing_materialized, resumed_mid_epoch, spark_jobs
from spark_hvd.spark import Store
from spark_hvd.spark.keras import KerasEstimator, KerasModel
from spark_hvd.spark.keras.checkpoint import read_checkpoint

ROWS = 96
# Every rank process and Python worker imports TensorFlow first: on a busy 2-core machine a
# test here can take longer than the suite's default 300 s without anything being stuck.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def frame(spark):
    """x1..x3, a 0/1 label y, the assembled Vector 'features' and a 3-value array y3."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 3))
    pdf = pd.DataFrame(x, columns=["x1", "x2", "x3"])
    pdf["y"] = (x @ np.array([1.5, -2.0, 0.5]) > 0).astype(np.float64)
    df = spark.createDataFrame(pdf).withColumn("y3", F.array("x1", "x2", "x3"))
    return VectorAssembler(inputCols=["x1", "x2", "x3"], outputCol="features").transform(df).cache()


def small_model(inputs=3, units=1):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(units)])


def make_estimator(tmp_path, **overrides):
    params = dict(num_proc=2, model=small_model(), optimizer=keras.optimizers.Adam(0.05),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True), feature_cols=["features"],
                  label_cols=["y"], batch_size=8, epochs=1, store=Store.create(str(tmp_path / "store")),
                  random_seed=3, verbose=0)
    params.update(overrides)
    return KerasEstimator(**params)


# -- checks before any Spark job ---------------------------------------------------------------

BAD_FITS = [
    ({"feature_cols": ["nope"]}, r"column 'nope' is not in the DataFrame; available columns: x1, x2"),
    ({"model": small_model(inputs=5)}, r"feature column 'features' has 3 values per row but model input 0 has shape "
                                       r"\(None, 5\).*set input_shapes"),
    ({"feature_cols": ["features", "x1"]}, r"gives 2 input\(s\) but the model has 1 input\(s\).*VectorAssembler"),
    ({"label_cols": ["y", "x1"]}, r"returned 1 output\(s\) for 2 label column"),
    ({"optimizer": None}, r"optimizer=None is not valid.*keras.optimizers.Adam"),
    ({"model": "model.keras"}, r"model='model.keras' is not valid: expected a Keras model \(keras.Model, or Keras 2"),
    ({"num_proc": 3}, r"num_proc=3 but the cluster has 2 task slots"),
    ({"model": small_model(units=2), "task": "binary"}, r"task='binary' needs one output value per row, but the "
                                                        r"model returns 2"),
    ({"train_minibatch_fn": lambda *a: None}, r"train_minibatch_fn is not supported by KerasEstimator"),
]


@pytest.mark.parametrize("overrides, message", BAD_FITS)
def test_fit_refuses_bad_input_before_any_spark_job(spark, frame, tmp_path, overrides, message):
    """Each mistake raises a ValueError naming the value and the fix; no Spark job ran, nothing was written."""
    est = make_estimator(tmp_path, **overrides)

    def call():
        with pytest.raises(ValueError, match=message):
            est.fit(frame)

    assert spark_jobs(spark, call) == []
    assert nothing_materialized(est)


def test_a_label_the_loss_would_broadcast_fails_after_one_probe_batch_before_materialization(spark, frame, tmp_path):
    """A label of 3 values per row against one output with MSE (which Keras broadcasts silently)
    fails with both shapes named, before any data is written."""
    est = make_estimator(tmp_path, label_cols=["y3"], loss="mse")
    with pytest.raises(ValueError, match=r"loss would compare tensors of different shapes: mean_squared_error got the "
                                         r"model's output of shape \(8, 1\) and label 'y3' of shape \(8, 3\)"):
        est.fit(frame)
    assert nothing_materialized(est)


# -- fit, transform, save, load, resume --------------------------------------------------------


@pytest.fixture(scope="module")
def digits(spark, tmp_path_factory):
    """The bundled digits (1,797 real 8x8 images) as a 64-value Vector, split 80/20, and a
    compiled softmax model over an (8, 8) input."""
    from spark_hvd.datasets import load_digits

    images, labels = load_digits()
    pixels = [f"p{i}" for i in range(images.shape[1])]
    pdf = pd.DataFrame(images.astype(np.float64) / 16.0, columns=pixels)
    pdf["label"] = labels
    assembled = VectorAssembler(inputCols=pixels, outputCol="features").transform(spark.createDataFrame(pdf))
    train, test = assembled.select("features", "label").randomSplit([0.8, 0.2], seed=5)
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((8, 8)), keras.layers.Flatten(), keras.layers.Dense(32, activation="relu"),
                            keras.layers.Dense(10, activation="softmax")])
    net.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    store = Store.create(str(tmp_path_factory.mktemp("digits") / "store"))
    return {"train": train.cache(), "test": test.withColumn("row_id", F.monotonically_increasing_id()).cache(),
            "net": net, "store": store}


@pytest.fixture(scope="module")
def digits_fit(digits):
    """Pipeline([KerasEstimator]) fitted on two ranks for 2 epochs under run_id 'digits'; the
    printed output and the model's weights before the fit."""
    import contextlib
    import io

    net = digits["net"]
    initial = [w.copy() for w in net.get_weights()]
    est = KerasEstimator(num_proc=2, model=net, feature_cols=["features"], label_cols=["label"], batch_size=32,
                         epochs=2, validation=0.2, store=digits["store"], run_id="digits", random_seed=0, verbose=1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        fitted = Pipeline(stages=[est]).fit(digits["train"])
    return {"est": est, "fitted": fitted, "printed": printed.getvalue(), "initial": initial}


def test_pipeline_on_digits_fits_evaluates_saves_and_loads(digits, digits_fit, tmp_path):
    """The loss makes a multiclass_probability model; each 64-value row is reshaped to the model's
    (8, 8) input; two ranks train with epoch lines; rank 0's checkpoint is a .keras file Keras
    loads; the Spark ML columns match a local predict and MulticlassClassificationEvaluator scores
    them; PipelineModel and KerasEstimator save and load."""
    fitted, est, store = digits_fit["fitted"], digits_fit["est"], digits["store"]
    printed = digits_fit["printed"]
    assert "epoch 1/2: accuracy " in printed and "val_accuracy" in printed and "spark-hvd-progress" not in printed
    model = fitted.stages[-1]
    assert isinstance(model, KerasModel) and model.getTask() == "multiclass_probability"
    assert model.getInputShapes() == [[8, 8]]
    history = model.getHistory()
    assert [h["epoch"] for h in history] == [1, 2]
    assert {"loss", "accuracy", "val_loss", "val_accuracy", "rows_per_s"} <= set(history[0])
    assert history[1]["loss"] < history[0]["loss"]
    assert set(model.fit_timings) == {"validation", "materialization", "launch", "training", "collection"}
    # The driver's model is untouched.
    assert all(np.array_equal(a, b) for a, b in zip(digits["net"].get_weights(), digits_fit["initial"]))

    checkpoint = store.read(os.path.join(store.get_run_path("digits"), "checkpoint.keras"))
    assert read_checkpoint(checkpoint).epoch == 2
    path = tmp_path / "checkpoint.keras"
    path.write_bytes(checkpoint)
    from_checkpoint = keras.saving.load_model(str(path), compile=False)
    for a, b in zip(from_checkpoint.get_weights(), model.getModel().get_weights()):
        np.testing.assert_array_equal(a, b)

    test = digits["test"]
    scored = fitted.transform(test)
    assert scored.columns == test.columns + ["rawPrediction", "probability", "prediction"]
    rows = scored.orderBy("row_id").collect()
    local = model.getModel().predict(np.stack([r["features"].toArray() for r in rows]).reshape(-1, 8, 8), verbose=0)
    np.testing.assert_allclose(np.stack([r["probability"].toArray() for r in rows]), local, rtol=1e-4, atol=1e-5)
    assert [r["prediction"] for r in rows] == [float(i) for i in local.argmax(axis=1)]
    accuracy = MulticlassClassificationEvaluator(labelCol="label", metricName="accuracy").evaluate(scored)
    assert accuracy > 0.8, accuracy

    fitted.write().overwrite().save(str(tmp_path / "pipeline"))
    loaded = PipelineModel.load(str(tmp_path / "pipeline"))
    assert isinstance(loaded.stages[-1], KerasModel) and loaded.stages[-1].getHistory() == history
    again = loaded.transform(test).orderBy("row_id").collect()
    assert [r["probability"] for r in again] == [r["probability"] for r in rows]
    est.write().overwrite().save(str(tmp_path / "estimator"))
    reloaded = KerasEstimator.load(str(tmp_path / "estimator"))
    assert reloaded.getEpochs() == 2 and reloaded.getRunId() == "digits"
    assert isinstance(reloaded.getModel(), keras.Model)


class KillRankOnce(keras.callbacks.Callback):
    """Rank 1 kills its own process (SIGKILL) when epoch ``epoch`` (from 0) begins, once: a marker
    file keeps the retried stage from doing it again."""

    def __init__(self, marker, epoch):
        super().__init__()
        self.marker, self.epoch = str(marker), epoch

    def on_epoch_begin(self, epoch, logs=None):
        import spark_hvd.keras as hvd

        if hvd.rank() == 1 and epoch == self.epoch and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def test_the_same_run_id_resumes_after_the_last_completed_epoch_and_retries_a_killed_rank(digits, digits_fit, tmp_path,
                                                                                      capsys):
    """A fit with the run_id and epochs=3 trains one more epoch and numbers it 3, its history
    starting with the first fit's; rank 1 dies as that epoch begins: fit reports the retry and
    resumes after epoch 2, so each epoch is in the history once; cleanup_intermediate removes the
    materialized data; once complete, a fit returns the run's model without training."""
    est, store = digits_fit["est"], digits["store"]
    history = digits_fit["fitted"].stages[-1].getHistory()
    marker = tmp_path / "killed"
    resumed = (est.copy({est.epochs: 3}).setVerbose(1).setCallbacks([KillRankOnce(marker, 2)])
               .setCleanupIntermediate(True).fit(digits["train"]))
    printed = capsys.readouterr().out
    assert marker.exists()
    assert "retry 1/3 (attempt 2) after the barrier stage failed" in printed, printed[-3000:]
    assert "resuming from the end of epoch 2" in printed, printed[-3000:]
    assert [h["epoch"] for h in resumed.getHistory()] == [1, 2, 3] and resumed.getHistory()[:2] == history
    assert read_checkpoint(store.read(os.path.join(store.get_run_path("digits"), "checkpoint.keras"))).epoch == 3
    assert store.list_intermediate() == []

    complete = est.copy({est.epochs: 3}).setVerbose(0).fit(digits["train"])
    assert complete.getHistory() == resumed.getHistory() and "launch" not in complete.fit_timings
    for a, b in zip(complete.getModel().get_weights(), resumed.getModel().get_weights()):
        np.testing.assert_array_equal(a, b)


class KillRankAfterBatch(keras.callbacks.Callback):
    """Rank 1 kills its own process after batch ``batch`` of epoch ``epoch`` (both from 0), once;
    rank 0 logs its pid and epoch for every batch it trains."""

    def __init__(self, marker, log, epoch, batch):
        super().__init__()
        self.marker, self.log, self.epoch, self.batch = str(marker), str(log), epoch, batch
        self.current = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        import spark_hvd.keras as hvd

        if hvd.rank() == 0:
            with open(self.log, "a") as f:
                f.write(f"{os.getpid()} {self.current}\n")
        if hvd.rank() == 1 and (self.current, batch) == (self.epoch, self.batch) and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def test_a_retry_resumes_within_the_epoch_from_a_mid_epoch_checkpoint(frame, tmp_path, capsys):
    """checkpoint_every_steps=2 (6 steps per epoch): rank 1 dies after the 3rd batch of epoch 2, so
    the retry resumes from the checkpoint at its step 2, trains that epoch's other 4 batches and
    the last epoch; each epoch is in the history once, with the losses of an uninterrupted run of
    the same seed (whose mid-epoch checkpoints do not change its training)."""
    resumed, baseline = resumed_mid_epoch(make_estimator, frame, tmp_path, capsys, KillRankAfterBatch, steps=6)
    history, want = resumed.getHistory(), baseline.getHistory()
    for got, expected in zip(history, want):
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-4), (history, want)
    for a, b in zip(resumed.getModel().get_weights(), baseline.getModel().get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_labels_the_loss_cannot_take_are_refused_before_training(frame, tmp_path):
    """BinaryCrossentropy refuses 0/2 labels and sparse_categorical_crossentropy a class past the
    model's outputs, each naming the column, the rows and the first value."""
    with pytest.raises(ValueError, match=rf"label column 'y' holds values outside \[0, 1\] in "
                                         rf"{frame.filter('y = 1').count()} rows \(the first: 2.0\), but "
                                         r"BinaryCrossentropy takes labels"):
        make_estimator(tmp_path).fit(frame.withColumn("y", F.col("y") * 2))
    classes = frame.withColumn("k", F.when(F.col("x1") > 1.0, 3).otherwise(1))
    with pytest.raises(ValueError, match=rf"label column 'k' holds {classes.filter('k = 3').count()} rows that are not "
                                         r"class indices 0 to 2 \(the first: 3\), but sparse_categorical_crossentropy"):
        make_estimator(tmp_path, model=small_model(units=3), loss="sparse_categorical_crossentropy",
                       label_cols=["k"]).fit(classes)


def test_cross_validator_fits_per_fold_and_picks_the_best(frame, tmp_path):
    """CrossValidator fits a model per fold (two at a time, one rank each) and the best model scores;
    the grid's learning_rate replaces the optimizer's own (0.0, which would leave the weights as they
    were)."""
    est = make_estimator(tmp_path, num_proc=1, optimizer=keras.optimizers.Adam(0.0))
    initial = est.getModel().get_weights()
    grid = ParamGridBuilder().addGrid(est.learning_rate, [0.05]).addGrid(est.getParam("batch_size"), [16]).build()
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid, evaluator=BinaryClassificationEvaluator(labelCol="y"),
                        numFolds=2, parallelism=2, seed=1)
    cv_model = cv.fit(frame)
    assert len(cv_model.avgMetrics) == 1 and 0.0 <= cv_model.avgMetrics[0] <= 1.0
    best = cv_model.bestModel
    assert isinstance(best, KerasModel) and best.getTask() == "binary"
    assert not all(np.array_equal(a, b) for a, b in zip(initial, best.getModel().get_weights()))
    out = best.transform(frame)
    assert out.count() == ROWS and 0.5 < BinaryClassificationEvaluator(labelCol="y").evaluate(out) <= 1.0


# -- Keras 2 (tf_keras) models -------------------------------------------------------------------

def keras2_model():
    import tf_keras

    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(8, activation="tanh"),
                                 tf_keras.layers.Dense(1)])
    model.compile(optimizer=tf_keras.optimizers.legacy.Adam(0.05),
                  loss=tf_keras.losses.BinaryCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def test_a_keras2_model_fits_resumes_scores_and_saves(frame, tmp_path):
    """A compiled tf_keras model (Keras 2's legacy Adam, from_logits cross-entropy): two ranks
    train it with its own compile settings; the fitted model is a tf_keras model whose Spark ML
    columns match its local predictions; a fit with the same run_id resumes from the checkpoint
    (the optimizer's slots and step count restored) and trains one more epoch; the fitted model
    saves and loads in a Pipeline."""
    import tf_keras

    model = keras2_model()
    store = Store.create(str(tmp_path / "store"))
    est = KerasEstimator(num_proc=2, model=model, feature_cols=["features"], label_cols=["y"], batch_size=8,
                         epochs=2, validation=0.25, store=store, run_id="keras2", random_seed=3, verbose=0)
    fitted = est.fit(frame)
    net = fitted.getModel()
    assert isinstance(net, tf_keras.Model) and fitted.getTask() == "binary"
    history = fitted.getHistory()
    assert [h["epoch"] for h in history] == [1, 2] and {"loss", "accuracy", "val_loss"} <= set(history[0])
    assert history[1]["loss"] < history[0]["loss"]
    checkpoint = read_checkpoint(store.read(os.path.join(store.get_run_path("keras2"), "checkpoint.keras")))
    assert checkpoint.epoch == 2 and len(checkpoint.optimizer_variables) == 1 + 2 * len(net.weights)

    rows = fitted.transform(frame).orderBy("x1").collect()
    logits = net.predict(np.stack([r["features"].toArray() for r in rows]), verbose=0).reshape(-1)
    np.testing.assert_allclose([r["probability"][1] for r in rows], 1 / (1 + np.exp(-logits)), rtol=1e-4, atol=1e-5)
    assert [r["prediction"] for r in rows] == [float(v > 0) for v in logits]

    resumed = est.copy({est.epochs: 3}).fit(frame)
    assert [h["epoch"] for h in resumed.getHistory()] == [1, 2, 3]
    assert resumed.getHistory()[:2] == history
    after = read_checkpoint(store.read(os.path.join(store.get_run_path("keras2"), "checkpoint.keras")))
    # The legacy Adam's step count went on from the checkpoint's: the third epoch's steps were added.
    assert int(after.optimizer_variables[0]) > int(checkpoint.optimizer_variables[0]) > 0

    PipelineModel(stages=[resumed]).write().overwrite().save(str(tmp_path / "pipeline"))
    loaded = PipelineModel.load(str(tmp_path / "pipeline")).stages[-1]
    assert isinstance(loaded.getModel(), tf_keras.Model)
    again = loaded.transform(frame).orderBy("x1").collect()
    expected = resumed.transform(frame).orderBy("x1").collect()
    assert [r["probability"] for r in again] == [r["probability"] for r in expected]


def test_keras2_and_keras3_objects_are_not_mixed(frame, tmp_path):
    """A tf_keras model with a Keras 3 optimizer, or a Keras 3 ModelCheckpoint, is refused before
    any Spark job, naming both Keras and the fix."""
    model = keras2_model()
    with pytest.raises(ValueError, match=r"is Keras 3's but the model is Keras 2 \(tf_keras\)'s.*tf_keras.optimizers"):
        make_estimator(tmp_path, model=model, optimizer=keras.optimizers.Adam(0.05)).fit(frame)
    with pytest.raises(ValueError, match=r"expected a tf_keras.callbacks.ModelCheckpoint \(the model's Keras\)"):
        make_estimator(tmp_path, model=model, optimizer=None, loss=None,
                       checkpoint_callback=keras.callbacks.ModelCheckpoint("best.keras")).fit(frame)
    assert nothing_materialized(make_estimator(tmp_path))
