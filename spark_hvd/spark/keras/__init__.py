"""Spark ML estimator and model for Keras 3: ``KerasEstimator(...).fit(df)`` returns a ``KerasModel``."""

from spark_hvd.spark.exports import lazy_exports

_EXPORTS = {
    "KerasEstimator": "spark_hvd.spark.keras.estimator",
    "KerasModel": "spark_hvd.spark.keras.model",
}
"""Each public name and the module that defines it (imported on first use)."""

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
