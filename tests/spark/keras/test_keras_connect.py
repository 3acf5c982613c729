"""KerasEstimator and KerasModel on a Spark Connect session (SparkSession.builder.remote): fit on two
ranks with output through the store, transform with Spark ML columns, and model save/load."""

from __future__ import annotations

import keras
import numpy as np
import pandas as pd
import pytest
from pyspark.ml.evaluation import BinaryClassificationEvaluator
from pyspark.ml.feature import VectorAssembler

from spark_hvd.spark import Store
from spark_hvd.spark.keras import KerasEstimator, KerasModel
from spark_hvd.spark.session import is_connect

SESSION_KINDS = ("connect",)
# Every rank process and Python worker imports TensorFlow first: on a busy 2-core machine a
# test here can take longer than the suite's default 300 s without anything being stuck.
pytestmark = pytest.mark.timeout(900)
ROWS = 96


def test_fit_transform_save_and_load_on_spark_connect(spark, tmp_path):
    """Two epochs on two ranks with validation; the model's probabilities match a local predict,
    BinaryClassificationEvaluator reads them, and a saved model loads and predicts the same."""
    assert is_connect(spark)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 3))
    pdf = pd.DataFrame(x, columns=["x1", "x2", "x3"])
    pdf["y"] = (x @ np.array([1.5, -2.0, 0.5]) > 0).astype(np.float64)
    pdf["row_id"] = np.arange(ROWS)
    frame = VectorAssembler(inputCols=["x1", "x2", "x3"], outputCol="features").transform(spark.createDataFrame(pdf))
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    est = KerasEstimator(num_proc=2, model=net, optimizer=keras.optimizers.Adam(0.05),
                         loss=keras.losses.BinaryCrossentropy(from_logits=True), metrics=["binary_accuracy"],
                         feature_cols=["features"], label_cols=["y"], batch_size=8, epochs=2, validation=0.25,
                         store=Store.create(str(tmp_path / "store")), random_seed=3, verbose=0)
    model = est.fit(frame)
    assert [h["epoch"] for h in model.getHistory()] == [1, 2]
    assert {"binary_accuracy", "val_loss"} <= set(model.getHistory()[0]) and model.getTask() == "binary"

    out = model.transform(frame)
    rows = out.orderBy("row_id").collect()
    logits = model.getModel().predict(np.stack([r["features"].toArray() for r in rows]), verbose=0).reshape(-1)
    np.testing.assert_allclose([r["rawPrediction"][1] for r in rows], logits, rtol=1e-4, atol=1e-5)
    assert 0.5 < BinaryClassificationEvaluator(labelCol="y").evaluate(out) <= 1.0

    path = str(tmp_path / "model")
    model.write().overwrite().save(path)
    loaded = KerasModel.load(path)
    assert loaded.getHistory() == model.getHistory()
    again = loaded.transform(frame).orderBy("row_id").collect()
    assert [r["probability"] for r in again] == [r["probability"] for r in rows]
