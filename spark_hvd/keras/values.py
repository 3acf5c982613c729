"""Collectives on Keras values (numpy arrays, backend tensors, Keras variables), returning numpy arrays.

They run outside any compiled step (in callbacks, between epochs), so they go straight to the
runtime on numpy copies and work the same on every Keras backend.
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

import spark_hvd.runtime as _rt
from spark_hvd.keras.compression import Compression, Compressor
from spark_hvd.runtime.ops import Average, Sum
from spark_hvd.runtime.kinds import ALLGATHER, ALLREDUCE, BROADCAST

__all__ = ["allreduce", "allgather", "broadcast", "broadcast_object", "allgather_object",
           "broadcast_global_variables", "broadcast_variables", "to_numpy", "resolve_op"]


def to_numpy(value: Any) -> np.ndarray:
    """``value`` as a numpy array (Keras variables and backend tensors are converted)."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "numpy"):
        return np.asarray(value.numpy())
    import keras

    return np.asarray(keras.ops.convert_to_numpy(value))


def resolve_op(op: Optional[int], average: Optional[bool]) -> int:
    """Horovod's deprecated ``average=`` flag folded into ``op`` (default Average)."""
    if average is not None:
        if op is not None:
            raise ValueError(f"both op={op!r} and average={average!r} were given; pass only op")
        return Average if average else Sum
    return Average if op is None else op


def _staged(array: np.ndarray) -> tuple:
    array = np.ascontiguousarray(array)
    if array.dtype.name == "bfloat16":
        return array.view(np.uint16), "bfloat16"
    return array, None


def _named(kind: str, name: Optional[str]) -> Optional[str]:
    return f"keras.{kind}.{name}" if name else None


def allreduce(value: Any, name: Optional[str] = None, average: Optional[bool] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op: Optional[int] = None,
              compression: Compressor = Compression.none, process_set: Any = _rt.global_process_set) -> np.ndarray:
    """Reduce ``value`` over the ranks (default op: Average) and return the result as a numpy array.

    Afterwards the result is identical on all ranks, with the value's shape and dtype.
    ``compression`` is accepted for Horovod compatibility (values travel uncompressed).
    """
    array = to_numpy(value)
    staged, wire = _staged(array.reshape(1) if array.ndim == 0 else array)
    out = _rt.allreduce(staged, op=resolve_op(op, average), name=_named(ALLREDUCE, name),
                        prescale_factor=prescale_factor, postscale_factor=postscale_factor, dtype=wire,
                        process_set=process_set)
    return out.view(array.dtype).reshape(array.shape)


def allgather(value: Any, name: Optional[str] = None, process_set: Any = _rt.global_process_set) -> np.ndarray:
    """Concatenate every rank's ``value`` along dimension 0, in rank order; a numpy array, the same on all ranks."""
    array = to_numpy(value)
    staged, wire = _staged(array.reshape(1) if array.ndim == 0 else array)
    return _rt.allgather(staged, name=_named(ALLGATHER, name), dtype=wire, process_set=process_set).view(array.dtype)


def broadcast(value: Any, root_rank: int, name: Optional[str] = None,
              process_set: Any = _rt.global_process_set) -> np.ndarray:
    """Return ``root_rank``'s ``value`` on every rank, as a numpy array of its shape and dtype."""
    array = to_numpy(value)
    staged, wire = _staged(array.reshape(1) if array.ndim == 0 else array)
    out = _rt.broadcast(staged, root_rank, name=_named(BROADCAST, name), dtype=wire, process_set=process_set)
    return out.view(array.dtype).reshape(array.shape)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: Any = _rt.global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (serialized with cloudpickle)."""
    return _rt.broadcast_object(obj, root_rank=root_rank, name=name, process_set=process_set)


def allgather_object(obj: Any, name: Optional[str] = None, process_set: Any = _rt.global_process_set) -> List[Any]:
    """Return the list of every rank's ``obj``, in rank order, on every rank."""
    return _rt.allgather_object(obj, name=name, process_set=process_set)


def broadcast_variables(variables: Any, root_rank: int, process_set: Any = _rt.global_process_set) -> None:
    """Overwrite each Keras (or backend) variable with its value on ``root_rank``.

    Afterwards every rank holds root_rank's values. Variables of one dtype travel as one buffer.
    """
    variables = list(variables)
    by_dtype: dict = {}
    for var in variables:
        array = to_numpy(var)
        by_dtype.setdefault(array.dtype.str if array.dtype.name != "bfloat16" else "bfloat16", []).append(
            (var, array))
    for key in sorted(by_dtype):
        members = by_dtype[key]
        flat = np.concatenate([a.reshape(-1) for _, a in members]) if members else np.empty(0)
        flat = broadcast(flat, root_rank, name=f"variables.{key}.{len(members)}", process_set=process_set)
        start = 0
        for var, array in members:
            var.assign(flat[start:start + array.size].reshape(array.shape))
            start += array.size


def broadcast_global_variables(root_rank: int, model: Any = None) -> None:
    """Overwrite ``model``'s variables and its optimizer's with their values on ``root_rank``.

    Keras 3 keeps no global variable collection, so the model must be named; afterwards every
    rank holds root_rank's weights and optimizer state.
    """
    if model is None:
        raise ValueError(
            "broadcast_global_variables(root_rank, model) needs the model: Keras 3 keeps no global variables. "
            "Pass the model, or add hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) to model.fit"
        )
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        variables += list(optimizer.variables)
    broadcast_variables(variables, root_rank)
