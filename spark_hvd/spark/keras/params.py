"""Params KerasEstimator and KerasModel add to the shared tables of :mod:`spark_hvd.spark.estimator.params`."""

from __future__ import annotations

from typing import Tuple

from spark_hvd.spark.estimator.params import AnyValue, EstimatorParams, ModelParams, ParamSpec, ToInt, params_mixin

__all__ = ["KERAS_PARAMS", "KERAS_ESTIMATOR_PARAMS", "KerasEstimatorParams", "KerasModelParams"]

KERAS_PARAMS: Tuple[ParamSpec, ...] = (
    ParamSpec("custom_objects", "Custom Keras classes and functions by name (layers, losses, metrics) for "
                                "loading the model on the workers.", None, AnyValue(), json=False),
)
"""Params KerasEstimator and KerasModel add to their tables."""

KERAS_ESTIMATOR_PARAMS: Tuple[ParamSpec, ...] = KERAS_PARAMS + (
    ParamSpec("shuffle_buffer_size", "Rows each process holds to shuffle within (default 10,000; 0 shuffles "
                                     "row groups only).", None, ToInt(0)),
)
"""Params KerasEstimator adds to ESTIMATOR_PARAMS."""

KerasEstimatorParams = params_mixin("KerasEstimatorParams", KERAS_ESTIMATOR_PARAMS, module=__name__,
                                    bases=(EstimatorParams,))
KerasModelParams = params_mixin("KerasModelParams", KERAS_PARAMS, module=__name__, bases=(ModelParams,))
