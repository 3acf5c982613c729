"""Checks LightningEstimator makes on the driver before any Spark job runs.

Each failure is a ValueError that names the value seen, what was expected and the fix. The
column, store, slot and forward checks are the torch estimator's (spark_hvd.spark.torch.checks);
these are the ones a LightningModule adds.
"""

from __future__ import annotations

import copy
import inspect
import traceback
import warnings
from typing import Any, Dict, List, Optional

import pytorch_lightning as pl
import torch

__all__ = ["check_module", "check_trainer_args", "check_callbacks", "first_optimizer", "configured_optimizer",
           "dry_run_training_step"]

_OWNED_TRAINER_ARGS = {
    "strategy": "the estimator trains with spark_hvd.lightning.SparkHvdStrategy",
    "devices": "each rank trains on one device; set num_proc for more ranks",
    "num_nodes": "the ranks are Spark barrier tasks; set num_proc for more ranks",
    "accelerator": "the estimator picks 'gpu' when use_gpu=True and CUDA is available, else 'cpu'; set use_gpu",
    "max_epochs": "set epochs instead",
    "callbacks": "pass Lightning callbacks with callbacks=[...]",
    "enable_checkpointing": "the estimator checkpoints every epoch into the store under run_id",
    "gpus": "set use_gpu instead",
    "max_steps": "set epochs and train_steps_per_epoch instead",
}
"""Trainer arguments the estimator sets itself, and why."""


def check_module(model: Any, validation: Any) -> None:
    """``model`` is a pytorch_lightning.LightningModule with training_step and configure_optimizers
    of its own, and validation_step when validation rows are held out."""
    if not isinstance(model, pl.LightningModule):
        if any(base.__module__.startswith("lightning.pytorch") for base in type(model).__mro__):
            raise ValueError(f"model={type(model).__name__} is a lightning.pytorch.LightningModule: expected a "
                             "pytorch_lightning.LightningModule (SparkHvdStrategy is built on the pytorch_lightning "
                             "package); fix: import LightningModule from pytorch_lightning")
        raise ValueError(f"model={model!r} is not valid: expected a pytorch_lightning.LightningModule with "
                         "training_step and configure_optimizers; for a plain torch.nn.Module use "
                         "spark_hvd.spark.torch.TorchEstimator")
    for hook, what in (("training_step", "the loss of a batch"), ("configure_optimizers", "the optimizer")):
        if getattr(type(model), hook) is getattr(pl.LightningModule, hook):
            raise ValueError(f"{type(model).__name__} does not define {hook}: expected a LightningModule whose "
                             f"{hook} gives {what}; fix: implement {type(model).__name__}.{hook}")
    if validation is not None and type(model).validation_step is pl.LightningModule.validation_step:
        raise ValueError(f"validation={validation!r} holds rows out for validation, but {type(model).__name__} does "
                         "not define validation_step: expected a validation_step that logs (self.log) the "
                         "validation metrics; fix: implement it, or leave validation unset")


def check_trainer_args(trainer_args: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The Trainer arguments, refusing those the estimator sets itself."""
    args = dict(trainer_args or {})
    for name, reason in _OWNED_TRAINER_ARGS.items():
        if name in args:
            raise ValueError(f"trainer_args sets {name}={args[name]!r}, which the estimator sets itself: {reason}; "
                             f"fix: remove {name!r} from trainer_args")
    accepted = inspect.signature(pl.Trainer.__init__).parameters
    unknown = [name for name in args if name not in accepted]
    if unknown:
        raise ValueError(f"trainer_args has {unknown}, which pytorch_lightning.Trainer {pl.__version__} does not "
                         "take: expected Trainer keyword arguments such as gradient_clip_val or precision; fix: "
                         "remove or rename them")
    return args


def check_callbacks(callbacks: Optional[List[Any]]) -> List[Any]:
    """Every callback is a pytorch_lightning Callback."""
    for i, callback in enumerate(callbacks or []):
        if not isinstance(callback, pl.Callback):
            raise ValueError(f"callbacks[{i}]={callback!r} is not valid: expected pytorch_lightning.Callback "
                             "instances, e.g. callbacks=[pytorch_lightning.callbacks.LearningRateMonitor()]")
    return list(callbacks or [])


def first_optimizer(configured: Any) -> Optional[torch.optim.Optimizer]:
    """The first optimizer in whatever configure_optimizers returned (an optimizer, a list or
    tuple, a dict with 'optimizer', or lists of optimizers and schedulers), or None."""
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, dict):
        return first_optimizer(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)):
        for item in configured:
            found = first_optimizer(item)
            if found is not None:
                return found
    return None


def configured_optimizer(model: pl.LightningModule) -> Optional[torch.optim.Optimizer]:
    """The optimizer configure_optimizers makes on the driver (over the driver's parameters, which it
    does not change); None when it needs a Trainer (``self.trainer``), which only the ranks have."""
    try:
        configured = model.configure_optimizers()
    except Exception as exc:
        if _needs_trainer(exc):
            return None
        raise _user_code_error(model, "configure_optimizers", exc, "") from exc
    optimizer = first_optimizer(configured)
    if optimizer is None:
        raise ValueError(f"{type(model).__name__}.configure_optimizers returned {configured!r}: expected an "
                         "optimizer over the module's parameters (or Lightning's list/dict forms holding one); "
                         "fix: return e.g. torch.optim.Adam(self.parameters(), lr=1e-3)")
    return optimizer


def _needs_trainer(exc: BaseException) -> bool:
    """Whether the hook failed only for want of a Trainer (``self.trainer``), which the ranks have."""
    return isinstance(exc, RuntimeError) and "not attached to a `Trainer`" in str(exc)


def _user_code_error(model: Any, hook: str, exc: BaseException, context: str) -> ValueError:
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" (at {frame.filename}:{frame.lineno}, '{(frame.line or '').strip()}')" if frame else ""
    return ValueError(f"{type(model).__name__}.{hook} raised {type(exc).__name__}: {exc}{where}{context}; fix "
                      f"{hook} and fit again")


def dry_run_training_step(model: pl.LightningModule, batch: Dict[str, torch.Tensor]) -> None:
    """Call training_step on a copy of the module with one real batch, as a rank will, so a wrong
    column name or shape fails on the driver; the driver's module is not changed. A training_step
    that reads ``self.trainer`` is left to the ranks."""
    probe = copy.deepcopy(model)
    probe.train()
    described = ", ".join(f"{k!r}: {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}" for k, v in batch.items())
    context = f" on a batch of {{{described}}} (one tensor per column, rows first)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer warns; nothing is logged here
        try:
            result = probe.training_step(batch, 0)
        except Exception as exc:
            if _needs_trainer(exc):
                return  # it reads self.trainer: only the ranks can run it
            raise _user_code_error(model, "training_step", exc, context) from exc
    loss = result.get("loss") if isinstance(result, dict) else result
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
        raise ValueError(f"{type(model).__name__}.training_step returned {type(result).__name__} "
                         f"{result!r:.200}{context}: expected the loss, a one-element tensor with a gradient (or a "
                         "dict with 'loss'); fix training_step to return it")
