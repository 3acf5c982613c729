"""TorchModel: a trained torch model as a Spark ML Model with batched Arrow inference."""

from __future__ import annotations

import copy
import hashlib
import sys
from typing import Any, Dict, List, Optional, Tuple

import cloudpickle
import torch
from pyspark.ml import Model
from pyspark.ml.util import MLReadable, MLWritable

from spark_hvd.spark.outputs import check_task, column_kinds
from spark_hvd.spark.params import ModelParams
from spark_hvd.spark.session import session_info
from spark_hvd.spark.torch import checks
from spark_hvd.spark.torch.batches import model_dtype
from spark_hvd.spark.torch.persistence import ParamsReader, ParamsWriter
from spark_hvd.spark.torch.transform import InferencePlan, feature_args, output_is_scalar, prediction_udf

__all__ = ["TorchModel"]


def _cpu_model(model: torch.nn.Module) -> torch.nn.Module:
    if all(t.device.type == "cpu" for t in list(model.parameters()) + list(model.buffers())):
        return model
    return copy.deepcopy(model).cpu()


class TorchModel(Model, ModelParams, MLReadable, MLWritable):
    """A fitted torch model; ``transform(df)`` adds Spark ML's prediction columns.

    Params (keyword-only constructor, ``getX``/``setX`` accessors): ``model``, ``feature_cols``,
    ``label_cols``, ``task``, ``prediction_col``, ``probability_col``, ``raw_prediction_col``,
    ``output_cols`` (raw outputs when ``task`` is 'none', default ``<label>__output``),
    ``input_shapes``, ``inference_batch_size`` (rows per forward pass, default 1024), ``run_id``,
    ``history`` (one dict per epoch: loss, metrics, ``val_`` metrics, rows_per_s, seconds).

    For a classification task ``transform`` adds ``rawPrediction`` and ``probability`` (Vectors)
    and ``prediction`` (the class index), for regression ``prediction``, as Spark ML's own models
    do, so its evaluators work unchanged; with ``task='none'`` one raw output column per label
    (a double for one value per row, else a dense Vector). It feeds the feature columns (numeric
    scalars, arrays or Spark ML Vectors) to the model over Arrow (an Arrow UDF: only the features
    leave the JVM), cast to the model's dtype, in batches of ``inference_batch_size`` rows; the
    model travels with the UDF and is loaded once per Python worker, on the task's GPU when Spark
    assigned one; classic and Spark Connect sessions alike. Saved with ``write().save(path)`` / loaded with
    ``TorchModel.load(path)``, also inside a ``PipelineModel``. Loading unpickles the model:
    load only what you trust, as with ``torch.load``.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fit_timings: Dict[str, float] = {}
        """Seconds fit() spent per phase (validation, materialization, launch, training,
        collection); empty for a model that was loaded or built by hand."""
        self.mlflow_run_id: Optional[str] = None
        """The MLflow run this model's fit was logged to, if it was."""

    def getOutputCols(self) -> List[str]:
        """Prediction column of each label: ``output_cols`` when set, else ``<label>__output``."""
        cols = self.getOrDefault(self.output_cols)
        if cols:
            return list(cols)
        return [f"{label}__output" for label in (self.getLabelCols() or [])]

    # ---- checks ---------------------------------------------------------------------------
    def _check(self, df: Any) -> Tuple[torch.nn.Module, List[str], List[str]]:
        from spark_hvd.spark.data import _inspect_column

        model = self.getModel()
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model={model!r} is not valid: expected a torch.nn.Module; set it with setModel()")
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
        new_cols = self._task_columns() or output_cols
        if len(set(new_cols)) != len(new_cols):
            raise ValueError(f"prediction columns {new_cols} repeat a name: expected distinct names; fix: "
                             "setPredictionCol / setProbabilityCol / setRawPredictionCol")
        fields = {f.name: f.dataType for f in df.schema.fields}
        for col in feature_cols:
            if col not in fields:
                raise ValueError(f"feature column {col!r} is not in the DataFrame; available columns: "
                                 f"{', '.join(fields) or '(none)'}; fix: add it or set feature_cols")
            _inspect_column(col, fields[col], "float32")  # raises for strings, structs, nested arrays
        clash = [c for c in new_cols if c in fields]
        if clash:
            setter = "setPredictionCol(...) and the like" if self._task_columns() else "setOutputCols([...])"
            raise ValueError(f"output column(s) {clash} already exist in the DataFrame: expected new names; fix: "
                             f"{setter} with other names, or drop those columns first")
        return model, feature_cols, output_cols

    def _task_columns(self) -> List[str]:
        """Names of the Spark ML columns transform() adds for the task, in the UDF's field order."""
        names = {"prediction": self.getPredictionCol(), "probability": self.getProbabilityCol(),
                 "raw_prediction": self.getRawPredictionCol()}
        return [names[role] for role, _ in column_kinds(self.getTask())]

    def _input_shapes(self, df: Any, feature_cols: List[str]) -> List[Tuple[int, ...]]:
        shapes = self.getInputShapes()
        sizes = checks.schema_row_sizes(df.schema, feature_cols)
        if shapes is not None and all(-1 not in s for s in shapes):
            sizes = [max(1, _size(s)) if z is None else z for s, z in zip(shapes, sizes)]
        if any(z is None for z in sizes):
            sizes = _sizes_from_data(df, feature_cols, sizes)
        resolved = checks.feature_shapes(shapes, feature_cols, sizes)
        assert resolved is not None, "all sizes are known here"
        return resolved

    def _payload(self, model: torch.nn.Module) -> Tuple[str, bytes]:
        """The serialized model and its key; it travels in the UDF's closure, which Spark ships
        (and broadcasts, when large) on classic and Connect sessions alike."""
        data = cloudpickle.dumps(_cpu_model(model))
        return hashlib.blake2b(data, digest_size=16).hexdigest(), data

    # ---- Spark ML -------------------------------------------------------------------------
    def _transform(self, dataset: Any) -> Any:
        from pyspark.ml.functions import array_to_vector
        from pyspark.sql import functions as F

        model, feature_cols, output_cols = self._check(dataset)
        session = dataset.sparkSession
        checks.ensure_executor_python(session, session_info(session))
        shapes = self._input_shapes(dataset, feature_cols)
        dtype = model_dtype(model)
        row_shapes = checks.dry_run(model, shapes, len(output_cols), dtype)
        check_task(self.getTask(), row_shapes)
        scalar = tuple(output_is_scalar(s) for s in row_shapes)
        key, payload = self._payload(model)
        dtype_name = str(dtype).replace("torch.", "")
        plan = InferencePlan(
            key=key, feature_cols=tuple(feature_cols), input_shapes=tuple(tuple(s) for s in shapes),
            output_cols=tuple(output_cols), scalar_outputs=scalar, batch_size=self.getInferenceBatchSize(),
            dtype=dtype_name, sys_path=tuple(p for p in sys.path if isinstance(p, str)), task=self.getTask())
        predicted = prediction_udf(plan, payload)(*feature_args(dataset.schema, feature_cols, dtype_name))
        if plan.task != "none":
            packed = "__spark_hvd_outputs"
            kinds = column_kinds(plan.task)
            result = dataset.withColumn(packed, predicted)
            columns = []
            for (role, kind), name in zip(kinds, self._task_columns()):
                column = F.col(packed)[role]
                columns.append((array_to_vector(column) if kind == "vector" else column).alias(name))
            return result.select(*[F.col(f"`{c}`") for c in dataset.columns], *columns)
        if len(output_cols) == 1:
            result = dataset.withColumn(output_cols[0], predicted)
        else:
            packed = "__spark_hvd_outputs"
            result = dataset.withColumn(packed, predicted)
            result = result.select(*[F.col(f"`{c}`") for c in dataset.columns],
                                   *[F.col(packed)[f"o{i}"].alias(c) for i, c in enumerate(output_cols)])
        for col, is_scalar in zip(output_cols, scalar):
            if not is_scalar:
                result = result.withColumn(col, array_to_vector(F.col(f"`{col}`")))
        return result

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
        except ImportError:
            raise ImportError("plot_history() needs matplotlib: pip install matplotlib") from None
        frame = self.history_frame()
        if frame.empty:
            raise ValueError("the model has no history to plot: expected a model returned by fit(); "
                             "history_frame() shows what there is")
        names = metrics or [c for c in frame.columns if not c.startswith("val_") and c not in ("rows_per_s", "seconds")]
        if ax is None:
            _, ax = plt.subplots(figsize=(6, 3.5))
        for name in names:
            line, = ax.plot(frame.index, frame[name], marker="o", label=name)
            if f"val_{name}" in frame.columns:
                ax.plot(frame.index, frame[f"val_{name}"], marker="o", linestyle="--", color=line.get_color(),
                        label=f"val_{name}")
        ax.set_xlabel("epoch")
        ax.set_title(f"run {self.getRunId()}" if self.getRunId() else "training history")
        ax.legend()
        return ax

    def write(self) -> ParamsWriter:
        """A writer saving this model (``.save(path)``; ``.overwrite()`` to replace)."""
        return ParamsWriter(self)

    @classmethod
    def read(cls) -> ParamsReader["TorchModel"]:
        """A reader loading a saved TorchModel (``TorchModel.load(path)`` is the short form)."""
        return ParamsReader(cls)

    def copy(self, extra: Optional[Dict[Any, Any]] = None) -> "TorchModel":
        """A copy sharing the torch model object, with ``extra`` Params set."""
        that = super().copy(extra)
        that.fit_timings = dict(self.fit_timings)
        that.mlflow_run_id = self.mlflow_run_id
        return that


def _size(shape: Any) -> int:
    size = 1
    for d in shape:
        size *= int(d)
    return size


def _sizes_from_data(df: Any, cols: List[str], sizes: List[Optional[int]]) -> List[Optional[int]]:
    """Values per row of array and Vector columns whose size the schema does not record (one row read)."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F

    fields = {f.name: f.dataType for f in df.schema.fields}
    exprs = []
    for i, (col, size) in enumerate(zip(cols, sizes)):
        if size is None:
            column = F.col("`" + col.replace("`", "``") + "`")
            if isinstance(fields[col], VectorUDT):
                column = vector_to_array(column)
            exprs.append(F.size(column).alias(f"s{i}"))
    row = df.select(*exprs).first()
    if row is None:
        return [1 if s is None else s for s in sizes]  # an empty frame: any shape predicts nothing
    found = row.asDict()
    return [int(found[f"s{i}"]) if size is None else size for i, size in enumerate(sizes)]
