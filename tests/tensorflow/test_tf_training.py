"""Training with spark_hvd.tensorflow and spark_hvd.keras (tensorflow backend) at sizes 1, 2 and 3:
DistributedGradientTape and Keras model.fit against single-process training, accumulation,
callbacks, load_model, XLA refusal; one launched world per size, shared with test_tf_collectives (conftest.py)."""

import numpy as np
import pytest

from keras_checks import (
    _fit_pair,
    check_adasum_optimizer_step,
    check_backward_passes_per_step,
    check_broadcast_callback_keeps_local_variables,
    check_callbacks,
    check_fit_matches_single_process,
    check_flat_gradients_of_mixed_dtypes,
    check_sync_batch_normalization,
    check_sync_batch_normalization_in_fit,
    check_keras_values_and_state,
)
from tf_world import assert_passed, close


def check_gradient_tape_matches_single_process(hvd, rank, size):
    """Three SGD steps with DistributedGradientTape, eagerly and inside tf.function, leave the
    weights within 1e-5 of one process on the concatenated batch; with a PartialDistributedGradientTape
    the local layer's gradient is this rank's own divided by size."""
    import keras
    import tensorflow as tf

    rng = np.random.default_rng(7)
    x = rng.normal(size=(3, size * 4, 5)).astype("float32")
    y = rng.normal(size=(3, size * 4, 2)).astype("float32")

    def model():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)])

    def train(net, wrap, rows, compiled):
        opt = keras.optimizers.SGD(0.1)

        def step(xs, ys):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((net(xs) - ys) ** 2)
            tape = wrap(tape)
            grads = tape.gradient(loss, net.trainable_variables)
            opt.apply_gradients(zip(grads, net.trainable_variables))

        run = tf.function(step) if compiled else step
        for s in range(3):
            run(x[s][rows], y[s][rows])
        return net

    mine = slice(rank * 4, rank * 4 + 4)
    want = train(model(), lambda t: t, slice(None), False).get_weights()
    for compiled in (False, True):
        got = train(model(), hvd.DistributedGradientTape, mine, compiled).get_weights()
        for g, w in zip(got, want):
            close(g, w, 1e-5, f"DistributedGradientTape compiled={compiled}")

    net = model()
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_mean((net(x[0][mine]) - y[0][mine]) ** 2)
    own = tape.gradient(loss, net.trainable_variables)
    partial = hvd.PartialDistributedGradientTape(tape, local_layers=net.layers[0])
    got = partial.gradient(loss, net.trainable_variables)
    close(got[0], own[0] / size, 1e-6, "local kernel gradient")
    shared = hvd.allreduce(own[2])
    close(got[2], shared, 1e-6, "shared kernel gradient")


def check_adasum_gradient_tape(hvd, rank, size):
    """op=Adasum: DistributedGradientTape, eagerly and inside tf.function, returns each variable's
    gradient combined over the ranks as the numpy reference of every rank's own gradients (each
    variable on its own); over 3 ranks the combination is refused naming the power-of-two rule."""
    import keras
    import tensorflow as tf

    from harness import adasum_reference

    rng = np.random.default_rng(3)
    x = rng.normal(size=(size * 4, 5)).astype("float32")
    y = rng.normal(size=(size * 4, 2)).astype("float32")
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])

    def own(r):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((net(x[r * 4:r * 4 + 4]) - y[r * 4:r * 4 + 4]) ** 2)
        return tape, loss

    def distributed():
        tape, loss = own(rank)
        return hvd.DistributedGradientTape(tape, op=hvd.Adasum).gradient(loss, net.trainable_variables)

    if size & (size - 1):
        try:
            distributed()
        except Exception as exc:  # the runtime's ValueError, as the framework surfaces it
            assert "power-of-two" in str(exc), str(exc)
        else:
            raise AssertionError(f"Adasum over {size} ranks was not refused")
        return
    grads = []
    for r in range(size):
        tape, loss = own(r)
        grads.append([g.numpy() for g in tape.gradient(loss, net.trainable_variables)])
    want = [adasum_reference([g[i].reshape(-1) for g in grads]).reshape(grads[0][i].shape).astype("float32")
            for i in range(len(grads[0]))]
    for compiled in (False, True):
        got = (tf.function(distributed) if compiled else distributed)()
        for g, w in zip(got, want):
            close(g.numpy(), w, 1e-5, f"Adasum gradient, compiled={compiled}")


def check_load_model_rewraps_optimizer(hvd, rank, size):
    """A model saved after training loads through spark_hvd.keras.load_model with a distributed
    optimizer of the same class that kept its iteration count, and trains on."""
    import os
    import tempfile

    import keras

    import spark_hvd.keras as khvd
    from spark_hvd.keras.optimizer import _DistributedOptimizer

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=khvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    x, y = np.ones((8, 3), "float32"), np.ones((8, 1), "float32")
    model.fit(x, y, batch_size=4, verbose=0)
    path = os.path.join(tempfile.mkdtemp(), f"model-{rank}.keras")
    model.save(path)
    loaded = khvd.load_model(path)
    assert isinstance(loaded.optimizer, _DistributedOptimizer)
    assert isinstance(loaded.optimizer, keras.optimizers.Adam)
    assert int(loaded.optimizer.iterations.numpy()) == 2
    loaded.fit(x, y, batch_size=4, verbose=0)
    assert int(loaded.optimizer.iterations.numpy()) == 4
    plain = keras.models.load_model(path)
    assert not isinstance(plain.optimizer, _DistributedOptimizer)


def check_xla_is_refused_with_the_fix(hvd, rank, size):
    """model.compile(jit_compile=True) with a DistributedOptimizer fails at fit with a message that
    names jit_compile=False, instead of an XLA compilation error."""
    import keras

    import spark_hvd.keras as khvd

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=khvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=True)
    if size == 1:
        return  # a world of one exchanges nothing, so there is no collective for XLA to refuse
    with pytest.raises(Exception, match="jit_compile=False"):
        model.fit(np.ones((4, 3), "float32"), np.ones((4, 1), "float32"), verbose=0)


def check_elastic_tensorflow_state(hvd, rank, size):
    """TensorFlowState.sync gives every rank rank 0's variables and attributes; restore returns to
    the last commit, and commit moves it."""
    import tensorflow as tf

    variables = [tf.Variable([float(rank)] * 2)]
    state = hvd.elastic.TensorFlowState(variables, batch=rank)
    state.sync()
    assert variables[0].numpy().tolist() == [0.0, 0.0] and state.batch == 0
    variables[0].assign([5.0, 5.0])
    state.batch = 3
    state.restore()
    assert variables[0].numpy().tolist() == [0.0, 0.0] and state.batch == 0
    variables[0].assign([5.0, 5.0])
    state.commit()
    state.restore()
    assert variables[0].numpy().tolist() == [5.0, 5.0]


def check_keras_fit_takes_the_one_host_path(hvd, rank, size):
    """Keras model.fit with DistributedOptimizer reduces its one flat gradient tensor through the
    one-host fast path at every step (when it is on), with the same weights as single-process
    fitting on every rank; gradients split into two groups are negotiated."""
    import keras

    from harness import counting_lockstep
    from spark_hvd.runtime.api import runtime_config

    def sgd(micro):
        return keras.optimizers.SGD(0.1, momentum=0.9)

    with counting_lockstep() as calls:
        model, reference = _fit_pair(rank, size, sgd, steps=4)
        for got, want in zip(model.get_weights(), reference.get_weights()):
            close(got, want, 1e-5, "weights after fit")
        on = size > 1 and runtime_config().lockstep_bytes > 0 and runtime_config().shm
        assert calls == ([True] * 4 if on else [False] * 4 if size > 1 else []), calls
        calls.clear()
        model, reference = _fit_pair(rank, size, sgd, steps=4, groups=2)
        for got, want in zip(model.get_weights(), reference.get_weights()):
            close(got, want, 1e-5, "weights after fit in two groups")
        assert calls == [], calls


CHECKS = [
    check_gradient_tape_matches_single_process,
    check_adasum_gradient_tape,
    check_adasum_optimizer_step,
    check_fit_matches_single_process,
    check_keras_fit_takes_the_one_host_path,
    check_flat_gradients_of_mixed_dtypes,
    check_sync_batch_normalization,
    check_sync_batch_normalization_in_fit,
    check_backward_passes_per_step,
    check_callbacks,
    check_broadcast_callback_keeps_local_variables,
    check_keras_values_and_state,
    check_load_model_rewraps_optimizer,
    check_xla_is_refused_with_the_fix,
    check_elastic_tensorflow_state,
]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_training(world, check):
    """Each check passes on every rank of the world (see the check's docstring)."""
    assert_passed(world, check)
