"""The fingerprint of a run: what a ``run_id`` trains, so a re-run of something else is refused.

A checkpoint records a hash of each part: the model's architecture (its printed structure and
the names, shapes and dtypes of its tensors, not their values), the optimizer (class and
hyperparameters), the loss (each loss and its weight) and the data (columns, their types, and
the DataFrame's plan, files and in-memory rows as ``data.data_identity`` hashes them, the same in
a new process, so a fit re-run after a crash resumes). Resuming compares part by part and names what
changed.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from spark_hvd.spark.data import data_identity

__all__ = ["run_fingerprint", "changed_parts"]

_PARTS = ("model architecture", "optimizer", "loss", "data")


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=repr).encode()).hexdigest()[:16]


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
    fields = {f.name: f.dataType.simpleString() for f in df.schema.fields}
    semantic: Any = data_identity(df, columns)
    if semantic is None:
        try:
            semantic = int(df.semanticHash())
        except Exception:  # a plan Spark cannot hash still has its columns and types
            semantic = None
    return {
        "model architecture": _digest([type(model).__qualname__, repr(model), tensors]),
        "optimizer": _digest([optimizer.cls.__qualname__, sorted((k, repr(v)) for k, v in optimizer.defaults.items()),
                              hyper]),
        "loss": _digest([_describe(fn) for fn in losses] + [list(loss_weights)]),
        "data": _digest([[(c, fields.get(c)) for c in columns], repr(validation), semantic]),
    }


def changed_parts(recorded: Optional[Mapping[str, str]], current: Mapping[str, str]) -> List[str]:
    """The parts whose hash differs; every part when nothing was recorded (an older checkpoint)."""
    if not recorded:
        return list(_PARTS)
    return [part for part in _PARTS if recorded.get(part) != current.get(part)]
