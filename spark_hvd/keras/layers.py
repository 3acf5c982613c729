"""``SyncBatchNormalization``: Keras 3 batch normalization whose statistics cover all ranks' batches."""

from __future__ import annotations

from typing import Any, Optional

import keras
from keras import ops

import spark_hvd.runtime as _rt
from spark_hvd.keras.basics import binding

__all__ = ["SyncBatchNormalization"]


@keras.saving.register_keras_serializable(package="spark_hvd")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization with the mean and variance of the union of every rank's batch in training.

    A drop-in for ``keras.layers.BatchNormalization`` (same arguments, on the tensorflow and torch
    backends): in training each rank sums, per channel, its number of values, their sum and their
    sum of squares; one allreduce (Sum) of those gives the statistics of all ranks' batches
    together, as one process would compute them on the concatenated batch, also when ranks hold
    batches of different sizes or masks. The moving statistics are updated from them identically
    on every rank; gradients flow through the allreduce as through the statistics of one big batch.
    Inference uses the moving statistics, with no communication. Every rank must call the layer in
    training the same number of times. The layer turns XLA off for ``jit_compile="auto"``, since
    the allreduce is a Python-function op; with the torch backend it runs eagerly as Keras does.

    Arguments:
        fused: Accepted for Horovod compatibility; only False (or leaving it out) is possible,
            since a fused kernel computes each rank's statistics on its own.
        process_set: The ranks whose batches are normalized together (default: all ranks).
        **kwargs: Those of ``keras.layers.BatchNormalization`` (axis, momentum, epsilon, center,
            scale, initializers, renorm ...); ``synchronized`` is refused, it is the
            tf.distribute form of the same idea.
    """

    def __init__(self, fused: Optional[bool] = False, process_set: Any = _rt.global_process_set, **kwargs: Any) -> None:
        if fused or fused is None:
            raise ValueError(f"SyncBatchNormalization got fused={fused!r}; only fused=False is supported (a fused "
                             "kernel computes each rank's statistics alone). Leave fused out or pass fused=False.")
        if kwargs.get("synchronized"):
            raise ValueError("SyncBatchNormalization got synchronized=True, which synchronizes through a "
                             "tf.distribute strategy; leave it out: this layer synchronizes through spark-hvd.")
        super().__init__(**kwargs)
        self.process_set = process_set
        self.supports_jit = False

    def get_config(self) -> dict:
        config = super().get_config()
        config.pop("synchronized", None)
        return config

    def _moments(self, inputs: Any, mask: Any) -> Any:
        process_set = self.process_set
        members = process_set.size() if process_set is not None else 1
        if members <= 1:
            return super()._moments(inputs, mask)
        axes = self._reduction_axes
        if mask is None:
            sums = ops.sum(inputs, axis=axes)
            squares = ops.sum(ops.square(inputs), axis=axes)
            counts = ops.reshape(ops.cast(ops.size(inputs), inputs.dtype) / ops.cast(ops.size(sums), inputs.dtype),
                                 (1,))
        else:
            weights = ops.cast(ops.broadcast_to(ops.expand_dims(mask, axis=-1), ops.shape(inputs)), inputs.dtype)
            sums = ops.sum(inputs * weights, axis=axes)
            squares = ops.sum(ops.square(inputs) * weights, axis=axes)
            counts = ops.reshape(ops.sum(weights, axis=axes), (-1,))
        stat_shape = ops.shape(sums)
        flat_sums = ops.reshape(sums, (-1,))
        local = ops.concatenate([counts, flat_sums, ops.reshape(squares, (-1,))], axis=0)
        total = binding().allreduce(local, op=_rt.Sum, process_set=process_set)
        n, channels = ops.shape(counts)[0], ops.shape(flat_sums)[0]
        count = total[:n] if mask is None else total[:n] + keras.backend.epsilon()  # as Keras's masked moments
        mean = total[n:n + channels] / count
        variance = ops.maximum(total[n + channels:] / count - ops.square(mean), 0.0)
        return ops.reshape(mean, stat_shape), ops.reshape(variance, stat_shape)
