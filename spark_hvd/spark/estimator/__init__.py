"""The estimator kit every framework shares: Params declared from tables, the driver's checks,
one ``fit`` in a fixed order (:class:`DistributedEstimator`), the training spec every rank gets,
the fitted-model base with batched Arrow inference, outputs, persistence, progress and MLflow.

A framework (``spark_hvd.spark.torch``, ``.keras``, ``.lightning``) supplies only hooks."""

from spark_hvd.spark.exports import lazy_exports

_EXPORTS = {
    "EstimatorParams": "spark_hvd.spark.estimator.params",
    "ModelParams": "spark_hvd.spark.estimator.params",
    "ParamSpec": "spark_hvd.spark.estimator.params",
    "params_mixin": "spark_hvd.spark.estimator.params",
}
"""Each public name and the module that defines it (imported on first use)."""

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
