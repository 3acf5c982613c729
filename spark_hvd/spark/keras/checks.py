"""Checks KerasEstimator and KerasModel make on the driver before any Spark job runs.

Each failure is a ValueError that names the parameter or column, the value seen, what was
expected and how to fix it. The framework-independent checks are :mod:`spark_hvd.spark.estimator.checks`.
"""

from __future__ import annotations

import traceback
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from spark_hvd.spark.estimator.checks import check_loss_weights, per_label, require, resolve_shape, user_frame
from spark_hvd.spark.estimator.outputs import check_task
from spark_hvd.spark.keras.flavor import is_model, is_optimizer, keras_of, to_numpy

__all__ = [
    "check_model",
    "compiled_settings",
    "check_optimizer",
    "with_learning_rate",
    "check_losses",
    "check_metrics",
    "loss_name",
    "infer_task",
    "model_dtype",
    "model_input_shapes",
    "check_input_count",
    "feature_shapes",
    "label_arrays",
    "call_model",
    "dry_run",
    "dry_run_batch",
]


def check_model(model: Any, param: str = "model") -> None:
    """ValueError unless ``model`` is a Keras 3 model (``keras.Model``) or a Keras 2 one (``tf_keras.Model``)."""
    if not is_model(model):
        raise ValueError(f"{param}={model!r} is not valid: expected a Keras model (keras.Model, or Keras 2's "
                         f"tf_keras.Model); pass e.g. {param}=keras.Sequential([keras.Input((30,)), "
                         "keras.layers.Dense(1)])")


def compiled_settings(model: Any) -> Dict[str, Any]:
    """The optimizer, loss, loss_weights and metrics a compiled ``model`` was compiled with
    (fresh objects from its compile config); empty for a model that was not compiled."""
    compiled = getattr(model, "compiled", getattr(model, "_is_compiled", False))  # Keras 3; Keras 2
    config = model.get_compile_config() if compiled else None
    if not config:
        return {}
    keras = keras_of(model)
    settings: Dict[str, Any] = {}
    if config.get("optimizer") is not None:
        settings["optimizer"] = keras.optimizers.deserialize(config["optimizer"])

    def deserialize_loss(loss: Any) -> Any:
        return loss if isinstance(loss, str) else keras.losses.deserialize(loss)

    if config.get("loss") is not None:
        loss = config["loss"]
        settings["loss"] = [deserialize_loss(x) for x in loss] if isinstance(loss, list) else deserialize_loss(loss)
    if config.get("loss_weights") is not None:
        settings["loss_weights"] = config["loss_weights"]
    if config.get("metrics") is not None:
        settings["metrics"] = [m if isinstance(m, str) else keras.metrics.deserialize(m) for m in config["metrics"]]
    return settings


def with_learning_rate(optimizer: Any, lr: Optional[float]) -> Any:
    """A fresh optimizer of ``optimizer``'s class and settings with learning rate ``lr`` (replacing
    a schedule); ``optimizer`` itself when ``lr`` is None."""
    if lr is None:
        return optimizer
    return type(optimizer).from_config({**optimizer.get_config(), "learning_rate": float(lr)})


def check_optimizer(optimizer: Any, model: Any = None) -> Any:
    """A Keras optimizer from the ``optimizer`` Param (an optimizer, or its name such as 'adam'), of
    the Keras of ``model`` (when given)."""
    require("optimizer", optimizer, "a Keras optimizer (or a compiled model, whose optimizer is used)",
            "keras.optimizers.Adam(learning_rate=1e-3)")
    keras = keras_of(model) if model is not None else keras_of(optimizer)
    if isinstance(optimizer, str):
        try:
            optimizer = keras.optimizers.get(optimizer)
        except ValueError:
            raise ValueError(f"optimizer={optimizer!r} is not a Keras optimizer name: expected e.g. 'adam' or "
                             "keras.optimizers.Adam(learning_rate=1e-3)") from None
    if not is_optimizer(optimizer):
        raise ValueError(f"optimizer={optimizer!r} is not valid: expected a Keras optimizer such as "
                         "keras.optimizers.Adam(learning_rate=1e-3)")
    if model is not None and keras_of(optimizer) is not keras:
        raise ValueError(f"optimizer={optimizer!r} is {_which(optimizer)}'s but the model is {_which(model)}'s: "
                         f"expected one Keras for both; fix: create the optimizer from {keras.__name__}.optimizers")
    return optimizer


def _which(obj: Any) -> str:
    return "Keras 2 (tf_keras)" if keras_of(obj).__name__ == "tf_keras" else "Keras 3"


def check_losses(loss: Any, loss_weights: Optional[Sequence[float]], label_cols: Sequence[str],
                 model: Any = None) -> Tuple[List[Any], Optional[List[float]]]:
    """One loss per label column (Keras loss objects, functions or names, of the Keras of
    ``model``) and the weights."""
    require("loss", loss, "a Keras loss, a loss name or a function (or one per label column)",
            "keras.losses.BinaryCrossentropy(from_logits=True)")
    losses = per_label(loss, label_cols)
    keras = keras_of(model) if model is not None else keras_of(losses[0])
    resolved = []
    for i, fn in enumerate(losses):
        if isinstance(fn, str):
            try:
                keras.losses.get(fn)
            except ValueError:
                raise ValueError(f"loss[{i}]={fn!r} is not a Keras loss name: expected e.g. 'mse' or "
                                 "keras.losses.BinaryCrossentropy(from_logits=True)") from None
        elif not callable(fn):
            raise ValueError(f"loss[{i}]={fn!r} is not callable: expected a Keras loss or a function "
                             "(y_true, y_pred) -> tensor")
        resolved.append(fn)
    check_loss_weights(loss_weights, label_cols)
    return resolved, None if loss_weights is None else [float(w) for w in loss_weights]


def check_metrics(metrics: Optional[Sequence[Any]]) -> List[Any]:
    """The metrics: Keras metric objects, names such as 'accuracy', or functions."""
    for i, metric in enumerate(metrics or []):
        if not (isinstance(metric, str) or callable(metric)):
            raise ValueError(f"metrics[{i}]={metric!r} is not valid: expected a Keras metric, a metric name "
                             "such as 'accuracy', or a function (y_true, y_pred) -> tensor")
    return list(metrics or [])


def loss_name(loss: Any) -> Tuple[str, bool]:
    """(name, from_logits) of a loss: the Keras function or class name it stands for."""
    if isinstance(loss, str):
        fn = keras_of(loss).losses.get(loss)  # the names are Keras 3's and Keras 2's alike
        return getattr(fn, "__name__", loss), False
    if isinstance(loss, keras_of(loss).losses.Loss):
        config = loss.get_config() if hasattr(loss, "get_config") else {}
        inner = getattr(loss, "fn", None)
        name = type(loss).__name__ if type(loss).__name__ != "LossFunctionWrapper" else getattr(inner, "__name__", "")
        return name, bool(config.get("from_logits", False))
    return getattr(loss, "__name__", type(loss).__name__), False


_TASK_BY_LOSS = {
    "BinaryCrossentropy": "binary", "binary_crossentropy": "binary",
    "BinaryFocalCrossentropy": "binary", "binary_focal_crossentropy": "binary",
    "CategoricalCrossentropy": "multiclass", "categorical_crossentropy": "multiclass",
    "SparseCategoricalCrossentropy": "multiclass", "sparse_categorical_crossentropy": "multiclass",
    "MeanSquaredError": "regression", "mean_squared_error": "regression",
    "MeanAbsoluteError": "regression", "mean_absolute_error": "regression",
    "Huber": "regression", "huber": "regression", "LogCosh": "regression", "log_cosh": "regression",
}


def infer_task(task: str, losses: Sequence[Any], label_cols: Sequence[str]) -> str:
    """The concrete task: ``task`` unless it is 'auto', else the one the single label's loss
    implies (a cross-entropy without ``from_logits=True`` means the model outputs probabilities)."""
    if task != "auto":
        return task
    if len(label_cols) != 1 or not losses:
        return "none"
    name, from_logits = loss_name(losses[0])
    found = _TASK_BY_LOSS.get(name, "none")
    if found in ("binary", "multiclass") and not from_logits:
        return "binary_probability" if found == "binary" else "multiclass_probability"
    return found


def _is_sparse(loss: Any) -> bool:
    return "sparse" in loss_name(loss)[0].lower()


def model_dtype(model: Any) -> str:
    """The numpy dtype inputs are given in: float64 for a model with float64 weights, else float32."""
    return "float64" if any(str(w.dtype).endswith("float64") for w in model.weights) else "float32"


def model_input_shapes(model: Any) -> Optional[List[Tuple[Optional[int], ...]]]:
    """Per-row shape of each model input, None dimensions unknown; None for a model without
    defined inputs (a Sequential without ``keras.Input``, a subclassed model)."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return None
    if not inputs:
        return None
    return [tuple(None if d is None else int(d) for d in tuple(t.shape)[1:]) for t in inputs]


def check_input_count(model: Any, feature_cols: Sequence[str]) -> None:
    """Every feature column is one model input."""
    shapes = model_input_shapes(model)
    if shapes is not None and len(shapes) != len(feature_cols):
        raise ValueError(
            f"feature_cols={list(feature_cols)} gives {len(feature_cols)} input(s) but the model has {len(shapes)} "
            f"input(s): each feature column is one model input; fix: assemble the columns into one vector column "
            "(pyspark.ml.feature.VectorAssembler) or list one column per model input")


def feature_shapes(input_shapes: Optional[Sequence[Sequence[int]]], model: Any, feature_cols: Sequence[str],
                   sizes: Sequence[int]) -> List[Tuple[int, ...]]:
    """Per-row shape of each feature as the model receives it: ``input_shapes`` when given, else
    the model's input shape (its unknown dimension filled from the column's size), else flat."""
    if input_shapes is not None and len(input_shapes) != len(feature_cols):
        raise ValueError(f"input_shapes has {len(input_shapes)} shape(s) for {len(feature_cols)} feature column(s) "
                         f"{list(feature_cols)}: expected one shape per feature column, e.g. input_shapes=[[28, 28, 1]]")
    model_shapes = model_input_shapes(model)
    shapes = []
    for i, (col, size) in enumerate(zip(feature_cols, sizes)):
        if input_shapes is not None:
            shapes.append(resolve_shape(input_shapes[i], int(size), col))
            continue
        wanted = model_shapes[i] if model_shapes is not None else None
        if wanted is None or wanted == ():
            shapes.append((int(size),) if wanted is None else ())
            if wanted == () and size != 1:
                raise ValueError(f"feature column {col!r} has {size} values per row but model input {i} takes one "
                                 "value per row: fix the model's input shape or feature_cols")
            continue
        unknown = sum(d is None for d in wanted)
        known = int(np.prod([d for d in wanted if d is not None]))
        if unknown > 1 or (unknown == 0 and known != size) or (unknown == 1 and size % known):
            raise ValueError(f"feature column {col!r} has {size} values per row but model input {i} has shape "
                             f"{(None,) + tuple(wanted)} ({known if not unknown else 'a multiple of ' + str(known)} "
                             "values per row): expected matching sizes; fix: change the model's input shape, choose "
                             "another column, or set input_shapes")
        shapes.append(tuple(size // known if d is None else d for d in wanted))
    return shapes


def label_arrays(batch: Mapping[str, np.ndarray], label_cols: Sequence[str],
                 output_shapes: Sequence[Tuple[int, ...]], dtype: str) -> List[np.ndarray]:
    """Each label as the loss receives it: reshaped to its output's per-row shape (and cast to
    the model's dtype) when it has as many values per row; else as stored (class indices)."""
    labels = []
    for col, shape in zip(label_cols, output_shapes):
        values = np.asarray(batch[col])
        width = int(np.prod(shape)) if shape else 1
        if values.size == len(values) * width:
            labels.append(values.reshape((len(values),) + tuple(shape)).astype(dtype, copy=False))
        else:
            labels.append(values)
    return labels


def _inputs(batch: Mapping[str, np.ndarray], feature_cols: Sequence[str], shapes: Sequence[Tuple[int, ...]],
            dtype: str) -> List[np.ndarray]:
    return [np.asarray(batch[c]).reshape((len(batch[c]),) + tuple(s)).astype(dtype, copy=False)
            for c, s in zip(feature_cols, shapes)]


def call_model(model: Any, inputs: List[np.ndarray]) -> List[np.ndarray]:
    """The model's outputs for ``inputs`` (inference mode) as numpy arrays; a ValueError that
    tells an input-size problem from a bug in the model's ``call``."""
    described = ", ".join(str(tuple(x.shape)) for x in inputs)
    try:
        outputs = model(inputs[0] if len(inputs) == 1 else inputs, training=False)
    except Exception as exc:
        text = str(exc)
        if any(word in text for word in ("shape", "Shape", "incompatible", "dimension")):
            raise ValueError(f"the model cannot take the features: it got inputs of shapes {described} (rows first) "
                             f"and raised {type(exc).__name__}: {text.strip().splitlines()[0] if text else ''}; fix: "
                             "match the model's input shape to the feature columns, or set input_shapes") from None
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        raise ValueError(f"the model raised {type(exc).__name__}: {text} (at {frame.filename}:{frame.lineno}) when "
                         f"called with inputs of shapes {described}; this is an error in the model, not in the data; "
                         "fix the model and fit again") from exc
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    return [to_numpy(o) for o in outputs]


def dry_run(model: Any, shapes: Sequence[Tuple[int, ...]], num_labels: Optional[int],
            dtype: str) -> List[Tuple[int, ...]]:
    """Call the model on two rows of zeros of ``shapes``; each output's per-row shape. Builds a
    model that was not built yet; its weights are not trained."""
    outputs = call_model(model, [np.zeros((2,) + tuple(s), dtype=dtype) for s in shapes])
    if num_labels is not None and len(outputs) != num_labels:
        raise ValueError(f"the model returned {len(outputs)} output(s) for {num_labels} label column(s): expected "
                         "one output per label column; fix label_cols or the model's outputs")
    return [tuple(o.shape[1:]) for o in outputs]


def dry_run_batch(model: Any, losses: Sequence[Any], batch: Mapping[str, np.ndarray], feature_cols: Sequence[str],
                  label_cols: Sequence[str], shapes: Sequence[Tuple[int, ...]], dtype: str,
                  task: str = "none") -> List[Tuple[int, ...]]:
    """One real batch through the model and each loss, as the ranks will run them, on the driver;
    returns each output's per-row shape.

    Raises a ValueError naming the shapes when the outputs do not suit the labels or ``task``, or
    a loss refuses an output and its label, or would silently broadcast them (Keras's mean
    squared error accepts a label of 3 values per row against an output of 1 and averages over 3x
    the pairs). The model's weights are not changed (a model without defined inputs is built).
    """
    outputs = call_model(model, _inputs(batch, feature_cols, shapes, dtype))
    if len(outputs) != len(label_cols):
        raise ValueError(f"the model returned {len(outputs)} output(s) for {len(label_cols)} label column(s): "
                         "expected one output per label column; fix label_cols or the model's outputs")
    output_shapes = [tuple(o.shape[1:]) for o in outputs]
    check_task(task, output_shapes)
    labels = label_arrays(batch, label_cols, [tuple(o.shape[1:]) for o in outputs], dtype)
    for fn, col, out, lab in zip(losses, label_cols, outputs, labels):
        name = loss_name(fn)[0]
        raw = np.asarray(batch[col])
        label_width = raw[0].size if len(raw) else 1
        out_width = int(np.prod(out.shape[1:])) if out.ndim > 1 else 1
        shapes_text = (f"{name} got the model's output of shape {tuple(out.shape)} and label {col!r} of shape "
                       f"{tuple(raw.shape)}")
        if _is_sparse(fn):
            if label_width != 1:
                raise ValueError(f"the loss needs one class index per row: {shapes_text}; fix: give a label column "
                                 "of class indices, or a categorical (not sparse) loss for one-hot labels")
        elif label_width != out_width:
            raise ValueError(f"the loss would compare tensors of different shapes: {shapes_text}; it needs the label "
                             f"to have the output's shape, else Keras broadcasts them silently; fix: make the model "
                             f"return {label_width} value(s) per row for {col!r}, or give a label column with "
                             f"{out_width} value(s) per row")
        loss = keras_of(model).losses.get(fn) if isinstance(fn, str) else fn
        try:
            value = to_numpy(loss(lab, out))
        except Exception as exc:
            frame = user_frame(exc, ("keras", "tensorflow", "torch", "jax", "numpy"))
            if frame is not None:
                raise ValueError(
                    f"the loss {name} raised {type(exc).__name__}: {exc} (at {frame.filename}:{frame.lineno}, "
                    f"'{(frame.line or '').strip()}') on a real batch, where {shapes_text}; this is an error in the "
                    "loss, not in the data (its traceback is above); fix the loss and fit again") from exc
            raise ValueError(f"the loss failed on a real batch: {shapes_text}; it raised {type(exc).__name__}: "
                             f"{str(exc).strip().splitlines()[0] if str(exc) else ''}; fix the label column or "
                             "choose a loss for these shapes") from None
        if not np.all(np.isfinite(value)):
            raise ValueError(f"the loss is not finite on a real batch: {shapes_text} gave {value}; expected a finite "
                             "loss; fix: check the labels' range for this loss (e.g. 0/1 for binary cross-entropy)")
    return output_shapes
