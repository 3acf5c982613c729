"""Spark ML estimator and model for PyTorch: ``TorchEstimator(...).fit(df)`` returns a ``TorchModel``."""

from spark_hvd.spark.torch.callbacks import Callback, TrainingState
from spark_hvd.spark.torch.estimator import TorchEstimator
from spark_hvd.spark.torch.model import TorchModel

__all__ = ["TorchEstimator", "TorchModel", "Callback", "TrainingState"]
