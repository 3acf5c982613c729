"""Keras models as bytes, and the checkpoint of a KerasEstimator run.

A checkpoint is one ``.keras`` file (Keras's own zip format, loadable with
``keras.saving.load_model``) that also holds, under ``spark_hvd/``, the run's state as JSON
(completed epochs, history, fingerprint; within an epoch also the batches done, the epoch's
running metrics and the shuffle seed) and the optimizer's variables in order, so a resumed run
continues with the same moments and step count. It is written whole through
``Store.write``, which makes it visible atomically.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import zipfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np

__all__ = ["CHECKPOINT_FORMAT", "CHECKPOINT_NAME", "KerasCheckpoint", "model_bytes", "load_model_bytes",
           "checkpoint_bytes", "read_checkpoint"]

CHECKPOINT_FORMAT = 1
"""Version of the layout under ``spark_hvd/``; a checkpoint of another version is not resumed."""

CHECKPOINT_NAME = "checkpoint.keras"
"""File name of the checkpoint in the run's directory of the store."""

_STATE = "spark_hvd/state.json"
_OPTIMIZER = "spark_hvd/optimizer.npz"


def model_bytes(model: Any) -> bytes:
    """``model`` saved in the ``.keras`` format, as bytes."""
    with tempfile.TemporaryDirectory(prefix="spark-hvd-keras-") as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def load_model_bytes(data: bytes, custom_objects: Optional[Dict[str, Any]] = None, compile: bool = False) -> Any:
    """The model saved in ``data`` (``.keras`` bytes) by the Keras that saved it (Keras 3, or
    Keras 2's ``tf_keras``); uncompiled unless ``compile``."""
    from spark_hvd.spark.keras.flavor import saved_keras

    keras = saved_keras(data)
    with tempfile.TemporaryDirectory(prefix="spark-hvd-keras-") as tmp:
        path = os.path.join(tmp, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        return keras.saving.load_model(path, custom_objects=custom_objects, compile=compile)


@dataclass
class KerasCheckpoint:
    """What a checkpoint holds besides the model."""

    epoch: int
    """Completed epochs."""
    history: List[Dict[str, Any]] = field(default_factory=list)
    fingerprint: Dict[str, str] = field(default_factory=dict)
    optimizer_variables: List[np.ndarray] = field(default_factory=list)
    """The optimizer's variables in ``optimizer.variables`` order (its learning rate included)."""
    model: bytes = b""
    """The ``.keras`` bytes (the whole checkpoint file)."""
    batch: int = 0
    """Batches of epoch ``epoch`` (counted from 0) already trained: a mid-epoch checkpoint; else 0."""
    partial: Dict[str, float] = field(default_factory=dict)
    """A mid-epoch checkpoint's running means of that epoch's metrics, averaged over the ranks."""
    seed: Optional[int] = None
    """The shuffle seed of the run, so a mid-epoch resume keeps the epoch's batch order."""


def checkpoint_bytes(model: Any, epoch: int, history: List[Dict[str, Any]], fingerprint: Dict[str, str],
                     optimizer_variables: List[np.ndarray], batch: int = 0,
                     partial: Optional[Dict[str, float]] = None, seed: Optional[int] = None) -> bytes:
    """The checkpoint file: ``model`` as ``.keras`` with the run's state added to the archive
    (``batch``, ``partial`` and ``seed`` for a checkpoint within epoch ``epoch``)."""
    data = model_bytes(model)
    buf = io.BytesIO(data)
    with zipfile.ZipFile(buf, "a") as archive:
        archive.writestr(_STATE, json.dumps({"format": CHECKPOINT_FORMAT, "epoch": epoch, "history": history,
                                             "fingerprint": fingerprint, "batch": batch,
                                             "partial": dict(partial or {}), "seed": seed}))
        arrays = io.BytesIO()
        np.savez(arrays, *[np.asarray(v) for v in optimizer_variables])
        archive.writestr(_OPTIMIZER, arrays.getvalue())
    return buf.getvalue()


def read_checkpoint(data: bytes) -> KerasCheckpoint:
    """Inverse of :func:`checkpoint_bytes`; a ValueError for a file of another format."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            state = json.loads(archive.read(_STATE))
            with np.load(io.BytesIO(archive.read(_OPTIMIZER)), allow_pickle=False) as arrays:
                variables = [arrays[f"arr_{i}"] for i in range(len(arrays.files))]
    except (KeyError, zipfile.BadZipFile, ValueError) as exc:
        raise ValueError(f"not a KerasEstimator checkpoint ({exc})") from None
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint format {state.get('format')} is not {CHECKPOINT_FORMAT}")
    return KerasCheckpoint(epoch=int(state["epoch"]), history=list(state["history"]),
                           fingerprint=dict(state.get("fingerprint") or {}), optimizer_variables=variables,
                           model=data, batch=int(state.get("batch") or 0), partial=dict(state.get("partial") or {}),
                           seed=state.get("seed"))
