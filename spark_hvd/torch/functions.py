"""Whole-model helpers: broadcast parameters, optimizer state and Python objects between ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, List, Mapping, Optional, Set, Tuple, Union

import torch

import spark_hvd.runtime as _rt
from spark_hvd.torch.basics import global_process_set, rank
from spark_hvd.torch.handles import Handle, enqueue
from spark_hvd.torch.optimizer import _DistributedOptimizer
from spark_hvd.runtime.kinds import BROADCAST

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]

Params = Union[Mapping[str, torch.Tensor], Iterable[Union[torch.Tensor, Tuple[str, torch.Tensor]]]]


def _named_tensors(params: Params) -> List[Tuple[Optional[str], torch.Tensor]]:
    if isinstance(params, Mapping):
        items: List[Tuple[Optional[str], Any]] = sorted(params.items(), key=lambda kv: str(kv[0]))
    elif isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
        raise ValueError(
            f"invalid params of type {type(params).__name__}: expected model.state_dict(), "
            "model.named_parameters() or model.parameters()"
        )
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    for name, value in items:
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"params[{name!r}] is a {type(value).__name__}, not a tensor; broadcast_parameters moves "
                "tensors only (use broadcast_object for other values)"
            )
    return items


def broadcast_parameters(params: Params, root_rank: int, prefix: str = "Parameter.",
                         process_set: Any = global_process_set) -> None:
    """Overwrite the given tensors, in place, with their values on ``root_rank``.

    Afterwards every rank holds root_rank's values. ``params`` is ``model.state_dict()`` (a
    mapping, broadcast in sorted key order), ``model.named_parameters()`` or
    ``model.parameters()``; names, prefixed with ``prefix``, key the operations.
    """
    handles = []
    for name, tensor in _named_tensors(params):
        op_name = None if name is None else f"{prefix}{name}"
        handles.append(enqueue(BROADCAST, [tensor], inplace=True, root_rank=root_rank, name=op_name,
                               process_set=process_set))
    for handle in handles:
        handle.wait()


@dataclass(frozen=True)
class _TensorSlot:
    """Stands for a tensor in the structure that travels as an object."""

    index: int
    shape: Tuple[int, ...]
    dtype: torch.dtype


def _hollow(value: Any, tensors: List[torch.Tensor]) -> Any:
    """``value`` with every dense tensor replaced by a :class:`_TensorSlot` (tensors collected in
    order); sparse tensors, such as SGD's momentum for sparse gradients, stay in the pickled part."""
    if isinstance(value, torch.Tensor) and value.layout == torch.strided:
        tensors.append(value)
        return _TensorSlot(len(tensors) - 1, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: _hollow(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_hollow(v, tensors) for v in value)
    return value


def _fill(value: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(value, _TensorSlot):
        return tensors[value.index]
    if isinstance(value, dict):
        return {k: _fill(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_fill(v, tensors) for v in value)
    return value


def _sparse_gradient_params(optimizer: torch.optim.Optimizer, model: Optional[torch.nn.Module]) -> Set[int]:
    """Ids of the parameters whose gradients are sparse in training: all of them for SparseAdam,
    else those of the model's sparse embeddings."""
    if isinstance(optimizer, torch.optim.SparseAdam):
        return {id(p) for group in optimizer.param_groups for p in group["params"]}
    if model is None:
        return set()
    return {id(p) for m in model.modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse for p in m.parameters()}


def _create_state(optimizer: torch.optim.Optimizer, model: Optional[torch.nn.Module]) -> None:
    """Give an optimizer that has not stepped yet its state, as Horovod does: one step of the
    wrapped optimizer on zero gradients.

    The step must not train: parameters get their values back afterwards (weight decay would
    otherwise move them), and gradients that existed are restored. Parameters that had no
    gradient keep the zero gradient, as in Horovod, in the layout they have in training.
    """
    sparse = _sparse_gradient_params(optimizer, model)
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    saved = [(p, p.detach().clone(), p.grad) for p in params]
    for p in params:
        zeros = torch.zeros_like(p)
        p.grad = zeros.to_sparse() if id(p) in sparse else zeros
    try:
        if isinstance(optimizer, _DistributedOptimizer):
            # Its own step() would reduce gradients, a collective that ranks which already have
            # state (a loaded checkpoint) never join: take the wrapped optimizer's step.
            super(_DistributedOptimizer, optimizer).step()
        else:
            optimizer.step()
    finally:
        with torch.no_grad():
            for p, value, grad in saved:
                p.copy_(value)
                if grad is not None:
                    p.grad = grad


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: Optional[torch.nn.Module] = None,
                              process_set: Any = global_process_set) -> None:
    """Make every rank's optimizer state and options equal to ``root_rank``'s.

    Afterwards every rank holds root_rank's per-parameter state (momentum buffers, Adam moments,
    ``step``) and the options of every param group (learning rate, momentum, betas, weight decay
    ...), numbers with their exact type and value. As in Horovod, an optimizer that has no state
    yet first creates it with one step on zero gradients (parameters keep their values, and
    parameters without a gradient get a zero one), so that a fresh optimizer on the root still
    sends state of the shape training will have. L-BFGS, whose step needs a closure, is
    broadcast as it is.

    Arguments:
        optimizer: A torch optimizer or a DistributedOptimizer.
        root_rank: The rank whose state is sent.
        model: The model the optimizer trains; its sparse embeddings get sparse zero gradients
            for the state-creating step (needed by optimizers that take sparse gradients).
        process_set: The ranks taking part (default: all ranks).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    if not optimizer.state and not isinstance(optimizer, torch.optim.LBFGS):
        _create_state(optimizer, model)
    is_root = rank() == root_rank
    tensors: List[torch.Tensor] = []
    skeleton = _hollow(optimizer.state_dict(), tensors) if is_root else None
    skeleton = _rt.broadcast_object(skeleton, root_rank=root_rank, process_set=process_set)
    if not is_root:
        tensors = []
        slots: List[_TensorSlot] = []
        _collect_slots(skeleton, slots)
        for slot in sorted(slots, key=lambda s: s.index):
            tensors.append(torch.empty(slot.shape, dtype=slot.dtype))
    handles: List[Handle] = [
        enqueue(BROADCAST, [t], inplace=True, root_rank=root_rank, process_set=process_set) for t in tensors
    ]
    for handle in handles:
        handle.wait()
    if not is_root:
        optimizer.load_state_dict(_fill(skeleton, tensors))


def _collect_slots(value: Any, out: List[_TensorSlot]) -> None:
    if isinstance(value, _TensorSlot):
        out.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _collect_slots(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect_slots(v, out)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: Any = global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (serialized with cloudpickle).

    Unnamed calls take names from a counter, so ranks may pass objects of different types
    (only the root's matters) without disagreeing on the operation.
    """
    return _rt.broadcast_object(obj, root_rank=root_rank, name=name, process_set=process_set)


def allgather_object(obj: Any, name: Optional[str] = None, process_set: Any = global_process_set) -> List[Any]:
    """Return the list of every rank's ``obj``, in rank order, on every rank."""
    return _rt.allgather_object(obj, name=name, process_set=process_set)
