"""Spark integration: run() and run_elastic() on barrier tasks, sessions, stores, data preparation, readers and estimator Params."""
from .runner import RankFailedError, run
from .elastic import run_elastic
from .data import ColumnInfo, PreparedData, prepare_data
from .params import EstimatorParams, ModelParams, ParamSpec, params_mixin
from .reader import BatchReader, make_reader
from .session import local_session
from .store import DBFSLocalStore, FsspecStore, LocalStore, Store, VolumeStore

__all__ = [
    "run",
    "run_elastic",
    "RankFailedError",
    "local_session",
    "Store",
    "LocalStore",
    "FsspecStore",
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
