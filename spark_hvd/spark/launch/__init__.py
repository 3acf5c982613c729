"""The launch part of the Spark layer: ``run()`` on one barrier stage (its tasks, their output
streams and results), ``run_elastic()`` over stages of changing size, and the retries of a stage
that lost a task, an executor or a host."""

from spark_hvd.spark.launch.backend import Backend, SparkBackend
from spark_hvd.spark.launch.barrier import RankFailedError, run
from spark_hvd.spark.launch.elastic import run_elastic
from spark_hvd.spark.launch.horovod_runner import HorovodRunner

__all__ = ["run", "run_elastic", "RankFailedError", "Backend", "SparkBackend", "HorovodRunner"]
