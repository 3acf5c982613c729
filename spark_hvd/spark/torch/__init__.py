"""Spark ML estimator and model for PyTorch: ``TorchEstimator(...).fit(df)`` returns a ``TorchModel``."""

from spark_hvd.spark.exports import lazy_exports

_EXPORTS = {
    "TorchEstimator": "spark_hvd.spark.torch.estimator",
    "TorchModel": "spark_hvd.spark.torch.model",
    "Callback": "spark_hvd.spark.torch.callbacks",
    "TrainingState": "spark_hvd.spark.torch.callbacks",
}
"""Each public name and the module that defines it (imported on first use)."""

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
