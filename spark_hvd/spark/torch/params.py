"""Params TorchEstimator adds to the shared tables of :mod:`spark_hvd.spark.estimator.params`."""

from __future__ import annotations

import numbers
from typing import Any, Dict, Tuple

from spark_hvd.spark.estimator.params import (Converter, EstimatorParams, ParamSpec, ToCallable, ToChoice, ToList,
                                             params_mixin)

__all__ = ["TORCH_ESTIMATOR_PARAMS", "TorchEstimatorParams", "ToEarlyStopping", "EARLY_STOPPING_DEFAULTS"]

EARLY_STOPPING_DEFAULTS: Dict[str, Any] = {"monitor": "val_loss", "patience": 0, "min_delta": 0.0, "mode": "auto",
                                           "restore_best_weights": True}
"""The keys of the ``early_stopping`` Param and their values when left out (Keras's EarlyStopping
names; ``restore_best_weights`` on by default, as a fitted model is expected to be the best one)."""


class ToEarlyStopping(Converter):
    """A dict of early-stopping settings (see :data:`EARLY_STOPPING_DEFAULTS`), completed with the defaults."""

    expected = ("a dict with some of monitor (a history key such as 'val_loss'), patience (an integer >= 0), "
                "min_delta (a number >= 0), mode ('auto', 'min' or 'max') and restore_best_weights (True/False)")
    example = "{'monitor': 'val_loss', 'patience': 2}"

    def __call__(self, value: Any) -> Dict[str, Any]:
        if not isinstance(value, dict) or set(value) - set(EARLY_STOPPING_DEFAULTS):
            raise self.fail(value)
        settings = {**EARLY_STOPPING_DEFAULTS, **value}
        patience, delta = settings["patience"], settings["min_delta"]
        if (not isinstance(settings["monitor"], str) or not settings["monitor"]
                or isinstance(patience, bool) or not isinstance(patience, numbers.Integral) or patience < 0
                or isinstance(delta, bool) or not isinstance(delta, numbers.Real) or delta < 0
                or settings["mode"] not in ("auto", "min", "max")
                or not isinstance(settings["restore_best_weights"], bool)):
            raise self.fail(value)
        return {**settings, "patience": int(patience), "min_delta": float(delta)}


TORCH_ESTIMATOR_PARAMS: Tuple[ParamSpec, ...] = (
    ParamSpec("loss_constructors", "Functions that each return a loss (Horovod's), one for all labels or one per "
                                   "label; instead of loss.", None, ToList(), json=False),
    ParamSpec("early_stopping", "Stop when a history value stops improving, as Keras's EarlyStopping: a dict of "
                                "monitor (default 'val_loss'), patience (epochs without improvement, default 0), "
                                "min_delta, mode ('auto': max for accuracy and AUC, else min) and "
                                "restore_best_weights (default True); unset: train every epoch.", None,
              ToEarlyStopping()),
    ParamSpec("lr_scheduler_fn", "A function given the rank's optimizer that returns a torch.optim.lr_scheduler "
                                 "scheduler (e.g. lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)); stepped "
                                 "per lr_scheduler_interval, its state kept in checkpoints.", None, ToCallable(),
              json=False),
    ParamSpec("lr_scheduler_interval", "When lr_scheduler_fn's scheduler steps: 'epoch' (after each epoch's "
                                       "validation; ReduceLROnPlateau is given val_loss, or loss) or 'step' (after "
                                       "each optimizer step).", "epoch", ToChoice(("epoch", "step"))),
)
"""Params TorchEstimator adds to the shared ones."""

TorchEstimatorParams = params_mixin("TorchEstimatorParams", TORCH_ESTIMATOR_PARAMS, module=__name__,
                                    bases=(EstimatorParams,))
