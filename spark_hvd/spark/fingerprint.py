"""The fingerprint of a run: what a ``run_id`` trains, so a re-run of something else is refused.

A checkpoint records a short hash of each part: the model's architecture, the optimizer, the
loss and the data. The framework packages hash their models, optimizers and losses (without
weights); the data part, the hashing and the comparison are the same for every framework.
Resuming compares part by part and names what changed.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, List, Mapping, Optional, Sequence

__all__ = ["PARTS", "digest", "data_digest", "changed_parts"]

PARTS = ("model architecture", "optimizer", "loss", "data")
"""The parts of a fingerprint, in the order messages name them."""


def digest(value: Any) -> str:
    """A short stable hash of a JSON-like value (other objects by their repr)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def data_digest(df: Any, columns: Sequence[str], validation: Any) -> str:
    """The data part: the columns and their types, the validation setting, and the DataFrame's
    plan, files and in-memory rows as ``data.data_identity`` hashes them: the same in a new
    process (Spark's semantic hash is not), so a fit re-run after a crash resumes."""
    from spark_hvd.spark.data import data_identity

    fields = {f.name: f.dataType.simpleString() for f in df.schema.fields}
    semantic: Any = data_identity(df, columns)
    if semantic is None:
        try:
            semantic = int(df.semanticHash())
        except Exception:  # a plan Spark cannot hash still has its columns and types
            semantic = None
    return digest([[(c, fields.get(c)) for c in columns], repr(validation), semantic])


def changed_parts(recorded: Optional[Mapping[str, str]], current: Mapping[str, str]) -> List[str]:
    """The parts whose hash differs; every part when nothing was recorded (an older checkpoint)."""
    if not recorded:
        return list(PARTS)
    return [part for part in PARTS if recorded.get(part) != current.get(part)]
