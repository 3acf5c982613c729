"""State that elastic training keeps in step across ranks: commit, restore and sync, framework-neutral.

Framework bindings build their state classes (TensorFlow variables, Keras models) on
:class:`VariableState`, which needs only objects with ``numpy()`` and ``assign(array)``.
Re-forming a world after a failure (``run``) belongs to the elastic driver.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Iterable, List

import numpy as np

from . import api

__all__ = ["State", "ObjectState", "VariableState"]


class State:
    """Something kept in step across ranks: ``save``/``restore`` locally, ``sync`` from rank 0.

    ``commit()`` saves a copy that ``restore()`` returns to; ``sync()`` makes every rank equal
    to rank 0 and commits that. Reset callbacks run when the world has been re-formed.
    """

    def __init__(self) -> None:
        self._reset_callbacks: List[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` after the world has been re-formed."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks (called after the world has been re-formed)."""
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the current state; afterwards :meth:`restore` returns to it."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Where the elastic driver reports membership changes; nothing to do without one."""

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class ObjectState(State):
    """Plain attributes given as keyword arguments (``epoch=0, batch=0``), synced with broadcast_object."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._saved: Dict[str, Any] = dict(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)

    def save(self) -> None:
        self._saved = {name: copy.deepcopy(getattr(self, name)) for name in self._saved}

    def restore(self) -> None:
        for name, value in self._saved.items():
            setattr(self, name, copy.deepcopy(value))

    def sync(self) -> None:
        """Give every rank rank 0's attribute values; afterwards they are committed everywhere."""
        if self._saved:
            current = {name: getattr(self, name) for name in self._saved}
            for name, value in api.broadcast_object(current, root_rank=0).items():
                setattr(self, name, value)
        self.save()


def _broadcast_array(array: np.ndarray, root_rank: int) -> np.ndarray:
    array = np.ascontiguousarray(array)
    if array.dtype.name == "bfloat16":  # ml_dtypes: travels as its 16-bit storage
        return api.broadcast(array.view(np.uint16), root_rank, dtype="bfloat16").view(array.dtype)
    shape = array.shape
    return api.broadcast(array.reshape(-1) if array.ndim == 0 else array, root_rank).reshape(shape)


class VariableState(ObjectState):
    """Variables (anything with ``numpy()`` and ``assign()``) plus plain attributes.

    The variables come from :meth:`variables_to_keep`, asked afresh on every call, so state
    created later (an optimizer's slots) is kept too.
    """

    def __init__(self, **kwargs: Any) -> None:
        self._values: List[np.ndarray] = []
        super().__init__(**kwargs)
        self._values = [np.array(v.numpy()) for v in self.variables_to_keep()]

    def variables_to_keep(self) -> List[Any]:
        raise NotImplementedError

    def save(self) -> None:
        self._values = [np.array(v.numpy()) for v in self.variables_to_keep()]
        super().save()

    def restore(self) -> None:
        for var, value in zip(self.variables_to_keep(), self._values):
            var.assign(value)
        super().restore()

    def sync(self) -> None:
        """Give every rank rank 0's variable values and attributes; afterwards they are committed."""
        for var in self.variables_to_keep():
            var.assign(_broadcast_array(np.asarray(var.numpy()), root_rank=0))
        super().sync()
