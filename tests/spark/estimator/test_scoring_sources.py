"""transform() on every source a user scores from: Parquet, ORC and CSV scans, tables, cached and
in-memory frames, with Vector, array, scalar and decimal feature columns, for TorchModel,
KerasModel and LightningModel, on classic and Spark Connect sessions; and a nightly job: a
Pipeline fitted on a stored table and saved, loaded in a fresh process that scores the night's
Parquet and writes the scores."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from decimal import Decimal

import numpy as np
import pytest
import torch
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.feature import StandardScaler
from pyspark.ml.functions import vector_to_array
from pyspark.ml.linalg import Vectors
from pyspark.sql import functions as F
from pyspark.sql import types as T

from scoring_models import LinearModule, ThreeInputs, keras_linear, logits, torch_linear
from spark_hvd.spark import Store
from spark_hvd.spark.keras import KerasModel
from spark_hvd.spark.lightning import LightningModel
from spark_hvd.spark.session import LOCAL_ENVIRONMENT
from spark_hvd.spark.torch import TorchEstimator, TorchModel

SESSION_KINDS = ("classic", "connect")
# Keras models load TensorFlow in every Python worker: slow on a busy two-core machine.
pytestmark = pytest.mark.timeout(900)
HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = 60


def _rows(seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    x = np.round(rng.normal(size=(ROWS, 3)), 4)
    # Every third Vector is sparse: both layouts score, also where a format keeps only their struct.
    return [(i, Vectors.sparse(3, [0, 1, 2], x[i].tolist()) if i % 3 == 0 else Vectors.dense(x[i].tolist()),
             x[i].tolist(), *map(float, x[i]), *[Decimal(str(v)) for v in x[i]],
             float(logits(x[i]) > 0)) for i in range(ROWS)]


def _frame(spark, seed: int = 0):
    from pyspark.ml.linalg import VectorUDT

    fields = [T.StructField("id", T.LongType()), T.StructField("features", VectorUDT()),
              T.StructField("arr", T.ArrayType(T.DoubleType())), *[T.StructField(f"x{i}", T.DoubleType()) for i in range(3)],
              *[T.StructField(f"d{i}", T.DecimalType(10, 4)) for i in range(3)], T.StructField("label", T.DoubleType())]
    return spark.createDataFrame(_rows(seed), T.StructType(fields))


@pytest.fixture(scope="module")
def sources(spark, tmp_path_factory):
    """The same rows from every kind of source: a stored Vector column in Parquet and ORC, the scalars
    in CSV, an external table, a cached scan and the in-memory frame itself."""
    root = tmp_path_factory.mktemp("sources")
    frame = _frame(spark)
    frame.write.parquet(str(root / "parquet"))
    frame.write.orc(str(root / "orc"))
    frame.select("id", "x0", "x1", "x2").write.option("header", True).csv(str(root / "csv"))
    table = f"scoring_{abs(hash(str(root))) % 10_000}"
    frame.write.option("path", str(root / "table")).saveAsTable(table)
    cached = spark.read.parquet(str(root / "parquet")).cache()
    yield {"parquet": spark.read.parquet(str(root / "parquet")), "orc": spark.read.orc(str(root / "orc")),
           "csv": spark.read.option("header", True).schema("id long, x0 double, x1 double, x2 double")
           .csv(str(root / "csv")), "table": spark.table(table), "cached": cached, "memory": frame}
    cached.unpersist()
    spark.sql(f"DROP TABLE IF EXISTS {table}")


def _expected() -> np.ndarray:
    return logits(np.array([row[2] for row in _rows()]))


def _scores(out) -> np.ndarray:
    rows = out.select("id", vector_to_array("rawPrediction").alias("raw")).orderBy("id").collect()
    assert [r["id"] for r in rows] == list(range(ROWS))
    return np.array([r["raw"][1] for r in rows])


@pytest.mark.parametrize("source", ["parquet", "orc", "table", "cached", "memory"])
def test_torch_model_scores_a_stored_vector_column_from_every_source(spark, sources, source):
    """A Vector feature column read back from storage scores as it does in memory (it failed with
    UNSUPPORTED_DATATYPE over a file scan); an aggregate over the probabilities runs too."""
    model = TorchModel(model=torch_linear(), feature_cols=["features"], label_cols=["label"], task="binary")
    out = model.transform(sources[source])
    np.testing.assert_allclose(_scores(out), _expected(), rtol=1e-5, atol=1e-5)
    total = out.agg(F.sum(vector_to_array("probability")[1])).collect()[0][0]
    np.testing.assert_allclose(total, (1 / (1 + np.exp(-_expected()))).sum(), rtol=1e-5)


@pytest.mark.parametrize("source, columns", [("parquet", ["arr"]), ("table", ["arr"]), ("csv", ["x0", "x1", "x2"]),
                                             ("parquet", ["x0", "x1", "x2"]), ("parquet", ["d0", "d1", "d2"]),
                                             ("memory", ["d0", "d1", "d2"])])
def test_torch_model_scores_array_scalar_and_decimal_columns(spark, sources, source, columns):
    """Arrays and scalars score from any source; decimals are cast to doubles, as fit() stores them
    (they failed in the Python worker naming no column)."""
    net = torch_linear() if len(columns) == 1 else ThreeInputs()
    model = TorchModel(model=net, feature_cols=columns, label_cols=["label"], task="binary")
    np.testing.assert_allclose(_scores(model.transform(sources[source])), _expected(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("source", ["parquet", "table"])
def test_keras_and_lightning_models_score_a_stored_vector_column(spark, sources, source):
    """KerasModel and LightningModel score the stored Vector column as TorchModel does."""
    keras_model = KerasModel(model=keras_linear(), feature_cols=["features"], label_cols=["label"], task="binary")
    np.testing.assert_allclose(_scores(keras_model.transform(sources[source])), _expected(), rtol=1e-5, atol=1e-5)
    lightning_model = LightningModel(model=LinearModule(), feature_cols=["features"], label_cols=["label"],
                                     task="binary")
    np.testing.assert_allclose(_scores(lightning_model.transform(sources[source])), _expected(), rtol=1e-5,
                               atol=1e-5)


_NIGHTLY_JOB = textwrap.dedent('''
    import sys
    from pyspark.ml import PipelineModel
    from pyspark.ml.functions import vector_to_array
    from spark_hvd.spark import local_session

    models, night, out = sys.argv[1], sys.argv[2], sys.argv[3]
    spark = local_session("nightly-scoring")
    scores = spark.read.parquet(night)
    for name in ("torch", "keras", "lightning"):
        model = PipelineModel.load(f"{models}/{name}")
        scored = model.transform(scores).select("id", vector_to_array("probability").alias("p"), "prediction")
        scored.write.mode("overwrite").parquet(f"{out}/{name}")
    spark.stop()
''')


@pytest.mark.session_kinds("classic")
def test_nightly_job_loads_a_saved_pipeline_in_a_fresh_process_and_scores_the_nights_parquet(spark, tmp_path):
    """A Pipeline (scaler, TorchEstimator) fitted on a stored table and saved, and saved pipelines
    ending in a KerasModel and a LightningModel, are loaded by a new process that reads the
    night's Parquet (a stored Vector column), scores it and writes the scores; they equal what
    this process computes with the same pipelines."""
    day, night = str(tmp_path / "day"), str(tmp_path / "night")
    _frame(spark, seed=1).select("id", "features", "label").write.parquet(day)
    _frame(spark, seed=2).select("id", "features").write.parquet(night)
    scaler = StandardScaler(inputCol="features", outputCol="scaled", withMean=False, withStd=True)
    net = torch_linear()
    estimator = TorchEstimator(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
                               loss=torch.nn.BCEWithLogitsLoss(), feature_cols=["scaled"], label_cols=["label"],
                               batch_size=16, epochs=1, store=Store.create(str(tmp_path / "store")), verbose=0)
    fitted = Pipeline(stages=[scaler, estimator]).fit(spark.read.parquet(day))
    scaler_model = fitted.stages[0]
    pipelines = {
        "torch": fitted,
        "keras": PipelineModel(stages=[scaler_model, KerasModel(model=keras_linear(), feature_cols=["scaled"],
                                                                label_cols=["label"], task="binary")]),
        "lightning": PipelineModel(stages=[scaler_model, LightningModel(model=LinearModule(), feature_cols=["scaled"],
                                                                        label_cols=["label"], task="binary")]),
    }
    models, out = tmp_path / "models", tmp_path / "scores"
    for name, pipeline in pipelines.items():
        pipeline.write().overwrite().save(str(models / name))

    env = {**os.environ, **LOCAL_ENVIRONMENT,
           "PYTHONPATH": os.pathsep.join([HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    job = subprocess.run([sys.executable, "-c", _NIGHTLY_JOB, str(models), night, str(out)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert job.returncode == 0, job.stderr[-3000:]

    night_frame = spark.read.parquet(night)
    for name, pipeline in pipelines.items():
        written = spark.read.parquet(str(out / name)).orderBy("id").collect()
        here = (pipeline.transform(night_frame).select("id", vector_to_array("probability").alias("p"), "prediction")
                .orderBy("id").collect())
        assert [r["id"] for r in written] == list(range(ROWS)), name
        np.testing.assert_allclose([r["p"][1] for r in written], [r["p"][1] for r in here], rtol=1e-6, err_msg=name)
        assert [r["prediction"] for r in written] == [r["prediction"] for r in here], name


@pytest.mark.parametrize("task", ["binary", "binary_probability", "regression"])
def test_columns_made_in_spark_equal_the_numpy_ones(spark, task):
    """transform builds a one-value task's Vectors and prediction in Spark from the model's double:
    they equal standard_columns on the same values, at the extremes, at 0.5 and for NaN (Spark
    orders NaN above every number, where numpy's comparisons with it are false)."""
    from spark_hvd.spark.estimator.outputs import column_kinds, spark_columns, standard_columns

    values = [-1000.0, -2.0, -0.0, 0.0, 0.3, 0.5, 1.0, 1.7, 3.0, 1000.0, float("inf"), float("-inf"), float("nan")]
    frame = spark.createDataFrame([(i, v) for i, v in enumerate(values)], "i long, z double")
    made = spark_columns(task, F.col("z"))
    roles = [role for role, _ in column_kinds(task)]
    rows = frame.select("i", *[made[r].alias(r) for r in roles]).orderBy("i").collect()
    expected = standard_columns(task, np.array(values).reshape(-1, 1))
    for role, kind in column_kinds(task):
        got = np.array([r[role].toArray() if kind == "vector" else r[role] for r in rows], dtype=np.float64)
        np.testing.assert_allclose(got, expected[role].reshape(got.shape), rtol=1e-12, atol=0, equal_nan=True)
