"""Live training progress of TorchEstimator: the shared reporter and printer of :mod:`spark_hvd.spark.progress`."""

from spark_hvd.spark.progress import PROGRESS_PREFIX, ProgressPrinter, ProgressReporter, format_epoch

__all__ = ["PROGRESS_PREFIX", "ProgressReporter", "ProgressPrinter", "format_epoch"]
