"""Spark integration: run() on barrier tasks, stores, data preparation, readers and estimator Params."""
from .runner import RankFailedError, run
from .data import ColumnInfo, PreparedData, prepare_data
from .params import EstimatorParams, ModelParams, ParamSpec, params_mixin
from .reader import BatchReader, make_reader
from .store import DBFSLocalStore, FsspecStore, LocalStore, Store

__all__ = [
    "run",
    "RankFailedError",
    "Store",
    "LocalStore",
    "FsspecStore",
    "DBFSLocalStore",
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
