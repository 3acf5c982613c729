"""What a user reads when something of theirs goes wrong: one message naming their own file and line,
the shape advice only for shape problems, the good message for rows of different lengths wherever
they are found, and no Java stack traces in between."""

from __future__ import annotations

import inspect

import keras
import numpy as np
import pytest
import torch
from pyspark.ml.linalg import Vectors

from spark_hvd.runner.errors import RankFailedError
from spark_hvd.spark import Store
from spark_hvd.spark.keras import KerasEstimator
from spark_hvd.spark.torch import TorchEstimator

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def frame(spark):
    rows = [(Vectors.dense([float(i % 7), 1.0, -1.0]), float(i % 2)) for i in range(64)]
    return spark.createDataFrame(rows, ["features", "label"])


def _torch(tmp_path, **overrides):
    net = torch.nn.Linear(3, 1)
    params = dict(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                  loss=torch.nn.BCEWithLogitsLoss(), feature_cols=["features"], label_cols=["label"], batch_size=8,
                  epochs=1, store=Store.create(str(tmp_path / "store")), verbose=0)
    params.update(overrides)
    return TorchEstimator(**params)


def test_a_torch_loss_that_raises_is_named_with_its_line_and_no_shape_advice(frame, tmp_path):
    """The user's loss raising during the dry run is reported as the loss's error, at its own line,
    chained to the original exception; the shape advice (change shapes that already match) is not."""
    def broken_loss(output, label):
        raise ValueError("my loss is broken")

    line = inspect.getsourcelines(broken_loss)[1] + 1
    with pytest.raises(ValueError) as info:
        _torch(tmp_path, loss=broken_loss).fit(frame)
    message = str(info.value)
    assert "the loss broken_loss raised ValueError: my loss is broken" in message
    assert f"{__file__}:{line}" in message
    assert "make the model return" not in message and "shape" not in message.split(" on a real batch")[0]
    assert isinstance(info.value.__cause__, ValueError) and str(info.value.__cause__) == "my loss is broken"


def test_a_loss_refusing_the_shapes_still_gets_the_shape_advice(frame, tmp_path):
    """A user's loss whose torch call refuses the shapes it was given keeps the shape advice."""
    def class_loss(output, label):
        return torch.nn.functional.cross_entropy(output, label.long().reshape(-1))

    with pytest.raises(ValueError, match=r"the loss failed on a real batch: class_loss.*fix: make the model"):
        _torch(tmp_path, loss=class_loss, task="none").fit(frame)


def test_a_keras_loss_that_raises_is_named_with_its_line(frame, tmp_path):
    """The same for a Keras loss function."""
    def broken_loss(y_true, y_pred):
        raise ValueError("my keras loss is broken")

    line = inspect.getsourcelines(broken_loss)[1] + 1
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    estimator = KerasEstimator(num_proc=2, model=model, optimizer=keras.optimizers.SGD(0.1), loss=broken_loss,
                               feature_cols=["features"], label_cols=["label"], batch_size=8, epochs=1,
                               store=Store.create(str(tmp_path / "store")), verbose=0)
    with pytest.raises(ValueError) as info:
        estimator.fit(frame)
    assert "the loss broken_loss raised ValueError: my keras loss is broken" in str(info.value)
    assert f"{__file__}:{line}" in str(info.value)


def test_rows_of_different_lengths_in_the_first_batch_get_the_good_message(spark, tmp_path):
    """Vectors of 4 and 5 values among the first rows are refused naming the column and both lengths
    (the probe batch gave numpy's 'all input arrays must have the same shape')."""
    rows = [(Vectors.dense(np.ones(4 + i % 2).tolist()), float(i % 2)) for i in range(16)]
    uneven = spark.createDataFrame(rows, ["features", "label"])
    net = torch.nn.Linear(4, 1)
    with pytest.raises(ValueError, match=r"column 'features' has rows of different lengths \(4 to 5\)"):
        _torch(tmp_path, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1)).fit(uneven)


def test_a_ranks_error_arrives_once_with_the_users_file_and_line_and_no_java_traces(frame, tmp_path, capfd):
    """A metric raising on the ranks reaches the driver as one RankFailedError whose traceback names
    the metric's own file and line (not "<dynamic-code>"), with no Executor or TaskSetManager
    stack traces printed before it."""
    def failing_metric(outputs, labels):
        raise RuntimeError("metric broke on the rank")

    line = inspect.getsourcelines(failing_metric)[1] + 1
    capfd.readouterr()
    with pytest.raises(RankFailedError) as info:
        _torch(tmp_path, metrics=[failing_metric], max_retries=0).fit(frame)
    text = str(info.value)
    assert "metric broke on the rank" in text
    assert f'File "{__file__}", line {line}, in failing_metric' in text
    assert "<dynamic-code>" not in text
    _, err = capfd.readouterr()
    assert "ERROR Executor" not in err and "ERROR TaskSetManager" not in err, err[-2000:]
    assert "\tat org.apache.spark" not in err


class _CountingForward(torch.nn.Module):
    """Records the rows of every forward call made in this process (the driver's dry run)."""

    rows: list = []

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)

    def forward(self, x):
        _CountingForward.rows.append(len(x))
        return self.linear(x)


def test_the_driver_runs_the_model_once_before_training(spark, frame, tmp_path):
    """Where the schema tells the features' sizes (a VectorAssembler's column) the model and the loss
    run once, on two rows of zeros, and the real rows only have their labels checked; where it does
    not, the model and the loss run once, on one batch of real rows."""
    from pyspark.ml.feature import VectorAssembler

    scalars = spark.createDataFrame([(float(i % 7), 1.0, -1.0, float(i % 2)) for i in range(64)],
                                    ["a", "b", "c", "label"])
    assembled = VectorAssembler(inputCols=["a", "b", "c"], outputCol="features").transform(scalars)
    for df, want in ((assembled, [2]), (frame, [8])):
        model = _CountingForward()
        est = _torch(tmp_path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        fit = est._check(df, None)
        _CountingForward.rows.clear()
        est._dry_run(df, fit)
        assert _CountingForward.rows == want
        assert fit.sizes == [3] and fit.shapes == [(3,)] and fit.output_shapes == [(1,)]
