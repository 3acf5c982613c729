"""Batched inference over Arrow for the models' ``transform`` (TorchModel, KerasModel).

The prediction runs in a scalar-iterator Arrow UDF (``arrow_udf``, Spark 4.1+; a pandas UDF on
older Spark), Spark's Arrow-based batch interface for column functions: only the feature columns
travel to Python as Arrow record batches; the other columns stay in the JVM and the predictions
are appended to them. A ``mapInArrow`` pass would ship every column through Python and back,
which with Spark ML Vector columns in the frame takes about three times as long. The serialized
model travels in the UDF's closure (Spark broadcasts large closures itself, on classic and
Connect sessions alike); each Python worker deserializes it once (and keeps it while the worker
is reused), then predicts ``batch_size`` rows per forward pass. What is framework-specific
(deserializing the model, choosing its device, calling it) is a :class:`Predictor`.
"""

from __future__ import annotations

import logging
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator, List, Protocol, Sequence, Tuple

import numpy as np
import pandas as pd
import pyarrow as pa

from spark_hvd.spark.data.columns import bad_value, inspect_column, is_float, is_vector, quote, stack_rows, vector_as_array
from spark_hvd.spark.estimator.outputs import ONE_VALUE_TASKS, column_kinds, standard_columns

__all__ = ["InferencePlan", "Predictor", "output_is_scalar", "prediction_udf", "feature_args", "allow_vector_inputs",
           "usable_rows", "usable_args"]

log = logging.getLogger("spark_hvd.spark")

_FIX = ("clean them before transform() (DataFrame.fillna, DataFrame.dropna, a filter), or set the model's "
        "invalid_rows='skip' to leave those rows out or 'keep' for null predictions in them")

_CACHE_SIZE = 2
_models: "OrderedDict[Tuple[str, str], Any]" = OrderedDict()
"""Deserialized models of this worker process, by (model key, device)."""


@dataclass(frozen=True)
class InferencePlan:
    """What the workers need besides the model; plain values, shipped in the UDF's closure."""

    key: str
    """Identity of the serialized model, for the per-worker cache."""
    feature_cols: Tuple[str, ...]
    """Names of the feature columns, for error messages."""
    input_shapes: Tuple[Tuple[int, ...], ...]
    """Per-row shape of each input."""
    output_cols: Tuple[str, ...]
    scalar_outputs: Tuple[bool, ...]
    """Per output: one value per row (a double column) or several (an array column)."""
    batch_size: int
    dtype: str
    """numpy name of the dtype the model takes, e.g. 'float32'."""
    sys_path: Tuple[str, ...]
    """The driver's sys.path, so model classes imported there import here too."""
    task: str = "none"
    """The Spark ML columns to compute from the single output (see ``spark_hvd.spark.estimator.outputs``)."""
    raw_outputs: bool = False
    """With a task, also the raw output of each label (fields ``o0, o1, ...``): ``output_cols`` was set."""
    fix: str = _FIX
    """How to get past rows the model cannot take, for the errors that name them."""


def output_is_scalar(row_shape: Sequence[int]) -> bool:
    """Whether an output with per-row shape ``row_shape`` becomes one double per row."""
    return int(np.prod([int(d) for d in row_shape])) == 1


class Predictor(Protocol):
    """The framework's part of inference; instances travel in the UDF's closure (pickled)."""

    def device(self) -> str:
        """Where this worker runs the model (e.g. 'cpu', 'cuda:0'); part of the cache key."""

    def load(self, payload: Any, device: str) -> Any:
        """The model deserialized from ``payload``, ready to predict on ``device``."""

    def predict(self, model: Any, device: str, plan: "InferencePlan", columns: List[np.ndarray]) -> List[np.ndarray]:
        """Each output for the rows of ``columns`` (one array per feature column), as float64
        arrays of shape (rows, values per row), predicting ``plan.batch_size`` rows at a time."""


def _load(plan: InferencePlan, payload: Any, predictor: Predictor) -> Tuple[Any, str]:
    device = predictor.device()
    key = (plan.key, device)
    if key in _models:
        _models.move_to_end(key)
        return _models[key], device
    sys.path.extend(p for p in plan.sys_path if p not in sys.path)
    model = predictor.load(payload, device)
    _models[key] = model
    while len(_models) > _CACHE_SIZE:
        _models.popitem(last=False)
    return model, device


def _nulls(column: str, rows: int, fix: str) -> ValueError:
    return ValueError(f"feature column {column!r} has null values in {rows} rows of a batch: expected a value in every "
                      f"row; fix: {fix}")


def _width(shape: Sequence[int]) -> int:
    return int(np.prod(shape)) if len(shape) else 1


def _check_lengths(lengths: np.ndarray, column: str, shape: Sequence[int], fix: str) -> None:
    """A ValueError when rows of an array feature do not hold the values the model takes per row."""
    wrong = lengths != _width(shape)
    if np.any(wrong):
        raise ValueError(f"feature column {column!r} has {int(np.count_nonzero(wrong))} rows of a batch with "
                         f"{int(lengths[wrong][0])} values where the model takes {_width(shape)} per row (input shape "
                         f"{tuple(shape)}): expected the column the model was fitted on; fix: {fix}")


def _checked_values(values: np.ndarray, column: str, shape: Sequence[int], fix: str) -> np.ndarray:
    """``values`` of one feature column after the checks the model's input needs: rows of the length
    ``shape`` holds, and no NaN or infinity; a ValueError naming the column, the rows and the fix."""
    if values.ndim == 2:
        _check_lengths(np.full(len(values), values.shape[1]), column, shape, fix)
    if values.dtype.kind == "f":
        finite = np.isfinite(values)
        bad = int(np.count_nonzero(~finite if finite.ndim == 1 else ~finite.all(axis=tuple(range(1, finite.ndim)))))
        if bad:
            raise ValueError(f"feature column {column!r} has NaN or infinite values in {bad} rows of a batch of "
                             f"{len(values)}: expected finite numbers; fix: {fix}")
    return values


def _series_to_numpy(series: pd.Series, column: str, shape: Sequence[int], fix: str = _FIX) -> np.ndarray:
    """A feature column's batch as an ndarray: (rows,) for scalars, (rows, n) for arrays."""
    nulls = int(series.isna().sum())
    if nulls:
        raise _nulls(column, nulls, fix)
    values = series.to_numpy()
    if values.dtype == object:  # array columns arrive as one ndarray per row
        _check_lengths(np.array([len(v) for v in values]), column, shape, fix)
        values = stack_rows(values, column)
    return _checked_values(values, column, shape, fix)


def _arrow_to_numpy(array: Any, column: str, shape: Sequence[int], fix: str = _FIX) -> np.ndarray:
    import pyarrow.compute as pc

    from spark_hvd.spark.data.reader import arrow_to_numpy

    nulls = array.null_count + (array.flatten().null_count if pa.types.is_list(array.type) else 0)
    if nulls:
        raise _nulls(column, nulls, fix)
    if pa.types.is_list(array.type) and len(array):
        _check_lengths(np.asarray(pc.list_value_length(array)), column, shape, fix)
    return _checked_values(arrow_to_numpy(array, None, column), column, shape, fix)


def _arrow_output(values: np.ndarray, scalar: bool) -> Any:
    if scalar:
        return pa.array(values[:, 0])
    rows, width = values.shape
    offsets = pa.array(np.arange(0, (rows + 1) * width, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1)))


def _task_fields(plan: InferencePlan, values: np.ndarray) -> List[Tuple[str, np.ndarray, bool]]:
    """(field name, values, scalar) of each Spark ML column of the task, in ``column_kinds`` order."""
    columns = standard_columns(plan.task, values)
    return [(role, columns[role], kind == "double") for role, kind in column_kinds(plan.task)]


def _raw_fields(plan: InferencePlan, predicted: List[np.ndarray]) -> List[Tuple[str, np.ndarray, bool]]:
    """(field, values, scalar) of each raw output next to a task's columns, when asked for."""
    if not plan.raw_outputs:
        return []
    return [(f"o{i}", v, s) for i, (v, s) in enumerate(zip(predicted, plan.scalar_outputs))]


def _series(values: np.ndarray, scalar: bool) -> pd.Series:
    return pd.Series(values[:, 0]) if scalar else pd.Series(list(values))


@dataclass(frozen=True)
class _Format:
    """How one kind of UDF batch (Arrow arrays, pandas Series) is read and written."""

    to_numpy: Any
    """(batch column, column name, input shape, fix) -> the column as numpy."""
    values: Any
    """(1-D numpy values) -> one output column of one value per row."""
    column: Any
    """(2-D numpy values, scalar) -> one output column."""
    table: Any
    """(names, columns) -> one struct output of several columns."""


_ARROW = _Format(to_numpy=_arrow_to_numpy, values=pa.array, column=_arrow_output,
                 table=lambda names, columns: pa.StructArray.from_arrays(columns, names=names))
_PANDAS = _Format(to_numpy=_series_to_numpy, values=pd.Series, column=_series,
                  table=lambda names, columns: pd.DataFrame(dict(zip(names, columns))))


def _predict(form: _Format, plan: InferencePlan, payload: Any, predictor: Predictor,
             batches: Iterator[Any]) -> Iterator[Any]:
    model, device = _load(plan, payload, predictor)
    for batch in batches:
        parts = batch if isinstance(batch, tuple) else (batch,)
        columns = [form.to_numpy(v, c, s, plan.fix) for v, c, s in zip(parts, plan.feature_cols, plan.input_shapes)]
        predicted = predictor.predict(model, device, plan, columns)
        if plan.task in ONE_VALUE_TASKS:
            yield form.values(predicted[0].reshape(-1))
        elif plan.task != "none":
            fields = _task_fields(plan, predicted[0]) + _raw_fields(plan, predicted)
            yield form.table([name for name, _, _ in fields], [form.column(v.reshape(len(v), -1), s)
                                                               for _, v, s in fields])
        else:
            outputs = [form.column(v, s) for v, s in zip(predicted, plan.scalar_outputs)]
            yield outputs[0] if len(outputs) == 1 else form.table([f"o{i}" for i in range(len(outputs))], outputs)


def prediction_udf(plan: InferencePlan, payload: Any, predictor: Predictor) -> Any:
    """The UDF predicting from the feature arguments: for a task of one value per row
    (``ONE_VALUE_TASKS``), that value as a double, from which Spark makes the task's columns; for
    another task, a struct with one field per Spark ML column role; else a double or
    array<double> column for one output, a struct with fields ``o0, o1, ...`` for several."""
    from pyspark.sql.types import ArrayType, DataType, DoubleType, StructField, StructType

    return_type: DataType
    if plan.task in ONE_VALUE_TASKS:
        return_type = DoubleType()
    elif plan.task != "none":
        fields = [StructField(role, DoubleType() if kind == "double" else ArrayType(DoubleType()))
                  for role, kind in column_kinds(plan.task)]
        if plan.raw_outputs:
            fields += [StructField(f"o{i}", DoubleType() if s else ArrayType(DoubleType()))
                       for i, s in enumerate(plan.scalar_outputs)]
        return_type = StructType(fields)
    else:
        types: List[DataType] = [DoubleType() if s else ArrayType(DoubleType()) for s in plan.scalar_outputs]
        return_type = types[0] if len(types) == 1 else StructType(
            [StructField(f"o{i}", t) for i, t in enumerate(types)])
    single = len(plan.feature_cols) == 1
    # Spark picks the UDF kind from the type hints, so each arity gets its own exact signature.
    try:
        from pyspark.sql.functions import arrow_udf
    except ImportError:  # Spark before 4.1: the same batches, converted to pandas on the way
        from pyspark.sql.functions import pandas_udf

        def pandas_one(batches: Iterator[pd.Series]) -> Iterator[pd.Series]:
            return _predict(_PANDAS, plan, payload, predictor, batches)

        def pandas_many(batches: Iterator[Tuple[pd.Series, ...]]) -> Iterator[pd.Series]:
            return _predict(_PANDAS, plan, payload, predictor, batches)

        return pandas_udf(pandas_one if single else pandas_many, return_type)  # type: ignore[call-overload]

    def arrow_one(batches: Iterator[pa.Array]) -> Iterator[pa.Array]:
        return _predict(_ARROW, plan, payload, predictor, batches)

    def arrow_many(batches: Iterator[Tuple[pa.Array, ...]]) -> Iterator[pa.Array]:
        return _predict(_ARROW, plan, payload, predictor, batches)

    return arrow_udf(arrow_one if single else arrow_many, return_type)


_COLUMNAR_INPUT = "spark.sql.execution.arrow.pythonUDF.columnarInput.enabled"
"""Spark 4.1+: Arrow UDFs read a columnar scan's batches directly, which cannot carry a Vector (a
UDT): over a Parquet table with a stored Vector column the UDF fails with UNSUPPORTED_DATATYPE."""


def allow_vector_inputs(session: Any, schema: Any, feature_cols: Sequence[str]) -> None:
    """Make the prediction UDF take Vector feature columns from any source: when one is a Vector,
    turn off Spark's columnar UDF input for the session (rows then reach the UDF the way they do
    from an in-memory frame; the Vector becomes an array first, see :func:`feature_args`)."""
    fields = {f.name: f.dataType for f in schema.fields}
    if not any(is_vector(fields[col]) for col in feature_cols):
        return
    try:
        if str(session.conf.get(_COLUMNAR_INPUT, "true")).lower() != "false":
            session.conf.set(_COLUMNAR_INPUT, "false")
    except Exception as exc:  # a Spark without the setting reads rows already
        log.debug("could not set %s: %s", _COLUMNAR_INPUT, exc)


def feature_args(schema: Any, feature_cols: Sequence[str], dtype: str) -> List[Any]:
    """The UDF's arguments: each feature column, Spark ML Vectors as arrays of ``dtype`` (a
    Vector would reach Python as a struct to decode row by row) and decimals (scalars or arrays)
    as doubles, the way ``fit`` stores them."""
    from pyspark.sql import functions as F

    fields = {f.name: f.dataType for f in schema.fields}
    args = []
    for col in feature_cols:
        column = F.col(quote(col))
        stored = inspect_column(col, fields[col], dtype)
        if stored.kind == "vector":
            # A null array reaches the UDF, which names the column.
            column = vector_as_array(column, fields[col], "float64" if dtype == "float64" else "float32")
        elif stored.cast:  # decimals become doubles, as fit() stores them
            column = column.cast(stored.cast)
        args.append(column)
    return args


def usable_rows(schema: Any, feature_cols: Sequence[str], args: Sequence[Any], shapes: Sequence[Sequence[int]],
                dtype: str) -> Any:
    """A Spark condition true for the rows whose feature arguments (``args``, see :func:`feature_args`)
    the model can take: no null, NaN or infinite value, and arrays of the length of ``shapes``."""
    from pyspark.sql import functions as F

    fields = {f.name: f.dataType for f in schema.fields}
    condition = F.lit(True)
    for col, arg, shape in zip(feature_cols, args, shapes):
        stored = inspect_column(col, fields[col], dtype)
        condition = condition & arg.isNotNull()
        floats = is_float(stored) or stored.cast is not None
        if stored.kind != "scalar":
            bad = (lambda x: x.isNull() | bad_value(x)) if floats else (lambda x: x.isNull())
            condition = condition & (F.size(arg) == F.lit(_width(shape))) & ~F.exists(arg, bad)
        elif floats:
            condition = condition & ~bad_value(arg)
    return condition


def usable_args(schema: Any, feature_cols: Sequence[str], args: Sequence[Any], shapes: Sequence[Sequence[int]],
                dtype: str, valid: Any) -> List[Any]:
    """``args`` with zeros of the model's input shape in the rows where ``valid`` is false, so the
    model runs on every row (their predictions are then set to null)."""
    from pyspark.sql import functions as F

    fields = {f.name: f.dataType for f in schema.fields}
    replaced = []
    for col, arg, shape in zip(feature_cols, args, shapes):
        stored = inspect_column(col, fields[col], dtype)
        if stored.kind == "vector":
            type_text = "array<double>" if dtype == "float64" else "array<float>"
        else:
            type_text = stored.cast or fields[col].simpleString()
        zero = (F.array_repeat(F.lit(0), _width(shape)) if stored.kind != "scalar" else F.lit(0)).cast(type_text)
        replaced.append(F.when(valid, arg).otherwise(zero))
    return replaced
