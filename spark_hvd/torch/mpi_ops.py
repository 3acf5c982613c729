"""Horovod's collective grid for torch tensors, generated from one enqueue path over the runtime.

Every operation goes through :func:`enqueue`: it stages the tensors (zero-copy views where the
memory allows), starts the runtime operation and returns a :class:`Handle` whose
:func:`synchronize` turns the runtime's arrays back into tensors. The public names are thin
variants of one operation spec each: ``<verb>_async`` (start, return a handle),
``<verb>_async_`` and ``<verb>_`` (in place), and ``grouped_<verb>...`` for lists. The
differentiable blocking names (``allreduce``, ``allgather`` ...) live in
:mod:`spark_hvd.torch.autograd` and are built from the same specs.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

import spark_hvd.runtime as _rt
from spark_hvd.torch.basics import Average, Sum, global_process_set
from spark_hvd.torch.tensor_bridge import Staged, stage

__all__ = [
    "Handle",
    "poll",
    "synchronize",
    "enqueue",
    "resolve_op",
    "allreduce_async",
    "allreduce_async_",
    "allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_allreduce_",
    "allgather_async",
    "grouped_allgather_async",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_",
    "alltoall_async",
    "reducescatter_async",
    "grouped_reducescatter_async",
    "sparse_allreduce_async",
    "join",
    "barrier",
]


class Handle:
    """An operation in flight. Pass it to :func:`poll` or :func:`synchronize`; hashable, like
    Horovod's integer handles, so it can key a dict."""

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


# --- The one enqueue path --------------------------------------------------------------------

_REDUCTIONS = frozenset({"allreduce", "reducescatter"})


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
) -> Handle:
    """Start ``kind`` (allreduce, allgather, broadcast, alltoall or reducescatter) on ``tensors``.

    The single entry point of the grid: stages tensors, calls the runtime, and returns a Handle
    whose result is one tensor (``grouped=False``) or a list. With ``inplace`` the results are
    written into the given tensors.
    """
    name = _op_name(kind, name)
    if grouped:
        tensors = list(tensors)
        if not tensors:
            raise ValueError(f"grouped_{kind} got an empty list of tensors; expected at least one tensor")
    what = "tensors[{}]" if grouped else "tensor"
    staged = [stage(t, reduction=kind in _REDUCTIONS, what=what.format(i)) for i, t in enumerate(tensors)]
    wire = _common_wire(staged, kind)
    arrays = [s.array for s in staged]

    if kind in ("allreduce", "broadcast"):
        if inplace:
            outs = arrays
            hosts: List[torch.Tensor] = []
        else:
            hosts, outs = map(list, zip(*(s.empty_like() for s in staged)))
        common: Dict[str, Any] = dict(name=name, dtype=wire, process_set=process_set)
        if kind == "allreduce":
            common.update(op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor)
            if grouped:
                inner = _rt.grouped_allreduce_async(arrays, outs=outs, **common)
            else:
                inner = _rt.allreduce_async(arrays[0], out=outs[0], **common)
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

    elif kind in ("allgather", "reducescatter"):
        common = dict(name=name, dtype=wire, process_set=process_set)
        if kind == "reducescatter":
            common.update(op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor)
        start = getattr(_rt, ("grouped_" if grouped else "") + kind + "_async")
        inner = start(arrays if grouped else arrays[0], **common)

        def finish(raw: List[Any]) -> Any:
            results = [s.result(a) for s, a in zip(staged, raw[0] if grouped else raw)]
            return results if grouped else results[0]

    elif kind == "alltoall":
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


# --- Generated public variants ---------------------------------------------------------------

_P = inspect.Parameter


def _param(name: str, default: Any = _P.empty) -> inspect.Parameter:
    return _P(name, _P.POSITIONAL_OR_KEYWORD, default=default)


@dataclass(frozen=True)
class Verb:
    """One operation family of the grid: its runtime kind, Horovod's signature and what it computes."""

    kind: str
    grouped: bool
    params: Tuple[inspect.Parameter, ...]
    """Parameters after the first (``tensor`` or ``tensors``), in Horovod's order."""
    computes: str
    """One sentence: the postcondition of the blocking, out-of-place form."""
    compressible: bool = False
    """Whether the differentiable form takes ``compression=`` (inserted after ``name``)."""

    @property
    def first(self) -> str:
        return "tensors" if self.grouped else "tensor"

    def public_name(self, *, blocking: bool, inplace: bool) -> str:
        base = ("grouped_" if self.grouped else "") + self.kind
        return base + ("" if blocking else "_async") + ("_" if inplace else "")

    def signature(self, *, with_compression: bool = False) -> inspect.Signature:
        params = [_param(self.first)]
        for p in self.params:
            params.append(p)
            if with_compression and p.name == "name":
                from spark_hvd.torch.compression import Compression

                params.append(_param("compression", Compression.none))
        return inspect.Signature(params)

    def call(self, arguments: Dict[str, Any], *, inplace: bool) -> Handle:
        """Enqueue from bound public arguments."""
        extra: Dict[str, Any] = {}
        if "op" in arguments:
            extra["op"] = resolve_op(arguments["op"], arguments.get("average"))
        for key in ("prescale_factor", "postscale_factor", "root_rank", "splits"):
            if key in arguments:
                extra[key] = arguments[key]
        tensors = arguments[self.first]
        return enqueue(
            self.kind,
            tensors if self.grouped else [tensors],
            grouped=self.grouped,
            inplace=inplace,
            name=arguments["name"],
            process_set=arguments["process_set"],
            **extra,
        )


_ARG_DOCS = {
    "tensor": "A torch tensor (CPU, any supported dtype; CUDA tensors are staged through host memory).",
    "tensors": "A list of torch tensors; the i-th tensor is combined with the i-th tensor of every rank.",
    "average": "Deprecated: True means op=Average, False op=Sum. Pass op instead.",
    "name": "Name that matches this operation across ranks. When None, a name is drawn from a "
            "per-kind counter, so ranks must then issue unnamed operations in the same order.",
    "op": "Reduction: Average (default), Sum, Min, Max or Product.",
    "prescale_factor": "Factor applied to the input before the reduction.",
    "postscale_factor": "Factor applied to the result after the reduction.",
    "process_set": "ProcessSet limiting the operation to a subset of ranks (default: all ranks).",
    "root_rank": "Rank whose tensor is sent to every rank.",
    "splits": "Rows of dimension 0 to send to each rank, in rank order (list or int tensor); "
              "None splits dimension 0 evenly.",
    "compression": "Compression.none (default) or Compression.fp16: how the tensor travels.",
}


def variant_doc(verb: Verb, *, blocking: bool, inplace: bool, differentiable: bool = False) -> str:
    """The docstring of one variant: the postcondition, the variant's contract, the arguments."""
    subject = "each tensor of the list" if verb.grouped else "the tensor"
    lines = [verb.computes, ""]
    if inplace and blocking:
        lines.append(f"In place: after the call {subject} holds the result, and is returned.")
    elif inplace:
        lines.append(
            f"In place and asynchronous: returns a Handle at once; after synchronize(handle) {subject} "
            "holds the result. Do not modify it before then."
        )
    elif blocking:
        lines.append("Returns new tensors; the input is not modified.")
        if differentiable:
            lines.append("Differentiable: gradients flow back through the operation as in Horovod.")
    else:
        lines.append(
            "Asynchronous: returns a Handle at once; synchronize(handle) returns the result. The input "
            "is not modified; do not change it before the operation completes."
        )
    lines += ["", "Arguments:"]
    sig = verb.signature(with_compression=differentiable and verb.compressible)
    lines += [f"    {p}: {_ARG_DOCS[p]}" for p in sig.parameters]
    return "\n".join(lines)


def dress(func: Callable, verb: Verb, *, blocking: bool, inplace: bool, module: str,
          differentiable: bool = False) -> Callable:
    """Give a generated variant its public name, signature and docstring."""
    name = verb.public_name(blocking=blocking, inplace=inplace)
    func.__name__ = func.__qualname__ = name
    func.__module__ = module
    func.__signature__ = verb.signature(with_compression=differentiable and verb.compressible)  # type: ignore[attr-defined]
    func.__doc__ = variant_doc(verb, blocking=blocking, inplace=inplace, differentiable=differentiable)
    return func


def _binder(name: str, signature: inspect.Signature) -> Callable[[tuple, Dict[str, Any]], Dict[str, Any]]:
    """A fast equivalent of ``signature.bind(...).apply_defaults()`` for plain positional-or-keyword
    parameters (``inspect``'s binder costs more than the rest of a small enqueue)."""
    names = list(signature.parameters)
    position = {n: i for i, n in enumerate(names)}
    defaults = {n: p.default for n, p in signature.parameters.items() if p.default is not p.empty}
    required = [n for n in names if n not in defaults]

    def bind(args: tuple, kwargs: Dict[str, Any]) -> Dict[str, Any]:
        if len(args) > len(names):
            raise TypeError(f"{name}() takes at most {len(names)} positional arguments ({len(args)} given)")
        arguments = dict(defaults)
        arguments.update(zip(names, args))
        for key, value in kwargs.items():
            index = position.get(key)
            if index is None:
                raise TypeError(f"{name}() got an unexpected keyword argument {key!r}")
            if index < len(args):
                raise TypeError(f"{name}() got multiple values for argument {key!r}")
            arguments[key] = value
        missing = [n for n in required if n not in arguments]
        if missing:
            raise TypeError(f"{name}() missing required argument(s): {', '.join(map(repr, missing))}")
        return arguments

    return bind


def _make_variant(verb: Verb, *, blocking: bool, inplace: bool) -> Callable[..., Any]:
    bind = _binder(verb.public_name(blocking=blocking, inplace=inplace), verb.signature())

    def variant(*args: Any, **kwargs: Any) -> Any:
        handle = verb.call(bind(args, kwargs), inplace=inplace)
        return handle.wait() if blocking else handle

    return dress(variant, verb, blocking=blocking, inplace=inplace, module=__name__)


_PS = _param("process_set", global_process_set)
_NAME = _param("name", None)
_REDUCE_PARAMS = (_param("average", None), _NAME, _param("op", None), _param("prescale_factor", 1.0),
                  _param("postscale_factor", 1.0), _PS)
_SCATTER_PARAMS = (_NAME, _param("op", Average), _PS, _param("prescale_factor", 1.0),
                   _param("postscale_factor", 1.0))

ALLREDUCE = Verb("allreduce", False, _REDUCE_PARAMS,
                 "Reduce the tensor over all ranks (element-wise; Average by default): afterwards the "
                 "result is identical on every rank, with the input's shape and dtype.", compressible=True)
GROUPED_ALLREDUCE = Verb("allreduce", True, _REDUCE_PARAMS,
                         "Reduce each tensor of the list over all ranks, as one fused operation: afterwards "
                         "every result is identical on every rank.", compressible=True)
ALLGATHER = Verb("allgather", False, (_NAME, _PS),
                 "Concatenate every rank's tensor along dimension 0, in rank order; the first dimension "
                 "may differ between ranks, the others must agree. The result is identical on every rank.")
GROUPED_ALLGATHER = Verb("allgather", True, (_NAME, _PS),
                         "Allgather each tensor of the list (concatenation along dimension 0 in rank order), "
                         "as one operation.")
BROADCAST = Verb("broadcast", False, (_param("root_rank"), _NAME, _PS),
                 "Send root_rank's tensor to every rank: afterwards every rank holds root_rank's values.")
ALLTOALL = Verb("alltoall", False, (_param("splits", None), _NAME, _PS),
                "Send splits[i] rows of dimension 0 to rank i and concatenate what every rank sent here, "
                "in rank order. The result is a tensor (and, when splits is given, the tensor of rows "
                "received from each rank); synchronize() of the async form returns both.")
REDUCESCATTER = Verb("reducescatter", False, _SCATTER_PARAMS,
                     "Reduce the tensor over all ranks (Average by default) and keep this rank's block of "
                     "dimension 0: blocks are as even as possible, earlier ranks taking the extra rows.",
                     compressible=True)
GROUPED_REDUCESCATTER = Verb("reducescatter", True, _SCATTER_PARAMS,
                             "Reducescatter each tensor of the list, as one fused operation.", compressible=True)

allreduce_async = _make_variant(ALLREDUCE, blocking=False, inplace=False)
allreduce_async_ = _make_variant(ALLREDUCE, blocking=False, inplace=True)
allreduce_ = _make_variant(ALLREDUCE, blocking=True, inplace=True)
grouped_allreduce_async = _make_variant(GROUPED_ALLREDUCE, blocking=False, inplace=False)
grouped_allreduce_async_ = _make_variant(GROUPED_ALLREDUCE, blocking=False, inplace=True)
grouped_allreduce_ = _make_variant(GROUPED_ALLREDUCE, blocking=True, inplace=True)
allgather_async = _make_variant(ALLGATHER, blocking=False, inplace=False)
grouped_allgather_async = _make_variant(GROUPED_ALLGATHER, blocking=False, inplace=False)
broadcast_async = _make_variant(BROADCAST, blocking=False, inplace=False)
broadcast_async_ = _make_variant(BROADCAST, blocking=False, inplace=True)
broadcast_ = _make_variant(BROADCAST, blocking=True, inplace=True)
alltoall_async = _make_variant(ALLTOALL, blocking=False, inplace=False)
reducescatter_async = _make_variant(REDUCESCATTER, blocking=False, inplace=False)
grouped_reducescatter_async = _make_variant(GROUPED_REDUCESCATTER, blocking=False, inplace=False)


# --- Operations outside the grid ---------------------------------------------------------------


def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str] = None, op: int = Average,
                           process_set: Any = global_process_set) -> Handle:
    """Start combining a sparse COO tensor over all ranks by allgathering its indices and values.

    ``synchronize(handle)`` returns a sparse tensor holding every rank's entries (duplicates are
    summed when coalesced; with op=Average the values are divided by the number of ranks).
    """
    if not tensor.is_sparse:
        raise ValueError(f"sparse_allreduce_async expects a sparse COO tensor, got layout {tensor.layout}")
    if op not in (Average, Sum):
        raise ValueError(f"op={op!r} is not supported for sparse tensors; expected Average or Sum")
    sparse = tensor.detach().coalesce()
    base = None if name is None else str(name)
    # Indices are transposed so that allgather concatenates entries, not coordinates.
    indices = enqueue("allgather", [sparse.indices().t().contiguous()],
                      name=None if base is None else base + ".indices", process_set=process_set)
    values = enqueue("allgather", [sparse.values().contiguous()],
                     name=None if base is None else base + ".values", process_set=process_set)
    count = _process_set_size(process_set)

    def finish(raw: List[Any]) -> torch.Tensor:
        gathered_indices, gathered_values = raw
        if op == Average:
            gathered_values = gathered_values / count
        return torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, sparse.shape).to(tensor.device)

    return Handle([indices, values], finish)


def _process_set_size(process_set: Any) -> int:
    return process_set.size() if process_set is not None else _rt.size()


def join(device: int = -1) -> int:
    """Declare that this rank has no more data; return the rank that joined last.

    Until every rank has joined, the ranks that have not keep running collectives and this rank
    takes part with zeros (allreduce) or nothing. ``device`` is accepted for Horovod
    compatibility; the zeros live in host memory.
    """
    return int(_rt.join())


def barrier(process_set: Any = global_process_set) -> None:
    """Block until every rank of ``process_set`` has reached this call."""
    _rt.barrier(process_set=process_set)
