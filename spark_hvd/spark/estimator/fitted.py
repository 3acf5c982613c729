"""What every fitted model (TorchModel, KerasModel, LightningModel) shares: ``transform`` over a
prediction UDF, output columns and their checks, the training history, and persistence."""

from __future__ import annotations

import sys
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

from pyspark.ml import Model
from pyspark.ml.util import MLReadable, MLWritable

from spark_hvd.spark.data.columns import STACKED_FEATURES, stacked_column
from spark_hvd.spark.estimator import checks
from spark_hvd.spark.estimator.inference import (InferencePlan, Predictor, allow_vector_inputs, feature_args,
                                                 output_is_scalar, prediction_udf, usable_args, usable_rows)
from spark_hvd.spark.estimator.outputs import ONE_VALUE_TASKS, check_task, column_kinds, spark_columns
from spark_hvd.spark.estimator.params import ModelParams
from spark_hvd.spark.estimator.persistence import ParamsReader, ParamsWriter

__all__ = ["FittedModel"]

_PACKED = "__spark_hvd_outputs"
_HOROVOD_NAMES = {"feature_columns": "feature_cols", "label_columns": "label_cols"}
"""Horovod's keyword for a fitted model's Param -> ours."""


class FittedModel(Model, ModelParams, MLReadable, MLWritable):
    """Base of the fitted models: a Spark ML Model whose ``transform`` runs a prediction UDF.

    ``transform`` checks the columns, resolves the features' shapes, tries the model on rows of
    zeros (outputs against the task), and adds the prediction UDF's columns; a framework supplies
    the hooks ``_check_model``, ``_dtype``, ``_shapes``, ``_dry_run``, ``_payload`` and ``_predictor``.
    """

    worker_modules: ClassVar[Tuple[str, ...]] = ()
    """Modules Spark's Python workers need besides spark_hvd's own to load and run the model."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fit_timings: Dict[str, float] = {}
        """Seconds fit() spent per phase (validation, materialization, launch, training,
        collection); empty for a model that was loaded or built by hand."""
        self.fit_summary: Dict[str, int] = {}
        """Rows fit() trained on (``train_rows``), validated on (``val_rows``) and left out with
        ``invalid_rows='skip'`` (``skipped_rows``); empty for a model that was loaded or built by hand."""
        self.mlflow_run_id: Optional[str] = None
        """The MLflow run this model's fit was logged to, if it was."""

    def setParams(self, **kwargs: Any) -> Any:
        """Set several Params by keyword. Horovod's constructor names of the fitted models are
        taken too: ``feature_columns`` for ``feature_cols`` and ``label_columns`` for ``label_cols``."""
        for horovod_name, ours in _HOROVOD_NAMES.items():
            if horovod_name in kwargs:
                if ours in kwargs:
                    raise ValueError(f"{type(self).__name__} got both {horovod_name}= and {ours}=, which name the "
                                     f"same Param ({ours}); pass one of them")
                kwargs[ours] = kwargs.pop(horovod_name)
        return super().setParams(**kwargs)

    def _raw_outputs(self) -> bool:
        """Whether transform adds raw output columns next to a task's (``output_cols`` set, as Horovod's)."""
        return self.getTask() != "none" and self.isSet(self.output_cols)

    def getFeatureColumns(self) -> List[str]:
        """Horovod's name for :meth:`getFeatureCols`."""
        return self.getFeatureCols()

    def getLabelColumns(self) -> List[str]:
        """Horovod's name for :meth:`getLabelCols`."""
        return self.getLabelCols()

    def setFeatureColumns(self, value: List[str]) -> Any:
        """Horovod's name for :meth:`setFeatureCols`."""
        return self.setFeatureCols(value)

    def setLabelColumns(self, value: List[str]) -> Any:
        """Horovod's name for :meth:`setLabelCols`."""
        return self.setLabelCols(value)

    def getOutputCols(self) -> List[str]:
        """Prediction column of each label: ``output_cols`` when set, else ``<label>__output``."""
        cols = self.getOrDefault(self.output_cols)
        if cols:
            return list(cols)
        return [f"{label}__output" for label in (self.getLabelCols() or [])]

    # ---- hooks ----------------------------------------------------------------------------
    def _check_model(self, model: Any) -> None:
        """ValueError unless ``model`` is the framework's model."""
        raise NotImplementedError

    def _dtype(self, model: Any) -> str:
        """numpy name of the floating dtype the model takes."""
        raise NotImplementedError

    def _shapes(self, model: Any, feature_cols: List[str], sizes: List[int]) -> List[Tuple[int, ...]]:
        """Per-row shape of each feature as the model takes it, for columns of ``sizes`` values per row."""
        return checks.known_shapes(self.getInputShapes(), feature_cols, sizes)

    def _dry_run(self, model: Any, shapes: List[Tuple[int, ...]], outputs: int, dtype: str) -> List[Tuple[int, ...]]:
        """Per-row shape of each of the model's ``outputs`` outputs, from two rows of zeros."""
        raise NotImplementedError

    def _payload(self, model: Any) -> Tuple[str, bytes]:
        """The model's key (for the workers' cache) and the bytes that travel in the UDF's closure."""
        raise NotImplementedError

    def _predictor(self) -> Predictor:
        """What loads and runs the model in a Spark Python worker."""
        raise NotImplementedError

    # ---- Spark ML -------------------------------------------------------------------------
    def _transform(self, dataset: Any) -> Any:
        from spark_hvd.spark.session import session_info

        model = self.getModel()
        self._check_model(model)
        feature_cols, output_cols = self._check_columns(dataset)
        session = dataset.sparkSession
        checks.ensure_executor_python(session, session_info(session), self.worker_modules)
        dtype = self._dtype(model)
        given = self.getInputShapes()
        stacked = len(feature_cols) > 1 and given is not None and len(given) == 1
        if stacked:  # fitted on the numeric columns stacked into one input, in order
            dataset = dataset.withColumn(STACKED_FEATURES, stacked_column(feature_cols, dtype))
            feature_cols = [STACKED_FEATURES]
        shapes = self._shapes(model, feature_cols, self._input_sizes(dataset, feature_cols))
        row_shapes = self._dry_run(model, shapes, len(output_cols), dtype)
        check_task(self.getTask(), row_shapes)
        scalar = tuple(output_is_scalar(s) for s in row_shapes)
        key, payload = self._payload(model)
        plan = InferencePlan(
            key=key, feature_cols=tuple(feature_cols), input_shapes=tuple(tuple(s) for s in shapes),
            output_cols=tuple(output_cols), scalar_outputs=scalar, batch_size=self.getInferenceBatchSize(),
            dtype=dtype, sys_path=tuple(p for p in sys.path if isinstance(p, str)), task=self.getTask(),
            raw_outputs=self._raw_outputs())
        allow_vector_inputs(session, dataset.schema, feature_cols)
        args = feature_args(dataset.schema, feature_cols, dtype)
        valid = None
        if self.getInvalidRows() != "error":
            valid = usable_rows(dataset.schema, feature_cols, args, shapes, dtype)
            if self.getInvalidRows() == "skip":
                dataset, valid = dataset.filter(valid), None
            else:  # 'keep': the model sees zeros in those rows, whose predictions become null
                args = usable_args(dataset.schema, feature_cols, args, shapes, dtype, valid)
        predicted = prediction_udf(plan, payload, self._predictor())(*args)
        result = self._add_predictions(dataset, predicted, output_cols, scalar, valid)
        return result.drop(STACKED_FEATURES) if stacked else result

    # ---- checks ---------------------------------------------------------------------------
    def _check_columns(self, df: Any) -> Tuple[List[str], List[str]]:
        """(feature_cols, output_cols) after checking them against ``df``'s schema."""
        from spark_hvd.spark.data.columns import inspect_column

        feature_cols = self.getFeatureCols()
        checks.require("feature_cols", feature_cols, "the model's input columns", "['features']")
        output_cols = self.getOutputCols()
        if not output_cols:
            raise ValueError("output_cols and label_cols are both unset: expected the name of each prediction "
                             "column; fix: setOutputCols(['prediction']) or set label_cols")
        labels = self.getLabelCols()
        if labels and len(output_cols) != len(labels):
            raise ValueError(f"output_cols={output_cols} has {len(output_cols)} names for {len(labels)} label "
                             f"column(s) {labels}: expected one output column per label column")
        new_cols = self._new_columns(output_cols)
        if len(set(new_cols)) != len(new_cols):
            raise ValueError(f"prediction columns {new_cols} repeat a name: expected distinct names; fix: "
                             "setPredictionCol / setProbabilityCol / setRawPredictionCol")
        fields = {f.name: f.dataType for f in df.schema.fields}
        for col in feature_cols:
            if col not in fields:
                raise ValueError(f"feature column {col!r} is not in the DataFrame; available columns: "
                                 f"{', '.join(fields) or '(none)'}; fix: add it or set feature_cols")
            inspect_column(col, fields[col], "float32")  # raises for strings, structs, nested arrays
        clash = [c for c in new_cols if c in fields]
        if clash:
            setter = "setPredictionCol(...) and the like" if self._task_columns() else "setOutputCols([...])"
            raise ValueError(f"output column(s) {clash} already exist in the DataFrame: expected new names; fix: "
                             f"{setter} with other names, or drop those columns first")
        return list(feature_cols), output_cols

    def _new_columns(self, output_cols: List[str]) -> List[str]:
        """The columns transform() adds, in order."""
        return (self._task_columns() + (output_cols if self._raw_outputs() else [])) or output_cols

    def _task_columns(self) -> List[str]:
        """Names of the Spark ML columns transform() adds for the task, in the UDF's field order."""
        names = {"prediction": self.getPredictionCol(), "probability": self.getProbabilityCol(),
                 "raw_prediction": self.getRawPredictionCol()}
        return [names[role] for role, _ in column_kinds(self.getTask())]

    def _input_sizes(self, df: Any, feature_cols: List[str]) -> List[int]:
        """Values per row of each feature column: from the schema, else from ``input_shapes``,
        else from one row of data."""
        shapes = self.getInputShapes()
        sizes = checks.schema_row_sizes(df.schema, feature_cols)
        if shapes is not None and len(shapes) == len(feature_cols) and all(-1 not in s for s in shapes):
            sizes = [max(1, _size(s)) if z is None else z for s, z in zip(shapes, sizes)]
        if any(z is None for z in sizes):
            sizes = checks.sizes_from_data(df, feature_cols, sizes)
        return [int(z) for z in sizes]  # type: ignore[arg-type]

    # ---- the UDF's columns ----------------------------------------------------------------
    def _add_predictions(self, dataset: Any, predicted: Any, output_cols: List[str],
                         scalar: Sequence[bool], valid: Any = None) -> Any:
        """``dataset`` with the columns of the prediction UDF's result ``predicted`` (see
        :func:`spark_hvd.spark.estimator.inference.prediction_udf`): the task's Spark ML columns, or one raw
        output column per label (dense Vectors where an output has several values per row); null in
        the rows where the condition ``valid`` (when given) is false."""
        from pyspark.ml.functions import array_to_vector
        from pyspark.sql import functions as F

        if valid is not None:
            predicted = F.when(valid, predicted)
            return self._add_predictions(dataset, predicted, output_cols, scalar).select(
                *[F.col(f"`{c}`") for c in dataset.columns],
                *[F.when(valid, F.col(f"`{c}`")).alias(c) for c in self._new_columns(output_cols)])
        task = self.getTask()
        if task in ONE_VALUE_TASKS:
            # The UDF returns the model's one value per row; Spark makes the columns from it.
            result = dataset.withColumn(_PACKED, predicted)
            value = F.col(_PACKED)
            made = spark_columns(task, value)
            columns = [made[role].alias(name) for (role, _), name in zip(column_kinds(task), self._task_columns())]
            if self._raw_outputs():
                columns.append(value.alias(output_cols[0]))
            return result.select(*[F.col(f"`{c}`") for c in dataset.columns], *columns)
        if task != "none":
            result = dataset.withColumn(_PACKED, predicted)
            columns = []
            for (role, kind), name in zip(column_kinds(task), self._task_columns()):
                column = F.col(_PACKED)[role]
                columns.append((array_to_vector(column) if kind == "vector" else column).alias(name))
            if self._raw_outputs():
                for i, (name, is_scalar) in enumerate(zip(output_cols, scalar)):
                    column = F.col(_PACKED)[f"o{i}"]
                    columns.append((column if is_scalar else array_to_vector(column)).alias(name))
            return result.select(*[F.col(f"`{c}`") for c in dataset.columns], *columns)
        if len(output_cols) == 1:
            result = dataset.withColumn(output_cols[0], predicted)
        else:
            result = dataset.withColumn(_PACKED, predicted)
            result = result.select(*[F.col(f"`{c}`") for c in dataset.columns],
                                   *[F.col(_PACKED)[f"o{i}"].alias(c) for i, c in enumerate(output_cols)])
        for col, is_scalar in zip(output_cols, scalar):
            if not is_scalar:
                result = result.withColumn(col, array_to_vector(F.col(f"`{col}`")))
        return result

    # ---- history ---------------------------------------------------------------------------
    def history_frame(self) -> Any:
        """The per-epoch history as a pandas DataFrame indexed by epoch (one column per metric)."""
        import pandas as pd

        frame = pd.DataFrame(list(self.getHistory() or []))
        return frame.set_index("epoch") if "epoch" in frame.columns else frame

    def plot_history(self, metrics: Optional[List[str]] = None, ax: Any = None) -> Any:
        """Plot loss and metrics per epoch (training solid, validation dashed) with matplotlib;
        returns the Axes. ``metrics`` picks the training metrics (default: all of them)."""
        try:
            import matplotlib.pyplot as plt
            from matplotlib.ticker import MaxNLocator
        except ImportError:
            raise ImportError("plot_history() needs matplotlib: pip install matplotlib") from None
        frame = self.history_frame()
        if frame.empty:
            raise ValueError("the model has no history to plot: expected a model returned by fit(); "
                             "history_frame() shows what there is")
        names = metrics or [c for c in frame.columns if not c.startswith("val_")
                            and c not in ("rows_per_s", "seconds", "profile")]
        if ax is None:
            # Constrained layout keeps the axis labels inside the figure, also in savefig.
            _, ax = plt.subplots(figsize=(6, 3.5), layout="constrained")
        for name in names:
            line, = ax.plot(frame.index, frame[name], marker="o", label=name)
            if f"val_{name}" in frame.columns:
                ax.plot(frame.index, frame[f"val_{name}"], marker="o", linestyle="--", color=line.get_color(),
                        label=f"val_{name}")
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
        ax.set_title(f"run {self.getRunId()}" if self.getRunId() else "training history")
        ax.legend()
        return ax

    # ---- persistence -----------------------------------------------------------------------
    def write(self) -> ParamsWriter:
        """A writer saving this model (``.save(path)``; ``.overwrite()`` to replace)."""
        return ParamsWriter(self)

    @classmethod
    def read(cls) -> ParamsReader[Any]:
        """A reader loading a saved model of this class (``<Class>.load(path)`` is the short form)."""
        return ParamsReader(cls)

    def copy(self, extra: Optional[Dict[Any, Any]] = None) -> Any:
        """A copy sharing the framework's model object, with ``extra`` Params set."""
        that = super().copy(extra)
        that.fit_timings = dict(self.fit_timings)
        that.fit_summary = dict(self.fit_summary)
        that.mlflow_run_id = self.mlflow_run_id
        return that


def _size(shape: Any) -> int:
    size = 1
    for d in shape:
        size *= int(d)
    return size
