"""Horovod's ``horovod.spark.common`` module paths: ``spark_hvd.spark.common.store`` and
``spark_hvd.spark.common.backend`` name the same classes as ``spark_hvd.spark``, so a Horovod Spark
program runs after its imports are renamed."""

from spark_hvd.spark.common import backend, store

__all__ = ["backend", "store"]
