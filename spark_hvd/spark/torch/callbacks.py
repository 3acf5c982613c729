"""Callbacks that TorchEstimator calls on every rank during training."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

__all__ = ["Callback", "TrainingState", "call_hook"]


@dataclass
class TrainingState:
    """What a callback sees of the training on its rank; the same object for the whole fit."""

    model: Any
    """The torch model being trained (on the rank's device)."""
    optimizer: Any
    """The rank's DistributedOptimizer."""
    rank: int
    size: int
    epoch: int = 0
    """Index (from 0) of the current epoch; resumed runs continue the count."""
    epochs: int = 0
    """Total epochs of the run."""
    history: List[Dict[str, Any]] = field(default_factory=list)
    """One dict per completed epoch: loss, metrics, val_ metrics, rows_per_s, seconds."""
    stop_training: bool = False
    """Set True (on any rank) to end training after the current epoch; all ranks stop together."""


class Callback:
    """Base class of training callbacks; override the hooks you need.

    Callbacks are pickled with the estimator and run on every rank, so they must not hold
    driver-only objects (sessions, open files). ``logs`` dicts hold plain floats.
    """

    def on_train_begin(self, state: TrainingState) -> None:
        """Before the first epoch of this fit (after a resume, before the first remaining epoch)."""

    def on_epoch_begin(self, epoch: int, state: TrainingState) -> None:
        """Before epoch ``epoch`` (counted from 0)."""

    def on_batch_end(self, step: int, logs: Dict[str, float], state: TrainingState) -> None:
        """After training step ``step`` of the epoch; ``logs`` has this rank's batch ``loss``."""

    def on_epoch_end(self, epoch: int, logs: Dict[str, float], state: TrainingState) -> None:
        """After epoch ``epoch``: ``logs`` holds the metrics averaged over all ranks."""

    def on_train_end(self, state: TrainingState) -> None:
        """After the last epoch."""


def call_hook(callbacks: List[Any], hook: str, *args: Any) -> None:
    """Call ``hook`` on each callback that has it (callbacks need not subclass :class:`Callback`)."""
    for callback in callbacks:
        method = getattr(callback, hook, None)
        if method is not None:
            method(*args)
