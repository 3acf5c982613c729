"""allreduce, grouped_allreduce, reducescatter and grouped_reducescatter as Horovod's TensorFlow API has them.

Beyond the plain ops of :mod:`spark_hvd.tensorflow.mpi_ops` they take Horovod's deprecated
``average`` flag, compression, and ``tf.IndexedSlices`` (sparse gradients), which are combined by
allgathering their values and indices.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Union

import tensorflow as tf

from spark_hvd.tensorflow.basics import Adasum, Average, Sum, global_process_set, size
from spark_hvd.tensorflow.compression import Compression, Compressor
from spark_hvd.tensorflow.mpi_ops import _allreduce, _grouped_allreduce, _grouped_reducescatter, grouped_allgather

__all__ = ["allreduce", "grouped_allreduce", "reducescatter", "grouped_reducescatter", "resolve_op"]

Reducible = Union[tf.Tensor, tf.Variable, tf.IndexedSlices]


def resolve_op(op: Optional[int], average: Optional[bool]) -> int:
    """Horovod's deprecated ``average=`` flag folded into ``op`` (default Average)."""
    if average is not None:
        if op is not None:
            raise ValueError(
                f"both op={op!r} and average={average!r} were given; the op parameter supersedes average: "
                "pass only op"
            )
        return Average if average else Sum
    return Average if op is None else op


def _check_sparse(op: int, prescale_factor: float, postscale_factor: float) -> None:
    if op == Adasum:
        raise NotImplementedError(
            "op=Adasum is not supported for tf.IndexedSlices; pass sparse_as_dense=True, or use op=Average or Sum"
        )
    if op not in (Average, Sum):
        raise NotImplementedError(
            f"op={op!r} is not supported for tf.IndexedSlices: only Sum and Average are; convert the slices "
            "with tf.convert_to_tensor() to use other reductions"
        )
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError(
            "prescale_factor/postscale_factor are not supported for tf.IndexedSlices; scale the values first, "
            "or convert the slices with tf.convert_to_tensor()"
        )


def _set_size(process_set: Any) -> int:
    return process_set.size() if process_set is not None else size()


def _sparse_allreduce(slices: Sequence[tf.IndexedSlices], op: int, process_set: Any) -> List[tf.IndexedSlices]:
    gathered = grouped_allgather([s.values for s in slices] + [s.indices for s in slices], process_set=process_set)
    values, indices = gathered[: len(slices)], gathered[len(slices):]
    if op == Average:
        values = [v / tf.cast(_set_size(process_set), v.dtype) for v in values]
    return [tf.IndexedSlices(v, i, dense_shape=s.dense_shape) for v, i, s in zip(values, indices, slices)]


def allreduce(tensor: Reducible, average: Optional[bool] = None, device_dense: str = "", device_sparse: str = "",
              compression: Compressor = Compression.none, op: Optional[int] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None, process_set: Any = global_process_set,
              ignore_name_scope: bool = False) -> Reducible:
    """Reduce ``tensor`` over the ranks and return the result (default op: Average).

    Afterwards the result is identical on all ranks, with the input's shape and dtype. A
    ``tf.IndexedSlices`` is combined by allgathering its values and indices (op Sum or Average
    only; Average divides the values by the number of ranks) and the result is a
    ``tf.IndexedSlices`` holding every rank's rows. Differentiable. ``device_dense`` and
    ``device_sparse`` are accepted for Horovod compatibility; data moves through host memory.

    Arguments:
        tensor: tf.Tensor, tf.Variable or tf.IndexedSlices, of the same shape on every rank.
        average: Deprecated: True means op=Average, False op=Sum. Pass op instead.
        compression: Compression.none (the default) or Compression.fp16 (travels as float16).
        op: Average (the default), Sum, Min, Max or Product.
        prescale_factor: Multiplies the input before the reduction.
        postscale_factor: Multiplies the result after the reduction.
        name: Matches this operation across ranks; None names it automatically.
        process_set: The ranks taking part (default: all ranks).
    """
    return grouped_allreduce([tensor], average=average, compression=compression, op=op,
                             prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                             process_set=process_set, name=name, _grouped=False)[0]


def grouped_allreduce(tensors: Sequence[Reducible], average: Optional[bool] = None, device_dense: str = "",
                      device_sparse: str = "", compression: Compressor = Compression.none, op: Optional[int] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Any = global_process_set, ignore_name_scope: bool = False,
                      name: Optional[str] = None, _grouped: bool = True) -> List[Reducible]:
    """Reduce each tensor of ``tensors`` over the ranks as one operation; return the results in order.

    Afterwards each result is identical on all ranks. Dense tensors travel as one grouped
    allreduce; ``tf.IndexedSlices`` as one grouped allgather of values and indices (see
    :func:`allreduce`). Differentiable. Arguments as for :func:`allreduce`.
    """
    tensors = list(tensors)
    if not tensors:
        return tensors
    op = resolve_op(op, average)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    results: List[Any] = [None] * len(tensors)
    if sparse:
        _check_sparse(op, prescale_factor, postscale_factor)
        for i, reduced in zip(sparse, _sparse_allreduce([tensors[i] for i in sparse], op, process_set)):
            results[i] = reduced
    if dense:
        packed = [compression.compress(tensors[i]) for i in dense]
        if _grouped or len(dense) > 1:
            outs = _grouped_allreduce([p[0] for p in packed], name=name, op=op, prescale_factor=prescale_factor,
                                      postscale_factor=postscale_factor, process_set=process_set)
        else:
            outs = [_allreduce(packed[0][0], name=name, op=op, prescale_factor=prescale_factor,
                               postscale_factor=postscale_factor, process_set=process_set)]
        for i, out, (_, ctx) in zip(dense, outs, packed):
            results[i] = compression.decompress(out, ctx)
    return results


def reducescatter(tensor: Any, device_dense: str = "", compression: Compressor = Compression.none, op: int = Average,
                  name: Optional[str] = None, process_set: Any = global_process_set, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce ``tensor`` over the ranks and return this rank's block of the result (default op: Average).

    Afterwards rank r holds block r of the reduction along dimension 0 (blocks as even as
    possible, earlier ranks taking the extra rows). The input must have at least one dimension.
    Differentiable: the gradient is the allgather of the output gradients.
    """
    sent, ctx = compression.compress(tensor)
    out = _grouped_reducescatter([sent], name=name, op=op, process_set=process_set, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor, _grouped=False)[0]
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "", compression: Compressor = Compression.none,
                          op: int = Average, process_set: Any = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, name: Optional[str] = None) -> List[tf.Tensor]:
    """Reducescatter each tensor of ``tensors`` as one operation (default op: Average).

    Afterwards rank r holds block r of each reduction along dimension 0. Differentiable, like
    :func:`reducescatter`.
    """
    tensors = list(tensors)
    if not tensors:
        return tensors
    packed = [compression.compress(t) for t in tensors]
    outs = _grouped_reducescatter([p[0] for p in packed], name=name, op=op, process_set=process_set,
                                  prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, packed)]
