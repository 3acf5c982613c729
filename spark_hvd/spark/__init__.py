"""Spark integration: run() and run_elastic() on barrier tasks, sessions, stores, data preparation, readers and estimator Params.

The package is in parts: ``launch`` (barrier stages, elastic stages, retries, task output),
``data`` (stores, preparation, readers), ``estimator`` (the kit every estimator shares), and one
subpackage of hooks per framework (``torch``, ``keras``, ``lightning``)."""

from spark_hvd.spark.data import EXPORTS as _data_exports
from spark_hvd.spark.exports import lazy_exports

_EXPORTS = {
    "run": "spark_hvd.spark.launch",
    "run_elastic": "spark_hvd.spark.launch",
    "RankFailedError": "spark_hvd.spark.launch",
    "HorovodRunner": "spark_hvd.spark.launch",
    "Backend": "spark_hvd.spark.launch",
    "SparkBackend": "spark_hvd.spark.launch",
    "local_session": "spark_hvd.spark.session",
    **_data_exports,
    "ParamSpec": "spark_hvd.spark.estimator.params",
    "params_mixin": "spark_hvd.spark.estimator.params",
    "EstimatorParams": "spark_hvd.spark.estimator.params",
    "ModelParams": "spark_hvd.spark.estimator.params",
}
"""Each public name and the module that defines it (imported on first use)."""

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
