"""Keras 3 checks that run on either backend (tensorflow or torch): fit equivalence, accumulation, callbacks."""

from __future__ import annotations

import numpy as np

from tf_world import close

BATCH = 4  # rows per rank per step


def _model(seed):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])


def _data(size, steps):
    rng = np.random.default_rng(42)
    return rng.normal(size=(steps * size * BATCH, 6)).astype("float32"), rng.normal(size=(steps * size * BATCH, 3)).astype("float32")


def _my_rows(array, rank, size):
    """Rank r's rows: B rows of each step's full batch of size*B rows, in step order."""
    steps = len(array) // (size * BATCH)
    return np.concatenate([array[(s * size + rank) * BATCH:(s * size + rank + 1) * BATCH] for s in range(steps)])


def _fit_pair(rank, size, make_optimizer, steps=4, micro=1, **distributed):
    import keras

    import spark_hvd.keras as khvd

    x, y = _data(size, steps * micro)
    reference = _model(0)
    reference.compile(optimizer=make_optimizer(micro), loss="mse", jit_compile=False)
    reference.fit(x, y, batch_size=size * BATCH, shuffle=False, epochs=1, verbose=0)
    model = _model(rank)
    optimizer = khvd.DistributedOptimizer(make_optimizer(1), backward_passes_per_step=micro, **distributed)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(_my_rows(x, rank, size), _my_rows(y, rank, size), batch_size=BATCH, shuffle=False, epochs=1,
              verbose=0, callbacks=[khvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert isinstance(model.optimizer, type(make_optimizer(1))), "the wrapped optimizer keeps its class"
    assert keras.config.backend() in ("tensorflow", "torch")
    return model, reference


def check_fit_matches_single_process(hvd, rank, size):
    """model.fit with DistributedOptimizer (momentum SGD) on each rank's share of every batch, after
    BroadcastGlobalVariablesCallback from differently initialised models, leaves weights within 1e-5
    of one process fitting the concatenated batches, equal on every rank."""
    import keras

    import spark_hvd.keras as khvd

    def sgd(micro):
        return keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=micro if micro > 1 else None)

    model, reference = _fit_pair(rank, size, sgd)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        close(got, want, 1e-5, "weights after fit")
    gathered = khvd.allgather(model.get_weights()[0][None])
    assert all(np.array_equal(gathered[0], g) for g in gathered), "weights differ between ranks"


def check_backward_passes_per_step(hvd, rank, size):
    """backward_passes_per_step=2 with average_aggregated_gradients accumulates two local steps and
    applies their mean once: the same weights as one process with gradient_accumulation_steps=2 on
    the concatenated batches; the iteration count counts updates."""
    import keras

    def sgd(micro):
        return keras.optimizers.SGD(0.1, gradient_accumulation_steps=micro if micro > 1 else None)

    model, reference = _fit_pair(rank, size, sgd, steps=3, micro=2, average_aggregated_gradients=True)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        close(got, want, 1e-5, "weights after accumulated fit")
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 3


def check_callbacks(hvd, rank, size):
    """LearningRateWarmupCallback starts at initial_lr/size and reaches initial_lr after warm-up;
    LearningRateScheduleCallback multiplies from its start epoch; MetricAverageCallback leaves every
    rank with the mean of the ranks' epoch losses in History."""
    import keras

    import spark_hvd.keras as khvd

    seen = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    class RawLoss(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            raw.append(float(logs["loss"]))

    raw = []
    model = _model(rank)
    model.compile(optimizer=khvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x, y = _data(size, 4)
    x, y = _my_rows(x, rank, size) * (rank + 1), _my_rows(y, rank, size)
    history = model.fit(x, y, batch_size=BATCH, epochs=4, verbose=0, callbacks=[
        RawLoss(), khvd.callbacks.MetricAverageCallback(),
        khvd.callbacks.LearningRateWarmupCallback(initial_lr=0.04, warmup_epochs=2),
        khvd.callbacks.LearningRateScheduleCallback(initial_lr=0.04, multiplier=0.5, start_epoch=3), Probe()])
    steps = 4
    assert abs(seen[0] - 0.04 / size) < 1e-9, seen[:3]
    want_mid = 0.04 / size * ((1 + 2 / steps) * (size - 1) / 2 + 1)  # epoch 1, batch 2
    assert abs(seen[steps + 2] - want_mid) < 1e-7, (seen, want_mid)
    assert abs(seen[2 * steps] - 0.04) < 1e-9 and abs(seen[3 * steps] - 0.02) < 1e-9, seen
    means = khvd.allreduce(np.array(raw))
    close(np.array(history.history["loss"]), means, 1e-6, "averaged epoch losses")


def check_broadcast_callback_keeps_local_variables(hvd, rank, size):
    """BroadcastGlobalVariablesCallback(root) gives every rank the root's weights, except the
    variables passed as local_variables, which keep each rank's own values."""
    import keras

    import spark_hvd.keras as khvd

    root = size - 1
    model = _model(rank)
    for layer in model.layers:
        layer.trainable = False
    model.compile(optimizer=khvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
    local = list(model.layers[0].variables)
    before = [np.array(keras.ops.convert_to_numpy(v)) for v in local]
    x, y = _data(1, 1)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
              callbacks=[khvd.callbacks.BroadcastGlobalVariablesCallback(root, local_variables=local)])
    for v, b in zip(local, before):
        close(keras.ops.convert_to_numpy(v), b, 0.0, "local variable")
    for got, want in zip(model.layers[1].get_weights(), _model(root).layers[1].get_weights()):
        close(got, want, 0.0, "broadcast weights")


def check_keras_values_and_state(hvd, rank, size):
    """spark_hvd.keras allreduce/allgather/broadcast return numpy arrays of the Keras value's dtype;
    KerasState.sync gives rank 0's weights and attributes, restore returns to the commit."""
    import keras

    import spark_hvd.keras as khvd

    value = keras.ops.ones((2,), dtype="float32") * (rank + 1)
    close(khvd.allreduce(value, op=khvd.Sum), np.full(2, size * (size + 1) / 2, np.float32))
    close(khvd.allgather(value), np.repeat(np.arange(1, size + 1, dtype=np.float32), 2))
    close(khvd.broadcast(value, size - 1), np.full(2, size, np.float32))
    model = _model(rank)
    state = khvd.elastic.KerasState(model, epoch=rank)
    state.sync()
    assert state.epoch == 0
    for got, want in zip(model.get_weights(), _model(0).get_weights()):
        close(got, want, 0.0, "synced weights")
    model.set_weights([w * 0 for w in model.get_weights()])
    state.epoch = 5
    state.restore()
    assert state.epoch == 0 and np.abs(model.get_weights()[0]).sum() > 0


def check_adasum_optimizer_step(hvd, rank, size):
    """DistributedOptimizer(op=Adasum) on this backend: an SGD step with rate 1 moves each variable
    by the numpy reference's Adasum of every rank's gradient for it (each variable on its own, even
    where an element-wise compression would flatten them together); over 3 ranks it is refused
    naming the power-of-two rule."""
    import keras

    import spark_hvd.keras as khvd
    from harness import adasum_reference

    shapes = [(3, 2), (2,), (4,)]
    grads = [[np.random.default_rng(100 * r + i).normal(size=shape).astype("float32")
              for i, shape in enumerate(shapes)] for r in range(size)]
    variables = [keras.Variable(np.ones(shape, "float32")) for shape in shapes]
    opt = khvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=khvd.Adasum)
    step = [keras.ops.convert_to_tensor(g) for g in grads[rank]]
    if size & (size - 1):
        try:
            opt.apply_gradients(zip(step, variables))
        except Exception as exc:  # the runtime's ValueError, as the backend surfaces it
            assert "power-of-two" in str(exc), str(exc)
        else:
            raise AssertionError(f"Adasum over {size} ranks was not refused")
        return
    opt.apply_gradients(zip(step, variables))
    for i, v in enumerate(variables):
        want = 1.0 - adasum_reference([g[i].reshape(-1) for g in grads]).reshape(shapes[i])
        close(keras.ops.convert_to_numpy(v), want.astype("float32"), 1e-5, f"variable {i} after the Adasum step")


def check_flat_gradients_of_mixed_dtypes(hvd, rank, size):
    """DistributedOptimizer.apply with gradients of two dtypes and four shapes (a scalar among
    them) moves each variable by the average gradient: with no compression (the gradients of a
    dtype travel as one flat tensor), with fp16, and with a compressor of the user's own, which
    gets every gradient on its own."""
    import keras

    import spark_hvd.keras as khvd

    specs = [((3, 4), "float32"), ((), "float32"), ((5,), "float64"), ((2, 2), "float32")]

    def grads_of(r):
        rng = np.random.default_rng(100 + r)
        return [np.asarray(rng.normal(size=shape), dtype) for shape, dtype in specs]

    average = [np.mean([grads_of(r)[k] for r in range(size)], axis=0).astype(dtype)
               for k, (_, dtype) in enumerate(specs)]
    seen = []

    class Doubling(khvd.Compression.none):
        """Sends twice each gradient and halves the result: exact, and records what it got."""

        @staticmethod
        def compress(tensor):
            seen.append(tuple(tensor.shape))
            return tensor * 2, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor / 2

    for compression, atol in ((khvd.Compression.none, 1e-6), (khvd.Compression.fp16, 2e-3), (Doubling, 1e-6)):
        variables = [keras.Variable(np.zeros(shape, dtype), dtype=dtype) for shape, dtype in specs]
        optimizer = khvd.DistributedOptimizer(keras.optimizers.SGD(1.0), compression=compression)
        optimizer.apply([keras.ops.convert_to_tensor(g) for g in grads_of(rank)], variables)
        for k, (variable, want) in enumerate(zip(variables, average)):
            close(keras.ops.convert_to_numpy(variable.value), -want, atol, f"{compression.__name__} variable {k}")
    if size > 1:
        assert sorted(seen) == sorted(shape for shape, _ in specs), f"the own compressor got {seen}"


def _value_and_grads(loss_fn, tensors):
    """loss_fn() and its gradients with respect to ``tensors`` (backend tensors or Keras variables)."""
    import keras

    if keras.config.backend() == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            tape.watch([t.value if isinstance(t, keras.Variable) else t for t in tensors])
            loss = loss_fn()
        return loss, tape.gradient(loss, [t.value if isinstance(t, keras.Variable) else t for t in tensors])
    values = [t.value if isinstance(t, keras.Variable) else t for t in tensors]
    for v in values:
        v.grad = None
    loss = loss_fn()
    loss.backward()
    return loss, [v.grad for v in values]


def check_sync_batch_normalization(hvd, rank, size):
    """SyncBatchNormalization on each rank's rows (ranks hold different numbers of rows, also
    with a mask) matches keras.layers.BatchNormalization on all rows in one process: outputs,
    moving statistics, and gradients (of the inputs, and of gamma and beta summed over ranks)."""
    import keras

    import spark_hvd.keras as khvd

    torch_backend = keras.config.backend() == "torch"
    rows = [3 + r for r in range(size)]
    rng = np.random.default_rng(7)
    full = rng.normal(2.0, 3.0, size=(sum(rows), 5, 4)).astype("float32")
    weights = rng.normal(size=full.shape).astype("float32")
    full_mask = rng.random(full.shape[:2]) > 0.3
    lo = sum(rows[:rank])
    mine = slice(lo, lo + rows[rank])
    for axis, masked in ((-1, False), (1, False), (-1, True)):
        def layers():
            options = dict(axis=axis, momentum=0.5, beta_initializer="ones", gamma_initializer="glorot_uniform")
            keras.utils.set_random_seed(3)
            reference = keras.layers.BatchNormalization(**options)
            keras.utils.set_random_seed(3)
            return reference, khvd.SyncBatchNormalization(**options)

        reference, layer = layers()
        x_full, x_mine = keras.ops.convert_to_tensor(full), keras.ops.convert_to_tensor(full[mine])
        if torch_backend:
            x_full.requires_grad_(True)
            x_mine.requires_grad_(True)
        mask_full = keras.ops.convert_to_tensor(full_mask) if masked else None
        mask_mine = keras.ops.convert_to_tensor(full_mask[mine]) if masked else None
        reference.build(full.shape)
        layer.build(full[mine].shape)

        def loss(bn, x, mask, w):
            return keras.ops.sum(bn(x, training=True, mask=mask) * keras.ops.convert_to_tensor(w))

        want, want_grads = _value_and_grads(lambda: loss(reference, x_full, mask_full, weights),
                                            [x_full, reference.gamma, reference.beta])
        got, got_grads = _value_and_grads(lambda: loss(layer, x_mine, mask_mine, weights[mine]),
                                          [x_mine, layer.gamma, layer.beta])
        what = f"axis={axis} mask={masked}"
        out_want = keras.ops.convert_to_numpy(reference(x_full, training=False, mask=mask_full))[mine]
        out_got = keras.ops.convert_to_numpy(layer(x_mine, training=False, mask=mask_mine))
        close(out_got, out_want, 1e-4, f"{what}: inference output with the moving statistics")
        for name in ("moving_mean", "moving_variance"):
            close(keras.ops.convert_to_numpy(getattr(layer, name).value),
                  keras.ops.convert_to_numpy(getattr(reference, name).value), 1e-4, f"{what}: {name}")
        total = khvd.allreduce(np.array([float(keras.ops.convert_to_numpy(got))]), op=khvd.Sum)
        close(total.astype("float32")[0], np.float32(keras.ops.convert_to_numpy(want)), 1e-2, f"{what}: loss")
        close(keras.ops.convert_to_numpy(got_grads[0]), keras.ops.convert_to_numpy(want_grads[0])[mine], 1e-4,
              f"{what}: input gradient")
        for k, name in ((1, "gamma"), (2, "beta")):
            summed = khvd.allreduce(keras.ops.convert_to_numpy(got_grads[k]), op=khvd.Sum)
            close(summed, keras.ops.convert_to_numpy(want_grads[k]), 1e-3, f"{what}: {name} gradient")
    try:
        khvd.SyncBatchNormalization(fused=True)
    except ValueError as exc:
        assert "fused=False" in str(exc), exc
    else:
        raise AssertionError("fused=True was accepted")


def check_sync_batch_normalization_in_fit(hvd, rank, size):
    """model.fit of a model with SyncBatchNormalization, DistributedOptimizer and each rank's share
    of every batch ends with the weights and moving statistics of one process fitting the whole
    batches with BatchNormalization (the compiled train step on tensorflow); the model saves and
    loads as a .keras file."""
    import keras

    import spark_hvd.keras as khvd

    def model(layer_class, seed):
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), layer_class(momentum=0.8),
                                 keras.layers.Activation("tanh"), keras.layers.Dense(3)])

    x, y = _data(size, 4)
    reference = model(keras.layers.BatchNormalization, 0)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
    reference.fit(x, y, batch_size=size * BATCH, shuffle=False, epochs=1, verbose=0)
    synced = model(khvd.SyncBatchNormalization, 0)
    synced.compile(optimizer=khvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    synced.fit(_my_rows(x, rank, size), _my_rows(y, rank, size), batch_size=BATCH, shuffle=False, epochs=1,
               verbose=0)
    for got, want in zip(synced.get_weights(), reference.get_weights()):
        close(got, want, 1e-4, "weights and moving statistics after fit")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # registered: loads without custom_objects
        synced.save(f"{tmp}/model.keras")
        loaded = keras.models.load_model(f"{tmp}/model.keras")
    assert type(loaded.layers[1]) is khvd.SyncBatchNormalization and loaded.layers[1].momentum == 0.8
    for got, want in zip(loaded.get_weights(), synced.get_weights()):
        close(got, want, 0.0, "weights after save and load")
