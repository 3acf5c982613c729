"""Whole-model helpers: broadcast variables and Python objects between ranks, gather objects."""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional

import tensorflow as tf

import spark_hvd.runtime as _rt
from spark_hvd.tensorflow.basics import global_process_set
from spark_hvd.tensorflow.bridge import collective
from spark_hvd.runtime.kinds import BROADCAST

__all__ = ["broadcast_variables", "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
           "allgather_object"]


def broadcast_variables(variables: Iterable[tf.Variable], root_rank: int, process_set: Any = global_process_set,
                        inplace: bool = False) -> Optional[tf.Operation]:
    """Overwrite each of ``variables`` with its value on ``root_rank``.

    Afterwards every rank's variables hold root_rank's values. Eagerly this happens at once and
    returns None; inside ``tf.function`` it returns the op that assigns them. ``inplace`` is
    accepted for Horovod compatibility.
    """
    variables = list(variables)
    bad = [i for i, v in enumerate(variables) if not isinstance(v, tf.Variable)]
    if bad:
        raise ValueError(f"variables[{bad[0]}] is a {type(variables[bad[0]]).__name__}, not a tf.Variable; "
                         "broadcast_variables overwrites variables (use broadcast() for tensors)")
    assigns = []
    for var in variables:
        value = collective(BROADCAST, [var.read_value()], root_rank=root_rank, process_set=process_set)[0]
        assigns.append(var.assign(value))
    if tf.executing_eagerly():
        return None
    return tf.group(*assigns)


def broadcast_global_variables(root_rank: int) -> Optional[tf.Operation]:
    """The op that overwrites every global variable of the default graph with its value on
    ``root_rank`` (TensorFlow 1 style graphs: ``tf.compat.v1.global_variables()``), as in Horovod.

    Eagerly there are no global variables to find, so this raises RuntimeError naming the
    replacement: ``broadcast_variables(model.variables, root_rank)`` (or, with Keras,
    ``spark_hvd.keras.callbacks.BroadcastGlobalVariablesCallback``).
    """
    if tf.executing_eagerly():
        raise RuntimeError(
            "broadcast_global_variables() works on the global variables of a TensorFlow 1 style graph, and eagerly "
            f"there are none; call hvd.broadcast_variables(model.variables, root_rank={root_rank}) instead, or with "
            "Keras use hvd.callbacks.BroadcastGlobalVariablesCallback"
        )
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                     process_set: Any = global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (serialized with cloudpickle).

    Afterwards every rank holds an equal copy. ``session`` is accepted for Horovod compatibility.
    """
    return _rt.broadcast_object(obj, root_rank=root_rank, name=name, process_set=process_set)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                        process_set: Any = global_process_set) -> Callable[[Any], Any]:
    """A function that broadcasts its argument from ``root_rank`` (see :func:`broadcast_object`)."""
    def broadcast(obj: Any) -> Any:
        return broadcast_object(obj, root_rank=root_rank, name=name, process_set=process_set)

    return broadcast


def allgather_object(obj: Any, session: Any = None, name: Optional[str] = None,
                     process_set: Any = global_process_set) -> List[Any]:
    """Return the list of every rank's ``obj``, in rank order, on every rank."""
    return _rt.allgather_object(obj, name=name, process_set=process_set)
