"""KerasEstimator and KerasModel without Spark: Params, driver-side checks, task inference,
checkpoints and fingerprints, and the rank training loop in two real local processes
(spark_hvd.runner.run)."""

from __future__ import annotations

import os
import pickle

import keras
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_hvd.runner import run as run_local
from spark_hvd.spark.keras import KerasEstimator, KerasModel, checks
from spark_hvd.spark.keras.checkpoint import checkpoint_bytes, read_checkpoint
from spark_hvd.spark.keras.environment import RANK_ENVIRONMENT
from spark_hvd.spark.keras.fingerprint import run_fingerprint
from spark_hvd.spark.keras.training import KerasTrainingSpec, train_on_rank
from spark_hvd.spark.estimator.outputs import standard_columns
from spark_hvd.spark.estimator.params import ESTIMATOR_PARAMS, HOROVOD_ESTIMATOR_PARAMS
from spark_hvd.spark.data.store import Store


def dense(units=1, inputs=3, hidden=0):
    layers = [keras.Input((inputs,))] + ([keras.layers.Dense(hidden, activation="tanh")] if hidden else [])
    return keras.Sequential(layers + [keras.layers.Dense(units)])


# -- Params ------------------------------------------------------------------------------------


def test_estimator_has_the_shared_params_and_the_keras_ones():
    """Every estimator Param (Horovod's included) plus the Keras ones, keyword-only, and it pickles."""
    names = [s.name for s in KerasEstimator.param_specs()]
    assert names == ([s.name for s in ESTIMATOR_PARAMS + HOROVOD_ESTIMATOR_PARAMS]
                     + ["custom_objects", "checkpoint_callback", "backend_env"])
    est = KerasEstimator(batch_size=4, shuffle_buffer_size=0, custom_objects={"f": len}, model=dense())
    assert (est.getBatchSize(), est.getShuffleBufferSize(), est.getCustomObjects()) == (4, 0, {"f": len})
    with pytest.raises(ValueError, match=r"unknown parameter 'shuffle_buffer'; did you mean 'shuffle_buffer_size'"):
        KerasEstimator(shuffle_buffer=5)
    with pytest.raises(TypeError):
        KerasEstimator(2)
    copied = pickle.loads(pickle.dumps(est))
    assert copied.getBatchSize() == 4 and isinstance(copied.getModel(), keras.Model)
    model = KerasModel(feature_cols=["f"], label_cols=["y"], custom_objects={"a": 1})
    assert model.getOutputCols() == ["y__output"] and model.getCustomObjects() == {"a": 1}


# -- checks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss, labels, expected", [
    (keras.losses.BinaryCrossentropy(from_logits=True), ["y"], "binary"),
    ("binary_crossentropy", ["y"], "binary_probability"),
    (keras.losses.SparseCategoricalCrossentropy(from_logits=True), ["y"], "multiclass"),
    ("sparse_categorical_crossentropy", ["y"], "multiclass_probability"),
    (keras.losses.CategoricalCrossentropy(), ["y"], "multiclass_probability"),
    ("mse", ["y"], "regression"),
    (keras.losses.Huber(), ["y"], "regression"),
    ("mse", ["y", "z"], "none"),
    (lambda y, p: (y - p) ** 2, ["y"], "none"),
])
def test_task_is_inferred_from_the_keras_loss(loss, labels, expected):
    """Cross-entropies without from_logits mean probability outputs; two labels or an unknown loss: none."""
    assert checks.infer_task("auto", [loss] * len(labels), labels) == expected
    assert checks.infer_task("regression", [loss], labels) == "regression"


def test_softmax_outputs_give_their_own_probabilities():
    """multiclass_probability keeps the model's probabilities (softmax of them would flatten them)."""
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    columns = standard_columns("multiclass_probability", probs)
    np.testing.assert_allclose(columns["probability"], probs)
    assert list(columns["prediction"]) == [0.0, 2.0]


def test_feature_shapes_follow_the_model_inputs_and_name_mismatches():
    """A column is reshaped to its model input (an unknown dimension filled in); a size that does
    not fit names the column, both sizes and the fix; input_shapes overrides; unbuilt is flat."""
    image = keras.Sequential([keras.Input((8, 8)), keras.layers.Flatten(), keras.layers.Dense(2)])
    assert checks.feature_shapes(None, image, ["pixels"], [64]) == [(8, 8)]
    seq = keras.Sequential([keras.Input((None, 4)), keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    assert checks.feature_shapes(None, seq, ["steps"], [12]) == [(3, 4)]
    with pytest.raises(ValueError, match=r"feature column 'features' has 3 values per row but model input 0 has shape "
                                         r"\(None, 5\) \(5 values per row\).*set input_shapes"):
        checks.feature_shapes(None, dense(inputs=5), ["features"], [3])
    assert checks.feature_shapes([[2, 32]], image, ["pixels"], [64]) == [(2, 32)]
    unbuilt = keras.Sequential([keras.layers.Dense(1)])
    assert checks.model_input_shapes(unbuilt) is None
    assert checks.feature_shapes(None, unbuilt, ["features"], [3]) == [(3,)]
    with pytest.raises(ValueError, match=r"gives 2 input\(s\) but the model has 1 input\(s\).*VectorAssembler"):
        checks.check_input_count(dense(), ["a", "b"])


def test_a_real_batch_through_the_model_and_the_loss_names_both_shapes():
    """A label of 3 values against one output, one-hot labels for a sparse loss, a non-Keras model
    and a model without an optimizer each fail with the shapes or the fix named; a good batch passes."""
    model = dense()
    batch = {"features": np.ones((4, 3), np.float32), "y": np.zeros(4, np.float32),
             "y3": np.zeros((4, 3), np.float32)}
    checks.dry_run_batch(model, ["mse"], batch, ["features"], ["y"], [(3,)], "float32")
    with pytest.raises(ValueError, match=r"the loss would compare tensors of different shapes: mean_squared_error got "
                                         r"the model's output of shape \(4, 1\) and label 'y3' of shape \(4, 3\)"):
        checks.dry_run_batch(model, ["mse"], batch, ["features"], ["y3"], [(3,)], "float32")
    three = dense(units=3)
    with pytest.raises(ValueError, match=r"needs one class index per row.*label 'y3' of shape \(4, 3\)"):
        checks.dry_run_batch(three, [keras.losses.SparseCategoricalCrossentropy()], batch, ["features"], ["y3"],
                             [(3,)], "float32")
    with pytest.raises(ValueError, match=r"expected a Keras model \(keras.Model, or Keras 2"):
        checks.check_model(object())
    with pytest.raises(ValueError, match=r"optimizer=None is not valid.*compiled model"):
        checks.check_optimizer(None)
    assert checks.dry_run(model, [(3,)], 1, "float32") == [(1,)]
    with pytest.raises(ValueError, match=r"returned 1 output\(s\) for 2 label column"):
        checks.dry_run(model, [(3,)], 2, "float32")


def test_a_model_without_inputs_is_built_on_the_drivers_copy_only():
    """A Sequential without keras.Input: the driver copies it through .keras, the dry run builds the
    copy from the column sizes, and the copy saves with its weights; the user's model stays unbuilt."""
    from spark_hvd.spark.keras.checkpoint import load_model_bytes, model_bytes
    from spark_hvd.spark.keras.estimator import _copy_model

    unbuilt = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(1)])
    copy = _copy_model(unbuilt, None)
    assert checks.dry_run(copy, checks.feature_shapes(None, copy, ["features"], [3]), 1, "float32") == [(1,)]
    assert not unbuilt.built
    assert [w.shape for w in load_model_bytes(model_bytes(copy)).get_weights()] == [(3, 4), (4,), (4, 1), (1,)]


def test_a_compiled_model_brings_optimizer_loss_and_metrics():
    """Fresh objects from the compile config: the same class and settings."""
    model = dense()
    model.compile(optimizer=keras.optimizers.SGD(0.25), loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    settings = checks.compiled_settings(model)
    assert isinstance(settings["optimizer"], keras.optimizers.SGD)
    assert settings["optimizer"].get_config()["learning_rate"] == pytest.approx(0.25)
    assert checks.infer_task("auto", [settings["loss"]], ["y"]) == "binary"
    assert settings["metrics"] == ["accuracy"]
    assert checks.compiled_settings(dense()) == {}


# -- checkpoints and fingerprints ----------------------------------------------------------------


def test_checkpoint_is_a_keras_file_with_the_run_state(tmp_path):
    """The bytes load with keras.saving.load_model; the state and optimizer variables read back."""
    model = dense()
    data = checkpoint_bytes(model, 2, [{"epoch": 1}, {"epoch": 2}], {"data": "x"}, [np.arange(3.0), np.ones((2, 2))])
    state = read_checkpoint(data)
    assert (state.epoch, state.history, state.fingerprint) == (2, [{"epoch": 1}, {"epoch": 2}], {"data": "x"})
    np.testing.assert_array_equal(state.optimizer_variables[1], np.ones((2, 2)))
    path = tmp_path / "checkpoint.keras"
    path.write_bytes(data)
    loaded = keras.saving.load_model(str(path), compile=False)
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="not a KerasEstimator checkpoint"):
        read_checkpoint(b"not a zip")


class _Frame:
    """Just what the data fingerprint reads of a DataFrame."""

    class schema:
        fields = []

    @staticmethod
    def semanticHash():
        return 7


def test_fingerprint_ignores_layer_names_and_weights_but_not_architecture_or_optimizer():
    """Two builds of one architecture (Keras numbers their layer names) match; more units or
    another learning rate are named."""
    def fingerprint(model, lr=0.1):
        return run_fingerprint(model, keras.optimizers.Adam(lr), ["mse"], None, _Frame(), ["f", "y"], None)

    base = fingerprint(dense(hidden=4))
    assert fingerprint(dense(hidden=4)) == base
    from spark_hvd.spark.estimator.fingerprint import changed_parts

    assert changed_parts(base, fingerprint(dense(hidden=8))) == ["model architecture"]
    assert changed_parts(base, fingerprint(dense(hidden=4), lr=0.2)) == ["optimizer"]


# -- the rank loop in two local processes ------------------------------------------------------


def _write_shards(path, rows_per_file, files, seed=0):
    """Parquet like prepare_data writes: a float32 array column 'features' and a float label 'y'."""
    os.makedirs(path)
    rng = np.random.default_rng(seed)
    for i in range(files):
        x = rng.normal(size=(rows_per_file, 3)).astype(np.float32)
        y = (x @ np.array([1.0, -1.0, 0.5])).astype(np.float64)
        pq.write_table(pa.table({"features": pa.array(list(x)), "y": y}), os.path.join(path, f"part-{i}.parquet"))


def _spec(tmp_path, model, optimizer, **overrides):
    from spark_hvd.spark.keras.checkpoint import model_bytes

    store = Store.create(str(tmp_path / "store"))
    values = dict(
        model=model if isinstance(model, bytes) else model_bytes(model), optimizer=keras.optimizers.serialize(optimizer), losses=["mse"], loss_weights=None,
        metrics=[], custom_objects=None, feature_cols=["features"], label_cols=["y"], sample_weight_col=None,
        feature_shapes=[(3,)], output_shapes=[(1,)], column_shapes={"features": (3,), "y": ()}, dtype="float32",
        train_url=str(tmp_path / "train"), val_url=None, storage_options={}, reader="builtin", batch_size=8,
        val_batch_size=8, epochs=1, start_epoch=0, train_steps=1, val_steps=0, shuffle=False,
        shuffle_buffer_size=0, seed=0, random_seed=0, store=store,
        checkpoint_path=os.path.join(store.get_run_path("run"), "checkpoint.keras"), progress=False)
    values.update(overrides)
    return KerasTrainingSpec(**values), store


def test_rank_loop_scales_lr_averages_gradients_checkpoints_and_resumes(tmp_path):
    """Two ranks take one SGD step with lr * 2 on the mean gradient of their first batches (MSE of a
    linear model, computed here by hand); rank 0 checkpoints each epoch with the unscaled rate; a
    spec resuming the checkpoint continues the epoch count and the optimizer's step count."""
    _write_shards(tmp_path / "train", rows_per_file=16, files=2)
    keras.utils.set_random_seed(0)
    model = dense()
    spec, store = _spec(tmp_path, model, keras.optimizers.SGD(0.05))
    results = run_local(train_on_rank, args=(spec,), np=2, env=RANK_ENVIRONMENT)
    assert results[1] is None
    w, b = model.get_weights()
    grads_w, grads_b = [], []
    for rank in range(2):
        table = pq.read_table(str(tmp_path / "train" / f"part-{rank}.parquet"))
        x = np.stack(table.column("features").to_pylist())[:8].astype(np.float64)
        y = table.column("y").to_numpy()[:8].reshape(8, 1)
        residual = x @ w + b - y
        grads_w.append(2 * x.T @ residual / 8)
        grads_b.append(2 * residual.mean(axis=0))
    trained_w, trained_b = results[0]["weights"]
    np.testing.assert_allclose(trained_w, w - 0.1 * (grads_w[0] + grads_w[1]) / 2, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(trained_b, b - 0.1 * (grads_b[0] + grads_b[1]) / 2, rtol=1e-4, atol=1e-5)

    first, _ = _spec(tmp_path, model, keras.optimizers.Adam(0.01), epochs=2, train_steps=2,
                     val_url=str(tmp_path / "train"), val_steps=1, metrics=["mae"])
    run_local(train_on_rank, args=(first,), np=2, env=RANK_ENVIRONMENT)
    saved = read_checkpoint(store.read(first.checkpoint_path))
    assert saved.epoch == 2 and [h["epoch"] for h in saved.history] == [1, 2]
    assert set(saved.history[0]) == {"epoch", "loss", "mae", "val_loss", "val_mae", "rows_per_s", "seconds"}
    iteration, learning_rate = saved.optimizer_variables[:2]
    assert int(iteration) == 4 and float(learning_rate) == pytest.approx(0.01)

    resumed, _ = _spec(tmp_path, saved.model, keras.optimizers.Adam(0.01), epochs=3, train_steps=2, start_epoch=2,
                       history=saved.history, optimizer_variables=saved.optimizer_variables, metrics=["mae"])
    out = run_local(train_on_rank, args=(resumed,), np=2, env=RANK_ENVIRONMENT)[0]
    assert [h["epoch"] for h in out["history"]] == [1, 2, 3] and out["history"][:2] == saved.history
    again = read_checkpoint(store.read(first.checkpoint_path))
    assert again.epoch == 3 and int(again.optimizer_variables[0]) == 6


def test_each_estimator_package_imports_only_its_framework():
    """spark_hvd.spark.keras pulls in no torch, and spark_hvd.spark.torch no TensorFlow or Keras:
    the layers they share (data, stores, run, progress, persistence, inference) are framework-free."""
    import subprocess
    import sys

    probe = ("import sys, importlib; importlib.import_module({package!r}); "
             "print(sorted(m for m in {banned!r} if m in sys.modules))")
    for package, banned in (("spark_hvd.spark.keras", ("torch",)),
                            ("spark_hvd.spark.torch", ("tensorflow", "keras"))):
        out = subprocess.run([sys.executable, "-c", probe.format(package=package, banned=banned)],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == "[]", (package, out.stdout)
