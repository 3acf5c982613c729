"""Horovod's asynchronous and in-place collectives on torch tensors, each a short call of ``enqueue``.

Naming follows Horovod: ``<verb>_async`` starts the operation and returns a :class:`Handle`,
a trailing ``_`` writes the result into the input, and ``grouped_<verb>`` takes a list that
travels as one operation. The differentiable blocking forms (``allreduce``, ``allgather`` ...)
are in :mod:`spark_hvd.torch.autograd`.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

import spark_hvd.runtime as _rt
from spark_hvd.torch.basics import Average, Sum, global_process_set
from spark_hvd.torch.handles import Handle, enqueue, poll, resolve_op, synchronize
from spark_hvd.runtime.kinds import ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, REDUCESCATTER

__all__ = [
    "Handle",
    "poll",
    "synchronize",
    "allreduce_async",
    "allreduce_async_",
    "allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_allreduce_",
    "sparse_allreduce_async",
    "allgather_async",
    "grouped_allgather_async",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_",
    "alltoall_async",
    "reducescatter_async",
    "grouped_reducescatter_async",
    "join",
    "barrier",
]

# --- allreduce ---------------------------------------------------------------------------------


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = global_process_set) -> Handle:
    """Start reducing ``tensor`` element-wise over the ranks; return a Handle at once.

    ``synchronize(handle)`` returns a new tensor of the input's shape and dtype; afterwards the
    result is identical on all ranks. The input is not modified; do not change it before the
    operation completes.

    Arguments:
        tensor: The tensor to reduce (CUDA tensors travel through host memory).
        average: Deprecated: True means op=Average, False op=Sum. Pass op instead.
        name: Matches this operation across ranks; None draws a name from a per-kind counter,
            so unnamed operations must then be issued in the same order on every rank.
        op: Average (the default), Sum, Min, Max, Product, or Adasum (see
            :func:`spark_hvd.runtime.ops.adasum`: floating point, a power-of-two number of ranks,
            each tensor combined on its own).
        prescale_factor: Multiplies the input before the reduction.
        postscale_factor: Multiplies the result after the reduction.
        process_set: The ranks taking part (default: all ranks).
    """
    return enqueue(ALLREDUCE, (tensor,), name=name, op=resolve_op(op, average), prescale_factor=prescale_factor,
                   postscale_factor=postscale_factor, process_set=process_set)


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = global_process_set) -> Handle:
    """Start reducing ``tensor`` element-wise over the ranks, in place; return a Handle at once.

    ``synchronize(handle)`` returns ``tensor`` itself; afterwards ``tensor`` holds the result,
    identical on all ranks. Do not read or modify it before then.

    Arguments:
        tensor: The tensor to reduce and overwrite.
        average: Deprecated: True means op=Average, False op=Sum. Pass op instead.
        name: Matches this operation across ranks; None draws a name from a per-kind counter.
        op: Average (the default), Sum, Min, Max, Product or Adasum (as for :func:`allreduce_async`).
        prescale_factor: Multiplies the input before the reduction.
        postscale_factor: Multiplies the result after the reduction.
        process_set: The ranks taking part (default: all ranks).
    """
    return enqueue(ALLREDUCE, (tensor,), inplace=True, name=name, op=resolve_op(op, average),
                   prescale_factor=prescale_factor, postscale_factor=postscale_factor, process_set=process_set)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` element-wise over the ranks, in place, and return it.

    Afterwards ``tensor`` holds the result, identical on all ranks. Not differentiable.

    Arguments:
        tensor: The tensor to reduce and overwrite.
        average: Deprecated: True means op=Average, False op=Sum. Pass op instead.
        name: Matches this operation across ranks; None draws a name from a per-kind counter.
        op: Average (the default), Sum, Min, Max, Product or Adasum (as for :func:`allreduce_async`).
        prescale_factor: Multiplies the input before the reduction.
        postscale_factor: Multiplies the result after the reduction.
        process_set: The ranks taking part (default: all ranks).
    """
    return enqueue(ALLREDUCE, (tensor,), inplace=True, name=name, op=resolve_op(op, average),
                   prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                   process_set=process_set, will_wait=True).wait()


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[int] = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set: Any = global_process_set) -> Handle:
    """Start reducing each tensor of ``tensors`` over the ranks as one operation; return a Handle.

    ``synchronize(handle)`` returns a list of new tensors; afterwards each result is identical on
    all ranks. The inputs are not modified; do not change them before the operation completes.

    Arguments:
        tensors: The tensors to reduce; the i-th is combined with the i-th of every rank.
        average: Deprecated: True means op=Average, False op=Sum. Pass op instead.
        name: Matches this operation across ranks; None draws a name from a per-kind counter.
        op: Average (the default), Sum, Min, Max, Product or Adasum (as for :func:`allreduce_async`).
        prescale_factor: Multiplies each input before the reduction.
        postscale_factor: Multiplies each result after the reduction.
        process_set: The ranks taking part (default: all ranks).
    """
    return enqueue(ALLREDUCE, tensors, grouped=True, name=name, op=resolve_op(op, average),
                   prescale_factor=prescale_factor, postscale_factor=postscale_factor, process_set=process_set)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[int] = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set: Any = global_process_set) -> Handle:
    """Start reducing each tensor of ``tensors`` over the ranks in place, as one operation.

    ``synchronize(handle)`` returns the list of the given tensors; afterwards each holds its
    result, identical on all ranks. Do not read or modify them before then.

    Arguments:
        tensors: The tensors to reduce and overwrite.
        average: Deprecated: True means op=Average, False op=Sum. Pass op instead.
        name: Matches this operation across ranks; None draws a name from a per-kind counter.
        op: Average (the default), Sum, Min, Max, Product or Adasum (as for :func:`allreduce_async`).
        prescale_factor: Multiplies each input before the reduction.
        postscale_factor: Multiplies each result after the reduction.
        process_set: The ranks taking part (default: all ranks).
    """
    return enqueue(ALLREDUCE, tensors, grouped=True, inplace=True, name=name, op=resolve_op(op, average),
                   prescale_factor=prescale_factor, postscale_factor=postscale_factor, process_set=process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None,
                       op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Any = global_process_set) -> List[torch.Tensor]:
    """Reduce each tensor of ``tensors`` over the ranks in place, as one operation; return them.

    Afterwards each tensor holds its result, identical on all ranks. Not differentiable.

    Arguments:
        tensors: The tensors to reduce and overwrite.
        average: Deprecated: True means op=Average, False op=Sum. Pass op instead.
        name: Matches this operation across ranks; None draws a name from a per-kind counter.
        op: Average (the default), Sum, Min, Max, Product or Adasum (as for :func:`allreduce_async`).
        prescale_factor: Multiplies each input before the reduction.
        postscale_factor: Multiplies each result after the reduction.
        process_set: The ranks taking part (default: all ranks).
    """
    return enqueue(ALLREDUCE, tensors, grouped=True, inplace=True, name=name, op=resolve_op(op, average),
                   prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                   process_set=process_set).wait()


def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str], op: int,
                           process_set: Any = global_process_set) -> Handle:
    """Start combining a sparse COO tensor over the ranks by allgathering its indices and values.

    Returns a Handle; ``handle()`` (as in Horovod) or ``synchronize(handle)`` returns a sparse
    tensor of the input's shape holding every rank's entries (coalescing sums duplicates); with
    op=Average the values are divided by the number of ranks. Afterwards the result is identical
    on all ranks.

    Arguments:
        tensor: A sparse COO tensor, such as the gradient of a sparse ``torch.nn.Embedding``.
        name: Matches this operation across ranks; None draws names from a per-kind counter.
        op: Average or Sum.
        process_set: The ranks taking part (default: all ranks).
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        layout = tensor.layout if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(
            f"sparse_allreduce_async expects a sparse COO tensor, got {layout}; use allreduce_async for "
            "dense tensors"
        )
    if op not in (Average, Sum):
        raise ValueError(f"op={op!r} is not supported for sparse tensors; expected Average or Sum")
    sparse = tensor.detach().coalesce()
    base = None if name is None or name == "" else str(name)
    # Indices are transposed so that allgather concatenates entries, not coordinates.
    indices = enqueue(ALLGATHER, (sparse.indices().t().contiguous(),),
                      name=None if base is None else base + ".indices", process_set=process_set)
    values = enqueue(ALLGATHER, (sparse.values().contiguous(),),
                     name=None if base is None else base + ".values", process_set=process_set)
    count = process_set.size() if process_set is not None else _rt.size()

    def finish(raw: List[Any]) -> torch.Tensor:
        gathered_indices, gathered_values = raw
        if op == Average:
            gathered_values = gathered_values / count
        # Checked: another rank's indices may lie outside this rank's shape if the shapes differ.
        return torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, sparse.shape,
                                       check_invariants=True).to(tensor.device)

    return Handle([indices, values], finish)


# --- allgather ---------------------------------------------------------------------------------


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: Any = global_process_set) -> Handle:
    """Start concatenating every rank's ``tensor`` along dimension 0, in rank order; return a Handle.

    ``synchronize(handle)`` returns the concatenation; afterwards it is identical on all ranks.
    The first dimension may differ between ranks; the others and the dtype must agree.

    Arguments:
        tensor: This rank's rows.
        name: Matches this operation across ranks; None draws a name from a per-kind counter.
        process_set: The ranks taking part (default: all ranks).
    """
    return enqueue(ALLGATHER, (tensor,), name=name, process_set=process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: Any = global_process_set) -> Handle:
    """Start allgathering each tensor of ``tensors`` as one operation; return a Handle.

    ``synchronize(handle)`` returns the list of concatenations along dimension 0 in rank order;
    afterwards each is identical on all ranks.

    Arguments:
        tensors: This rank's rows of each gathered tensor.
        name: Matches this operation across ranks; None draws a name from a per-kind counter.
        process_set: The ranks taking part (default: all ranks).
    """
    return enqueue(ALLGATHER, tensors, grouped=True, name=name, process_set=process_set)


# --- broadcast ---------------------------------------------------------------------------------


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: Any = global_process_set) -> Handle:
    """Start sending ``root_rank``'s tensor to every rank; return a Handle at once.

    ``synchronize(handle)`` returns a new tensor; afterwards it holds root_rank's values on all
    ranks. The input is not modified.

    Arguments:
        tensor: The root's data on root_rank; elsewhere a tensor of the same shape and dtype.
        root_rank: The rank whose tensor is sent.
        name: Matches this operation across ranks; None draws a name from a per-kind counter.
        process_set: The ranks taking part (default: all ranks).
    """
    return enqueue(BROADCAST, (tensor,), root_rank=root_rank, name=name, process_set=process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: Any = global_process_set) -> Handle:
    """Start overwriting ``tensor`` with ``root_rank``'s values, in place; return a Handle at once.

    ``synchronize(handle)`` returns ``tensor`` itself; afterwards ``tensor`` holds root_rank's
    values on all ranks. Do not read or modify it before then.

    Arguments:
        tensor: The root's data on root_rank; elsewhere the tensor to overwrite.
        root_rank: The rank whose tensor is sent.
        name: Matches this operation across ranks; None draws a name from a per-kind counter.
        process_set: The ranks taking part (default: all ranks).
    """
    return enqueue(BROADCAST, (tensor,), inplace=True, root_rank=root_rank, name=name, process_set=process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: Any = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s values, in place, and return it.

    Afterwards ``tensor`` holds root_rank's values on all ranks. Not differentiable.

    Arguments:
        tensor: The root's data on root_rank; elsewhere the tensor to overwrite.
        root_rank: The rank whose tensor is sent.
        name: Matches this operation across ranks; None draws a name from a per-kind counter.
        process_set: The ranks taking part (default: all ranks).
    """
    return enqueue(BROADCAST, (tensor,), inplace=True, root_rank=root_rank, name=name,
                   process_set=process_set).wait()


# --- alltoall and reducescatter ----------------------------------------------------------------


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
                   process_set: Any = global_process_set) -> Handle:
    """Start sending ``splits[i]`` rows of dimension 0 to rank i; return a Handle at once.

    ``synchronize(handle)`` returns ``(received, received_splits)``: afterwards each rank holds
    the rows every rank sent it, concatenated in rank order, and the number of rows from each
    (int32, or the dtype of a ``splits`` tensor). The input is not modified.

    Arguments:
        tensor: The rows to send, grouped by destination rank.
        splits: Rows for each rank, in rank order (list or integer tensor); None splits dimension
            0 evenly, which needs it to divide by the number of ranks.
        name: Matches this operation across ranks; None draws a name from a per-kind counter.
        process_set: The ranks taking part (default: all ranks).
    """
    return enqueue(ALLTOALL, (tensor,), splits=splits, name=name, process_set=process_set)


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: int = Average,
                        process_set: Any = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle:
    """Start reducing ``tensor`` over the ranks, keeping this rank's block of it; return a Handle.

    ``synchronize(handle)`` returns a new tensor: afterwards rank r holds block r of the
    reduction along dimension 0 (blocks as even as possible, earlier ranks taking the extra
    rows). The input must have at least one dimension; it is not modified.

    Arguments:
        tensor: The tensor to reduce; the same shape on every rank.
        name: Matches this operation across ranks; None draws a name from a per-kind counter.
        op: Average (the default), Sum, Min, Max or Product.
        process_set: The ranks taking part (default: all ranks).
        prescale_factor: Multiplies the input before the reduction.
        postscale_factor: Multiplies the result after the reduction.
    """
    return enqueue(REDUCESCATTER, (tensor,), name=name, op=op, prescale_factor=prescale_factor,
                   postscale_factor=postscale_factor, process_set=process_set)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None, op: int = Average,
                                process_set: Any = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    """Start reducescattering each tensor of ``tensors`` as one operation; return a Handle.

    ``synchronize(handle)`` returns a list: afterwards rank r holds block r of each reduction
    along dimension 0. Every tensor must have at least one dimension; none is modified.

    Arguments:
        tensors: The tensors to reduce; the i-th has the same shape on every rank.
        name: Matches this operation across ranks; None draws a name from a per-kind counter.
        op: Average (the default), Sum, Min, Max or Product.
        process_set: The ranks taking part (default: all ranks).
        prescale_factor: Multiplies each input before the reduction.
        postscale_factor: Multiplies each result after the reduction.
    """
    return enqueue(REDUCESCATTER, tensors, grouped=True, name=name, op=op, prescale_factor=prescale_factor,
                   postscale_factor=postscale_factor, process_set=process_set)


# --- coordination ------------------------------------------------------------------------------


def join(device: int = -1) -> int:
    """Declare that this rank has no more data; return the rank that joined last.

    Until every rank has joined, the ranks that have not keep running collectives and this rank
    takes part with zeros (allreduce) or nothing. Afterwards every rank has joined and gets the
    same return value. ``device`` is accepted for Horovod compatibility; the zeros live in host
    memory.
    """
    return int(_rt.join())


def barrier(process_set: Any = global_process_set) -> None:
    """Block until every rank of ``process_set`` has reached this call; afterwards all have."""
    _rt.barrier(process_set=process_set)
