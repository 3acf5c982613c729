"""placeholder"""
from .runner import RankFailedError, run
from .data import ColumnInfo, PreparedData, prepare_data
from .params import EstimatorParams, ModelParams, ParamSpec, params_mixin
from .reader import BatchReader, make_reader
from .store import DBFSLocalStore, FsspecStore, LocalStore, Store
