"""Collectives in flight: the one enqueue path from torch tensors to the runtime, and its handles.

:func:`enqueue` stages the tensors (zero-copy views where the memory allows), starts the runtime
operation and returns a :class:`Handle`; :func:`synchronize` waits for it and turns the runtime's
arrays back into tensors. Every public collective of :mod:`spark_hvd.torch` is a short function
over :func:`enqueue`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

import spark_hvd.runtime as _rt
from spark_hvd.torch.basics import Adasum, Average, Sum, global_process_set
from spark_hvd.torch.device import enqueue_device, use_device
from spark_hvd.torch.tensor_bridge import Staged, stage
from spark_hvd.runtime.kinds import ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, REDUCESCATTER

__all__ = ["Handle", "poll", "synchronize", "enqueue", "resolve_op"]


class Handle:
    """An operation in flight. Pass it to :func:`poll` or :func:`synchronize`; hashable, like
    Horovod's integer handles, so it can key a dict. Calling it, ``handle()``, is
    ``synchronize(handle)``, which is how Horovod's ``sparse_allreduce_async`` result is used."""

    __slots__ = ("_inner", "_finish", "_result", "_finished", "__weakref__")

    def __init__(self, inner: Sequence[Any], finish: Callable[[List[Any]], Any]) -> None:
        self._inner: Optional[Sequence[Any]] = inner
        self._finish = finish
        self._result: Any = None
        self._finished = False

    def done(self) -> bool:
        """Whether the operation has completed (then :func:`synchronize` does not block)."""
        return self._finished or all(
            h.done() if isinstance(h, Handle) else _rt.poll(h) for h in self._inner or ()
        )

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until the operation completes and return its result (see :func:`synchronize`)."""
        if not self._finished:
            raw = [
                h.wait(timeout) if isinstance(h, Handle) else _rt.synchronize(h, timeout=timeout)
                for h in self._inner or ()
            ]
            self._result = self._finish(raw)
            self._finished = True
            self._inner = None
            self._finish = _no_finish
        return self._result

    def __call__(self) -> Any:
        """Wait for the operation and return its result, as :func:`synchronize` does."""
        return self.wait()


def _no_finish(raw: List[Any]) -> Any:
    raise AssertionError("a handle finishes once")


def poll(handle: Handle) -> bool:
    """Whether the asynchronous operation behind ``handle`` has completed.

    After ``poll()`` returns True, :func:`synchronize` returns without blocking.
    """
    _check_handle(handle)
    return handle.done()


def synchronize(handle: Handle) -> Any:
    """Wait for the asynchronous operation behind ``handle`` and return its result.

    The result is a tensor (the input tensor itself for in-place operations), a list of tensors
    for grouped operations, or ``(tensor, received_splits)`` for ``alltoall_async``. Calling it
    again returns the same result. A failed operation raises ``HorovodInternalError``
    (``spark_hvd.runtime.errors.CollectiveError``) or the ValueError that describes a mismatch.
    """
    _check_handle(handle)
    return handle.wait()


def _check_handle(handle: Any) -> None:
    if not isinstance(handle, Handle):
        raise ValueError(
            f"handle={handle!r} is not a spark_hvd.torch handle; expected the value returned by an "
            "*_async function such as allreduce_async()"
        )


def resolve_op(op: Optional[int], average: Optional[bool]) -> int:
    """Horovod's deprecated ``average=`` flag folded into ``op`` (default Average)."""
    if average is not None:
        if op is not None:
            raise ValueError(
                f"both op={op!r} and average={average!r} were given; the op parameter supersedes "
                "average: pass only op"
            )
        return Average if average else Sum
    return Average if op is None else op


_REDUCTIONS = frozenset({ALLREDUCE, REDUCESCATTER})


def _common_wire(staged: Sequence[Staged], kind: str) -> Optional[str]:
    wires = {s.wire for s in staged}
    if len(wires) > 1:
        dtypes = sorted({str(s.target.dtype) for s in staged})
        raise ValueError(
            f"grouped_{kind} got tensors of dtypes {dtypes}; bfloat16 cannot share a group with other "
            "dtypes. Put the bfloat16 tensors in a separate grouped call."
        )
    return next(iter(wires), None)


def _splits_array(splits: Any) -> Optional[np.ndarray]:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        values = splits.detach().to("cpu", torch.int64).reshape(-1).numpy()
    else:
        values = np.asarray(list(splits), dtype=np.int64).reshape(-1)
    return values


def _op_name(kind: str, name: Optional[str]) -> Optional[str]:
    """Horovod keys operations by kind and name, so an allreduce and a broadcast may share a name."""
    if name is None or name == "":
        return None  # the runtime draws a name from its per-kind counter
    if not isinstance(name, str):
        raise ValueError(f"name={name!r} is invalid: expected a string (or None for an automatic name)")
    return f"{kind}.{name}"


def _refuse_scalars(tensors: Sequence[Any], grouped: bool) -> None:
    # The bridge gives 0-dim tensors one row so they can be gathered and broadcast; a reducescatter
    # of that row would hand a meaningless piece to one rank, so Horovod refuses scalars here.
    for i, tensor in enumerate(tensors):
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 0:
            what = f"tensors[{i}]" if grouped else "tensor"
            raise ValueError(
                f"{what} is 0-dimensional (shape ()), but reducescatter splits dimension 0 across ranks "
                "and needs at least one dimension; reshape it, e.g. tensor.reshape(1), or use allreduce"
            )


def enqueue(
    kind: str,
    tensors: Sequence[torch.Tensor],
    *,
    grouped: bool = False,
    inplace: bool = False,
    name: Optional[str] = None,
    op: int = Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    root_rank: Optional[int] = None,
    splits: Any = None,
    process_set: Any = global_process_set,
    will_wait: bool = False,
) -> Handle:
    """Start ``kind`` (allreduce, allgather, broadcast, alltoall or reducescatter) on ``tensors``.

    The single entry point of the grid: stages tensors, calls the runtime, and returns a Handle
    whose result is one tensor (``grouped=False``) or a list. With ``inplace`` the results are
    written into the given tensors. ``will_wait``: the caller waits for the handle next (a
    blocking call), which lets a single allreduce skip negotiation (see
    :func:`spark_hvd.runtime.allreduce`).
    """
    name = _op_name(kind, name)
    if grouped:
        tensors = list(tensors)
        if not tensors:
            raise ValueError(f"grouped_{kind} got an empty list of tensors; expected at least one tensor")
    if kind == REDUCESCATTER:
        _refuse_scalars(tensors, grouped)
    if tensors and tensors[0].is_cuda and not (kind == ALLREDUCE and op == Adasum) and use_device(tensors):
        inner, finish_device = enqueue_device(kind, list(tensors), grouped=grouped, inplace=inplace, name=name, op=op,
                                              prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                              root_rank=root_rank, splits=splits, process_set=process_set)
        return Handle([inner], finish_device)
    what = "tensors[{}]" if grouped else "tensor"
    staged = [stage(t, reduction=kind in _REDUCTIONS, what=what.format(i)) for i, t in enumerate(tensors)]
    wire = _common_wire(staged, kind)
    arrays = [s.array for s in staged]

    if kind in (ALLREDUCE, BROADCAST):
        if inplace:
            outs = arrays
            hosts: List[torch.Tensor] = []
        else:
            hosts, outs = map(list, zip(*(s.empty_like() for s in staged)))
        common: Dict[str, Any] = dict(name=name, dtype=wire, process_set=process_set)
        if kind == ALLREDUCE:
            common.update(op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor)
            if grouped:
                inner = _rt.grouped_allreduce_async(arrays, outs=outs, **common)
            else:
                inner = _rt.allreduce_async(arrays[0], out=outs[0], will_wait=will_wait, **common)
        else:
            if grouped:
                raise ValueError("broadcast has no grouped form; call broadcast_async_ once per tensor")
            inner = _rt.broadcast_async(arrays[0], root_rank, out=outs[0], **common)

        def finish(raw: List[Any]) -> Any:
            if inplace:
                results = [s.write_back() for s in staged]
            else:
                results = [s.finish_out(h) for s, h in zip(staged, hosts)]
            return results if grouped else results[0]

    elif kind in (ALLGATHER, REDUCESCATTER):
        common = dict(name=name, dtype=wire, process_set=process_set)
        if kind == REDUCESCATTER:
            common.update(op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor)
        start = {(ALLGATHER, False): _rt.allgather_async, (ALLGATHER, True): _rt.grouped_allgather_async,
                 (REDUCESCATTER, False): _rt.reducescatter_async,
                 (REDUCESCATTER, True): _rt.grouped_reducescatter_async}[(kind, grouped)]
        inner = start(arrays if grouped else arrays[0], **common)

        def finish(raw: List[Any]) -> Any:
            results = [s.result(a) for s, a in zip(staged, raw[0] if grouped else raw)]
            return results if grouped else results[0]

    elif kind == ALLTOALL:
        if grouped:
            raise ValueError("alltoall has no grouped form; call alltoall_async once per tensor")
        splits_dtype = splits.dtype if isinstance(splits, torch.Tensor) else torch.int32
        inner = _rt.alltoall_async(arrays[0], splits=_splits_array(splits), name=name, dtype=wire,
                                   process_set=process_set)

        def finish(raw: List[Any]) -> Any:
            received, received_splits = raw[0]
            splits_tensor = torch.from_numpy(np.asarray(received_splits, dtype=np.int64)).to(splits_dtype)
            return staged[0].result(received), splits_tensor

    else:
        raise ValueError(
            f"kind={kind!r} is not a collective; expected allreduce, allgather, broadcast, alltoall or reducescatter"
        )
    return Handle([inner], finish)
