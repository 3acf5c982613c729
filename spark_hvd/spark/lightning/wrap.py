"""A plain torch.nn.Module trained by LightningEstimator, as Horovod's Lightning estimator allows.

Given a module that is not a LightningModule, with ``optimizer`` and ``loss`` (and ``metrics``),
the estimator wraps it in :class:`ModuleAsLightning`: ``forward`` is the module's, the optimizer is
rebuilt over its parameters, and a step's loss is TorchEstimator's (each label's loss, weighted,
with per-row sample weights), so the same data and seed train the same model as TorchEstimator
does. The fitted LightningModel scores with the module's ``forward``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import pytorch_lightning as pl
import torch

from spark_hvd.spark.torch.batches import LossFunction, metric_names, metric_values, transform_outputs
from spark_hvd.spark.torch.training import OptimizerSpec

__all__ = ["ModuleAsLightning"]


class ModuleAsLightning(pl.LightningModule):
    """``module`` with the optimizer, losses and metrics of the estimator's Params, as a LightningModule."""

    def __init__(self, module: torch.nn.Module, optimizer: OptimizerSpec) -> None:
        super().__init__()
        self.module = module
        self.optimizer_spec = optimizer
        self.losses: List[Any] = []
        self.loss_fn: Optional[LossFunction] = None
        self.metric_fns: List[Any] = []
        self.metric_names: List[str] = []
        self.feature_cols: List[str] = []
        self.label_cols: List[str] = []
        self.weight_col: Optional[str] = None

    def configure(self, losses: Sequence[Any], loss_weights: Sequence[float], metrics: Sequence[Any],
                  feature_cols: Sequence[str], label_cols: Sequence[str], weight_col: Optional[str]) -> None:
        """The loss, metrics and columns of the fit (known once the columns are checked)."""
        self.losses = list(losses)
        self.loss_fn = LossFunction(self.losses, loss_weights)  # made once: it keeps its per-row losses
        self.feature_cols, self.label_cols, self.weight_col = list(feature_cols), list(label_cols), weight_col
        self.metric_fns, self.metric_names = list(metrics), metric_names(metrics, self.label_cols)

    def forward(self, *inputs: Any) -> Any:
        return self.module(*inputs)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Built over the module's parameters, in the order the spec recorded them.
        return self.optimizer_spec.build(self.module)

    def _step(self, batch: Dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
        outputs = self(*[batch[col] for col in self.feature_cols])
        outs, labels = transform_outputs(outputs, [batch[col] for col in self.label_cols])
        weights = batch.get(self.weight_col) if self.weight_col else None
        assert self.loss_fn is not None, "configure() gives the loss before training"
        loss = self.loss_fn(outs, labels, weights)
        rows = len(labels[0]) if labels else None
        self.log(f"{prefix}loss", loss, on_step=False, on_epoch=True, batch_size=rows)
        if self.metric_fns:
            with torch.no_grad():
                for name, value in metric_values(self.metric_fns, self.metric_names, outs, labels).items():
                    self.log(f"{prefix}{name}", float(value), on_step=False, on_epoch=True, batch_size=rows)
        return loss

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "")

    def validation_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "val_")
