"""Horovod's Keras callbacks for Keras 3: broadcast at start, metric averaging, learning-rate warm-up and schedules.

They work on every supported Keras backend: values travel as numpy arrays through the runtime,
and learning rates are set through the optimizer's ``learning_rate`` variable, which the
compiled step reads when it runs.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import keras
import numpy as np

import spark_hvd.runtime as _rt
from spark_hvd.keras.basics import is_keras2
from spark_hvd.keras.values import allreduce, broadcast_variables

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "BestModelCheckpoint"]


class _Keras2Hooks:
    """What Keras 2's ``tf_keras`` asks of a callback beyond Keras 3's methods, so the callbacks
    here also serve ``tf.keras`` models with ``TF_USE_LEGACY_KERAS=1``."""

    _supports_tf_logs = False

    def _implements_train_batch_hooks(self) -> bool:
        own = ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end")
        return any(getattr(type(self), name) is not getattr(keras.callbacks.Callback, name) for name in own)

    def _implements_test_batch_hooks(self) -> bool:
        return False

    def _implements_predict_batch_hooks(self) -> bool:
        return False


def optimizer_variables(optimizer: Any) -> List[Any]:
    """The variables of a Keras 3 or Keras 2 optimizer (a method of Keras 2's legacy optimizers)."""
    found = getattr(optimizer, "variables", None)
    return list((found() if callable(found) and not isinstance(found, list) else found) or [])


class BroadcastGlobalVariablesCallback(_Keras2Hooks, keras.callbacks.Callback):
    """At the start of training, give every rank ``root_rank``'s weights and optimizer state.

    Afterwards (from the first batch on) all ranks train the same model, whatever their initial
    values were. Variables in ``local_variables`` keep each rank's own values.
    """

    def __init__(self, root_rank: int, device: str = "", local_variables: Optional[Sequence[Any]] = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.local_variables = {id(v) for v in (local_variables or [])}
        self.broadcast_done = False

    def _broadcast(self) -> None:
        model = self.model
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and hasattr(optimizer, "build") and model.trainable_variables \
                and not getattr(optimizer, "built", getattr(optimizer, "_built", True)):
            optimizer.build(model.trainable_variables)
        variables = list(model.variables) + (optimizer_variables(optimizer) if optimizer is not None else [])
        broadcast_variables([v for v in variables if id(v) not in self.local_variables], self.root_rank)
        self.broadcast_done = True

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        if not self.broadcast_done:
            self._broadcast()

    def on_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if not self.broadcast_done:  # training driven without on_train_begin (train_on_batch loops)
            self._broadcast()


class MetricAverageCallback(_Keras2Hooks, keras.callbacks.Callback):
    """At the end of each epoch, replace every metric in the logs by its average over the ranks.

    Afterwards every rank's logs (and so its History and later callbacks, such as checkpoints
    and early stopping) hold the same values. Put it before callbacks that read the metrics.
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if not logs:
            return
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.isscalar(_as_float(v)))
        if not names:
            return
        values = np.array([_as_float(logs[k]) for k in names], dtype=np.float64)
        averaged = allreduce(values, name=f"metrics.{'.'.join(names)}")
        for name, value in zip(names, averaged.tolist()):
            logs[name] = value


def _as_float(value: Any) -> Any:
    try:
        return float(np.asarray(value))
    except (TypeError, ValueError):
        return None


def _set_lr(optimizer: Any, value: float) -> None:
    lr = optimizer.learning_rate
    if callable(lr) and not hasattr(lr, "assign"):
        raise ValueError("the optimizer's learning_rate is a schedule; learning-rate callbacks need a plain value")
    optimizer.learning_rate = value


def _get_lr(optimizer: Any) -> float:
    lr = optimizer.learning_rate
    return float(np.asarray(lr.numpy() if hasattr(lr, "numpy") else keras.ops.convert_to_numpy(lr)))


class LearningRateScheduleCallback(_Keras2Hooks, keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier`` from ``start_epoch`` until ``end_epoch``.

    ``multiplier`` is a number or a function of the epoch. With ``staircase=True`` the rate
    changes at epoch starts; otherwise every batch, with fractional epochs (``epoch +
    batch/steps_per_epoch``). Outside the epoch range the callback leaves the rate alone.
    ``momentum_correction`` is accepted for Horovod compatibility: Keras 3 compiles momentum as a
    constant into the training step, so it cannot be corrected from a callback.
    """

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]], start_epoch: int = 0,
                 end_epoch: Optional[int] = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("initial_lr is required: pass the learning rate the schedule multiplies")
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def _in_range(self, epoch: float) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _adjust(self, epoch: float) -> None:
        if self._in_range(epoch):
            _set_lr(self.model.optimizer, self.initial_lr * self.multiplier(epoch))

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.steps_per_epoch is None and not self.staircase:
            self.steps_per_epoch = (self.params or {}).get("steps")
            if not self.steps_per_epoch:
                raise ValueError("staircase=False needs steps_per_epoch: pass it, or let model.fit know the "
                                 "number of steps (steps_per_epoch=...)")

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.current_epoch = epoch
        if self.staircase:
            self._adjust(epoch)

    def on_batch_begin(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if not self.staircase:
            self._adjust(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if logs is not None:
            logs["lr"] = _get_lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``.

    The rate grows every batch (fractional epochs), as in Goyal et al., "Accurate, Large
    Minibatch SGD" (2017); after the warm-up it is ``initial_lr`` and the callback stops changing
    it. With ``verbose`` rank 0 prints when the warm-up ends.
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            size = _rt.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if epoch == self.warmup_epochs - 1:
            _set_lr(self.model.optimizer, self.initial_lr)
            if self.verbose and _rt.rank() == 0:
                print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {self.initial_lr:g}.")
        super().on_epoch_end(epoch, logs)


class BestModelCheckpoint(_Keras2Hooks, keras.callbacks.ModelCheckpoint):
    """Save the model to ``filepath`` whenever ``monitor`` improves, on rank 0 only.

    Afterwards ``filepath`` (a ``.keras`` file) holds the best model seen. Other ranks save
    nothing, so a shared directory is written once. A Keras 2 (``tf_keras``) model is saved by
    ``tf_keras``'s own ModelCheckpoint with the same settings (``.keras`` or ``.h5``).
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, mode: str = "auto", save_freq: Any = "epoch",
                 filepath: Optional[str] = None) -> None:
        super().__init__(filepath=filepath or "best.keras", monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=False, mode=mode, save_freq=save_freq)
        self.filepath = filepath
        self._settings = {"monitor": monitor, "verbose": verbose, "mode": mode, "save_freq": save_freq}
        self._keras2: Any = None
        """tf_keras's ModelCheckpoint doing the work for a Keras 2 model (rank 0 only)."""

    def set_model(self, model: Any) -> None:
        if is_keras2(model):
            import tf_keras

            self._model = model
            if _rt.rank() == 0 and self._keras2 is None:
                self._keras2 = tf_keras.callbacks.ModelCheckpoint(filepath=self.filepath or "best.keras",
                                                                  save_best_only=True, **self._settings)
            if self._keras2 is not None:
                self._keras2.set_model(model)
            return
        super().set_model(model)

    def set_params(self, params: Dict[str, Any]) -> None:
        super().set_params(params)
        if self._keras2 is not None:
            self._keras2.set_params(params)

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        if not self.filepath:
            raise ValueError("BestModelCheckpoint has no filepath; pass filepath='best.keras' or set "
                             "callback.filepath before training")
        if self._keras2 is not None:
            self._keras2.filepath = self.filepath
        if not self._delegated("on_train_begin", logs):
            super().on_train_begin(logs)

    def _delegated(self, hook: str, *args: Any) -> bool:
        """For a Keras 2 model: run ``hook`` on tf_keras's ModelCheckpoint (rank 0) and say True."""
        if not is_keras2(self.model):
            return False
        if self._keras2 is not None:
            getattr(self._keras2, hook)(*args)
        return True

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if not self._delegated("on_epoch_begin", epoch, logs):
            super().on_epoch_begin(epoch, logs)

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if not self._delegated("on_train_batch_end", batch, logs):
            super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if not self._delegated("on_epoch_end", epoch, logs):
            super().on_epoch_end(epoch, logs)

    def _save_model(self, epoch: int, batch: Optional[int], logs: Optional[Dict[str, Any]]) -> None:
        if _rt.rank() == 0:
            super()._save_model(epoch, batch, logs)
