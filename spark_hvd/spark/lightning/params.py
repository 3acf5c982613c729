"""Params of LightningEstimator: the shared estimator Params that apply, plus the Lightning ones."""

from __future__ import annotations

from typing import Any, Dict, Tuple

from spark_hvd.spark.outputs import TASKS
from spark_hvd.spark.params import ESTIMATOR_PARAMS, AnyValue, Converter, ParamSpec, ToChoice, ToList, params_mixin

__all__ = ["ToTrainerArgs", "LIGHTNING_ESTIMATOR_PARAMS", "LightningEstimatorParams"]


class ToTrainerArgs(Converter):
    """A dict of ``pytorch_lightning.Trainer`` keyword arguments (string keys)."""

    expected = "a dict of pytorch_lightning.Trainer keyword arguments"
    example = "{'gradient_clip_val': 1.0}"

    def __call__(self, value: Any) -> Dict[str, Any]:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise self.fail(value)
        return dict(value)


_SHARED = ("num_proc", "feature_cols", "label_cols", "sample_weight_col", "validation", "batch_size",
           "val_batch_size", "epochs", "train_steps_per_epoch", "validation_steps_per_epoch", "shuffle",
           "random_seed", "store", "run_id", "gradient_compression", "input_shapes", "transformation_fn", "use_gpu",
           "verbose", "reader", "invalid_rows", "overwrite_run", "prediction_col", "probability_col",
           "raw_prediction_col", "max_retries", "cleanup_intermediate")
"""Params of the torch estimator that mean the same for a LightningModule (taken from its table)."""

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
) + tuple(spec for spec in ESTIMATOR_PARAMS if spec.name in _SHARED)
"""Params of LightningEstimator."""

LightningEstimatorParams = params_mixin("LightningEstimatorParams", LIGHTNING_ESTIMATOR_PARAMS, module=__name__)
