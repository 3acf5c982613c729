"""Spark integration: run() and run_elastic() on barrier tasks, sessions, stores, data preparation, readers and estimator Params.

The package is in parts: ``launch`` (barrier stages, elastic stages, retries, task output),
``data`` (stores, preparation, readers), ``estimator`` (the kit every estimator shares), and one
subpackage of hooks per framework (``torch``, ``keras``, ``lightning``)."""
from spark_hvd.spark.data import (BatchReader, ColumnInfo, DBFSLocalStore, FsspecStore, HDFSStore, LocalStore,
                                  PreparedData, Store, VolumeStore, make_reader, prepare_data)
from spark_hvd.spark.estimator import EstimatorParams, ModelParams, ParamSpec, params_mixin
from spark_hvd.spark.launch import Backend, HorovodRunner, RankFailedError, SparkBackend, run, run_elastic
from spark_hvd.spark.session import local_session

__all__ = [
    "run",
    "run_elastic",
    "RankFailedError",
    "HorovodRunner",
    "Backend",
    "SparkBackend",
    "local_session",
    "Store",
    "LocalStore",
    "FsspecStore",
    "HDFSStore",
    "DBFSLocalStore",
    "VolumeStore",
    "prepare_data",
    "PreparedData",
    "ColumnInfo",
    "make_reader",
    "BatchReader",
    "ParamSpec",
    "params_mixin",
    "EstimatorParams",
    "ModelParams",
]
