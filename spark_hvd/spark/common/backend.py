"""Horovod's ``horovod.spark.common.backend``: the backends of :mod:`spark_hvd.spark.launch.backend`."""

from spark_hvd.spark.launch.backend import Backend, SparkBackend

__all__ = ["Backend", "SparkBackend"]
