"""Spark ML persistence of TorchEstimator and TorchModel: the shared writer and reader of :mod:`spark_hvd.spark.persistence`."""

from spark_hvd.spark.persistence import ParamsReader, ParamsWriter, read_blob, write_blob

__all__ = ["ParamsWriter", "ParamsReader", "write_blob", "read_blob"]
