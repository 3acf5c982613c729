"""Elastic training for PyTorch (``hvd.elastic``): lose a worker or gain one, keep training.

Write the training loop as a function of a state object and decorate it::

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for batch_idx, (x, y) in enumerate(loader):
                ...
                state.sampler.record_batch(batch_idx, batch_size)
                state.commit()  # what a lost peer rolls back to

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)
    train(state)

When a peer is lost every survivor restores the last commit; when the elastic launcher
(``spark-hvd-run --min-np ...``) has a new world ready, every worker takes rank 0's state and
``train`` is called again.
"""

from __future__ import annotations

from typing import Any, Callable

from spark_hvd.runtime.elastic import ObjectState as _ObjectStateBase
from spark_hvd.runtime.elastic import State, run_fn
from spark_hvd.runtime.errors import CollectiveError as HorovodInternalError
from spark_hvd.runtime.errors import HostsUpdatedInterrupt
from spark_hvd.torch.basics import init, rank, shutdown
from spark_hvd.torch.elastic.sampler import ElasticSampler
from spark_hvd.torch.elastic.state import TorchState
from spark_hvd.torch.functions import broadcast_object

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "HostsUpdatedInterrupt",
           "HorovodInternalError"]


class ObjectState(_ObjectStateBase):
    """Plain Python values as attributes, committed by copy and synced from rank 0."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)


def _reset() -> None:
    shutdown()
    init()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate ``func(state, ...)`` so that it resumes across changes of the world.

    Before each call every rank takes rank 0's state. A lost peer (``HorovodInternalError``)
    makes every survivor restore the last commit, form a new world with the launcher and call
    ``func`` again; new workers announced by the launcher (``HostsUpdatedInterrupt`` from
    ``state.commit()``) do the same without restoring. Collectives must not be issued outside
    ``func`` while workers may be joining.
    """
    return run_fn(func, _reset)
