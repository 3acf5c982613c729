"""TorchEstimator: data-parallel training of a torch model on a DataFrame, as a Spark ML Estimator."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from spark_hvd.spark.data.columns import scalar_columns
from spark_hvd.spark.estimator import checks as common
from spark_hvd.spark.estimator.base import Checkpoint, DistributedEstimator, Fit
from spark_hvd.spark.estimator.training import TrainingSpec
from spark_hvd.spark.estimator.outputs import check_task, infer_task
from spark_hvd.spark.torch.params import TorchEstimatorParams
from spark_hvd.spark.torch import checks
from spark_hvd.spark.torch.batches import LossFunction, metric_names, model_dtype
from spark_hvd.spark.torch.fingerprint import run_fingerprint
from spark_hvd.spark.torch.model import TorchModel
from spark_hvd.spark.torch.training import OptimizerSpec, TorchTrainingSpec, load_checkpoint, train_on_rank

__all__ = ["TorchEstimator", "TorchModuleHooks", "log_torch_model"]

log = logging.getLogger("spark_hvd.spark")


@dataclass
class _Torch:
    """The torch values of one fit after the driver's checks."""

    model: torch.nn.Module
    """The user's model (never changed)."""
    optimizer: OptimizerSpec
    losses: List[Any]
    loss_weights: List[float]
    metrics: List[Any]


class TorchModuleHooks:
    """The hooks of an estimator whose model is a torch.nn.Module (TorchEstimator, LightningEstimator):
    the dtype it takes, the driver's working copy, its dry run on zeros, and loading its result."""

    def _model_dtype(self, own: Any) -> str:
        return "float64" if model_dtype(own.model) == torch.float64 else "float32"

    def _working_copy(self, own: Any) -> torch.nn.Module:
        return copy.deepcopy(own.model).cpu()

    def _try_model(self, fit: Fit[Any], sizes: List[int]) -> None:
        fit.shapes = common.known_shapes(self.getInputShapes(), fit.feature_cols, sizes)  # type: ignore[attr-defined]
        fit.output_shapes = checks.dry_run(fit.model, fit.shapes, len(fit.label_cols), model_dtype(fit.model))
        check_task(fit.task, fit.output_shapes)

    def _load_result(self, fit: Fit[Any], result: Dict[str, Any]) -> None:
        fit.model.load_state_dict(result["model"])

    def _log_model(self, mlflow: Any, fitted: Any) -> None:
        log_torch_model(mlflow, fitted.getModel(), [tuple(s) for s in fitted.getInputShapes() or []])


class TorchEstimator(TorchModuleHooks, DistributedEstimator[_Torch], TorchEstimatorParams):
    """Trains a torch model on a Spark DataFrame with data-parallel ranks on barrier tasks.

    Construct with keyword arguments (``TorchEstimator(model=..., optimizer=..., loss=...,
    feature_cols=[...], label_cols=[...], num_proc=2, ...)``) or the generated setters; every
    Param is listed by ``explainParams()``. Horovod's TorchEstimator names and meanings apply.

    ``fit(df)``:

    1. checks the Params, the columns and their types, the model's inputs, and the cluster's task
       slots (errors name the value and the fix; nothing runs on Spark before they pass);
    2. materializes the needed columns as Parquet in ``store`` (reused for the same DataFrame);
    3. trains on ``num_proc`` barrier tasks: each rank reads its shard, wraps a copy of the
       optimizer in ``spark_hvd.torch.DistributedOptimizer``, and averages gradients each step.
       With ``scale_lr`` (default True), the learning rate is multiplied by ``num_proc``, as
       Horovod recommends for a global batch ``num_proc`` times larger; pass ``scale_lr=False``
       to keep it as given;
    4. after each epoch, validates (``validation``), averages loss and metrics over the ranks,
       and rank 0 checkpoints model, optimizer and epoch to ``store`` under ``run_id`` (also
       every ``checkpoint_every_steps`` optimizer steps, when set). A fit with the ``run_id`` of
       an interrupted one resumes from its last checkpoint: ``epochs`` is the run's total, so a
       completed run is not trained again. When the stage loses a task, a rank process or an
       executor, fit waits for the slots and runs it again from the last checkpoint, up to
       ``max_retries`` times, printing a line per retry; an error of the code fails at once;
    5. prints a line per epoch (loss, metrics, rows per second) and a progress bar, per
       ``verbose``, and returns a :class:`TorchModel` with the trained model and ``history``.

    Metrics are callables ``(outputs, labels) -> tensor``; losses are callables ``(output,
    label) -> tensor`` or torch.nn loss modules, one for all labels or one per label. The
    driver's model and optimizer are never modified. The estimator saves and loads with Spark
    ML persistence (``write().save(path)``, ``TorchEstimator.load(path)``), also in a Pipeline.
    """

    framework = "torch"
    fitted_class = TorchModel
    worker_modules = ("torch",)
    # torch._dynamo: imported by torch.optim at the first step, about as slow as torch itself.
    rank_preload = ("torch", "torch._dynamo", "spark_hvd.torch", "spark_hvd.spark.torch.training")

    # ---- checks ---------------------------------------------------------------------------------
    def _check_model(self) -> _Torch:
        model = self.getModel()
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model={model!r} is not valid: expected a torch.nn.Module; pass e.g. "
                             "model=torch.nn.Sequential(torch.nn.Linear(30, 1))")
        optimizer = self.getOptimizer()
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer={optimizer!r} is not valid: expected a torch.optim.Optimizer over the "
                             "model's parameters; pass e.g. optimizer=torch.optim.Adam(model.parameters(), lr=1e-3)")
        spec = OptimizerSpec.of(optimizer, model).with_learning_rate(self.getLearningRate())
        return _Torch(model, spec, [], [], [])

    def _check_training(self, own: _Torch, feature_cols: List[str], label_cols: List[str]) -> None:
        own.losses, own.loss_weights = checks.check_losses(self._loss(), self.getLossWeights(), label_cols)
        own.metrics = checks.check_metrics(self.getMetrics())
        checks.check_compression(self.getGradientCompression())
        checks.check_feature_count(own.model, feature_cols)
        checks.check_early_stopping(self.getEarlyStopping(), metric_names(own.metrics, label_cols),
                                    self.getValidation() is not None, self.getLrSchedulerFn() is not None)
        checks.check_lr_scheduler(self.getLrSchedulerFn(), own.optimizer, own.model)

    def _loss(self) -> Any:
        """``loss``, or what Horovod's ``loss_constructors`` make (each called once)."""
        constructors = self.getLossConstructors()
        if constructors is None:
            return self.getLoss()
        if self.getLoss() is not None:
            raise ValueError("loss and loss_constructors are both set: expected one of them; fix: drop "
                             "loss_constructors, or pass loss=None")
        losses = []
        for i, make in enumerate(constructors):
            if not callable(make):
                raise ValueError(f"loss_constructors[{i}]={make!r} is not callable: expected functions that return a "
                                 "loss, e.g. loss_constructors=[torch.nn.BCEWithLogitsLoss]")
            losses.append(make())
        return losses[0] if len(losses) == 1 else losses

    def _stacked_features(self, df: Any) -> Optional[Tuple[List[str], str]]:
        """Several numeric feature columns for a model whose forward takes one tensor: stacked, in
        order, into one (rows, n) input."""
        cols, model = self.getFeatureCols(), self.getModel()
        shapes = self.getInputShapes()
        if not cols or len(cols) < 2 or not isinstance(model, torch.nn.Module) or (shapes and len(shapes) != 1):
            return None
        if checks.forward_arity(model)[1] != 1 or not scalar_columns(df.schema, cols):
            return None
        return list(cols), "float64" if model_dtype(model) == torch.float64 else "float32"

    def _loss_names(self, fit: Fit[_Torch]) -> List[Optional[str]]:
        return [checks.loss_name(fn) for fn in fit.own.losses]

    def _infer_task(self, own: _Torch, label_cols: List[str]) -> str:
        return infer_task(self.getTask(), own.losses, label_cols)

    # ---- dry runs -------------------------------------------------------------------------------
    def _try_batch(self, fit: Fit[_Torch], batch: Dict[str, Any], sizes: List[int]) -> None:
        fit.shapes = common.known_shapes(self.getInputShapes(), fit.feature_cols, sizes)
        own = fit.own
        fit.output_shapes = checks.dry_run_batch(fit.model, LossFunction(own.losses, own.loss_weights), batch,
                                                 fit.feature_cols, fit.label_cols, fit.shapes, model_dtype(fit.model),
                                                 task=fit.task)

    # ---- the run --------------------------------------------------------------------------------
    def _run_fingerprint(self, df: Any, fit: Fit[_Torch], columns: List[str]) -> Dict[str, str]:
        own = fit.own
        return run_fingerprint(fit.model, own.optimizer, own.losses, own.loss_weights, df, columns, self.getValidation())

    def _read_checkpoint(self, data: bytes) -> Checkpoint:
        state = load_checkpoint(data)
        stopped = bool((state.get("early_stopping") or {}).get("stopped"))
        return Checkpoint(epoch=int(state["epoch"]), history=list(state["history"]),
                          fingerprint=dict(state.get("fingerprint") or {}), batch=int(state.get("batch") or 0),
                          seed=state.get("seed"), state=state, finished=stopped)

    def _restore(self, fit: Fit[_Torch], checkpoint: Checkpoint) -> None:
        state = checkpoint.state
        best = state.get("best_model") if checkpoint.finished else None
        fit.model.load_state_dict(best if best is not None else state["model"])

    def _step_multiple(self) -> int:
        # Whole optimizer steps only: every epoch ends with the accumulated gradients applied.
        return int(self.getBackwardPassesPerStep())

    def _spec(self, fit: Fit[_Torch], common: TrainingSpec, resume: Optional[Checkpoint]) -> TorchTrainingSpec:
        own = fit.own
        state = resume.state if resume is not None else None
        partial = dict(state.get("partial") or {}) if state else {}
        return TorchTrainingSpec.extending(
            common, model=fit.model, optimizer=own.optimizer, losses=own.losses,
            loss_weights=own.loss_weights, metrics=own.metrics, metric_names=metric_names(own.metrics, fit.label_cols),
            start_batch=resume.batch if resume is not None else 0,
            partial=partial or None,
            resume_model=state["model"] if state else None, resume_optimizer=state["optimizer"] if state else None,
            backward_passes_per_step=self._step_multiple(), scale_lr=self.getScaleLr(), train_minibatch_fn=self.getTrainMinibatchFn(),
            callbacks=list(self.getCallbacks() or []), checkpoint_every_steps=self.getCheckpointEverySteps(),
            early_stopping=self.getEarlyStopping(), lr_scheduler_fn=self.getLrSchedulerFn(),
            lr_scheduler_interval=self.getLrSchedulerInterval(),
            resume_extra={key: state[key] for key in ("early_stopping", "best_model", "scheduler")
                          if state and state.get(key) is not None} or None)

    def _rank_function(self) -> Callable[[Any], Any]:
        return train_on_rank

    def _load_result(self, fit: Fit[_Torch], result: Dict[str, Any]) -> None:
        super()._load_result(fit, result)
        if result.get("early_stopping"):
            log.info("%s", result["early_stopping"])
            if self.getVerbose():
                print(result["early_stopping"])

    # ---- MLflow ---------------------------------------------------------------------------------
    def _mlflow_params(self, fit: Fit[_Torch]) -> Tuple[Dict[str, Any], Optional[float]]:
        own = fit.own
        return ({"model": own.model, "optimizer": own.optimizer.cls.__name__, "loss": own.losses},
                own.optimizer.defaults.get("lr"))



def log_torch_model(mlflow: Any, model: torch.nn.Module, shapes: List[Tuple[int, ...]]) -> None:
    """Log ``model`` with MLflow's PyTorch flavor, which ``mlflow.pyfunc.load_model`` scores.

    A one-input model gets an input example (one row of zeros), from which MLflow records the
    signature that Unity Catalog's registry requires. The model is pickled (cloudpickle), which
    any module allows; MLflow 3's default traced format refuses models torch.export cannot trace.
    """
    import inspect

    import mlflow.pytorch

    kwargs: Dict[str, Any] = {"pip_requirements": [f"torch=={torch.__version__.split('+')[0]}"]}
    accepted = inspect.signature(mlflow.pytorch.log_model).parameters
    if "serialization_format" in accepted:
        kwargs["serialization_format"] = "pickle"
    if len(shapes) == 1 and len(shapes[0]) == 1:
        kwargs["input_example"] = np.zeros((1, shapes[0][0]), dtype=np.float32)
    if "name" in accepted:
        kwargs["name"] = "model"
    else:  # MLflow 2 names the artifact by path
        kwargs["artifact_path"] = "model"
    mlflow.pytorch.log_model(model, **kwargs)
