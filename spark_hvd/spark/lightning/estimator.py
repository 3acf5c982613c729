"""LightningEstimator: data-parallel training of a LightningModule on a DataFrame, as a Spark ML Estimator."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytorch_lightning as pl
import torch

from spark_hvd.spark.estimator import checks as common
from spark_hvd.spark.estimator.base import Checkpoint, DistributedEstimator, Fit
from spark_hvd.spark.estimator.training import TrainingSpec
from spark_hvd.spark.estimator.outputs import check_task
from spark_hvd.spark.lightning import checks
from spark_hvd.spark.lightning.model import LightningModel
from spark_hvd.spark.lightning.params import LightningEstimatorParams
from spark_hvd.spark.lightning.training import (CHECKPOINT_FORMAT, CHECKPOINT_KEY, LightningTrainingSpec,
                                                fit_on_rank, module_batch)
from spark_hvd.spark.lightning.wrap import ModuleAsLightning
from spark_hvd.spark.torch import checks as torch_checks
from spark_hvd.spark.torch.batches import model_dtype, outputs_list
from spark_hvd.spark.torch.estimator import TorchModuleHooks
from spark_hvd.spark.torch.fingerprint import run_fingerprint
from spark_hvd.spark.torch.training import OptimizerSpec

__all__ = ["LightningEstimator", "MIN_PL_VERSION"]

MIN_PL_VERSION = "2.1.0"
"""The oldest pytorch_lightning this estimator supports (the package's ``lightning`` extra asks
for ``>=2.1,<3``); Horovod's estimator module has the same name for its own minimum."""

_WRAPPED_PARAMS = ("optimizer", "loss", "loss_constructors", "loss_weights", "metrics")
"""Horovod Params that a LightningModule brings itself, but that a plain torch.nn.Module needs."""


def _plain_module(model: Any) -> bool:
    return isinstance(model, torch.nn.Module) and not isinstance(model, pl.LightningModule) and not any(
        base.__module__.startswith("lightning.pytorch") for base in type(model).__mro__)


@dataclass
class _Lightning:
    """The Lightning values of one fit after the driver's checks."""

    model: pl.LightningModule
    """The user's module (never changed)."""
    trainer_args: Dict[str, Any]
    callbacks: List[Any]
    optimizer: OptimizerSpec
    """What configure_optimizers builds, for the run's fingerprint."""


def _optimizer_spec(model: pl.LightningModule) -> OptimizerSpec:
    optimizer = checks.configured_optimizer(model)
    if optimizer is not None:
        try:
            return OptimizerSpec.of(optimizer, model)
        except ValueError:  # over parameters of another module: still a class and hyperparameters
            return OptimizerSpec(type(optimizer), dict(optimizer.defaults), [])
    return OptimizerSpec(type(None), {}, [])


class LightningEstimator(TorchModuleHooks, DistributedEstimator[_Lightning], LightningEstimatorParams):
    """Trains a pytorch_lightning.LightningModule on a Spark DataFrame with data-parallel ranks.

    Construct with keyword arguments (``LightningEstimator(model=module, feature_cols=[...],
    label_cols=[...], num_proc=2, epochs=5, ...)``) or the generated setters; ``explainParams()``
    lists every Param. The module's ``configure_optimizers`` gives the optimizer and its
    ``training_step`` the loss; ``validation_step`` runs on the held-out rows when ``validation``
    is set.

    Each batch reaches ``training_step`` and ``validation_step`` as a dict from column name to a
    tensor: every feature column shaped ``(rows, *input_shape)`` in the module's dtype, every
    label column in its stored dtype (``.float()`` it for a BCE loss), and the
    ``sample_weight_col`` column, if set, in the module's dtype. ``forward`` takes one argument
    per feature column, as :class:`LightningModel` calls it in ``transform``.

    ``fit(df)`` works as TorchEstimator's: the Params, columns, the Trainer arguments, the module
    (``forward`` and ``training_step`` on one batch: rows of zeros when the schema tells every size,
    else real rows) and the cluster's task slots are checked
    before any data is written; the columns are materialized as Parquet in ``store``; ``num_proc``
    barrier tasks each build ``pytorch_lightning.Trainer(strategy=SparkHvdStrategy(), devices=1,
    max_epochs=epochs, **trainer_args)`` (accelerator 'gpu' with ``use_gpu`` and CUDA, else 'cpu')
    and fit on their shard. After each epoch what the module logged with ``self.log`` (epoch values,
    ``val_`` metrics included) is averaged over the ranks into ``history`` (with ``loss``, the mean
    of training_step's losses, when the module does not log one) and rank 0 writes a Lightning
    checkpoint to the store under ``run_id`` (with ``checkpoint_every_steps`` also every that many
    optimizer steps within an epoch); a fit with the ``run_id`` of an unfinished run, or a retry
    after a lost rank, resumes from the last checkpoint, optimizer and schedulers included, within
    an epoch at its next batch of the same seeded order. The fit is logged
    to MLflow as TorchEstimator's is (``log_to_mlflow``). The driver's module is never modified.
    Saves and loads with Spark ML persistence, also in a Pipeline.
    """

    framework = "lightning"
    fitted_class = LightningModel
    worker_modules = ("torch", "pytorch_lightning")
    rank_preload = ("torch", "torch._dynamo", "pytorch_lightning", "spark_hvd.torch",
                    "spark_hvd.spark.lightning.training")
    model_word = "module"
    label_rules_from_task = True

    # ---- checks ---------------------------------------------------------------------------------
    def _warn_unused(self, used: Sequence[str] = ()) -> None:
        plain = _plain_module(self.getModel())
        super()._warn_unused(tuple(used) + (_WRAPPED_PARAMS if plain else ()))

    def _check_model(self) -> _Lightning:
        model = self.getModel()
        common.require("model", model, "a pytorch_lightning.LightningModule", "MyModule()")
        if _plain_module(model):
            model = self._wrapped(model)
        checks.check_module(model, self.getValidation())
        trainer_args = checks.check_trainer_args(self.getTrainerArgs())
        callbacks = checks.check_callbacks(self.getCallbacks())
        return _Lightning(model, trainer_args, callbacks, OptimizerSpec(type(None), {}, []))

    def _check_training(self, own: _Lightning, feature_cols: List[str], label_cols: List[str]) -> None:
        torch_checks.check_compression(self.getGradientCompression())
        torch_checks.check_feature_count(own.model, feature_cols)
        own.optimizer = _optimizer_spec(own.model).with_learning_rate(self.getLearningRate())
        if isinstance(own.model, ModuleAsLightning):
            losses, weights = torch_checks.check_losses(self._loss(), self.getLossWeights(), label_cols)
            own.model.configure(losses, weights, torch_checks.check_metrics(self.getMetrics()), feature_cols,
                                label_cols, self.getSampleWeightCol())

    def _loss_names(self, fit: Fit[_Lightning]) -> List[Optional[str]]:
        if isinstance(fit.model, ModuleAsLightning):
            return [torch_checks.loss_name(fn) for fn in fit.model.losses]
        return super()._loss_names(fit)

    def _wrapped(self, module: torch.nn.Module) -> ModuleAsLightning:
        """A plain torch.nn.Module with the ``optimizer`` Param, as Horovod's Lightning estimator takes it."""
        optimizer = self.getOptimizer()
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"model={type(module).__name__} is a plain torch.nn.Module and optimizer={optimizer!r}: "
                             "expected a torch.optim.Optimizer over its parameters (with loss=...) to train it as "
                             "a LightningModule, or a pytorch_lightning.LightningModule; fix: pass e.g. "
                             "optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), loss=torch.nn.MSELoss()")
        if self.getLoss() is None and not self.getLossConstructors():
            raise ValueError(f"model={type(module).__name__} is a plain torch.nn.Module but loss is unset: expected "
                             "the loss to train it with; fix: pass e.g. loss=torch.nn.BCEWithLogitsLoss()")
        return ModuleAsLightning(module, OptimizerSpec.of(optimizer, module).with_learning_rate(self.getLearningRate()))

    def _loss(self) -> Any:
        """``loss``, or what Horovod's ``loss_constructors`` make (each called once)."""
        constructors = self.getLossConstructors()
        if not constructors:
            return self.getLoss()
        losses = [make() for make in constructors]
        return losses[0] if len(losses) == 1 else losses

    # ---- dry runs -------------------------------------------------------------------------------
    def _try_batch(self, fit: Fit[_Lightning], batch: Dict[str, Any], sizes: List[int]) -> None:
        """forward on the batch's features, then training_step on the batch, as a rank will run them."""
        fit.shapes = common.known_shapes(self.getInputShapes(), fit.feature_cols, sizes)
        tensors = module_batch(batch, fit.feature_cols, fit.label_cols, fit.sample_weight_col, fit.shapes,
                               model_dtype(fit.model))
        outputs = torch_checks.call_forward(fit.model, [tensors[col] for col in fit.feature_cols])
        fit.output_shapes = [tuple(out.shape[1:]) for out in outputs_list(outputs, len(fit.label_cols))]
        check_task(fit.task, fit.output_shapes)
        checks.dry_run_training_step(fit.model, tensors)

    # ---- the run --------------------------------------------------------------------------------
    def _run_fingerprint(self, df: Any, fit: Fit[_Lightning], columns: List[str]) -> Dict[str, str]:
        own = fit.own
        losses = fit.model.losses if isinstance(fit.model, ModuleAsLightning) else [type(fit.model).training_step]
        return run_fingerprint(fit.model, own.optimizer, losses, [1.0] * len(losses), df, columns, self.getValidation())

    def _read_checkpoint(self, data: bytes) -> Checkpoint:
        # A Lightning checkpoint holds pickled loop and hyperparameter state: the store is trusted,
        # as the ranks that wrote it were.
        checkpoint = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        record = checkpoint.get(CHECKPOINT_KEY) if isinstance(checkpoint, dict) else None
        if not isinstance(record, dict) or record.get("format") != CHECKPOINT_FORMAT:
            raise ValueError("not a LightningEstimator checkpoint")
        return Checkpoint(epoch=int(record["epochs_done"]), history=list(record["history"]),
                          fingerprint=dict(record.get("fingerprint") or {}), batch=int(record.get("batch") or 0),
                          seed=record.get("seed"), state=checkpoint["state_dict"])

    def _restore(self, fit: Fit[_Lightning], checkpoint: Checkpoint) -> None:
        fit.model.load_state_dict(checkpoint.state)

    def _spec(self, fit: Fit[_Lightning], common: TrainingSpec, resume: Optional[Checkpoint]) -> LightningTrainingSpec:
        own = fit.own
        return LightningTrainingSpec.extending(common, model=fit.model, resume=resume is not None,
                                     trainer_args=self._trainer_args(own), callbacks=own.callbacks,
                                     learning_rate=self.getLearningRate(),
                                     checkpoint_every_steps=self.getCheckpointEverySteps())

    def _trainer_args(self, own: _Lightning) -> Dict[str, Any]:
        """``trainer_args`` with what Horovod's Params set: accumulation, logger, logging interval, profiler."""
        args = dict(own.trainer_args)
        passes = self.getBackwardPassesPerStep()
        if passes != 1:
            if args.get("accumulate_grad_batches", passes) != passes:
                raise ValueError(f"backward_passes_per_step={passes} and trainer_args accumulate_grad_batches="
                                 f"{args['accumulate_grad_batches']} disagree: expected one of them")
            args["accumulate_grad_batches"] = passes
        for name in ("logger", "log_every_n_steps", "profiler"):
            if self.isSet(name):
                args.setdefault(name, self.getOrDefault(name))
        return args

    def _rank_function(self) -> Callable[[Any], Any]:
        return fit_on_rank

    # ---- MLflow ---------------------------------------------------------------------------------
    def _mlflow_params(self, fit: Fit[_Lightning]) -> Tuple[Dict[str, Any], Optional[float]]:
        own = fit.own
        return ({"model": own.model, "optimizer": own.optimizer.cls.__name__},
                own.optimizer.defaults.get("lr"))
