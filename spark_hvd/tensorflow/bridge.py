"""The one path from TensorFlow tensors to the runtime, eagerly and inside ``tf.function``.

:func:`collective` runs an operation on a list of tensors. Eagerly it hands the tensors' numpy
views to the runtime and wraps the results. While a graph is being built (``tf.function``,
Keras's compiled ``train_step``) it adds one ``tf.numpy_function`` op that does the same when the
graph runs. Graph ops are keyed across ranks by a name derived from the graph (the user's name,
or the kind and the input tensor's name) plus how often this process has run that name, so the
same graph run many times never puts two requests of one name in flight, and ranks agree on
names whatever order TensorFlow schedules independent ops in. Within one graph every collective
also waits for the previous one (a control dependency), so a rank never blocks a TensorFlow
thread on one collective while its peers wait on another.
"""

from __future__ import annotations

import os
import re
import threading
import weakref
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

import spark_hvd.runtime as _rt
from spark_hvd.runtime.errors import RankMismatchError
from spark_hvd.tensorflow.basics import Average, global_process_set, on_new_world
from spark_hvd.runtime.kinds import ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, JOIN, REDUCESCATTER

__all__ = ["collective", "executing_eagerly", "MismatchError", "InvalidArgument", "KINDS"]

KINDS = (ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER, BARRIER, JOIN)
_REDUCTIONS = frozenset({ALLREDUCE, REDUCESCATTER})

# TensorFlow dtype -> (the numpy dtype the runtime reads, the wire name the runtime is told).
_REDUCIBLE: Dict[tf.dtypes.DType, Tuple[np.dtype, Optional[str]]] = {
    tf.float16: (np.dtype(np.float16), None),
    tf.bfloat16: (np.dtype(np.uint16), "bfloat16"),
    tf.float32: (np.dtype(np.float32), None),
    tf.float64: (np.dtype(np.float64), None),
    tf.int8: (np.dtype(np.int8), None),
    tf.int16: (np.dtype(np.int16), None),
    tf.int32: (np.dtype(np.int32), None),
    tf.int64: (np.dtype(np.int64), None),
    tf.uint8: (np.dtype(np.uint8), None),
    tf.bool: (np.dtype(np.bool_), None),
}
# Moved, never reduced: unsigned integers travel as the signed integers of their width.
_MOVABLE = {
    **_REDUCIBLE,
    tf.uint16: (np.dtype(np.int16), None),
    tf.uint32: (np.dtype(np.int32), None),
    tf.uint64: (np.dtype(np.int64), None),
}


class MismatchError(RankMismatchError, tf.errors.FailedPreconditionError):
    """Ranks disagreed on an operation (shape, dtype, op, root rank): Horovod's FailedPreconditionError,
    and spark-hvd's RankMismatchError."""

    def __init__(self, message: str) -> None:
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)
        self.lost_rank = None


class InvalidArgument(tf.errors.InvalidArgumentError, ValueError):
    """A collective was called with arguments it cannot take: Horovod's InvalidArgumentError, and a ValueError."""

    def __init__(self, message: str) -> None:
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)


def executing_eagerly() -> bool:
    """Whether operations run at once (True) or are being added to a graph (inside ``tf.function``)."""
    return tf.executing_eagerly()


@dataclass(frozen=True)
class _Call:
    """Everything about one collective except its tensors; fixed when the op is created."""

    kind: str
    name: Optional[str]
    grouped: bool
    dtypes: Tuple[tf.dtypes.DType, ...]
    op: int = Average
    prescale_factor: float = 1.0
    postscale_factor: float = 1.0
    root_rank: int = 0
    has_splits: bool = False
    process_set: Any = global_process_set
    lockstep: bool = False


# -- names of graph operations ----------------------------------------------------------------------

_lock = threading.Lock()
_runs: Dict[str, int] = {}
_names_in_graph: "weakref.WeakKeyDictionary[Any, Dict[str, int]]" = weakref.WeakKeyDictionary()
_last_in_graph: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def _forget_runs() -> None:
    with _lock:
        _runs.clear()


on_new_world(_forget_runs)


def _graph_name(graph: Any, kind: str, name: Optional[str], tensors: Sequence[Any]) -> str:
    """A name for a new graph op, the same on every rank that builds the same graph."""
    if name:
        base = f"{kind}.{name}"
    else:
        source = tensors[0].name if tensors and hasattr(tensors[0], "name") else "none"
        base = f"{kind}.Horovod_{re.sub('[^a-zA-Z0-9_]', '_', source)}"
    with _lock:
        taken = _names_in_graph.setdefault(graph, {})
        count = taken.get(base, 0)
        taken[base] = count + 1
    return base if count == 0 else f"{base}_{count}"


def _next_run(base: str) -> str:
    with _lock:
        count = _runs.get(base, 0)
        _runs[base] = count + 1
    return f"{base}.{count}"


# -- staging between tensors and arrays --------------------------------------------------------------


def _check_dtype(dtype: tf.dtypes.DType, reduction: bool, what: str) -> None:
    table = _REDUCIBLE if reduction else _MOVABLE
    if dtype.base_dtype not in table:
        names = ", ".join(sorted(d.name for d in table))
        verb = "reduced" if reduction else "moved"
        raise InvalidArgument(
            f"{what} has dtype {dtype.name}, which cannot be {verb}; expected one of {names}. "
            f"Cast it first, e.g. tf.cast({what.split('[')[0]}, tf.float32)."
        )


def _to_runtime(array: np.ndarray, dtype: tf.dtypes.DType) -> np.ndarray:
    storage = _MOVABLE[dtype.base_dtype][0]
    array = np.ascontiguousarray(array)
    if array.ndim == 0:
        array = array.reshape(1)  # the runtime splits and concatenates along dimension 0
    return array.view(storage) if array.dtype != storage else array


def _from_runtime(array: np.ndarray, dtype: tf.dtypes.DType, scalar: bool) -> np.ndarray:
    target = np.dtype(dtype.base_dtype.as_numpy_dtype)
    if array.dtype != target:
        array = array.view(target)
    return array.reshape(()) if scalar else array


def _wire(call: _Call) -> Optional[str]:
    wires = {_MOVABLE[d.base_dtype][1] for d in call.dtypes}
    if len(wires) > 1:
        raise InvalidArgument(
            f"grouped_{call.kind} got tensors of dtypes {sorted(d.name for d in call.dtypes)}; bfloat16 cannot "
            "share a group with other dtypes. Put the bfloat16 tensors in a separate grouped call."
        )
    return next(iter(wires), None)


def _execute(call: _Call, name: Optional[str], arrays: Sequence[np.ndarray]) -> List[np.ndarray]:
    """Run ``call`` on numpy arrays and return numpy arrays of the callers' dtypes (blocking)."""
    try:
        return _execute_unchecked(call, name, arrays)
    except RankMismatchError as exc:
        raise MismatchError(str(exc)) from None
    except tf.errors.OpError:
        raise
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def _execute_unchecked(call: _Call, name: Optional[str], arrays: Sequence[np.ndarray]) -> List[np.ndarray]:
    kind, ps = call.kind, call.process_set
    if kind == JOIN:
        last = _rt.join()
        _forget_runs()  # ranks ran different numbers of operations before joining: number them afresh
        return [np.asarray(last, dtype=np.int32)]
    if kind == BARRIER:
        _rt.barrier(process_set=ps)
        return [np.zeros((), np.int32)]
    splits = None
    if call.has_splits:
        splits = np.asarray(arrays[-1]).reshape(-1).astype(np.int64)
        arrays = arrays[:-1]
    scalars = [np.ndim(a) == 0 for a in arrays]
    staged = [_to_runtime(a, d) for a, d in zip(arrays, call.dtypes)]
    wire = _wire(call)
    common: Dict[str, Any] = dict(name=name, dtype=wire, process_set=ps)
    if kind in _REDUCTIONS:
        common.update(op=call.op, prescale_factor=call.prescale_factor, postscale_factor=call.postscale_factor)
    if kind == ALLREDUCE and call.lockstep and len(staged) == 1 and wire is None:
        # TensorFlow's input memory is not this op's to write: the fast path reduces a copy.
        mine = np.array(staged[0], copy=True)
        if _rt.allreduce_lockstep(mine, op=call.op, name=call.name or "allreduce.lockstep",
                                  prescale_factor=call.prescale_factor, postscale_factor=call.postscale_factor,
                                  process_set=ps) is not None:
            return [_from_runtime(mine, call.dtypes[0], scalars[0])]
    if kind == ALLREDUCE:
        results = _rt.grouped_allreduce(staged, **common) if call.grouped else [_rt.allreduce(staged[0], **common)]
    elif kind == REDUCESCATTER:
        results = (_rt.grouped_reducescatter(staged, **common) if call.grouped
                   else [_rt.reducescatter(staged[0], **common)])
        scalars = [False] * len(staged)
    elif kind == ALLGATHER:
        results = _rt.grouped_allgather(staged, **common) if call.grouped else [_rt.allgather(staged[0], **common)]
        scalars = [False] * len(staged)
    elif kind == BROADCAST:
        results = [_rt.broadcast(staged[0], call.root_rank, **common)]
    elif kind == ALLTOALL:
        received, received_splits = _rt.alltoall(staged[0], splits=splits, **common)
        return [_from_runtime(received, call.dtypes[0], False),
                np.asarray(received_splits, dtype=np.int32).reshape(-1)]
    else:
        raise ValueError(f"kind={kind!r} is not a collective; expected one of {KINDS}")
    return [_from_runtime(r, d, s) for r, d, s in zip(results, call.dtypes, scalars)]


# -- output shapes of graph ops --------------------------------------------------------------------


def _set_size(process_set: Any) -> Optional[int]:
    try:
        return process_set.size() if process_set is not None else _rt.size()
    except Exception:  # shapes are a hint; an uninitialized runtime fails at run time instead
        return None


def _static_shapes(call: _Call, tensors: Sequence[tf.Tensor]) -> List[tf.TensorShape]:
    shapes = [t.shape for t in tensors[: len(call.dtypes)]]
    if call.kind in (ALLREDUCE, BROADCAST):
        return shapes
    if call.kind in (JOIN, BARRIER):
        return [tf.TensorShape([])]
    rows = [tf.TensorShape([None]).concatenate(s[1:]) if s.rank else tf.TensorShape(None) for s in shapes]
    if call.kind == ALLTOALL:
        return rows + [tf.TensorShape([_set_size(call.process_set)])]
    if call.kind == REDUCESCATTER:
        n = _set_size(call.process_set)
        for i, s in enumerate(shapes):
            if n and s.rank and s[0] is not None:
                me = call.process_set.rank() if call.process_set is not None else _rt.rank()
                rows[i] = tf.TensorShape([s[0] // n + (1 if me < s[0] % n else 0)]).concatenate(s[1:])
    return rows


def _out_dtypes(call: _Call) -> List[tf.dtypes.DType]:
    if call.kind in (JOIN, BARRIER):
        return [tf.int32]
    if call.kind == ALLTOALL:
        return [call.dtypes[0], tf.int32]
    return list(call.dtypes)


# -- the entry point --------------------------------------------------------------------------------


def collective(kind: str, tensors: Sequence[Any], *, grouped: bool = False, name: Optional[str] = None,
               op: int = Average, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               root_rank: int = 0, splits: Any = None, process_set: Any = global_process_set,
               lockstep: bool = False) -> List[tf.Tensor]:
    """Run ``kind`` over the ranks on ``tensors`` (eagerly, or as a graph op) and return the outputs.

    The outputs are one tensor per input (alltoall adds the received splits; join and barrier
    return one int32 scalar). Not differentiable by itself: :mod:`spark_hvd.tensorflow.mpi_ops`
    adds the gradients. ``lockstep=True`` (an allreduce of one tensor) is the caller's promise
    that every rank runs this op in the same program order, as a training step's only gradient
    reduction: it then skips negotiation (the program-order path of
    :func:`spark_hvd.runtime.allreduce_lockstep`: shared memory on one host, direct links between hosts).
    """
    if name is not None and not isinstance(name, str):
        raise InvalidArgument(f"name={name!r} is invalid: expected a string (or None for an automatic name)")
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if grouped and not tensors:
        raise InvalidArgument(f"grouped_{kind} got an empty list of tensors; expected at least one tensor")
    for i, t in enumerate(tensors):
        _check_dtype(t.dtype, kind in _REDUCTIONS, f"tensors[{i}]" if grouped else "tensor")
        if kind == REDUCESCATTER and t.shape.rank == 0:
            what = f"tensors[{i}]" if grouped else "tensor"
            raise InvalidArgument(
                f"{what} is 0-dimensional (shape ()), but reducescatter splits dimension 0 across ranks and "
                "needs at least one dimension; reshape it, e.g. tf.reshape(tensor, [1]), or use allreduce"
            )
    call = _Call(kind=kind, name=name or None, grouped=grouped, dtypes=tuple(t.dtype for t in tensors), op=op,
                 prescale_factor=float(prescale_factor), postscale_factor=float(postscale_factor),
                 root_rank=int(root_rank), has_splits=splits is not None, process_set=process_set,
                 lockstep=bool(lockstep) and kind == ALLREDUCE and len(tensors) == 1)
    _wire(call)
    inputs = list(tensors)
    if splits is not None:
        inputs.append(tf.cast(tf.convert_to_tensor(splits), tf.int64))

    if executing_eagerly():
        op_name = f"{kind}.{name}" if name else None
        outs = _execute(call, op_name, [t.numpy() for t in inputs])
        return [tf.convert_to_tensor(o) for o in outs]
    return _graph_op(call, inputs)


def _graph_op(call: _Call, inputs: List[tf.Tensor]) -> List[tf.Tensor]:
    graph = tf.compat.v1.get_default_graph()
    if control_flow_util.GraphOrParentsInXlaContext(graph):
        raise ValueError(
            f"spark-hvd's {call.kind} cannot be compiled by XLA: it runs as a Python-function op. Compile "
            "without XLA: model.compile(..., jit_compile=False), or tf.function(jit_compile=False)."
        )
    base = _graph_name(graph, call.kind, call.name, inputs)
    call = replace(call, name=base)

    shapes = _static_shapes(call, inputs)
    dtypes = _out_dtypes(call)

    def run(*arrays: np.ndarray) -> List[Any]:
        try:
            return [*_execute(call, _next_run(base), arrays), b""]
        except tf.errors.FailedPreconditionError as exc:
            # Handed to _raise_failed_precondition as the last output; the others are placeholders
            # no op reads.
            placeholders = [np.zeros([d or 0 for d in s.as_list()] if s.rank is not None else [0],
                                     t.as_numpy_dtype) for s, t in zip(shapes, dtypes)]
            return [*placeholders, exc.message.encode("utf-8", "replace")]

    with _lock:
        previous = _last_in_graph.get(graph)
    with tf.control_dependencies([previous] if previous is not None else []):
        *outs, failure = tf.numpy_function(run, inputs, [*dtypes, tf.string], stateful=True,
                                           name=re.sub("[^a-zA-Z0-9_]", "_", base)[:120])
    with tf.control_dependencies([_raise_failed_precondition(failure)]):
        outs = [tf.identity(out) for out in outs]
    with _lock:
        _last_in_graph[graph] = outs[0].op
    for out, shape in zip(outs, shapes):
        out.set_shape(shape)
    return list(outs)


# A Python function op reports every exception by its Python type alone (ValueError and TypeError as
# InvalidArgumentError, most others as UnknownError), and FailedPreconditionError, what Horovod's
# graph ops raise when ranks disagree, is none of them. So the op returns that error's message, and
# an op whose kernel fails with FAILED_PRECONDITION and a message given at run time raises it:
# opening a path below a file that is not a directory fails with ENOTDIR, which TensorFlow's file
# system layer maps to FAILED_PRECONDITION with the path in the message.
_MESSAGE_BYTES = 2048  # well under PATH_MAX: a longer path would fail with another code


def _raise_failed_precondition(message: tf.Tensor) -> tf.Tensor:
    """An op that raises ``FailedPreconditionError(message)`` when ``message`` is not empty."""

    def fail() -> tf.Tensor:
        path = tf.strings.join([f"{os.devnull}/\nspark-hvd: ", tf.strings.substr(message, 0, _MESSAGE_BYTES), "\n"])
        return tf.io.read_file(path)

    return tf.cond(tf.strings.length(message) > 0, fail, lambda: tf.constant(b""))
