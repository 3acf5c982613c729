"""Framework-neutral elastic training: states that commit, restore and sync, and the retry loop.

A training function written as ``@elastic.run def train(state): ...`` is called again, in a new
world, whenever a peer is lost (``HorovodInternalError``: the state is first restored to its last
commit) or the launcher has slots for more workers (``HostsUpdatedInterrupt``). Before each call
every rank takes rank 0's state. The framework bindings (spark_hvd.torch.elastic, later the
TensorFlow one) add state handlers for their models and optimizers on top of :class:`State`.
"""

from __future__ import annotations

import copy
import functools
import logging
from typing import Any, Callable, Dict, Iterable, List, Optional

from .errors import CollectiveError, HostsUpdatedInterrupt, RankMismatchError

__all__ = ["State", "ObjectState", "run_fn"]

log = logging.getLogger("spark_hvd.elastic")


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
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank when workers are waiting to join."""
        from . import api

        updated, added = api.host_updates()
        if updated:
            raise HostsUpdatedInterrupt(skip_sync=not added)

    def save(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def restore(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def sync(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

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

    def sync(self) -> None:
        """Every rank takes rank 0's values (live ones: what rank 0 has now), then commits them."""
        if self._object_names():
            live = {name: getattr(self, name) for name in self._object_names()}
            self._saved = copy.deepcopy(self._bcast_object(live, root_rank=0))
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved.items():
            object.__setattr__(self, name, copy.deepcopy(value))


def run_fn(func: Callable[..., Any], reset: Callable[[], None]) -> Callable[..., Any]:
    """Wrap ``func(state, ...)`` in the elastic retry loop; ``reset`` forms the next world."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
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
