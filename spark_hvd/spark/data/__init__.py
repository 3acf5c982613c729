"""The data part of the Spark layer: where prepared data lives (stores), how a DataFrame becomes
Parquet for training (columns, identity, preparation), and how ranks read it back (readers)."""

from spark_hvd.spark.exports import lazy_exports

EXPORTS = {
    "Store": "spark_hvd.spark.data.store",
    "LocalStore": "spark_hvd.spark.data.store",
    "FsspecStore": "spark_hvd.spark.data.store",
    "HDFSStore": "spark_hvd.spark.data.store",
    "DBFSLocalStore": "spark_hvd.spark.data.store",
    "VolumeStore": "spark_hvd.spark.data.store",
    "prepare_data": "spark_hvd.spark.data.prepare",
    "PreparedData": "spark_hvd.spark.data.prepare",
    "ColumnInfo": "spark_hvd.spark.data.prepare",
    "make_reader": "spark_hvd.spark.data.reader",
    "BatchReader": "spark_hvd.spark.data.reader",
}
"""Each public name and the module that defines it (imported on first use); spark_hvd.spark
exports them too."""

__all__ = list(EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS, globals())
