"""How a DataFrame's columns are stored for training: type checks, Vector and Decimal conversion,
the valid-row condition, and a small sample of real rows for the driver's dry run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["StoredColumn", "inspect_column", "is_vector", "is_vector_struct", "vector_as_array", "plan_columns", "quote", "is_float", "valid_rows", "to_arrays",
           "stack_rows", "sample_batch", "STACKED_FEATURES", "scalar_columns", "stacked_column"]

STACKED_FEATURES = "__spark_hvd_features"
"""The array column several numeric feature columns are stacked into, in their order, for a model
that takes one input (see :func:`stacked_column`)."""

_NUMPY_DTYPES = {
    "ByteType": "int8",
    "ShortType": "int16",
    "IntegerType": "int32",
    "LongType": "int64",
    "FloatType": "float32",
    "DoubleType": "float64",
    "BooleanType": "bool",
}


@dataclass(frozen=True)
class StoredColumn:
    """How one column is written: its kind, numpy dtype, source type, and a cast when one is needed."""

    name: str
    kind: str
    dtype: str
    spark_type: str
    cast: Optional[str] = None


def _type_error(name: str, type_text: str, problem: str, fix: str) -> ValueError:
    return ValueError(f"column {name!r} has type {type_text}, {problem}; fix: {fix}")


def inspect_column(name: str, dtype: Any, vector_dtype: str) -> StoredColumn:
    """How column ``name`` of Spark type ``dtype`` is stored, or a ValueError saying why it can't be."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.mllib.linalg import VectorUDT as OldVectorUDT
    from pyspark.sql import types as T

    text = dtype.simpleString()
    kind = type(dtype).__name__
    if kind in _NUMPY_DTYPES:
        return StoredColumn(name, "scalar", _NUMPY_DTYPES[kind], text)
    if isinstance(dtype, T.DecimalType):
        return StoredColumn(name, "scalar", "float64", text, cast="double")
    if isinstance(dtype, (VectorUDT, OldVectorUDT)):
        return StoredColumn(name, "vector", vector_dtype, text)
    if isinstance(dtype, T.ArrayType):
        element = type(dtype.elementType).__name__
        if element in _NUMPY_DTYPES:
            return StoredColumn(name, "array", _NUMPY_DTYPES[element], text)
        if isinstance(dtype.elementType, T.DecimalType):
            return StoredColumn(name, "array", "float64", text, cast="array<double>")
        if isinstance(dtype.elementType, (T.ArrayType, VectorUDT, OldVectorUDT)):
            raise _type_error(name, text, "a nested array, which is not supported",
                              "flatten it with pyspark.sql.functions.flatten and give the shape with "
                              "input_shapes")
        raise _type_error(name, text, "an array of non-numeric values",
                          "convert the elements to numbers before training")
    if is_vector_struct(dtype):  # a Vector written where its type is not kept (ORC, JSON)
        return StoredColumn(name, "vector", vector_dtype, text)
    if isinstance(dtype, T.StructType):
        raise _type_error(name, text, "a nested struct, which is not supported",
                          f"select its fields as separate columns (df.select('{name}.*')) or assemble "
                          "them with pyspark.ml.feature.VectorAssembler")
    if isinstance(dtype, T.MapType):
        raise _type_error(name, text, "a map, which is not supported",
                          "extract the needed keys into numeric columns")
    if isinstance(dtype, (T.StringType, T.VarcharType, T.CharType)):
        raise _type_error(name, text, "which is not numeric",
                          "index it with pyspark.ml.feature.StringIndexer or drop it from the columns")
    if isinstance(dtype, (T.DateType, T.TimestampType, T.TimestampNTZType)):
        raise _type_error(name, text, "which is not numeric",
                          "cast it to a number, e.g. pyspark.sql.functions.unix_timestamp")
    raise _type_error(name, text, "which is not numeric",
                      "convert it to numeric scalars, arrays of numbers or pyspark.ml Vectors")


def plan_columns(df: Any, feature_cols: Sequence[str], label_cols: Sequence[str],
                 sample_weight_col: Optional[str], validation: Any, vector_dtype: str) -> List[StoredColumn]:
    """How each needed column is stored; a ValueError naming a missing or unusable column (no Spark job)."""
    fields = {f.name: f.dataType for f in df.schema.fields}
    wanted: List[str] = []
    for c in list(feature_cols) + list(label_cols) + ([sample_weight_col] if sample_weight_col else []):
        if c not in wanted:
            wanted.append(c)
    for c in wanted + ([validation] if isinstance(validation, str) else []):
        if c not in fields:
            role = "validation column" if c == validation and c not in wanted else "column"
            raise ValueError(f"{role} {c!r} is not in the DataFrame; available columns: "
                             f"{', '.join(fields) or '(none)'}")
    planned = [inspect_column(c, fields[c], vector_dtype) for c in wanted]
    if sample_weight_col:
        weight = next(p for p in planned if p.name == sample_weight_col)
        if weight.kind != "scalar":
            raise ValueError(f"sample_weight_col {sample_weight_col!r} has type {weight.spark_type}: expected "
                             "a numeric scalar column (one weight per row)")
    if isinstance(validation, str):
        marker = inspect_column(validation, fields[validation], vector_dtype)
        if marker.kind != "scalar":
            raise ValueError(f"validation column {validation!r} has type {marker.spark_type}: expected a "
                             "boolean or 0/1 numeric column marking validation rows")
    return planned


def quote(name: str) -> str:
    """``name`` as a Spark SQL identifier (backquoted)."""
    return "`" + name.replace("`", "``") + "`"


def is_float(c: StoredColumn) -> bool:
    """Whether the column holds floating-point values (which can be NaN or infinite)."""
    return c.dtype in ("float32", "float64")


def bad_value(x: Any) -> Any:
    """Whether one numeric value is NaN or infinite (a Spark column expression)."""
    from pyspark.sql import functions as F

    return F.isnan(x) | (F.abs(x) == F.lit(float("inf")))


def valid_rows(planned: Sequence[StoredColumn]) -> Any:
    """A Spark condition true for rows with no null, NaN or infinite value in ``planned`` columns
    (as they are written: Vectors already arrays)."""
    from pyspark.sql import functions as F

    condition = F.lit(True)
    for c in planned:
        col = F.col(quote(c.name))
        condition = condition & col.isNotNull()
        if c.kind != "scalar":
            bad = (lambda x: x.isNull() | bad_value(x)) if is_float(c) else (lambda x: x.isNull())
            condition = condition & ~F.exists(col, bad)
        elif is_float(c):
            condition = condition & ~bad_value(col)
    return condition


_VECTOR_FIELDS = (("type", "tinyint"), ("size", "int"), ("indices", "array<int>"), ("values", "array<double>"))


def is_vector_struct(dtype: Any) -> bool:
    """Whether ``dtype`` is the struct a Spark ML Vector is made of, as formats that do not keep the
    Vector type (ORC, JSON) read it back."""
    from pyspark.sql import types as T

    return isinstance(dtype, T.StructType) and tuple(
        (f.name, f.dataType.simpleString()) for f in dtype.fields) == _VECTOR_FIELDS


def is_vector(dtype: Any) -> bool:
    """Whether ``dtype`` is a Spark ML (or MLlib) Vector."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.mllib.linalg import VectorUDT as OldVectorUDT

    return isinstance(dtype, (VectorUDT, OldVectorUDT))


def vector_as_array(column: Any, dtype: Any, vector_dtype: str = "float64") -> Any:
    """The array of a Vector column (a Vector, or its struct layout) of Spark type ``dtype``, in
    ``vector_dtype``; a null Vector gives null, where Spark's own conversion would fail the job."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    if is_vector(dtype):
        converted = vector_to_array(column, dtype=vector_dtype)
    else:  # type 1 is dense (values), 0 sparse (size, indices, values)
        dense = column["values"]
        sparse = F.transform(F.sequence(F.lit(0), column["size"] - 1), lambda i: F.coalesce(F.aggregate(
            F.arrays_zip(column["indices"].alias("k"), column["values"].alias("v")), F.lit(None).cast("double"),
            lambda acc, kv: F.coalesce(acc, F.when(kv["k"] == i, kv["v"]))), F.lit(0.0)))
        converted = F.when(column["type"] == 1, dense).otherwise(F.when(column["size"] > 0, sparse)
                                                                 .otherwise(F.array().cast("array<double>")))
        converted = converted.cast("array<float>" if vector_dtype == "float32" else "array<double>")
    return F.when(column.isNull(), F.lit(None)).otherwise(converted)


def to_arrays(df: Any, planned: Sequence[StoredColumn], vector_dtype: str) -> List[Any]:
    """Select expressions writing ``planned`` columns as stored: Vectors as arrays (null stays null,
    where Spark's own conversion would fail the job), decimals as doubles."""
    from pyspark.sql import functions as F

    fields = {f.name: f.dataType for f in df.schema.fields}
    exprs = []
    for c in planned:
        col = F.col(quote(c.name))
        if c.kind == "vector":
            col = vector_as_array(col, fields[c.name], vector_dtype)
        elif c.cast:
            col = col.cast(c.cast)
        exprs.append(col.alias(c.name))
    return exprs


def stack_rows(values: Any, column: str, dtype: Optional[str] = None) -> Any:
    """Per-row arrays of ``column`` as one (rows, n) matrix; a ValueError naming the column and the
    lengths when the rows differ."""
    import numpy as np

    if not len(values):
        return np.zeros((0, 0), dtype=dtype)
    rows = [np.asarray(v, dtype=dtype) for v in values]
    lengths = {len(r) for r in rows}
    if len(lengths) > 1:
        raise ValueError(f"column {column!r} has rows of different lengths ({min(lengths)} to {max(lengths)}): "
                         "expected the same length in every row; fix: pad or truncate the arrays")
    return np.stack(rows)


def sample_batch(df: Any, columns: Sequence[str], rows: int, vector_dtype: str = "float64") -> Dict[str, Any]:
    """Up to ``rows`` complete rows of ``columns`` as numpy arrays (one Spark job reading only as many
    rows as it needs); rows with a null are left out, as invalid values are reported elsewhere."""

    fields = {f.name: f.dataType for f in df.schema.fields}
    planned = [inspect_column(c, fields[c], vector_dtype) for c in dict.fromkeys(columns)]
    pdf = df.select(*to_arrays(df, planned, vector_dtype)).limit(rows).toPandas().dropna()
    batch: Dict[str, Any] = {}
    for c in planned:
        values = pdf[c.name].to_numpy()
        if c.kind != "scalar":
            values = stack_rows(values, c.name, c.dtype)
        batch[c.name] = values.astype(c.dtype, copy=False)
    return batch


def scalar_columns(schema: Any, columns: Sequence[str]) -> bool:
    """Whether every one of ``columns`` is in ``schema`` and holds one number per row."""
    fields = {f.name: f.dataType for f in schema.fields}
    try:
        return all(c in fields and inspect_column(c, fields[c], "float64").kind == "scalar" for c in columns)
    except ValueError:  # a column that cannot be a feature: the usual checks name it
        return False


def stacked_column(columns: Sequence[str], dtype: str) -> Any:
    """The numeric ``columns`` as one array column of ``dtype`` ('float32' or 'float64'), in their
    order: one (rows, len(columns)) input for a model of one input, as xgboost.spark takes a list
    of feature columns."""
    from pyspark.sql import functions as F

    element = "float" if dtype == "float32" else "double"
    return F.array(*[F.col(quote(c)).cast(element) for c in columns])
