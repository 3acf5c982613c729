"""Params TorchEstimator adds to the shared tables of :mod:`spark_hvd.spark.estimator.params`."""

from __future__ import annotations

from typing import Tuple

from spark_hvd.spark.estimator.params import EstimatorParams, ParamSpec, ToList, params_mixin

__all__ = ["TORCH_ESTIMATOR_PARAMS", "TorchEstimatorParams"]

TORCH_ESTIMATOR_PARAMS: Tuple[ParamSpec, ...] = (
    ParamSpec("loss_constructors", "Functions that each return a loss (Horovod's), one for all labels or one per "
                                   "label; instead of loss.", None, ToList(), json=False),
)
"""Params TorchEstimator adds to the shared ones."""

TorchEstimatorParams = params_mixin("TorchEstimatorParams", TORCH_ESTIMATOR_PARAMS, module=__name__,
                                    bases=(EstimatorParams,))
