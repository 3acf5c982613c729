"""KerasModel: a trained Keras model as a Spark ML Model with batched Arrow inference."""

from __future__ import annotations

import hashlib
import warnings
from typing import Any, List, Tuple

import cloudpickle
import numpy as np

from spark_hvd.spark.estimator.fitted import FittedModel
from spark_hvd.spark.estimator.inference import InferencePlan
from spark_hvd.spark.keras import checks
from spark_hvd.spark.keras.checkpoint import load_model_bytes, model_bytes
from spark_hvd.spark.keras.params import KerasModelParams

__all__ = ["KerasModel", "KerasPredictor", "WORKER_MODULES"]

WORKER_MODULES = ("keras", "tensorflow")
"""Modules Spark's Python workers need, besides spark_hvd's own, to train and predict with Keras."""


class KerasPredictor:
    """Loads a ``.keras`` model in a Spark Python worker and predicts with it (TensorFlow places
    it on the worker's GPU when it sees one)."""

    def device(self) -> str:
        return "keras"

    def load(self, payload: Any, device: str) -> Any:
        from spark_hvd.spark.keras.environment import prepare_worker

        prepare_worker()
        saved = cloudpickle.loads(payload)
        return load_model_bytes(saved["model"], saved["custom_objects"])

    def predict(self, model: Any, device: str, plan: InferencePlan, columns: List[np.ndarray]) -> List[np.ndarray]:
        rows = len(columns[0])
        outputs: List[List[np.ndarray]] = [[] for _ in plan.output_cols]
        for start in range(0, rows, plan.batch_size):
            inputs = [c[start:start + plan.batch_size] for c in columns]
            inputs = [x.reshape((len(x),) + tuple(s)).astype(plan.dtype, copy=False)
                      for x, s in zip(inputs, plan.input_shapes)]
            result = model.predict_on_batch(inputs[0] if len(inputs) == 1 else inputs)
            result = list(result) if isinstance(result, (list, tuple)) else [result]
            for i, values in enumerate(result[:len(outputs)]):
                values = np.asarray(values, dtype=np.float64)
                outputs[i].append(values.reshape(values.shape[0], -1))
        return [np.concatenate(parts) if parts else np.zeros((0, 1)) for parts in outputs]


def _model_key(model: Any) -> str:
    """Identity of the model's architecture and weights, for the workers' model cache."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(model.to_json().encode())
    for weight in model.get_weights():
        digest.update(np.ascontiguousarray(weight).tobytes())
    return digest.hexdigest()


class KerasModel(FittedModel, KerasModelParams):
    """A fitted Keras model; ``transform(df)`` adds Spark ML's prediction columns.

    Params (keyword-only constructor, ``getX``/``setX`` accessors): ``model`` (a Keras 3 or Keras 2 model),
    ``feature_cols``, ``label_cols``, ``task``, ``prediction_col``, ``probability_col``,
    ``raw_prediction_col``, ``output_cols`` (raw outputs when ``task`` is 'none', default
    ``<label>__output``), ``input_shapes``, ``inference_batch_size`` (rows per batch, default
    1024), ``custom_objects``, ``run_id``, ``history`` (one dict per epoch: loss, metrics,
    ``val_`` metrics, rows_per_s, seconds).

    ``transform`` works as TorchModel's: for a classification task it adds ``rawPrediction`` and
    ``probability`` (Vectors) and ``prediction`` (the class index), for regression
    ``prediction``, so Spark ML's evaluators work unchanged; with ``task='none'`` one raw output
    column per label. Only the feature columns travel to Python, over Arrow; the model travels
    in ``.keras`` format with the UDF and is loaded once per Python worker (TensorFlow backend
    unless the worker chose another). Each feature column is reshaped to the model's input
    shape (``input_shapes``). Saved with ``write().save(path)`` / loaded with
    ``KerasModel.load(path)``, also inside a ``PipelineModel``; loading unpickles the Params.
    """

    worker_modules = WORKER_MODULES

    def _check_model(self, model: Any) -> None:
        checks.check_model(model)

    def _dtype(self, model: Any) -> str:
        return checks.model_dtype(model)

    def _shapes(self, model: Any, feature_cols: List[str], sizes: List[int]) -> List[Tuple[int, ...]]:
        return checks.feature_shapes(self.getInputShapes(), model, feature_cols, sizes)

    def _dry_run(self, model: Any, shapes: List[Tuple[int, ...]], outputs: int, dtype: str) -> List[Tuple[int, ...]]:
        return checks.dry_run(model, shapes, outputs, dtype)

    def _payload(self, model: Any) -> Tuple[str, bytes]:
        """The model's key and what travels in the UDF's closure: its ``.keras`` bytes and the
        custom objects it needs."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            data = model_bytes(model)
        return _model_key(model), cloudpickle.dumps({"model": data, "custom_objects": self.getCustomObjects()})

    def _predictor(self) -> "KerasPredictor":
        return KerasPredictor()
