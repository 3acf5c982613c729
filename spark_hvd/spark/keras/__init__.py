"""Spark ML estimator and model for Keras 3: ``KerasEstimator(...).fit(df)`` returns a ``KerasModel``."""

from spark_hvd.spark.keras.estimator import KerasEstimator
from spark_hvd.spark.keras.model import KerasModel

__all__ = ["KerasEstimator", "KerasModel"]
