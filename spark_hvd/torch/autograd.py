"""The differentiable collectives, with the gradients Horovod defines.

``allreduce``, ``allgather``, ``broadcast``, ``alltoall``, ``reducescatter`` and their grouped
forms are ``torch.autograd.Function`` applications over the one enqueue path. Gradients, for a
rank's output gradient ``g``:

- allreduce: ``allreduce(g)`` with the same op and scale factors;
- allgather: ``allreduce(g, op=Average)``, then this rank's rows of it;
- broadcast: ``allreduce(g, op=Average)`` on the root rank, zeros elsewhere;
- alltoall: ``alltoall(g)`` with the received splits as the send splits;
- reducescatter: ``allgather(g)``, times the process set's size for op=Sum, times the scale factors.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Union

import torch

from spark_hvd.torch.basics import Average, Sum, global_process_set, rank, size
from spark_hvd.torch.compression import Compression, Compressor
from spark_hvd.torch.handles import enqueue, resolve_op
from spark_hvd.runtime.kinds import ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, REDUCESCATTER

__all__ = [
    "allreduce",
    "grouped_allreduce",
    "allgather",
    "grouped_allgather",
    "broadcast",
    "alltoall",
    "reducescatter",
    "grouped_reducescatter",
    "HorovodAllreduce",
    "HorovodGroupedAllreduce",
    "HorovodAllgather",
    "HorovodGroupedAllgather",
    "HorovodBroadcast",
    "HorovodAlltoall",
    "HorovodReducescatter",
    "HorovodGroupedReducescatter",
]


def _set_rank(process_set: Any) -> int:
    return process_set.rank() if process_set is not None else rank()


def _set_size(process_set: Any) -> int:
    return process_set.size() if process_set is not None else size()


def _row_offset(rows: int, process_set: Any) -> int:
    """Where this rank's rows start in an allgather result: the rows of the ranks before it."""
    counts = enqueue(ALLGATHER, [torch.tensor([rows], dtype=torch.int64)], process_set=process_set).wait()
    return int(counts[: _set_rank(process_set)].sum())


class HorovodAllreduce(torch.autograd.Function):
    """Allreduce whose gradient is the allreduce of the output gradients (same op and factors)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str], op: int, prescale_factor: float,
                postscale_factor: float, process_set: Any) -> torch.Tensor:
        ctx.op, ctx.process_set = op, process_set
        ctx.prescale_factor, ctx.postscale_factor = prescale_factor, postscale_factor
        return enqueue(ALLREDUCE, [tensor], name=name, op=op, prescale_factor=prescale_factor,
                       postscale_factor=postscale_factor, process_set=process_set, will_wait=True).wait()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        grad = allreduce(grad_output, op=ctx.op, prescale_factor=ctx.prescale_factor,
                         postscale_factor=ctx.postscale_factor, process_set=ctx.process_set)
        return grad, None, None, None, None, None


class HorovodGroupedAllreduce(torch.autograd.Function):
    """Grouped allreduce; each gradient is reduced like :class:`HorovodAllreduce`'s."""

    @staticmethod
    def forward(ctx: Any, name: Optional[str], op: int, prescale_factor: float, postscale_factor: float,
                process_set: Any, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.op, ctx.process_set = op, process_set
        ctx.prescale_factor, ctx.postscale_factor = prescale_factor, postscale_factor
        return tuple(enqueue(ALLREDUCE, tensors, grouped=True, name=name, op=op,
                             prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                             process_set=process_set).wait())

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        grads = grouped_allreduce(list(grad_outputs), op=ctx.op, prescale_factor=ctx.prescale_factor,
                                  postscale_factor=ctx.postscale_factor, process_set=ctx.process_set)
        return (None, None, None, None, None, *grads)


class HorovodAllgather(torch.autograd.Function):
    """Allgather whose gradient is this rank's rows of the averaged output gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str], process_set: Any) -> torch.Tensor:
        ctx.shape, ctx.process_set = tensor.shape, process_set
        return enqueue(ALLGATHER, [tensor], name=name, process_set=process_set).wait()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        reduced = allreduce(grad_output, op=Average, process_set=ctx.process_set)
        rows = ctx.shape[0] if len(ctx.shape) > 0 else 1
        offset = _row_offset(rows, ctx.process_set)
        return reduced.narrow(0, offset, rows).reshape(ctx.shape), None, None


class HorovodGroupedAllgather(torch.autograd.Function):
    """Grouped allgather; each gradient is computed like :class:`HorovodAllgather`'s."""

    @staticmethod
    def forward(ctx: Any, name: Optional[str], process_set: Any, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.shapes, ctx.process_set = [t.shape for t in tensors], process_set
        return tuple(enqueue(ALLGATHER, tensors, grouped=True, name=name, process_set=process_set).wait())

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        reduced = grouped_allreduce(list(grad_outputs), op=Average, process_set=ctx.process_set)
        rows = [s[0] if len(s) > 0 else 1 for s in ctx.shapes]
        counts = enqueue(ALLGATHER, [torch.tensor([rows], dtype=torch.int64)],
                         process_set=ctx.process_set).wait()
        offsets = counts[: _set_rank(ctx.process_set)].sum(dim=0).tolist()
        grads = [g.narrow(0, int(o), r).reshape(s) for g, o, r, s in zip(reduced, offsets, rows, ctx.shapes)]
        return (None, None, *grads)


class HorovodBroadcast(torch.autograd.Function):
    """Broadcast whose gradient is the averaged output gradient on the root rank, zeros elsewhere."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Optional[str], process_set: Any) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return enqueue(BROADCAST, [tensor], root_rank=root_rank, name=name, process_set=process_set).wait()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        reduced = allreduce(grad_output, op=Average, process_set=ctx.process_set)
        if rank() != ctx.root_rank:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


class HorovodAlltoall(torch.autograd.Function):
    """Alltoall whose gradient sends the output gradient back along the received splits."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Optional[str],
                process_set: Any) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        output, received_splits = enqueue(ALLTOALL, [tensor], splits=splits, name=name,
                                          process_set=process_set).wait()
        ctx.received_splits, ctx.process_set = received_splits, process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received_splits)
        return output, received_splits

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, *unused: Any) -> Tuple[Optional[torch.Tensor], ...]:
        grad, _ = alltoall(grad_output, splits=ctx.received_splits, process_set=ctx.process_set)
        return grad, None, None, None


class HorovodReducescatter(torch.autograd.Function):
    """Reducescatter whose gradient is the allgather of the (scaled) output gradients."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str], op: int, process_set: Any,
                prescale_factor: float, postscale_factor: float) -> torch.Tensor:
        ctx.scale = _scatter_grad_scale(op, process_set, prescale_factor, postscale_factor)
        ctx.process_set = process_set
        return enqueue(REDUCESCATTER, [tensor], name=name, op=op, prescale_factor=prescale_factor,
                       postscale_factor=postscale_factor, process_set=process_set).wait()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        grad = grad_output * ctx.scale if ctx.scale != 1.0 else grad_output
        return allgather(grad, process_set=ctx.process_set), None, None, None, None, None


class HorovodGroupedReducescatter(torch.autograd.Function):
    """Grouped reducescatter; each gradient is computed like :class:`HorovodReducescatter`'s."""

    @staticmethod
    def forward(ctx: Any, name: Optional[str], op: int, process_set: Any, prescale_factor: float,
                postscale_factor: float, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.scale = _scatter_grad_scale(op, process_set, prescale_factor, postscale_factor)
        ctx.process_set = process_set
        return tuple(enqueue(REDUCESCATTER, tensors, grouped=True, name=name, op=op,
                             prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                             process_set=process_set).wait())

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        grads = [g * ctx.scale if ctx.scale != 1.0 else g for g in grad_outputs]
        return (None, None, None, None, None, *grouped_allgather(grads, process_set=ctx.process_set))


def _scatter_grad_scale(op: int, process_set: Any, prescale_factor: float, postscale_factor: float) -> float:
    scale = float(prescale_factor) * float(postscale_factor)
    return scale * _set_size(process_set) if op == Sum else scale


def _compress_all(compression: Compressor, tensors: Sequence[torch.Tensor]) -> Tuple[List[torch.Tensor], List[Any]]:
    pairs = [compression.compress(t) for t in tensors]
    return [p[0] for p in pairs], [p[1] for p in pairs]


# --- Public differentiable functions ------------------------------------------------------------


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Compressor = Compression.none, op: Optional[int] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` element-wise over the ranks and return the result as a new tensor.

    Afterwards the result is identical on all ranks, with the input's shape and dtype; the input
    is not modified. Differentiable: the gradient is the same reduction of the output gradients.

    Arguments:
        tensor: The tensor to reduce (CUDA tensors travel through host memory).
        average: Deprecated: True means op=Average, False op=Sum. Pass op instead.
        name: Matches this operation across ranks; None draws a name from a per-kind counter,
            so unnamed operations must then be issued in the same order on every rank.
        compression: Compression.none (the default) or Compression.fp16 (travels as float16).
        op: Average (the default), Sum, Min, Max or Product.
        prescale_factor: Multiplies the input before the reduction.
        postscale_factor: Multiplies the result after the reduction.
        process_set: The ranks taking part (default: all ranks).
    """
    sent, ctx = compression.compress(tensor)
    out = HorovodAllreduce.apply(sent, name, resolve_op(op, average), prescale_factor, postscale_factor,
                                 process_set)
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None,
                      compression: Compressor = Compression.none, op: Optional[int] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Any = global_process_set) -> List[torch.Tensor]:
    """Reduce each tensor of ``tensors`` over the ranks as one operation; return new tensors.

    Afterwards each result is identical on all ranks; the inputs are not modified.
    Differentiable, like :func:`allreduce`.

    Arguments:
        tensors: The tensors to reduce; the i-th is combined with the i-th of every rank.
        average: Deprecated: True means op=Average, False op=Sum. Pass op instead.
        name: Matches this operation across ranks; None draws a name from a per-kind counter.
        compression: Compression.none (the default) or Compression.fp16 (travels as float16).
        op: Average (the default), Sum, Min, Max or Product.
        prescale_factor: Multiplies each input before the reduction.
        postscale_factor: Multiplies each result after the reduction.
        process_set: The ranks taking part (default: all ranks).
    """
    sent, ctxs = _compress_all(compression, tensors)
    outs = HorovodGroupedAllreduce.apply(name, resolve_op(op, average), prescale_factor, postscale_factor,
                                         process_set, *sent)
    return [compression.decompress(o, c) for o, c in zip(outs, ctxs)]


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0, in rank order.

    Afterwards the result is identical on all ranks. The first dimension may differ between
    ranks; the others and the dtype must agree. Differentiable: this rank's gradient is its rows
    of the averaged output gradient.

    Arguments:
        tensor: This rank's rows.
        name: Matches this operation across ranks; None draws a name from a per-kind counter.
        process_set: The ranks taking part (default: all ranks).
    """
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: Any = global_process_set) -> List[torch.Tensor]:
    """Allgather each tensor of ``tensors`` as one operation.

    Afterwards every concatenation (along dimension 0, in rank order) is identical on all ranks.
    Differentiable, like :func:`allgather`.

    Arguments:
        tensors: This rank's rows of each gathered tensor.
        name: Matches this operation across ranks; None draws a name from a per-kind counter.
        process_set: The ranks taking part (default: all ranks).
    """
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Return ``root_rank``'s tensor on every rank, as a new tensor.

    Afterwards the result holds root_rank's values on all ranks; the input is not modified.
    Differentiable: the root's gradient is the averaged output gradient, the others' zeros.

    Arguments:
        tensor: The root's data on root_rank; elsewhere a tensor of the same shape and dtype.
        root_rank: The rank whose tensor is sent.
        name: Matches this operation across ranks; None draws a name from a per-kind counter.
        process_set: The ranks taking part (default: all ranks).
    """
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


def alltoall(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
             process_set: Any = global_process_set) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Send ``splits[i]`` rows of dimension 0 to rank i and return what every rank sent here.

    Afterwards each rank holds the rows sent to it, concatenated in rank order. With ``splits``
    the result is ``(received, received_splits)`` (int32, or the dtype of a ``splits`` tensor);
    without, only ``received``. Differentiable: gradients travel back along the received splits.

    Arguments:
        tensor: The rows to send, grouped by destination rank.
        splits: Rows for each rank, in rank order (list or integer tensor); None splits dimension
            0 evenly, which needs it to divide by the number of ranks.
        name: Matches this operation across ranks; None draws a name from a per-kind counter.
        process_set: The ranks taking part (default: all ranks).
    """
    return HorovodAlltoall.apply(tensor, splits, name, process_set)


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, compression: Compressor = Compression.none,
                  op: int = Average, process_set: Any = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks and return this rank's block of the result.

    Afterwards rank r holds block r of the reduction along dimension 0 (blocks as even as
    possible, earlier ranks taking the extra rows). The input must have at least one dimension;
    a 0-dimensional tensor raises ValueError. Differentiable: the gradient is the allgather of
    the output gradients, times the number of ranks for op=Sum.

    Arguments:
        tensor: The tensor to reduce; the same shape on every rank.
        name: Matches this operation across ranks; None draws a name from a per-kind counter.
        compression: Compression.none (the default) or Compression.fp16 (travels as float16).
        op: Average (the default), Sum, Min, Max or Product.
        process_set: The ranks taking part (default: all ranks).
        prescale_factor: Multiplies the input before the reduction.
        postscale_factor: Multiplies the result after the reduction.
    """
    sent, ctx = compression.compress(tensor)
    out = HorovodReducescatter.apply(sent, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: Compressor = Compression.none, op: int = Average,
                          process_set: Any = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """Reducescatter each tensor of ``tensors`` as one operation.

    Afterwards rank r holds block r of each reduction along dimension 0. Every tensor must have
    at least one dimension. Differentiable, like :func:`reducescatter`.

    Arguments:
        tensors: The tensors to reduce; the i-th has the same shape on every rank.
        name: Matches this operation across ranks; None draws a name from a per-kind counter.
        compression: Compression.none (the default) or Compression.fp16 (travels as float16).
        op: Average (the default), Sum, Min, Max or Product.
        process_set: The ranks taking part (default: all ranks).
        prescale_factor: Multiplies each input before the reduction.
        postscale_factor: Multiplies each result after the reduction.
    """
    sent, ctxs = _compress_all(compression, tensors)
    outs = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor, *sent)
    return [compression.decompress(o, c) for o, c in zip(outs, ctxs)]
