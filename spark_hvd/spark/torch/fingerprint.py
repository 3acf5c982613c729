"""The fingerprint of a run: what a ``run_id`` trains, so a re-run of something else is refused.

A checkpoint records a hash of each part: the model's architecture (its printed structure and
the names, shapes and dtypes of its tensors, not their values), the optimizer (class and
hyperparameters), the loss (each loss and its weight) and the data (columns, their types, and
the DataFrame's plan, files and in-memory rows, hashed the same in a new process). Resuming
compares part by part and names what changed.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence

import torch

from spark_hvd.spark.estimator.fingerprint import changed_parts, data_digest
from spark_hvd.spark.estimator.fingerprint import digest as _digest

__all__ = ["run_fingerprint", "changed_parts"]


def _describe(fn: Any) -> str:
    if isinstance(fn, torch.nn.Module):
        return repr(fn)
    # A function's repr holds its address, which changes every session.
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def run_fingerprint(model: torch.nn.Module, optimizer: Any, losses: Sequence[Any], loss_weights: Sequence[float],
                    df: Any, columns: Sequence[str], validation: Any) -> Dict[str, str]:
    """One short hash per part of the run (``optimizer`` is an ``OptimizerSpec``)."""
    tensors = [(name, list(t.shape), str(t.dtype)) for name, t in model.state_dict().items()]
    hyper = [sorted((k, repr(v)) for k, v in group.items()) for _, group in optimizer.groups]
    return {
        "model architecture": _digest([type(model).__qualname__, repr(model), tensors]),
        "optimizer": _digest([optimizer.cls.__qualname__, sorted((k, repr(v)) for k, v in optimizer.defaults.items()),
                              hyper]),
        "loss": _digest([_describe(fn) for fn in losses] + [list(loss_weights)]),
        "data": data_digest(df, columns, validation),
    }
