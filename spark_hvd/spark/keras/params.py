"""Params KerasEstimator and KerasModel add to the shared tables of :mod:`spark_hvd.spark.estimator.params`."""

from __future__ import annotations

from typing import Any, Dict, Tuple

from spark_hvd.spark.estimator.params import AnyValue, Converter, EstimatorParams, ModelParams, ParamSpec, params_mixin

__all__ = ["KERAS_PARAMS", "KERAS_ESTIMATOR_PARAMS", "KerasEstimatorParams", "KerasModelParams"]

class ToEnv(Converter):
    """A dict of environment variable names to values, all strings."""

    expected = "a dict of str names to str values"
    example = "{'TF_CPP_MIN_LOG_LEVEL': '3'}"

    def __call__(self, value: Any) -> Dict[str, str]:
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise self.fail(value)
        return dict(value)


KERAS_PARAMS: Tuple[ParamSpec, ...] = (
    ParamSpec("custom_objects", "Custom Keras classes and functions by name (layers, losses, metrics) for "
                                "loading the model on the workers.", None, AnyValue(), json=False),
)
"""Params KerasEstimator and KerasModel add to their tables."""

KERAS_ESTIMATOR_PARAMS: Tuple[ParamSpec, ...] = KERAS_PARAMS + (
    ParamSpec("checkpoint_callback", "A keras.callbacks.ModelCheckpoint run on rank 0 (Horovod's); a relative "
                                     "filepath is under the run's directory of the store.", None, AnyValue(),
              json=False),
    ParamSpec("backend_env", "Environment variables added to every rank process's (Horovod's).", None, ToEnv()),
)
"""Params KerasEstimator adds to the shared ones."""

KerasEstimatorParams = params_mixin("KerasEstimatorParams", KERAS_ESTIMATOR_PARAMS, module=__name__,
                                    bases=(EstimatorParams,))
KerasModelParams = params_mixin("KerasModelParams", KERAS_PARAMS, module=__name__, bases=(ModelParams,))
