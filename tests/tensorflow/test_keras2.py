"""spark_hvd.keras with Keras 2 (``tf_keras``) objects, beside Keras 3 in the same processes: the
optimizers (current and legacy), local accumulation, callbacks and elastic state. The checks run
in the TensorFlow worlds of conftest.py."""

from __future__ import annotations

import numpy as np
import pytest

from tf_world import assert_passed, close

BATCH = 4  # rows per rank per step


def _model(seed):
    import tf_keras

    tf_keras.utils.set_random_seed(seed)
    return tf_keras.Sequential([tf_keras.Input((6,)), tf_keras.layers.Dense(8, activation="tanh"),
                                tf_keras.layers.Dense(3)])


def _data(size, steps):
    rng = np.random.default_rng(7)
    return (rng.normal(size=(steps * size * BATCH, 6)).astype("float32"),
            rng.normal(size=(steps * size * BATCH, 3)).astype("float32"))


def _my_rows(array, rank, size):
    steps = len(array) // (size * BATCH)
    return np.concatenate([array[(s * size + rank) * BATCH:(s * size + rank + 1) * BATCH] for s in range(steps)])


def check_keras2_fit_matches_single_process(hvd, rank, size):
    """tf_keras model.fit with DistributedOptimizer around a current (SGD with momentum) and a
    legacy (Adam) tf_keras optimizer, from differently initialised models after
    BroadcastGlobalVariablesCallback, ends within 1e-5 of one process fitting the concatenated
    batches, the same on every rank; the wrapped optimizer keeps its class and name."""
    import tf_keras

    import spark_hvd.keras as khvd

    makers = {"sgd": lambda: tf_keras.optimizers.SGD(0.1, momentum=0.9),
              "legacy adam": lambda: tf_keras.optimizers.legacy.Adam(0.01)}
    for what, make in makers.items():
        x, y = _data(size, 4)
        reference = _model(0)
        reference.compile(optimizer=make(), loss="mse")
        reference.fit(x, y, batch_size=size * BATCH, shuffle=False, epochs=1, verbose=0)
        model = _model(rank)
        optimizer = khvd.DistributedOptimizer(make())
        assert isinstance(optimizer, type(make())) and type(optimizer).__name__ == type(make()).__name__, what
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(_my_rows(x, rank, size), _my_rows(y, rank, size), batch_size=BATCH, shuffle=False, epochs=1,
                  verbose=0, callbacks=[khvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        for got, want in zip(model.get_weights(), reference.get_weights()):
            close(got, want, 1e-5, f"{what}: weights after fit")
        gathered = khvd.allgather(model.get_weights()[0][None])
        assert all(np.array_equal(gathered[0], g) for g in gathered), f"{what}: weights differ between ranks"


def check_keras2_local_accumulation(hvd, rank, size):
    """backward_passes_per_step=3: the variable moves only on every third call, by the sum (or with
    average_aggregated_gradients the mean) of the three passes' gradients averaged over the ranks;
    every call counts in iterations; inside tf.function too; an infinite gradient does not outlive
    the update it belongs to."""
    import tensorflow as tf
    import tf_keras

    import spark_hvd.keras as khvd

    mean_grad = (size + 1) / 2.0  # rank r's gradient is r + 1
    for average in (False, True):
        for in_graph in (False, True):
            opt = khvd.DistributedOptimizer(tf_keras.optimizers.SGD(1.0), backward_passes_per_step=3,
                                            average_aggregated_gradients=average)
            x = tf.Variable([0.0])

            def step():
                pairs = opt._compute_gradients(lambda: x * float(rank + 1), [x])
                opt.apply_gradients(pairs)

            run = tf.function(step) if in_graph else step
            moved = []
            for call in range(6):
                run()
                moved.append(float(x.numpy()[0]))
                assert int(opt.iterations.numpy()) == call + 1
                assert int(opt._agg_helper.counter.numpy()) == (call + 1) % 3
            one = -mean_grad * (1.0 if average else 3.0)
            assert moved == pytest.approx([0, 0, one, one, one, 2 * one]), (average, in_graph, moved)

    opt = khvd.DistributedOptimizer(tf_keras.optimizers.SGD(1.0), backward_passes_per_step=2)
    x = tf.Variable(1.0)
    factors = iter([float("inf"), 1.0, 1.0, 1.0])
    for _ in range(4):
        factor = next(factors)
        pairs = opt._compute_gradients(lambda: x * factor, [x])
        opt.apply_gradients(pairs)
    assert np.isfinite(pairs[0][0].numpy()), pairs


def check_keras2_callbacks_and_state(hvd, rank, size):
    """With a tf_keras model: LearningRateWarmupCallback starts at initial_lr/size and ends at
    initial_lr, MetricAverageCallback gives every rank the mean epoch losses; KerasState.sync
    gives rank 0's weights and optimizer state (its scalar iteration count included)."""
    import tf_keras

    import spark_hvd.keras as khvd

    seen, raw = [], []

    class Probe(tf_keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(self.model.optimizer.learning_rate.numpy()))

        def on_epoch_end(self, epoch, logs=None):
            raw.append(float(logs["loss"]))  # before MetricAverageCallback, which comes later

    model = _model(rank)
    model.compile(optimizer=khvd.DistributedOptimizer(tf_keras.optimizers.SGD(0.01)), loss="mse")
    x, y = _data(size, 4)
    x, y = _my_rows(x, rank, size) * (rank + 1), _my_rows(y, rank, size)
    history = model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, callbacks=[
        khvd.callbacks.LearningRateWarmupCallback(initial_lr=0.04, warmup_epochs=2), Probe(),
        khvd.callbacks.MetricAverageCallback()])
    assert abs(seen[0] - 0.04 / size) < 1e-7 and abs(seen[-1] - 0.04) < 1e-7, seen
    close(np.array(history.history["loss"]), khvd.allreduce(np.array(raw)), 1e-6, "averaged epoch losses")

    state = khvd.elastic.KerasState(model, epoch=rank)
    state.sync()
    assert state.epoch == 0
    weights = khvd.allgather(model.get_weights()[0][None])
    assert all(np.array_equal(weights[0], w) for w in weights)
    assert int(model.optimizer.iterations.numpy()) == 12


def check_keras2_sync_batch_normalization(hvd, rank, size):
    """The Keras 2 SyncBatchNormalization (what spark_hvd.tensorflow gives with TF_USE_LEGACY_KERAS=1)
    normalizes each rank's rows, of different counts per rank, with the statistics of all ranks'
    rows: outputs and moving statistics match tf_keras's BatchNormalization on the whole batch."""
    import tensorflow as tf
    import tf_keras

    from spark_hvd.keras.keras2 import sync_batch_normalization_class

    rng = np.random.default_rng(3)
    rows = [rng.normal(loc=r, size=(2 + r, 3)).astype("float32") for r in range(size)]
    everything = np.concatenate(rows)
    reference = tf_keras.layers.BatchNormalization(momentum=0.5)
    want = reference(everything, training=True).numpy()
    layer = sync_batch_normalization_class()(momentum=0.5)
    assert isinstance(layer, tf_keras.layers.BatchNormalization)
    got = layer(tf.constant(rows[rank]), training=True).numpy()
    start = sum(len(r) for r in rows[:rank])
    close(got, want[start:start + len(rows[rank])], 1e-5, "normalized rows")
    close(layer.moving_mean.numpy(), reference.moving_mean.numpy(), 1e-5, "moving mean")
    close(layer.moving_variance.numpy(), reference.moving_variance.numpy(), 1e-5, "moving variance")


def check_keras2_load_model_rewraps_optimizer(hvd, rank, size):
    """spark_hvd.keras.load_model of a model tf_keras saved (a Keras 2 .keras file and an .h5 file)
    loads it with tf_keras, its optimizer rebuilt as the distributed subclass with its state; a
    Keras 3 file still loads as Keras 3."""
    import os
    import tempfile

    import keras
    import tf_keras

    import spark_hvd.keras as khvd

    model = _model(rank)
    model.compile(optimizer=khvd.DistributedOptimizer(tf_keras.optimizers.Adam(0.01)), loss="mse")
    x, y = _data(size, 2)
    model.fit(_my_rows(x, rank, size), _my_rows(y, rank, size), batch_size=BATCH, epochs=1, verbose=0,
              callbacks=[khvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("model.keras", "model.h5"):
            path = os.path.join(tmp, name)
            model.save(path)
            loaded = khvd.load_model(path)
            assert isinstance(loaded, tf_keras.Model), name
            assert isinstance(loaded.optimizer, tf_keras.optimizers.Adam) and hasattr(loaded.optimizer, "_hvd"), name
            assert int(loaded.optimizer.iterations.numpy()) == 2, name
            for got, want in zip(loaded.get_weights(), model.get_weights()):
                close(got, want, 0.0, f"{name} weights")
        plain = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        path = os.path.join(tmp, "keras3.keras")
        plain.save(path)
        assert isinstance(khvd.load_model(path), keras.Model)


def check_keras2_best_model_checkpoint(hvd, rank, size):
    """BestModelCheckpoint with a tf_keras model saves on rank 0 only, the model of the epoch whose
    val_loss was lowest, as a file tf_keras loads."""
    import os
    import tempfile

    import tf_keras

    import spark_hvd.keras as khvd

    seen = []

    class ValLoss(tf_keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append((float(logs["val_loss"]), [w.copy() for w in self.model.get_weights()]))

    model = _model(rank)
    model.compile(optimizer=khvd.DistributedOptimizer(tf_keras.optimizers.SGD(0.05)), loss="mse")
    x, y = _data(size, 4)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"best-{rank}.keras")
        model.fit(_my_rows(x, rank, size), _my_rows(y, rank, size), batch_size=BATCH, epochs=4, verbose=0,
                  validation_data=(x[:8], y[:8]),
                  callbacks=[khvd.callbacks.BroadcastGlobalVariablesCallback(0), khvd.callbacks.MetricAverageCallback(),
                             ValLoss(), khvd.callbacks.BestModelCheckpoint(filepath=path, monitor="val_loss")])
        assert os.path.exists(path) == (rank == 0), (rank, os.listdir(tmp))
        if rank == 0:
            best = min(seen, key=lambda entry: entry[0])[1]
            for got, want in zip(tf_keras.models.load_model(path).get_weights(), best):
                close(got, want, 0.0, "best epoch's weights")


CHECKS = [check_keras2_fit_matches_single_process, check_keras2_load_model_rewraps_optimizer,
          check_keras2_best_model_checkpoint, check_keras2_local_accumulation, check_keras2_callbacks_and_state,
          check_keras2_sync_batch_normalization]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_keras2(world, check):
    """Each check passes on every rank of the world (see the check's docstring)."""
    assert_passed(world, check)
