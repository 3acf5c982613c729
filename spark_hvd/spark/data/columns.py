"""How a DataFrame's columns are stored for training: type checks, Vector and Decimal conversion,
the valid-row condition, and a small sample of real rows for the driver's dry run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["StoredColumn", "inspect_column", "plan_columns", "quote", "is_float", "valid_rows", "to_arrays",
           "sample_batch"]

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


def to_arrays(df: Any, planned: Sequence[StoredColumn], vector_dtype: str) -> List[Any]:
    """Select expressions writing ``planned`` columns as stored: Vectors as arrays (null stays null,
    where Spark's own conversion would fail the job), decimals as doubles."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    exprs = []
    for c in planned:
        col = F.col(quote(c.name))
        if c.kind == "vector":
            col = F.when(col.isNull(), F.lit(None)).otherwise(vector_to_array(col, dtype=vector_dtype))
        elif c.cast:
            col = col.cast(c.cast)
        exprs.append(col.alias(c.name))
    return exprs


def sample_batch(df: Any, columns: Sequence[str], rows: int, vector_dtype: str = "float64") -> Dict[str, Any]:
    """Up to ``rows`` complete rows of ``columns`` as numpy arrays (one Spark job reading only as many
    rows as it needs); rows with a null are left out, as invalid values are reported elsewhere."""
    import numpy as np

    fields = {f.name: f.dataType for f in df.schema.fields}
    planned = [inspect_column(c, fields[c], vector_dtype) for c in dict.fromkeys(columns)]
    pdf = df.select(*to_arrays(df, planned, vector_dtype)).limit(rows).toPandas().dropna()
    batch: Dict[str, Any] = {}
    for c in planned:
        values = pdf[c.name].to_numpy()
        if c.kind != "scalar":
            values = np.stack([np.asarray(v, dtype=c.dtype) for v in values]) if len(values) else np.zeros((0, 0))
        batch[c.name] = values.astype(c.dtype, copy=False)
    return batch
