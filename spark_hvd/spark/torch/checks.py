"""Checks TorchEstimator and TorchModel make on the driver before any Spark job runs.

Each failure is a ValueError that names the parameter or column, the value seen, what was
expected and how to fix it.
"""

from __future__ import annotations

import inspect
import logging
import traceback
import warnings
import os
import shutil
import subprocess
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from spark_hvd.spark.torch.batches import outputs_list, resolve_shape

__all__ = [
    "require",
    "check_losses",
    "check_metrics",
    "check_compression",
    "forward_arity",
    "check_feature_count",
    "schema_row_sizes",
    "feature_shapes",
    "dry_run",
    "dry_run_batch",
    "ensure_executor_python",
    "check_slots",
]

log = logging.getLogger("spark_hvd.spark")

_PROBE_TIMEOUT_S = 60.0


def require(name: str, value: Any, expected: str, example: str) -> None:
    """ValueError when a required Param is unset."""
    if value is None:
        raise ValueError(f"{name}=None is not valid: expected {expected}; pass e.g. {name}={example}")


def check_losses(loss: Any, loss_weights: Optional[Sequence[float]], label_cols: Sequence[str]) -> Tuple[List[Callable[..., Any]], List[float]]:
    """One loss and one weight per label column, from the ``loss`` and ``loss_weights`` Params."""
    require("loss", loss, "a loss function or torch.nn loss module (or one per label column)",
            "torch.nn.BCEWithLogitsLoss()")
    losses = list(loss) if isinstance(loss, (list, tuple)) else [loss] * len(label_cols)
    if len(losses) != len(label_cols):
        raise ValueError(f"loss has {len(losses)} entries for {len(label_cols)} label column(s) {list(label_cols)}: "
                         "expected one loss per label column, or a single loss for all of them")
    for i, fn in enumerate(losses):
        if not callable(fn):
            raise ValueError(f"loss[{i}]={fn!r} is not callable: expected a function (output, label) -> tensor "
                             "or a torch.nn loss module such as torch.nn.MSELoss()")
    weights = [1.0] * len(label_cols) if loss_weights is None else list(loss_weights)
    if len(weights) != len(label_cols):
        raise ValueError(f"loss_weights={list(weights)} has {len(weights)} entries for {len(label_cols)} label "
                         f"column(s) {list(label_cols)}: expected one weight per label column")
    return losses, weights


def check_metrics(metrics: Optional[Sequence[Any]]) -> List[Callable[..., Any]]:
    """The metric functions; each must be callable as ``metric(outputs, labels)``."""
    for i, fn in enumerate(metrics or []):
        if not callable(fn):
            raise ValueError(f"metrics[{i}]={fn!r} is not callable: expected functions (outputs, labels) -> tensor")
    return list(metrics or [])


def check_compression(compression: Any) -> None:
    """A gradient compression must offer ``compress`` and ``decompress`` (spark_hvd.torch.Compression)."""
    if compression is not None and not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise ValueError(f"gradient_compression={compression!r} is not valid: expected a compressor such as "
                         "spark_hvd.torch.Compression.fp16")


def forward_arity(model: torch.nn.Module) -> Tuple[int, Optional[int]]:
    """(required, maximum) positional arguments of ``model.forward``; maximum None for ``*args``."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return 0, None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return sum(p.default is p.empty for p in positional), None
    return sum(p.default is p.empty for p in positional), len(positional)


def check_feature_count(model: torch.nn.Module, feature_cols: Sequence[str]) -> None:
    """Every feature column is one positional argument of ``model.forward``."""
    required, maximum = forward_arity(model)
    count = len(feature_cols)
    if count < required or (maximum is not None and count > maximum):
        takes = f"{required}" if maximum == required else f"{required} to {maximum if maximum is not None else 'any'}"
        raise ValueError(
            f"feature_cols={list(feature_cols)} gives {count} input(s) but {type(model).__name__}.forward takes {takes}: "
            "each feature column is one argument of forward(); fix: assemble the columns into one vector "
            "column (pyspark.ml.feature.VectorAssembler) or list one column per forward() argument")


def schema_row_sizes(schema: Any, cols: Sequence[str]) -> List[Optional[int]]:
    """Values per row of each column where the schema tells: 1 for scalars, the ``ml_attr``
    size for Vectors made by Spark ML feature transformers; None where only the data knows."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    fields = {f.name: f for f in schema.fields}
    sizes: List[Optional[int]] = []
    for col in cols:
        field = fields.get(col)
        if field is None:
            sizes.append(None)
        elif isinstance(field.dataType, (T.NumericType, T.BooleanType)):
            sizes.append(1)
        elif isinstance(field.dataType, VectorUDT):
            num = (field.metadata or {}).get("ml_attr", {}).get("num_attrs")
            sizes.append(int(num) if isinstance(num, int) and num > 0 else None)
        else:
            sizes.append(None)
    return sizes


def feature_shapes(input_shapes: Optional[Sequence[Sequence[int]]], feature_cols: Sequence[str],
                   sizes: Sequence[Optional[int]]) -> Optional[List[Tuple[int, ...]]]:
    """Concrete per-row shapes of the features, or None while a size is still unknown."""
    if input_shapes is not None and len(input_shapes) != len(feature_cols):
        raise ValueError(f"input_shapes has {len(input_shapes)} shape(s) for {len(feature_cols)} feature column(s) "
                         f"{list(feature_cols)}: expected one shape per feature column, e.g. input_shapes=[[1, 28, 28]]")
    if any(size is None for size in sizes):
        return None
    if input_shapes is None:
        return [(1,) if size == 1 else (int(size),) for size in sizes]  # type: ignore[arg-type]
    return [resolve_shape(shape, int(size), col)  # type: ignore[arg-type]
            for shape, size, col in zip(input_shapes, sizes, feature_cols)]


_SHAPE_WORDS = ("shape", "size", "mat1 and mat2", "dimension", "expected input")


def _call_forward(model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> Any:
    """``model(*inputs)`` in eval mode without gradients; a ValueError that tells an input-size
    problem from a bug in ``forward``."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return model(*inputs)
    except Exception as exc:
        described = ", ".join(str(tuple(t.shape)) for t in inputs)
        text = str(exc)
        if isinstance(exc, RuntimeError) and any(word in text for word in _SHAPE_WORDS):
            raise ValueError(
                f"the model cannot take the features: {type(model).__name__}({described}) raised "
                f"{type(exc).__name__}: {text}; expected inputs of these shapes (rows first); fix: match the model's "
                "input size to the feature columns, or set input_shapes") from None
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        raise ValueError(
            f"the model's forward() raised {type(exc).__name__}: {text} (at {frame.filename}:{frame.lineno}, "
            f"'{(frame.line or '').strip()}') when called with inputs of shapes {described}; this is an error in "
            f"{type(model).__name__}.forward, not in the data; fix forward() and fit again") from None
    finally:
        model.train(was_training)


def dry_run(model: torch.nn.Module, shapes: Sequence[Tuple[int, ...]], num_labels: Optional[int],
            dtype: torch.dtype) -> List[Tuple[int, ...]]:
    """Call the model on two rows of zeros of ``shapes``; returns each output's per-row shape.

    Catches inputs of the wrong size and a wrong number of outputs on the driver, with a clear
    message, instead of in a traceback from every rank. The model's parameters are not changed.
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    inputs = [torch.zeros((2,) + tuple(shape), dtype=dtype, device=device) for shape in shapes]
    outputs = _call_forward(model, inputs)
    outs = outputs_list(outputs, num_labels if num_labels is not None else
                        (len(outputs) if isinstance(outputs, (list, tuple)) else 1))
    return [tuple(out.shape[1:]) for out in outs]


_ELEMENTWISE_LOSSES = (torch.nn.MSELoss, torch.nn.L1Loss, torch.nn.SmoothL1Loss, torch.nn.HuberLoss,
                       torch.nn.BCELoss, torch.nn.BCEWithLogitsLoss, torch.nn.SoftMarginLoss,
                       torch.nn.MultiLabelSoftMarginLoss, torch.nn.PoissonNLLLoss, torch.nn.GaussianNLLLoss)


def dry_run_batch(model: torch.nn.Module, loss_fn: Any, batch: Mapping[str, Any], feature_cols: Sequence[str],
                  label_cols: Sequence[str], shapes: Sequence[Tuple[int, ...]], dtype: torch.dtype) -> None:
    """One real batch through ``forward`` and the loss, as the ranks will run them, on the driver.

    Raises a ValueError naming the shapes when the loss refuses an output and its label, or would
    silently broadcast them (torch's elementwise losses accept a (rows, 3) label against a
    (rows, 1) output and average over 3x the pairs). The model's parameters are not changed.
    """
    from spark_hvd.spark.torch.batches import feature_tensors, label_tensors, transform_outputs

    rows = len(next(iter(batch.values()))) if batch else 0
    if rows == 0:
        return
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    inputs = feature_tensors(batch, feature_cols, shapes, dtype, device)
    labels = label_tensors(batch, label_cols, device)
    outputs = _call_forward(model, inputs)
    outs, labs = transform_outputs(outputs, labels)
    for fn, col, out, lab, raw in zip(loss_fn.losses, label_cols, outs, labs, labels):
        name = type(fn).__name__ if isinstance(fn, torch.nn.Module) else getattr(fn, "__name__", repr(fn))
        shapes_text = (f"{name} got the model's output of shape {tuple(out.shape)} and label {col!r} of shape "
                       f"{tuple(raw.shape)} (as given to the loss: {tuple(lab.shape)})")
        fix = (f"fix: make the model return {int(raw[0].numel())} value(s) per row for {col!r}, or give a label "
               f"column with {int(out[0].numel())} value(s) per row")
        if isinstance(fn, _ELEMENTWISE_LOSSES) and tuple(out.shape) != tuple(lab.shape):
            raise ValueError(f"the loss would compare tensors of different shapes: {shapes_text}; {name} needs "
                             f"the label to have the output's shape, else torch broadcasts them silently; {fix}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with torch.no_grad():
                    fn(out, lab)
            except Exception as exc:
                raise ValueError(f"the loss failed on a real batch: {shapes_text}; it raised {type(exc).__name__}: "
                                 f"{exc}; {fix}, or choose a loss for these shapes") from None
        broadcast = [w for w in caught if "size" in str(w.message).lower() and "target" in str(w.message).lower()]
        if broadcast:
            raise ValueError(f"the loss would broadcast the label against the output: {shapes_text}; torch warned "
                             f"'{broadcast[0].message}'; {fix}")


_WORKER_MODULES = ("spark_hvd", "torch", "numpy", "pyarrow", "pandas", "cloudpickle")
_PROBE = "import importlib.util as u, sys; sys.exit(0 if all(u.find_spec(m) for m in {!r}) else 1)"
_probed: Dict[str, bool] = {}


def _has_worker_modules(python: str) -> bool:
    """Whether ``python`` finds every module the workers need (looked up, not imported: fast)."""
    if os.path.abspath(python) == os.path.abspath(sys.executable):
        return True
    if python not in _probed:
        try:
            probe = subprocess.run([python, "-c", _PROBE.format(_WORKER_MODULES)], capture_output=True,
                                   timeout=_PROBE_TIMEOUT_S)
            _probed[python] = probe.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            _probed[python] = False
    return _probed[python]


def ensure_executor_python(session: Any, info: Any) -> None:
    """Make Spark's Python workers run an interpreter with spark_hvd and torch, or say how.

    On a local master the workers run on this machine: when the configured Python
    (``PYSPARK_PYTHON``, else ``python3`` on PATH, which need not be this virtualenv's) lacks
    spark_hvd, torch, numpy, pyarrow or pandas, a classic session switches to this process's own
    interpreter, with a warning; a Spark Connect server was started with its Python already, so
    there the answer is a ValueError naming PYSPARK_PYTHON. On a cluster the executors are checked
    by the job itself, which fails with the same advice.
    """
    from spark_hvd.runtime import config
    from spark_hvd.spark.runner import executor_python

    if not info.local:
        return
    configured = executor_python(session, info)
    resolved = shutil.which(configured, path=config.environ_snapshot().get("PATH")) or configured
    if _has_worker_modules(resolved):
        return
    if info.connect:
        raise ValueError(f"Spark runs its Python tasks with {resolved}, which lacks some of {', '.join(_WORKER_MODULES)}; "
                         f"fix: set PYSPARK_PYTHON={sys.executable} before the Spark Connect server starts (or "
                         "use spark_hvd.spark.local_session(connect=True), which does)")
    log.warning("Spark's Python workers would run %s, which lacks some of %s; using this driver's interpreter %s "
                "instead (set PYSPARK_PYTHON=%s before creating the SparkSession to choose it yourself)",
                resolved, ", ".join(_WORKER_MODULES), sys.executable, sys.executable)
    session.sparkContext.pythonExec = sys.executable


def check_slots(session: Any, num_proc: int) -> Any:
    """ValueError naming both numbers when the cluster cannot run ``num_proc`` barrier tasks at once;
    returns the session's :class:`spark_hvd.spark.session.SessionInfo`."""
    from spark_hvd.spark import runner

    # The same check run() makes, done before the data is materialized rather than after.
    return runner.wait_for_slots(session, num_proc)
