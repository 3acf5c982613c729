"""Reader batches to model inputs and labels, and model outputs to losses and metrics.

Both the training loop on the ranks and ``TorchModel.transform`` use these rules, so a model
sees the same tensors in training and in inference:

- every feature column becomes one positional argument of ``model.forward``, of shape
  ``(rows, *shape)`` where ``shape`` is the column's entry of ``input_shapes`` (a scalar column
  defaults to ``(1,)``, an array or Vector column of length n to ``(n,)``), cast to the model's
  floating dtype (the dtype of its first floating parameter);
- the model returns one tensor per label column (a tuple or list when there are several);
- a label with as many values per row as its output is reshaped to the output's shape and cast
  to its dtype (regression, binary and multi-label targets); any other label is cast to int64,
  the class indices that ``CrossEntropyLoss`` and ``NLLLoss`` expect.
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from spark_hvd.spark.estimator.checks import resolve_shape

__all__ = [
    "model_dtype",
    "resolve_shape",
    "feature_tensors",
    "label_tensors",
    "weight_tensor",
    "outputs_list",
    "align_labels",
    "transform_outputs",
    "LossFunction",
    "metric_names",
    "metric_values",
    "metric_tensors",
]


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype inputs are cast to: that of the model's first floating-point parameter or buffer."""
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


def _tensor(values: np.ndarray) -> torch.Tensor:
    # Arrays viewing Arrow buffers are read-only; torch needs memory it may write.
    if not values.flags.writeable or not values.flags.c_contiguous:
        values = np.array(values, order="C")
    return torch.from_numpy(values)


def feature_tensors(batch: Mapping[str, np.ndarray], feature_cols: Sequence[str],
                    shapes: Sequence[Sequence[int]], dtype: torch.dtype,
                    device: torch.device) -> List[torch.Tensor]:
    """One input tensor per feature column: ``(rows, *shape)`` of ``dtype`` on ``device``."""
    inputs = []
    for col, shape in zip(feature_cols, shapes):
        values = np.asarray(batch[col])
        tensor = _tensor(values)
        inputs.append(tensor.to(device=device, dtype=dtype).reshape((len(values),) + tuple(shape)))
    return inputs


def label_tensors(batch: Mapping[str, np.ndarray], label_cols: Sequence[str],
                  device: torch.device) -> List[torch.Tensor]:
    """One tensor per label column, in the column's own dtype (see :func:`align_labels`)."""
    return [_tensor(np.asarray(batch[col])).to(device) for col in label_cols]


def weight_tensor(batch: Mapping[str, np.ndarray], column: Optional[str], dtype: torch.dtype,
                  device: torch.device) -> Optional[torch.Tensor]:
    """The per-row sample weights, or None without a weight column."""
    if column is None:
        return None
    return _tensor(np.asarray(batch[column])).to(device=device, dtype=dtype).reshape(-1)


def outputs_list(outputs: Any, num_labels: int) -> List[torch.Tensor]:
    """The model's return value as one tensor per label column."""
    if isinstance(outputs, torch.Tensor):
        outputs = [outputs]
    elif isinstance(outputs, (list, tuple)):
        outputs = list(outputs)
    else:
        raise ValueError(f"the model returned {type(outputs).__name__}: expected a tensor, or a tuple of "
                         f"{num_labels} tensors (one per label column); fix the model's forward()")
    if len(outputs) != num_labels:
        raise ValueError(f"the model returned {len(outputs)} output(s) for {num_labels} label column(s): "
                         "expected one output per label column; fix label_cols or the model's forward()")
    return outputs


def align_labels(outputs: Sequence[torch.Tensor], labels: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Labels reshaped and cast to suit their outputs (rules in the module docstring)."""
    aligned = []
    for output, label in zip(outputs, labels):
        if label.numel() == output.numel():
            aligned.append(label.reshape(output.shape).to(output.dtype))
        elif label.dim() > 1 and label[0].numel() == 1:
            aligned.append(label.reshape(label.shape[0]).to(torch.long))  # (rows, 1) class ids
        else:
            aligned.append(label.to(torch.long))
    return aligned


def transform_outputs(outputs: Any, labels: Sequence[torch.Tensor]) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """``(outputs, labels)`` as lists with one entry per label column, labels aligned to outputs.

    This is the ``transform_outputs`` argument given to ``train_minibatch_fn``.
    """
    outs = outputs_list(outputs, len(labels))
    return outs, align_labels(outs, labels)


def _accepts_reduction(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return "reduction" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _unreduced(fn: Callable[..., Any]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``fn`` giving a loss per element: a torch.nn loss copied with ``reduction='none'`` (the copy
    shares the original's tensors, such as ``pos_weight``), a function that takes ``reduction``
    called with it, any other function as it is. Made once per loss, not every step."""
    if isinstance(fn, torch.nn.Module) and hasattr(fn, "reduction"):
        unreduced = copy.copy(fn)
        unreduced.reduction = "none"
        return unreduced
    if _accepts_reduction(fn):
        return functools.partial(fn, reduction="none")
    return fn


def _per_row(unreduced: Callable[..., Any], output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """The loss of each row, from the loss's per-element form (see :func:`_unreduced`)."""
    values = unreduced(output, label)
    rows = output.shape[0]
    if values.dim() == 0 or values.shape[0] != rows:
        raise ValueError(f"the loss returned shape {tuple(values.shape)} for {rows} rows: with sample_weight_col "
                         "the loss must give one value per row; use a torch.nn loss, a function taking "
                         "reduction='none', or one that returns per-row losses")
    if values.numel() == rows:
        return values.reshape(rows)  # one value per row already: its mean is itself
    return values.reshape(rows, -1).mean(dim=1)


class LossFunction:
    """The training loss: each label's loss, weighted by ``loss_weights`` and summed.

    With sample weights, each row's loss is multiplied by its weight and the products are
    averaged over the batch (as Horovod does): a row's influence then does not depend on the
    other weights in its batch.
    """

    def __init__(self, losses: Sequence[Callable[..., Any]], loss_weights: Sequence[float]) -> None:
        self.losses = list(losses)
        self.loss_weights = [float(w) for w in loss_weights]
        self._unreduced: Optional[List[Callable[..., Any]]] = None  # made at the first weighted batch

    def __call__(self, outputs: Sequence[torch.Tensor], labels: Sequence[torch.Tensor],
                 sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        total: Optional[torch.Tensor] = None
        unreduced = self.losses
        if sample_weights is not None:
            if self._unreduced is None:
                self._unreduced = [_unreduced(fn) for fn in self.losses]
            unreduced = self._unreduced
        for fn, per_element, weight, output, label in zip(self.losses, unreduced, self.loss_weights, outputs, labels):
            if sample_weights is None:
                value = fn(output, label)
            else:
                value = (_per_row(per_element, output, label) * sample_weights.to(output.dtype)).mean()
            if value.dim() != 0:
                value = value.mean()
            term = value * weight if weight != 1.0 else value
            total = term if total is None else total + term
        assert total is not None, "a LossFunction has at least one loss"
        return total


def metric_names(metrics: Sequence[Callable[..., Any]], label_cols: Sequence[str]) -> List[str]:
    """History keys of the metrics: the function's name (per label when there are several labels),
    made unique with a numeric suffix."""
    base = [getattr(m, "__name__", None) or type(m).__name__ for m in metrics]
    base = [name if name != "<lambda>" else "metric" for name in base]
    names: List[str] = []
    for name in base:
        for label in (label_cols if len(label_cols) > 1 else [None]):
            full = f"{label}_{name}" if label is not None else name
            candidate, n = full, 1
            while candidate in names or candidate in ("loss", "epoch"):
                n += 1
                candidate = f"{full}_{n}"
            names.append(candidate)
    return names


def metric_values(metrics: Sequence[Callable[..., Any]], names: Sequence[str], outputs: Sequence[torch.Tensor],
                  labels: Sequence[torch.Tensor]) -> Dict[str, float]:
    """Each metric of each (output, label) pair as a float, keyed as :func:`metric_names` says."""
    return {name: float(value) for name, value in metric_tensors(metrics, names, outputs, labels).items()}


def metric_tensors(metrics: Sequence[Callable[..., Any]], names: Sequence[str], outputs: Sequence[torch.Tensor],
                   labels: Sequence[torch.Tensor]) -> Dict[str, Any]:
    """Like :func:`metric_values`, but a metric that returns a tensor stays a 0-d float64 tensor on
    its device: summed over an epoch without a device synchronization per step."""
    values: Dict[str, Any] = {}
    it = iter(names)
    for metric in metrics:
        for output, label in zip(outputs, labels):
            value = metric(output.detach(), label)
            values[next(it)] = value.detach().double().mean() if isinstance(value, torch.Tensor) else float(value)
    return values
