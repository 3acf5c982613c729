"""``DistributedOptimizer`` for Keras 2 (the ``tf_keras`` package, TensorFlow only).

TensorFlow 2.16 and later run code written for Keras 2 through ``tf_keras`` when
``TF_USE_LEGACY_KERAS=1`` is set (then ``tf.keras`` is ``tf_keras``). Its optimizers, both
``tf.keras.optimizers.*`` and ``tf.keras.optimizers.legacy.*``, get a subclass that combines the
gradients over the ranks where Keras 2 hands them over:

- ``_compute_gradients`` (Horovod's entry point; the legacy optimizers' ``minimize`` calls it) and
  ``compute_gradients`` (the other optimizers' ``minimize``, so ``model.fit``) return combined
  gradients;
- ``apply_gradients`` combines gradients that did not come from those.

With ``backward_passes_per_step=N`` each rank adds its gradients into accumulators of its own
and the ranks combine them every N-th call only; the calls in between do not update the
variables but count in ``iterations``, as Horovod's optimizer does. ``_agg_helper.counter`` is
the number of calls since the last combination.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import tensorflow as tf

import spark_hvd.runtime as _rt
from spark_hvd.keras.basics import legacy_keras_selected
from spark_hvd.keras.combining import GradientCombining

__all__ = ["Keras2Distributed", "legacy_keras_selected", "sync_batch_normalization_class"]


class _Accumulation:
    """Local gradient sums between combinations: ``counter`` calls since the last one."""

    def __init__(self, passes: int) -> None:
        self.passes = passes
        with tf.init_scope():
            self.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvd_accumulated_passes")
        self.sums: Dict[int, tf.Variable] = {}

    def add(self, grads: Sequence[Any], variables: Sequence[Any]) -> List[Any]:
        """Add ``grads`` to the sums; return the sums (None where the gradient is None)."""
        out: List[Any] = []
        for grad, var in zip(grads, variables):
            if grad is None:
                out.append(None)
                continue
            if isinstance(grad, tf.IndexedSlices):
                grad = tf.convert_to_tensor(grad)  # summed densely
            total = self.sums.get(id(var))
            if total is None:
                with tf.init_scope():
                    total = self.sums[id(var)] = tf.Variable(tf.zeros(var.shape, grad.dtype), trainable=False,
                                                             name="hvd_accumulated_gradient")
            total.assign_add(grad)
            out.append(total.read_value())
        self.counter.assign_add(1)
        return out

    def clear(self) -> Any:
        ops = [total.assign(tf.zeros_like(total)) for total in self.sums.values()]
        ops.append(self.counter.assign(0))
        return tf.group(ops)


class Keras2Distributed(GradientCombining):
    """Methods placed in front of a ``tf_keras`` optimizer's class by
    :func:`spark_hvd.keras.DistributedOptimizer` (local variables and the combination over the
    ranks are Keras 3's, :class:`spark_hvd.keras.combining.GradientCombining`)."""

    @property
    def _agg_helper(self) -> Optional[_Accumulation]:
        passes = self._hvd.backward_passes_per_step
        if passes == 1:
            return None
        helper = self.__dict__.get("_hvd_accumulation")
        if helper is None:
            helper = self.__dict__["_hvd_accumulation"] = _Accumulation(passes)
        return helper

    def _hvd_on_tensorflow(self) -> bool:
        return True  # tf_keras runs on TensorFlow only

    def _hvd_gradients(self, grads: Sequence[Any], variables: Sequence[Any]) -> List[Any]:
        """The gradients to apply: combined now, or with backward_passes_per_step > 1 the local
        sums, combined (and the sums cleared) on every N-th call."""
        helper = self._agg_helper
        if helper is None:
            return self._hvd_reduce(grads, variables)
        sums = helper.add(grads, variables)
        present = [i for i, g in enumerate(sums) if g is not None]
        if not present:
            return sums
        scale = 1.0 / helper.passes if self._hvd.average_aggregated_gradients else 1.0

        def combine() -> List[Any]:
            combined = self._hvd_reduce([sums[i] for i in present], [variables[i] for i in present])
            with tf.control_dependencies([g for g in combined]):
                cleared = helper.clear()
            with tf.control_dependencies([cleared]):
                return [tf.identity(g * scale) for g in combined]

        chosen = tf.cond(tf.equal(helper.counter, helper.passes), combine,
                         lambda: [tf.identity(sums[i]) for i in present])
        out = list(sums)
        for i, g in zip(present, chosen if isinstance(chosen, (list, tuple)) else [chosen]):
            out[i] = g
        return out

    def _compute_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None, tape: Any = None) -> List[Any]:
        """``(gradient, variable)`` pairs of ``loss``, combined over the ranks (Horovod's entry point).

        ``loss`` is a tensor recorded on ``tape`` or a callable; ``var_list`` variables or a callable
        returning them.
        """
        if tape is None:
            tape = tf.GradientTape()
        if callable(loss):
            with tape:
                if not callable(var_list):
                    tape.watch(var_list)
                loss = loss()
        if callable(var_list):
            var_list = var_list()
        var_list = tf.nest.flatten(var_list)
        grads = tape.gradient(loss, var_list, grad_loss)
        grads = self._hvd_gradients(grads, var_list)
        self.__dict__["_hvd_handed_over"] = True
        return list(zip(grads, var_list))

    def compute_gradients(self, loss: Any, var_list: Any, tape: Any = None) -> List[Any]:
        """The optimizer's ``compute_gradients``, combined over the ranks (``minimize`` and so
        ``model.fit`` call it)."""
        return self._compute_gradients(loss, var_list, tape=tape)

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        """Apply gradients combined over the ranks (with backward_passes_per_step > 1 only on
        every N-th call; the others just count in ``iterations``)."""
        pairs = list(grads_and_vars)
        if not self.__dict__.pop("_hvd_handed_over", False) and pairs:
            grads, variables = zip(*pairs)
            pairs = list(zip(self._hvd_gradients(grads, variables), variables))
        apply = super(Keras2Distributed, self).apply_gradients  # type: ignore[misc]
        helper = self._agg_helper
        if helper is None:
            return apply(pairs, *args, **kwargs)

        def update() -> Any:
            apply(pairs, *args, **kwargs)
            return tf.constant(True)

        def count() -> Any:
            self.iterations.assign_add(1)
            return tf.constant(False)

        tf.cond(tf.equal(helper.counter, 0), update, count)
        return self.iterations


_SYNC_BATCH_NORM: Optional[type] = None


def sync_batch_normalization_class() -> type:
    """``SyncBatchNormalization`` for Keras 2: ``tf_keras.layers.BatchNormalization`` whose training
    statistics are those of every rank's batch together (as spark_hvd.keras's layer for Keras 3)."""
    global _SYNC_BATCH_NORM
    if _SYNC_BATCH_NORM is not None:
        return _SYNC_BATCH_NORM
    import tf_keras

    from spark_hvd.tensorflow.reductions import allreduce

    class SyncBatchNormalization(tf_keras.layers.BatchNormalization):
        """Batch normalization with the mean and variance of the union of every rank's batch in
        training: one allreduce (Sum) of per-channel counts, sums and sums of squares, so ranks may
        hold batches of different sizes or masks; gradients flow through it. Inference uses the
        moving statistics. ``fused`` may only be False (a fused kernel computes each rank's
        statistics alone); ``process_set`` names the ranks normalized together."""

        def __init__(self, fused: Optional[bool] = False, process_set: Any = _rt.global_process_set,
                     **kwargs: Any) -> None:
            if fused:
                raise ValueError(f"SyncBatchNormalization got fused={fused!r}; only fused=False is supported (a "
                                 "fused kernel computes each rank's statistics alone)")
            if kwargs.get("synchronized"):
                raise ValueError("SyncBatchNormalization got synchronized=True, which synchronizes through a "
                                 "tf.distribute strategy; leave it out: this layer synchronizes through spark-hvd.")
            super().__init__(fused=False, **kwargs)
            self.process_set = process_set

        def get_config(self) -> dict:
            config = super().get_config()
            config.pop("fused", None)
            config.pop("synchronized", None)
            return config

        def _calculate_mean_and_var(self, inputs: Any, reduction_axes: Any, keep_dims: bool, mask: Any = None) -> Any:
            ps = self.process_set
            if (ps.size() if ps is not None else _rt.size()) <= 1:
                return super()._calculate_mean_and_var(inputs, reduction_axes, keep_dims, mask=mask)
            if mask is None:
                weights = tf.ones_like(inputs)
            else:
                weights = tf.broadcast_to(tf.expand_dims(tf.cast(mask, inputs.dtype), -1), tf.shape(inputs))
            counts = tf.reduce_sum(weights, axis=reduction_axes, keepdims=keep_dims)
            sums = tf.reduce_sum(inputs * weights, axis=reduction_axes, keepdims=keep_dims)
            squares = tf.reduce_sum(tf.square(inputs) * weights, axis=reduction_axes, keepdims=keep_dims)
            total = allreduce(tf.stack([counts, sums, squares]), op=_rt.Sum, process_set=ps)
            mean = total[1] / total[0]
            return mean, tf.maximum(total[2] / total[0] - tf.square(mean), 0.0)

    SyncBatchNormalization.__module__ = __name__
    tf_keras.utils.register_keras_serializable(package="spark_hvd")(SyncBatchNormalization)
    _SYNC_BATCH_NORM = SyncBatchNormalization
    return SyncBatchNormalization
