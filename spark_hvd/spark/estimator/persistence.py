"""Spark ML persistence for the estimators and models (MLWriter / MLReader).

A saved instance is a directory Spark writes through its Hadoop filesystems (so any path Spark
can write works, local, HDFS, S3, DBFS): ``metadata/`` is Spark's standard JSON metadata with
the JSON-valued Params, so ``Pipeline`` and ``PipelineModel`` find the class to load; ``objects/``
is Parquet holding the cloudpickle of the other Params (model, optimizer, loss, store...),
in chunks.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Generic, Type, TypeVar

import cloudpickle
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

__all__ = ["ParamsWriter", "ParamsReader", "write_blob", "read_blob"]

T = TypeVar("T")

_CHUNK_BYTES = 4 * 1024 * 1024
_OBJECTS_DIR = "objects"


def write_blob(spark: Any, path: str, data: bytes) -> None:
    """Write ``data`` as Parquet rows ``(index, chunk)`` at ``path`` through Spark."""
    from pyspark.sql.types import BinaryType, IntegerType, StructField, StructType

    chunks = [(i, bytearray(data[start:start + _CHUNK_BYTES]))
              for i, start in enumerate(range(0, max(len(data), 1), _CHUNK_BYTES))]
    schema = StructType([StructField("index", IntegerType(), False), StructField("chunk", BinaryType(), False)])
    spark.createDataFrame(chunks, schema).coalesce(1).write.mode("overwrite").parquet(path)


def read_blob(spark: Any, path: str) -> bytes:
    """The bytes written by :func:`write_blob` at ``path``."""
    rows = spark.read.parquet(path).orderBy("index").collect()
    return b"".join(bytes(row["chunk"]) for row in rows)


class ParamsWriter(MLWriter):
    """Saves a generated-Params instance: JSON Params as metadata, the others pickled."""

    def __init__(self, instance: Any) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        instance = self.instance
        json_params: Dict[str, Any] = {}
        objects: Dict[str, Any] = {}
        for spec in instance.param_specs():
            param = instance.getParam(spec.name)
            if not instance.isSet(param):
                continue
            value = instance.getOrDefault(param)
            if spec.json:
                json_params[spec.name] = value
            else:
                objects[spec.name] = value
        spark = self.sparkSession
        metadata = DefaultParamsWriter._get_metadata_to_save(instance, spark, paramMap=json_params)
        # Spark's own metadata writer refuses an existing directory; each part is replaced here
        # instead, so overwrite() works without the JVM helper Spark Connect lacks.
        mode = "overwrite" if self.shouldOverwrite else "error"
        spark.createDataFrame([(metadata,)], schema=["value"]).coalesce(1).write.mode(mode).text(
            os.path.join(path, "metadata"))
        write_blob(spark, os.path.join(path, _OBJECTS_DIR), _dumps(objects))

    def _handleOverwrite(self, path: str) -> None:
        """Nothing to clear first: :meth:`saveImpl` replaces each part it writes."""


def _dumps(objects: Dict[str, Any]) -> bytes:
    try:
        return cloudpickle.dumps(objects)
    except Exception as exc:
        raise ValueError(f"cannot save parameters {sorted(objects)}: pickling them failed ({exc}); expected picklable "
                         "values (no open sessions, sockets or locks in the model, loss or callbacks)") from None


class ParamsReader(MLReader, Generic[T]):
    """Loads what :class:`ParamsWriter` saved into a new instance of ``cls``."""

    def __init__(self, cls: Type[T]) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> T:
        expected = f"{self.cls.__module__}.{self.cls.__name__}"
        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession, expected)
        instance = self.cls()
        instance._resetUid(metadata["uid"])  # type: ignore[attr-defined]
        DefaultParamsReader.getAndSetParams(instance, metadata)
        # Saved by this project's ParamsWriter next to the metadata it just read.
        objects = cloudpickle.loads(read_blob(self.sparkSession, os.path.join(path, _OBJECTS_DIR)))
        instance._set(**objects)  # type: ignore[attr-defined]
        return instance
