"""``TorchState``: models, optimizers, elastic samplers and plain values committed, restored and synced."""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Tuple, Type

import torch

from spark_hvd.runtime.elastic import ObjectState
from spark_hvd.torch.basics import rank
from spark_hvd.torch.elastic.sampler import ElasticSampler
from spark_hvd.torch.functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["TorchState", "StateHandler", "ModelStateHandler", "OptimizerStateHandler", "SamplerStateHandler"]


class StateHandler:
    """Commits, restores and syncs one kind of value held by a :class:`TorchState`."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.save()

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()

    def save(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def restore(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def sync(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class ModelStateHandler(StateHandler):
    """A ``torch.nn.Module``: parameters and buffers, copied in memory; synced by broadcast."""

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(StateHandler):
    """A ``torch.optim.Optimizer``: its state and param-group options; synced from rank 0 (a fresh
    optimizer of a new worker gets its state created first)."""

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(StateHandler):
    """An :class:`ElasticSampler`: synced by taking rank 0's position in the epoch and dealing
    the rest of the epoch to the current world."""

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        self.value.sync_from(broadcast_object(self.value.state_dict(), root_rank=0))


_HANDLERS: List[Tuple[type, Type[StateHandler]]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def _handler_for(value: Any) -> Any:
    for kind, handler in _HANDLERS:
        if isinstance(value, kind):
            return handler
    return None


class TorchState(ObjectState):
    """State of a PyTorch training process for ``hvd.elastic.run``.

    ``model``, ``optimizer`` and every keyword argument become attributes. Modules, optimizers and
    :class:`ElasticSampler` objects get handlers (state dicts copied in memory on ``commit()``,
    broadcast from rank 0 on ``sync()``); everything else is a plain value, deep-copied on commit
    and broadcast as an object. Assigning a new model or optimizer to the attribute commits it.
    """

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: Dict[str, StateHandler] = {}
        plain: Dict[str, Any] = {}
        for name, value in kwargs.items():
            handler = _handler_for(value)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler(value)
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def snapshot(self) -> Dict[str, Any]:
        return {**super().snapshot(), "handlers": {name: handler._saved for name, handler in self._handlers.items()}}

    def load_snapshot(self, snapshot: Dict[str, Any]) -> None:
        for name, saved in snapshot["handlers"].items():
            self._handlers[name]._saved = saved
            self._handlers[name].restore()
        super().load_snapshot(snapshot)

    def sync(self) -> None:
        """Every rank takes rank 0's models, optimizers, samplers and values, and commits them."""
        for handler in self._handlers.values():
            handler.sync()
        super().sync()  # ends with save(): the handlers commit what they synced too

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers")
        if handlers is not None and name in handlers:
            handlers[name].set_value(value)
        object.__setattr__(self, name, value)
