"""Params of LightningEstimator: the shared estimator Params that apply, plus the Lightning ones."""

from __future__ import annotations

from typing import Any, Dict, Tuple

from spark_hvd.spark.estimator.outputs import TASKS
from spark_hvd.spark.estimator.params import ESTIMATOR_PARAMS, AnyValue, Converter, ParamSpec, ToChoice, ToList, params_mixin

__all__ = ["ToTrainerArgs", "LIGHTNING_ESTIMATOR_PARAMS", "LightningEstimatorParams"]


class ToTrainerArgs(Converter):
    """A dict of ``pytorch_lightning.Trainer`` keyword arguments (string keys)."""

    expected = "a dict of pytorch_lightning.Trainer keyword arguments"
    example = "{'gradient_clip_val': 1.0}"

    def __call__(self, value: Any) -> Dict[str, Any]:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise self.fail(value)
        return dict(value)


_REPLACED = ("model", "callbacks", "task")
"""Shared Params whose meaning is Lightning's own here (declared below)."""

_NOT_FOR_LIGHTNING = ("optimizer", "loss", "loss_weights", "metrics", "backward_passes_per_step", "train_minibatch_fn",
                      "scale_lr", "checkpoint_every_steps")
"""Shared Params a LightningModule brings itself: configure_optimizers gives the optimizer and its
learning rate, training_step the loss, self.log the metrics; trainer_args holds the rest
(accumulate_grad_batches, val_check_interval)."""

LIGHTNING_ESTIMATOR_PARAMS: Tuple[ParamSpec, ...] = (
    ParamSpec("model", "The pytorch_lightning.LightningModule to train: its configure_optimizers gives the "
                       "optimizer, its training_step the loss.", None, AnyValue(), json=False),
    ParamSpec("trainer_args", "Extra pytorch_lightning.Trainer keyword arguments (e.g. gradient_clip_val); the "
                              "strategy, devices, nodes, epochs and checkpointing are the estimator's.",
              None, ToTrainerArgs(), json=False),
    ParamSpec("callbacks", "pytorch_lightning Callbacks added to the Trainer on every rank.", None, ToList(),
              json=False),
    ParamSpec("task", "Prediction columns of the fitted model: 'binary', 'binary_probability', 'multiclass', "
                      "'multiclass_log_probability', 'regression' or 'none' (raw outputs only).", "none",
              ToChoice(TASKS[1:])),
) + tuple(spec for spec in ESTIMATOR_PARAMS if spec.name not in _REPLACED + _NOT_FOR_LIGHTNING)
"""Params of LightningEstimator: its own, then every shared Param that means the same for a
LightningModule (a Param added to the shared table reaches it too)."""

LightningEstimatorParams = params_mixin("LightningEstimatorParams", LIGHTNING_ESTIMATOR_PARAMS, module=__name__)
