"""The data part of the Spark layer: where prepared data lives (stores), how a DataFrame becomes
Parquet for training (columns, identity, preparation), and how ranks read it back (readers)."""

from spark_hvd.spark.data.prepare import ColumnInfo, PreparedData, prepare_data
from spark_hvd.spark.data.reader import BatchReader, make_reader
from spark_hvd.spark.data.store import DBFSLocalStore, FsspecStore, HDFSStore, LocalStore, Store, VolumeStore

__all__ = ["Store", "LocalStore", "FsspecStore", "HDFSStore", "DBFSLocalStore", "VolumeStore", "prepare_data", "PreparedData",
           "ColumnInfo", "make_reader", "BatchReader"]
