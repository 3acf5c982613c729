"""``SparkHvdSyncBatchNorm``: Lightning's ``sync_batchnorm`` through spark-hvd's SyncBatchNorm."""

from __future__ import annotations

from typing import Dict

import torch
from pytorch_lightning.plugins.layer_sync import LayerSync
from torch.nn.modules.batchnorm import _BatchNorm

import spark_hvd.torch as hvd

__all__ = ["SparkHvdSyncBatchNorm"]


class SparkHvdSyncBatchNorm(LayerSync):
    """Turns every ``BatchNorm*d`` layer into :class:`spark_hvd.torch.SyncBatchNorm` for training, and back after.

    ``Trainer(sync_batchnorm=True)`` with :class:`~spark_hvd.lightning.SparkHvdStrategy` uses it in
    place of Lightning's torch.distributed one; it can also be passed as ``plugins=[...]``.
    Parameters and running statistics are kept, so the reverted layers hold what training learnt.
    """

    def __init__(self) -> None:
        self._classes: Dict[str, type] = {}

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """Replace the batch-norm layers of ``model`` (remembering their classes); return the model."""
        self._classes = {name: type(m) for name, m in model.named_modules()
                         if isinstance(m, _BatchNorm) and not isinstance(m, hvd.SyncBatchNorm)}
        return hvd.SyncBatchNorm.convert_sync_batchnorm(model)

    def revert(self, model: torch.nn.Module) -> torch.nn.Module:
        """Give the layers :meth:`apply` replaced their original classes back; return the model."""
        if "" in self._classes and isinstance(model, hvd.SyncBatchNorm):
            return _restore(model, self._classes[""])
        for name, module in list(model.named_modules()):
            original = self._classes.get(name)
            if original is None or not isinstance(module, hvd.SyncBatchNorm):
                continue
            parent_name, _, child = name.rpartition(".")
            model.get_submodule(parent_name).add_module(child, _restore(module, original))
        return model


def _restore(module: hvd.SyncBatchNorm, original: type) -> torch.nn.Module:
    """A module of class ``original`` holding ``module``'s parameters, buffers and settings."""
    restored = original.__new__(original)
    state = dict(module.__dict__)
    state.pop("process_set", None)
    restored.__dict__.update(state)
    return restored
