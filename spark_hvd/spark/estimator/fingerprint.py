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

__all__ = ["PARTS", "digest", "data_digest", "changed_parts", "start_over_or_refuse"]

PARTS = ("model architecture", "optimizer", "loss", "data")
"""The parts of a fingerprint, in the order messages name them."""


def digest(value: Any) -> str:
    """A short stable hash of a JSON-like value (other objects by their repr)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def data_digest(df: Any, columns: Sequence[str], validation: Any) -> str:
    """The data part: the columns and their types, the validation setting, and the DataFrame's
    plan, files and in-memory rows as ``data.data_identity`` hashes them: the same in a new
    process (Spark's semantic hash is not), so a fit re-run after a crash resumes."""
    from spark_hvd.spark.data.identity import data_identity

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


def start_over_or_refuse(store: Any, run_id: str, changed: Sequence[str], overwrite: bool,
                         epochs_done: Optional[int]) -> None:
    """``run_id``'s checkpoint trained something else (the ``changed`` parts): with ``overwrite``,
    delete the run so the fit starts over; otherwise refuse with a ValueError naming what changed
    (resuming would continue another training and return its model)."""
    import logging

    if overwrite:
        logging.getLogger("spark_hvd.spark").warning("run_id=%r: starting over; its checkpoint trained a different %s",
                                                     run_id, ", ".join(changed))
        store.delete(store.get_run_path(run_id))
        return
    trained = f" ({epochs_done} epoch(s) done)" if epochs_done is not None else ""
    raise ValueError(
        f"run_id={run_id!r} already holds a checkpoint{trained} of a different {', '.join(changed)}: "
        "resuming it would continue another training and return its model; fix: use a new run_id (or "
        f"leave run_id unset for a new run every fit), or pass overwrite_run=True to start {run_id!r} over")
