"""Early stopping and learning-rate schedules of a TorchEstimator run, on its ranks.

Every rank decides alike: the values it watches are the epoch's logs after they are averaged over
the ranks. What a resumed or retried run needs to go on where it stopped (the best value so far,
epochs without improvement, the best weights, the scheduler's state) travels in the checkpoint.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch

__all__ = ["EarlyStopping", "monitor_mode", "step_scheduler", "restore_scheduler"]

_HIGHER_IS_BETTER = ("acc", "auc", "precision", "recall", "f1")


def monitor_mode(monitor: str, mode: str = "auto") -> str:
    """'min' or 'max': ``mode``, or for 'auto' 'max' where the name says accuracy, AUC, precision,
    recall or F1, else 'min'."""
    if mode != "auto":
        return mode
    return "max" if any(word in monitor.lower() for word in _HIGHER_IS_BETTER) else "min"


class EarlyStopping:
    """Keras's EarlyStopping rule over a run's epoch logs: stop after ``patience`` epochs in a row
    without an improvement of more than ``min_delta`` in ``monitor``."""

    def __init__(self, settings: Dict[str, Any], state: Optional[Dict[str, Any]] = None) -> None:
        self.monitor = str(settings["monitor"])
        self.patience = int(settings["patience"])
        self.min_delta = float(settings["min_delta"])
        self.mode = monitor_mode(self.monitor, str(settings.get("mode", "auto")))
        self.restore_best_weights = bool(settings.get("restore_best_weights", True))
        state = state or {}
        self.best: Optional[float] = state.get("best")
        self.best_epoch = int(state.get("best_epoch") or 0)
        self.wait = int(state.get("wait") or 0)
        self.stopped = bool(state.get("stopped", False))

    def update(self, epoch: int, logs: Dict[str, Any]) -> bool:
        """Take epoch ``epoch``'s (from 1) averaged ``logs``; whether it is the best so far. Sets
        :attr:`stopped` once patience runs out."""
        if self.monitor not in logs:
            raise KeyError(f"early_stopping monitors {self.monitor!r}, which the epoch's logs do not have: "
                           f"{sorted(logs)}")
        value = float(logs[self.monitor])
        better = self.best is None or (value < self.best - self.min_delta if self.mode == "min"
                                       else value > self.best + self.min_delta)
        if better and not math.isnan(value):
            self.best, self.best_epoch, self.wait = value, epoch, 0
            return True
        self.wait += 1
        if self.wait >= max(self.patience, 1):
            self.stopped = True
        return False

    def state(self) -> Dict[str, Any]:
        """What a checkpoint keeps of it."""
        return {"best": self.best, "best_epoch": self.best_epoch, "wait": self.wait, "stopped": self.stopped}

    def describe(self) -> str:
        """One line on why training stopped (or that it did not)."""
        if not self.stopped:
            return ""
        restored = f"; the weights of epoch {self.best_epoch} are the model's" if self.restore_best_weights else ""
        return (f"early stopping: {self.monitor} did not improve by more than {self.min_delta:g} for {self.wait} "
                f"epoch(s) after epoch {self.best_epoch} (best {self.best:.6g}){restored}")


def step_scheduler(scheduler: Any, logs: Optional[Dict[str, Any]] = None) -> None:
    """Step ``scheduler`` (``ReduceLROnPlateau`` with the epoch's val_loss, or loss)."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        logs = logs or {}
        scheduler.step(logs["val_loss"] if "val_loss" in logs else logs["loss"])
    else:
        scheduler.step()


def restore_scheduler(scheduler: Any, optimizer: Any, state: Dict[str, Any]) -> None:
    """Load ``state`` into ``scheduler`` and give ``optimizer`` the rates it had when it was saved."""
    scheduler.load_state_dict(state)
    last = getattr(scheduler, "get_last_lr", None)
    rates = last() if callable(last) else None
    if rates:
        for group, lr in zip(optimizer.param_groups, rates):
            group["lr"] = lr
