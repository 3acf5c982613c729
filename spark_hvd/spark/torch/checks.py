"""Checks TorchEstimator and TorchModel make on the driver before any Spark job runs.

The framework-independent ones are :mod:`spark_hvd.spark.estimator.checks`.

Each failure is a ValueError that names the parameter or column, the value seen, what was
expected and how to fix it.
"""

from __future__ import annotations

import inspect
import traceback
import warnings
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import torch

from spark_hvd.spark.estimator.checks import check_loss_weights, per_label, require, user_frame
from spark_hvd.spark.estimator.outputs import check_task
from spark_hvd.spark.torch.batches import outputs_list

__all__ = [
    "check_losses",
    "loss_name",
    "check_early_stopping",
    "check_lr_scheduler",
    "check_metrics",
    "check_compression",
    "forward_arity",
    "check_feature_count",
    "call_forward",
    "dry_run",
    "dry_run_batch",
]


def check_losses(loss: Any, loss_weights: Optional[Sequence[float]], label_cols: Sequence[str]) -> Tuple[List[Callable[..., Any]], List[float]]:
    """One loss and one weight per label column, from the ``loss`` and ``loss_weights`` Params."""
    require("loss", loss, "a loss function or torch.nn loss module (or one per label column)",
            "torch.nn.BCEWithLogitsLoss()")
    losses = per_label(loss, label_cols)
    for i, fn in enumerate(losses):
        if not callable(fn):
            raise ValueError(f"loss[{i}]={fn!r} is not callable: expected a function (output, label) -> tensor "
                             "or a torch.nn loss module such as torch.nn.MSELoss()")
    check_loss_weights(loss_weights, label_cols)
    return losses, [1.0] * len(label_cols) if loss_weights is None else list(loss_weights)


def loss_name(fn: Any) -> str:
    """The name of a loss: its class for a torch.nn module, else the function's name."""
    return type(fn).__name__ if isinstance(fn, torch.nn.Module) else getattr(fn, "__name__", type(fn).__name__)


def check_early_stopping(settings: Optional[Mapping[str, Any]], metric_names: Sequence[str], validation: bool,
                         scheduled: bool) -> None:
    """The ``early_stopping`` monitor must be a value the run's history will have."""
    if settings is None:
        return
    names = ["loss", *metric_names] + (["lr"] if scheduled else [])
    if validation:
        names += ["val_loss", *(f"val_{name}" for name in metric_names)]
    monitor = settings["monitor"]
    if monitor not in names:
        hint = "; it needs validation set (e.g. validation=0.2)" if monitor.startswith("val_") and not validation else ""
        raise ValueError(f"early_stopping monitors {monitor!r}, which this fit's history will not have{hint}: "
                         f"expected one of {names}; fix: set early_stopping={{'monitor': {names[-1]!r}, ...}}")


def check_lr_scheduler(make: Optional[Callable[[Any], Any]], optimizer: Any, model: torch.nn.Module) -> None:
    """``lr_scheduler_fn`` called once on the driver, on a copy of the optimizer, must return a
    scheduler (something with ``step`` and ``state_dict``)."""
    if make is None:
        return
    import copy

    try:
        scheduler = make(optimizer.build(copy.deepcopy(model)))
    except Exception as exc:
        raise ValueError(f"lr_scheduler_fn raised {type(exc).__name__}: {exc} when called with the optimizer: expected "
                         "a function of the optimizer, e.g. lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)"
                         ) from exc
    if not all(callable(getattr(scheduler, name, None)) for name in ("step", "state_dict", "load_state_dict")):
        raise ValueError(f"lr_scheduler_fn returned {scheduler!r}: expected a torch.optim.lr_scheduler scheduler "
                         "(with step, state_dict and load_state_dict), e.g. lambda opt: "
                         "torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)")


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
            "each feature column is one argument of forward() (only columns of one number each are stacked into "
            "one input for a forward() of one argument); fix: assemble the columns into one vector column "
            "(pyspark.ml.feature.VectorAssembler) or list one column per forward() argument")


_SHAPE_WORDS = ("shape", "size", "mat1 and mat2", "dimension", "expected input")


def call_forward(model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> Any:
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
            f"{type(model).__name__}.forward, not in the data; fix forward() and fit again") from exc
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
    outputs = call_forward(model, inputs)
    outs = outputs_list(outputs, num_labels if num_labels is not None else
                        (len(outputs) if isinstance(outputs, (list, tuple)) else 1))
    return [tuple(out.shape[1:]) for out in outs]


_ELEMENTWISE_LOSSES = (torch.nn.MSELoss, torch.nn.L1Loss, torch.nn.SmoothL1Loss, torch.nn.HuberLoss,
                       torch.nn.BCELoss, torch.nn.BCEWithLogitsLoss, torch.nn.SoftMarginLoss,
                       torch.nn.MultiLabelSoftMarginLoss, torch.nn.PoissonNLLLoss, torch.nn.GaussianNLLLoss)


def dry_run_batch(model: torch.nn.Module, loss_fn: Any, batch: Mapping[str, Any], feature_cols: Sequence[str],
                  label_cols: Sequence[str], shapes: Sequence[Tuple[int, ...]], dtype: torch.dtype,
                  task: str = "none") -> List[Tuple[int, ...]]:
    """One real batch through ``forward`` and the loss, as the ranks will run them, on the driver;
    returns each output's per-row shape.

    Raises a ValueError naming the shapes when the outputs do not suit the labels or ``task``, or
    the loss refuses an output and its label, or would silently broadcast them (torch's
    elementwise losses accept a (rows, 3) label against a (rows, 1) output and average over 3x
    the pairs). The model's parameters are not changed.
    """
    from spark_hvd.spark.torch.batches import feature_tensors, label_tensors, transform_outputs

    rows = len(next(iter(batch.values()))) if batch else 0
    if rows == 0:
        return []
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    inputs = feature_tensors(batch, feature_cols, shapes, dtype, device)
    labels = label_tensors(batch, label_cols, device)
    outputs = call_forward(model, inputs)
    outs, labs = transform_outputs(outputs, labels)
    check_task(task, [tuple(out.shape[1:]) for out in outs])
    for fn, col, out, lab, raw in zip(loss_fn.losses, label_cols, outs, labs, labels):
        name = loss_name(fn)
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
                frame = user_frame(exc, ("torch",))
                if frame is not None:
                    raise ValueError(
                        f"the loss {name} raised {type(exc).__name__}: {exc} (at {frame.filename}:{frame.lineno}, "
                        f"'{(frame.line or '').strip()}') on a real batch, where {shapes_text}; this is an error in "
                        "the loss, not in the data (its traceback is above); fix the loss and fit again") from exc
                raise ValueError(f"the loss failed on a real batch: {shapes_text}; it raised {type(exc).__name__}: "
                                 f"{exc}; {fix}, or choose a loss for these shapes") from None
        broadcast = [w for w in caught if "size" in str(w.message).lower() and "target" in str(w.message).lower()]
        if broadcast:
            raise ValueError(f"the loss would broadcast the label against the output: {shapes_text}; torch warned "
                             f"'{broadcast[0].message}'; {fix}")
    return [tuple(out.shape[1:]) for out in outs]
