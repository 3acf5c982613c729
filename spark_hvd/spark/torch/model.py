"""TorchModel: a trained torch model as a Spark ML Model with batched Arrow inference."""

from __future__ import annotations

import copy
import hashlib
from typing import Any, List, Tuple

import cloudpickle
import torch

from spark_hvd.spark.estimator.fitted import FittedModel
from spark_hvd.spark.torch import checks
from spark_hvd.spark.torch.batches import model_dtype
from spark_hvd.spark.torch.predictor import TorchPredictor

__all__ = ["TorchModel"]


def _cpu_model(model: torch.nn.Module) -> torch.nn.Module:
    if all(t.device.type == "cpu" for t in list(model.parameters()) + list(model.buffers())):
        return model
    return copy.deepcopy(model).cpu()


class TorchModel(FittedModel):
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

    worker_modules = ("torch",)

    def _check_model(self, model: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model={model!r} is not valid: expected a torch.nn.Module; set it with setModel()")

    def _dtype(self, model: torch.nn.Module) -> str:
        return str(model_dtype(model)).replace("torch.", "")

    def _dry_run(self, model: torch.nn.Module, shapes: List[Tuple[int, ...]], outputs: int,
                 dtype: str) -> List[Tuple[int, ...]]:
        return checks.dry_run(model, shapes, outputs, getattr(torch, dtype))

    def _payload(self, model: torch.nn.Module) -> Tuple[str, bytes]:
        """The serialized model and its key; it travels in the UDF's closure, which Spark ships
        (and broadcasts, when large) on classic and Connect sessions alike."""
        data = cloudpickle.dumps(_cpu_model(model))
        return hashlib.blake2b(data, digest_size=16).hexdigest(), data

    def _predictor(self) -> TorchPredictor:
        return TorchPredictor()
