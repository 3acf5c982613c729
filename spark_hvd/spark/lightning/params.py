"""Params of LightningEstimator: the shared estimator Params that apply, plus the Lightning ones."""

from __future__ import annotations

from typing import Any, Dict, Tuple

from spark_hvd.spark.estimator.outputs import TASKS
from spark_hvd.spark.estimator.params import (ESTIMATOR_PARAMS, HOROVOD_ESTIMATOR_PARAMS, AnyValue, Converter, ParamSpec,
                                             ToBool, ToChoice, ToInt, ToList, params_mixin)

__all__ = ["ToTrainerArgs", "LIGHTNING_ESTIMATOR_PARAMS", "HOROVOD_LIGHTNING_PARAMS", "LightningEstimatorParams"]


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

_NOT_FOR_LIGHTNING = ("optimizer", "loss", "loss_weights", "metrics", "train_minibatch_fn", "scale_lr")
"""Shared Params a LightningModule brings itself: configure_optimizers gives the optimizer and its
learning rate, training_step the loss, self.log the metrics; trainer_args holds the rest
(val_check_interval). Horovod's Lightning estimator takes some of these names; they are accepted
with a warning (below)."""

_MODULE = "the LightningModule brings it (configure_optimizers, training_step, self.log)"
_LOADER = "the rank's batches come from spark-hvd's reader, which prefetches on its own thread"

HOROVOD_LIGHTNING_PARAMS: Tuple[ParamSpec, ...] = (
    ParamSpec("backward_passes_per_step", "Batches whose gradients are accumulated per optimizer step (Lightning's "
                                          "accumulate_grad_batches).", 1, ToInt(1)),
    ParamSpec("logger", "A Lightning logger (or list of them) for the Trainer on every rank (Horovod's); unset: a "
              "TensorBoardLogger writing under the run's logs directory of the store, as Horovod's (False: none).", None,
              AnyValue(), json=False),
    ParamSpec("log_every_n_steps", "How often the Trainer logs within an epoch (Horovod's).", 50, ToInt(1)),
    ParamSpec("profiler", "A Lightning profiler, or its name, for the Trainer (Horovod's).", None, AnyValue(),
              json=False),
    ParamSpec("optimizer", "Horovod's optimizer Param.", None, AnyValue(), json=False, unused=_MODULE),
    ParamSpec("loss", "Horovod's loss Param.", None, AnyValue(), json=False, unused=_MODULE),
    ParamSpec("loss_constructors", "Horovod's loss constructors.", None, ToList(), json=False, unused=_MODULE),
    ParamSpec("loss_weights", "Horovod's loss weights.", None, ToList(), unused=_MODULE),
    ParamSpec("metrics", "Horovod's metrics Param.", None, ToList(), json=False, unused=_MODULE),
    ParamSpec("train_minibatch_fn", "Horovod's custom training step.", None, AnyValue(), json=False,
              unused="training_step (or manual optimization in the module) is the training step"),
    ParamSpec("num_gpus", "Horovod's GPUs per process.", None, ToInt(0),
              unused="each rank trains on one device: its GPU with use_gpu=True and CUDA, else the CPU"),
    ParamSpec("loader_num_epochs", "Horovod's epochs per data loader.", None, ToInt(1), unused=_LOADER),
    ParamSpec("terminate_on_nan", "Horovod's stop on a NaN loss.", False, ToBool(),
              unused="Lightning 2 removed it; a callback can stop training (trainer.should_stop)"),
    ParamSpec("debug_data_loader", "Horovod's data loader debugging.", False, ToBool(), unused=_LOADER),
    ParamSpec("train_async_data_loader_queue_size", "Horovod's async loader queue for training.", None, ToInt(1),
              unused=_LOADER),
    ParamSpec("val_async_data_loader_queue_size", "Horovod's async loader queue for validation.", None, ToInt(1),
              unused=_LOADER),
)
"""Horovod's Lightning TorchEstimator Params: those that mean something set the Trainer, the others
are accepted with one warning saying why."""

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
) + tuple(spec for spec in ESTIMATOR_PARAMS if spec.name not in _REPLACED + _NOT_FOR_LIGHTNING
          and spec.name != "backward_passes_per_step") + HOROVOD_ESTIMATOR_PARAMS + HOROVOD_LIGHTNING_PARAMS
"""Params of LightningEstimator: its own, then every shared Param that means the same for a
LightningModule (a Param added to the shared table reaches it too)."""

LightningEstimatorParams = params_mixin("LightningEstimatorParams", LIGHTNING_ESTIMATOR_PARAMS, module=__name__)
