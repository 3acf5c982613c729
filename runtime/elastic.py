"""Framework-neutral elastic training: states that commit, restore and sync, and the retry loop.

A training function written as ``@elastic.run def train(state): ...`` is called again, in a new
world, whenever a peer is lost (``HorovodInternalError``: the state is first restored to its last
commit) or the launcher has slots for more workers (``HostsUpdatedInterrupt``). Before each call
every rank takes rank 0's state. The framework bindings build their state classes on these:
PyTorch's handlers for modules and optimizers, TensorFlow's and Keras's on :class:`VariableState`
(anything with ``numpy()`` and ``assign()``).

A launcher that runs every world as a job of fixed size (Spark's ``run_elastic``: one barrier
stage per world) installs :class:`StageHooks` in each worker instead of re-forming worlds in
place: commits are also persisted where the next job finds them, a lost peer ends the job (the
launcher starts the next one), and a resize ends it with :class:`WorldResizeRequested`.
"""

from __future__ import annotations

import copy
import functools
import logging
from typing import Any, Callable, Dict, Iterable, List, Optional

import numpy as np

from .errors import CollectiveError, HostsUpdatedInterrupt, RankMismatchError

__all__ = ["State", "ObjectState", "VariableState", "run_fn", "StageHooks", "WorldResizeRequested",
           "use_stage_hooks"]

log = logging.getLogger("spark_hvd.elastic")


class WorldResizeRequested(Exception):
    """Raised out of an elastic function, on every rank at once, when the launcher running fixed
    worlds (see :class:`StageHooks`) wants the world ended so it can start one of another size."""


class StageHooks:
    """A launcher's part in elastic training when each world is a separate job of fixed size.

    The base class persists nothing and never asks for a resize.
    """

    def load(self, state: "State") -> None:
        """Before the first sync of the job: load the last persisted commit (rank 0 only needs to;
        the sync then hands it to every rank)."""

    def committed(self, state: "State") -> None:
        """After every ``state.commit()``, on every rank: persist what the next job resumes from."""

    def resize_requested(self) -> bool:
        """Whether the launcher wants this world ended for a resize; the same answer on every rank."""
        return False


_stage_hooks: Optional[StageHooks] = None


def use_stage_hooks(hooks: Optional[StageHooks]) -> None:
    """Install ``hooks`` for elastic functions run in this process from now on (None removes them)."""
    global _stage_hooks
    _stage_hooks = hooks


class State:
    """Training state that can be committed, restored to its last commit, and synced from rank 0."""

    def __init__(self) -> None:
        self._reset_callbacks: List[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions called (without arguments) after every reset, before the state is synced,
        e.g. to scale the learning rate with the new world size."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (it is what a lost peer rolls back to), then react to new workers:
        raises :class:`HostsUpdatedInterrupt` on every rank at once when the launcher has some."""
        self.save()
        if _stage_hooks is not None:
            _stage_hooks.committed(self)
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank when workers are waiting to join."""
        from . import api

        if _stage_hooks is not None:
            if _stage_hooks.resize_requested():
                raise HostsUpdatedInterrupt(skip_sync=False)
            return
        updated, added = api.host_updates()
        if updated:
            raise HostsUpdatedInterrupt(skip_sync=not added)

    def save(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def restore(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def sync(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def snapshot(self) -> Dict[str, Any]:
        """The last commit as plain picklable values (what :class:`StageHooks` persist)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be persisted: implement snapshot() and "
                                  "load_snapshot() to run it under a launcher of fixed worlds")

    def load_snapshot(self, snapshot: Dict[str, Any]) -> None:
        """Make ``snapshot`` (from :meth:`snapshot`) the last commit and restore it."""
        raise NotImplementedError(f"{type(self).__name__} cannot be persisted: implement snapshot() and "
                                  "load_snapshot()")

    def reset(self) -> None:
        """Hook of subclasses called by the retry loop after a new world was formed."""


class ObjectState(State):
    """Plain Python values as attributes (``state.epoch``, ``state.batch`` ...), committed by deep
    copy and synced by broadcasting rank 0's committed values."""

    def __init__(self, bcast_object: Optional[Callable[..., Any]] = None, get_rank: Optional[Callable[[], int]] = None,
                 **kwargs: Any) -> None:
        super().__init__()
        if bcast_object is None or get_rank is None:
            from . import api

            bcast_object = bcast_object or api.broadcast_object
            get_rank = get_rank or api.rank
        self._bcast_object = bcast_object
        self._get_rank = get_rank
        self._saved: Dict[str, Any] = kwargs
        self._set_attrs()
        self.save()

    def _object_names(self) -> List[str]:
        return list(self._saved)

    def save(self) -> None:
        self._saved = {name: copy.deepcopy(getattr(self, name)) for name in self._object_names()}

    def restore(self) -> None:
        self._set_attrs()

    def snapshot(self) -> Dict[str, Any]:
        return {"objects": copy.deepcopy(self._saved)}

    def load_snapshot(self, snapshot: Dict[str, Any]) -> None:
        self._saved = dict(snapshot["objects"])
        self.restore()

    def sync(self) -> None:
        """Every rank takes rank 0's values (live ones: what rank 0 has now), then commits them."""
        if self._object_names():
            live = {name: getattr(self, name) for name in self._object_names()}
            for name, value in self._bcast_object(live, root_rank=0).items():
                object.__setattr__(self, name, value)
        self.save()

    def _set_attrs(self) -> None:
        for name, value in self._saved.items():
            object.__setattr__(self, name, copy.deepcopy(value))


def _broadcast_array(array: np.ndarray, root_rank: int) -> np.ndarray:
    from . import api

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

    def variables_to_keep(self) -> List[Any]:  # pragma: no cover - interface
        raise NotImplementedError

    def save(self) -> None:
        self._values = [np.array(v.numpy()) for v in self.variables_to_keep()]
        super().save()

    def restore(self) -> None:
        for var, value in zip(self.variables_to_keep(), self._values):
            var.assign(value)
        super().restore()

    def snapshot(self) -> Dict[str, Any]:
        return {**super().snapshot(), "variables": [np.array(v) for v in self._values]}

    def load_snapshot(self, snapshot: Dict[str, Any]) -> None:
        self._values = list(snapshot["variables"])
        super().load_snapshot(snapshot)

    def sync(self) -> None:
        """Every rank takes rank 0's variable values and attributes, and commits them."""
        for var in self.variables_to_keep():
            mine = np.asarray(var.numpy())
            var.assign(_broadcast_array(mine, root_rank=0).reshape(mine.shape))
        super().sync()


def run_fn(func: Callable[..., Any], reset: Callable[[], None]) -> Callable[..., Any]:
    """Wrap ``func(state, ...)`` in the elastic retry loop; ``reset`` forms the next world."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        hooks = _stage_hooks
        if hooks is not None:
            # A world of fixed size: a lost peer fails it (CollectiveError propagates), and the
            # launcher starts the next one, whose first sync hands out the persisted commit.
            hooks.load(state)
            state.sync()
            try:
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt:
                raise WorldResizeRequested("the launcher ends this world to start one of another size") from None
        reset_required = False
        skip_sync = False
        while True:
            try:
                if reset_required:
                    reset()
                    state.on_reset()
                    state.reset()
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except RankMismatchError:
                raise  # ranks disagree on an operation: a bug in the script, which a new world repeats
            except CollectiveError as exc:
                log.warning("spark-hvd elastic: %s; restoring the last commit and forming a new world", exc)
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as exc:
                log.info("spark-hvd elastic: the launcher has new workers; forming a new world")
                skip_sync = exc.skip_sync
            reset_required = True

    return wrapper
