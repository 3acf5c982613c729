"""Horovod's TensorFlow collectives, each a short call of the one bridge, with Horovod's gradients.

Every function works eagerly and inside ``tf.function`` on ``tf.Tensor`` and ``tf.Variable``
(read at call time). Gradients, for a rank's output gradient ``g``:

- allreduce: ``allreduce(g)`` with the same op and scale factors;
- allgather: ``allreduce(g, op=Average)``, then this rank's rows of it;
- broadcast: ``allreduce(g, op=Average)`` on the root rank, zeros elsewhere;
- alltoall: ``alltoall(g)`` with the received splits as the send splits;
- reducescatter: ``allgather(g)``, times the process set's size for op=Sum, times the scale factors.

``allreduce`` and ``grouped_allreduce`` (with ``tf.IndexedSlices`` and compression) are in
:mod:`spark_hvd.tensorflow.reductions`; these are the plain ops beneath them.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Union

import tensorflow as tf

import spark_hvd.runtime as _rt
from spark_hvd.tensorflow.basics import Average, Sum, global_process_set
from spark_hvd.tensorflow.bridge import collective
from spark_hvd.runtime.kinds import ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, JOIN, REDUCESCATTER

__all__ = [
    "_allreduce", "_grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_",
    "alltoall", "_reducescatter", "_grouped_reducescatter", "join", "barrier",
]


def _set_rank(process_set: Any) -> int:
    return process_set.rank() if process_set is not None else _rt.rank()


def _set_size(process_set: Any) -> int:
    return process_set.size() if process_set is not None else _rt.size()


def _differentiable(dtype: tf.dtypes.DType) -> bool:
    return dtype.is_floating or dtype.is_complex


def _allreduce(tensor: Any, name: Optional[str] = None, op: int = Sum, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, ignore_name_scope: bool = False,
               process_set: Any = global_process_set) -> tf.Tensor:
    """Reduce ``tensor`` element-wise over the ranks (default op: Sum); a tensor of its shape and dtype.

    Afterwards the result is identical on all ranks. Differentiable: the gradient is the same
    reduction of the output gradients. ``ignore_name_scope`` is accepted for Horovod compatibility.
    """
    def forward(x: tf.Tensor) -> Tuple[tf.Tensor, Any]:
        out = collective(ALLREDUCE, [x], name=name, op=op, prescale_factor=prescale_factor,
                         postscale_factor=postscale_factor, process_set=process_set)[0]

        def grad(dy: tf.Tensor) -> tf.Tensor:
            return _allreduce(dy, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                              process_set=process_set)

        return out, grad

    return tf.custom_gradient(forward)(tf.convert_to_tensor(tensor))


def _grouped_allreduce(tensors: Sequence[Any], name: Optional[str] = None, op: int = Sum,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0, ignore_name_scope: bool = False,
                       process_set: Any = global_process_set, _lockstep: bool = False) -> List[tf.Tensor]:
    """Reduce each tensor of ``tensors`` over the ranks as one operation (default op: Sum).

    Afterwards each result is identical on all ranks. Differentiable, like :func:`_allreduce`.
    ``_lockstep``: see :func:`~spark_hvd.tensorflow.bridge.collective`.
    """
    def forward(*xs: tf.Tensor) -> Tuple[List[tf.Tensor], Any]:
        outs = collective(ALLREDUCE, xs, grouped=True, name=name, op=op, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, process_set=process_set, lockstep=_lockstep)

        def grad(*dys: tf.Tensor) -> List[tf.Tensor]:
            return _grouped_allreduce(dys, op=op, prescale_factor=prescale_factor,
                                      postscale_factor=postscale_factor, process_set=process_set)

        return outs, grad

    return list(tf.custom_gradient(forward)(*[tf.convert_to_tensor(t) for t in tensors]))


def allgather(tensor: Any, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: Any = global_process_set) -> tf.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0, in rank order.

    Afterwards the result is identical on all ranks. The first dimension may differ between
    ranks; the others and the dtype must agree. Differentiable: this rank's gradient is its rows
    of the averaged output gradient.
    """
    return grouped_allgather([tensor], name=name, process_set=process_set, _grouped=False)[0]


def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None, ignore_name_scope: bool = False,
                      process_set: Any = global_process_set, _grouped: bool = True) -> List[tf.Tensor]:
    """Allgather each tensor of ``tensors`` as one operation.

    Afterwards every concatenation (along dimension 0, in rank order) is identical on all ranks.
    Differentiable, like :func:`allgather`.
    """
    def forward(*xs: tf.Tensor) -> Tuple[List[tf.Tensor], Any]:
        outs = collective(ALLGATHER, xs, grouped=_grouped, name=name, process_set=process_set)

        def grad(*dys: tf.Tensor) -> List[tf.Tensor]:
            reduced = _grouped_allreduce(dys, op=Average, process_set=process_set)
            rows = tf.stack([tf.shape(x, out_type=tf.int64)[0] if x.shape.rank else tf.constant(1, tf.int64)
                             for x in xs])
            counts = tf.reshape(allgather(tf.reshape(rows, [1, -1]), process_set=process_set), [-1, len(xs)])
            me = _set_rank(process_set)
            offsets = tf.reduce_sum(counts[:me], axis=0)
            return [tf.reshape(g[offsets[i]:offsets[i] + rows[i]], tf.shape(x))
                    for i, (g, x) in enumerate(zip(reduced, xs))]

        return outs, grad

    return list(tf.custom_gradient(forward)(*[tf.convert_to_tensor(t) for t in tensors]))


def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: Any = global_process_set) -> tf.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank, as a new tensor of its shape and dtype.

    Afterwards every rank holds root_rank's values. Differentiable: the gradient is the averaged
    output gradient on the root rank and zeros elsewhere.
    """
    def forward(x: tf.Tensor) -> Tuple[tf.Tensor, Any]:
        out = collective(BROADCAST, [x], name=name, root_rank=root_rank, process_set=process_set)[0]

        def grad(dy: tf.Tensor) -> tf.Tensor:
            reduced = _allreduce(dy, op=Average, process_set=process_set)
            if _rt.rank() == root_rank:
                return reduced
            # In a graph, zeros_like of a tensor of known shape is a constant that does not run the
            # allreduce, and the other ranks would wait for this one forever: depend on it explicitly.
            with tf.control_dependencies([reduced]):
                return tf.zeros_like(reduced)

        return out, grad

    return tf.custom_gradient(forward)(tf.convert_to_tensor(tensor))


def broadcast_(variables: Union[tf.Variable, Sequence[tf.Variable]], root_rank: int, name: Optional[str] = None,
               process_set: Any = global_process_set) -> List[tf.Tensor]:
    """Overwrite each variable of ``variables`` with its value on ``root_rank``, in place.

    Afterwards every rank's variables hold root_rank's values; returns their new values (one
    tensor per variable). Not differentiable.
    """
    variables = [variables] if isinstance(variables, tf.Variable) else list(variables)
    bad = [i for i, v in enumerate(variables) if not isinstance(v, tf.Variable)]
    if bad:
        raise ValueError(f"broadcast_ overwrites variables, but variables[{bad[0]}] is a "
                         f"{type(variables[bad[0]]).__name__}; pass tf.Variable objects, or use broadcast()")
    values = []
    for i, var in enumerate(variables):
        values.append(collective(BROADCAST, [var.read_value()], root_rank=root_rank, process_set=process_set,
                                 name=None if not name else f"{name}.{i}")[0])
    return [_assigned(var, value) for var, value in zip(variables, values)]


def _assigned(var: tf.Variable, value: tf.Tensor) -> tf.Tensor:
    with tf.control_dependencies([var.assign(value)]):
        return var.read_value()


def alltoall(tensor: Any, splits: Any = None, name: Optional[str] = None, ignore_name_scope: bool = False,
             process_set: Any = global_process_set) -> Union[tf.Tensor, Tuple[tf.Tensor, tf.Tensor]]:
    """Send ``splits[i]`` rows of dimension 0 to rank i and return what every rank sent here.

    Afterwards each rank holds the rows sent to it, concatenated in rank order. With ``splits``
    the result is ``(received, received_splits)`` (int32); without, dimension 0 is split evenly
    (it must divide by the number of ranks) and only ``received`` is returned. Differentiable:
    gradients travel back along the received splits.
    """
    def forward(x: tf.Tensor) -> Tuple[List[tf.Tensor], Any]:
        out, received_splits = collective(ALLTOALL, [x], splits=splits, name=name, process_set=process_set)

        def grad(dy: tf.Tensor, unused: Any = None) -> tf.Tensor:
            return alltoall(dy, splits=received_splits, process_set=process_set)[0]

        return [out, received_splits], grad

    out, received_splits = tf.custom_gradient(forward)(tf.convert_to_tensor(tensor))
    return (out, received_splits) if splits is not None else out


def _scatter_grad(dys: Sequence[tf.Tensor], op: int, process_set: Any, prescale_factor: float,
                  postscale_factor: float) -> List[tf.Tensor]:
    scale = float(prescale_factor) * float(postscale_factor) * (_set_size(process_set) if op == Sum else 1)
    scaled = [dy * tf.cast(scale, dy.dtype) if scale != 1.0 else dy for dy in dys]
    return grouped_allgather(scaled, process_set=process_set)


def _reducescatter(tensor: Any, name: Optional[str] = None, op: int = Sum, ignore_name_scope: bool = False,
                   process_set: Any = global_process_set, prescale_factor: float = 1.0,
                   postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce ``tensor`` over the ranks (default op: Sum) and return this rank's block of the result.

    Afterwards rank r holds block r of the reduction along dimension 0 (blocks as even as
    possible, earlier ranks taking the extra rows). Differentiable: the gradient is the allgather
    of the output gradients, times the number of ranks for op=Sum.
    """
    return _grouped_reducescatter([tensor], name=name, op=op, process_set=process_set,
                                  prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                  _grouped=False)[0]


def _grouped_reducescatter(tensors: Sequence[Any], name: Optional[str] = None, op: int = Sum,
                           ignore_name_scope: bool = False, process_set: Any = global_process_set,
                           prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                           _grouped: bool = True) -> List[tf.Tensor]:
    """Reducescatter each tensor of ``tensors`` as one operation; differentiable like :func:`_reducescatter`."""
    def forward(*xs: tf.Tensor) -> Tuple[List[tf.Tensor], Any]:
        outs = collective(REDUCESCATTER, xs, grouped=_grouped, name=name, op=op, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, process_set=process_set)

        def grad(*dys: tf.Tensor) -> List[tf.Tensor]:
            return _scatter_grad(dys, op, process_set, prescale_factor, postscale_factor)

        return outs, grad

    return list(tf.custom_gradient(forward)(*[tf.convert_to_tensor(t) for t in tensors]))


def join() -> tf.Tensor:
    """Declare that this rank has no more data; return the rank that joined last (int32 scalar).

    Until every rank has joined, the ranks that have not keep running allreduces, and this rank
    takes part with zeros. Afterwards every rank has joined and gets the same value.
    """
    return collective(JOIN, [])[0]


def barrier(process_set: Any = global_process_set) -> None:
    """Block until every rank of ``process_set`` has reached this call; afterwards all have."""
    collective(BARRIER, [], process_set=process_set)
