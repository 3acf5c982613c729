"""The estimator kit every framework shares: Params declared from tables, the driver's checks,
one ``fit`` in a fixed order (:class:`DistributedEstimator`), the training spec every rank gets,
the fitted-model base with batched Arrow inference, outputs, persistence, progress and MLflow.

A framework (``spark_hvd.spark.torch``, ``.keras``, ``.lightning``) supplies only hooks."""

from spark_hvd.spark.estimator.params import EstimatorParams, ModelParams, ParamSpec, params_mixin

__all__ = ["EstimatorParams", "ModelParams", "ParamSpec", "params_mixin"]
