"""KerasEstimator: data-parallel training of a Keras model on a DataFrame, as a Spark ML Estimator."""

from __future__ import annotations

import posixpath
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from spark_hvd.keras.basics import is_keras2
from spark_hvd.spark.data.store import Store
from spark_hvd.spark.estimator.base import Checkpoint, DistributedEstimator, Fit
from spark_hvd.spark.estimator.training import TrainingSpec
from spark_hvd.spark.estimator.outputs import check_task
from spark_hvd.spark.keras import checks
from spark_hvd.spark.keras.checkpoint import CHECKPOINT_NAME, load_model_bytes, model_bytes, read_checkpoint
from spark_hvd.spark.keras.environment import RANK_ENVIRONMENT
from spark_hvd.spark.keras.fingerprint import run_fingerprint
from spark_hvd.spark.keras.flavor import keras_of
from spark_hvd.spark.keras.model import WORKER_MODULES, KerasModel
from spark_hvd.spark.keras.params import KerasEstimatorParams
from spark_hvd.spark.keras.training import KerasTrainingSpec, train_on_rank

__all__ = ["KerasEstimator"]

@dataclass
class _Keras:
    """The Keras values of one fit after the driver's checks."""

    model: Any
    """The user's model (never changed)."""
    optimizer: Any
    compiled: Dict[str, Any]
    """What a compiled model was compiled with (optimizer, loss, loss weights, metrics)."""
    losses: List[Any] = field(default_factory=list)
    loss_weights: Optional[List[float]] = None
    metrics: List[Any] = field(default_factory=list)
    output_shapes: Optional[List[Tuple[int, ...]]] = None
    """Per-row shape of each model output, from the last dry run."""


def _copy_model(model: Any, custom_objects: Optional[Dict[str, Any]]) -> Any:
    """A copy of ``model`` through the ``.keras`` format (the format the ranks and checkpoints use),
    so a model that cannot be saved fails here, on the driver."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "saving a model that has not yet been built": it is built next
        try:
            data = model_bytes(model)
        except Exception as exc:
            raise ValueError(f"the model cannot be saved in the .keras format ({type(exc).__name__}: {exc}): expected "
                             "a model Keras can save, which the ranks and checkpoints need; fix: give custom layers "
                             "get_config() and @keras.saving.register_keras_serializable()") from None
        try:
            return load_model_bytes(data, custom_objects)
        except Exception as exc:
            raise ValueError(f"the model does not load back from the .keras format ({type(exc).__name__}: {exc}); fix: "
                             "pass its custom classes and functions as custom_objects={'Name': Name, ...}") from None


class KerasEstimator(DistributedEstimator[_Keras], KerasEstimatorParams):
    """Trains a Keras model on a Spark DataFrame with data-parallel ranks on barrier tasks.

    Construct with keyword arguments (``KerasEstimator(model=..., optimizer=..., loss=...,
    feature_cols=[...], label_cols=[...], num_proc=2, ...)``) or the generated setters; every
    Param is listed by ``explainParams()``. Horovod's KerasEstimator names and meanings apply.
    A compiled model brings its optimizer, loss, loss weights and metrics; the Params override
    them. The model is a Keras 3 one (``keras``) or a Keras 2 one (``tf_keras``, what ``tf.keras``
    is with ``TF_USE_LEGACY_KERAS=1``); its optimizer, losses and callbacks come from the same
    Keras, which the ranks, checkpoints and the fitted model use throughout.

    ``fit(df)`` works as TorchEstimator's:

    1. checks the Params, the columns and their types, the feature and label counts and sizes
       against the model's inputs and outputs, one batch through the model and the loss (rows
       of zeros when the schema tells every size, else real rows), and the cluster's task slots
       (errors name the value and the fix; nothing is written before they pass);
    2. materializes the needed columns as Parquet in ``store`` (reused for the same DataFrame);
    3. trains on ``num_proc`` barrier tasks, in processes with ``KERAS_BACKEND=tensorflow``:
       each rank reads its shard and runs ``model.fit`` with the optimizer wrapped in
       ``spark_hvd.keras.DistributedOptimizer``, ``BroadcastGlobalVariablesCallback(0)``,
       ``MetricAverageCallback()`` and ``callbacks``. With ``scale_lr`` (default True) a
       constant learning rate is multiplied by ``num_proc`` (a schedule is used as given);
    4. after each epoch rank 0 writes a checkpoint (``checkpoint.keras`` in the run's directory
       of ``store``: a ``.keras`` file ``keras.saving.load_model`` reads, holding also the
       optimizer's state, the epoch count and the history), and with ``checkpoint_every_steps``
       also every that many optimizer steps within an epoch (with the batches done and the
       epoch's running metrics). A fit with the ``run_id`` of an earlier one, or a retry after a
       lost rank, resumes from the last checkpoint, within an epoch at its next batch of the same
       seeded order (``epochs`` is the run's total);
    5. prints a line per epoch and a progress bar, per ``verbose``, and returns a
       :class:`KerasModel` with the trained (uncompiled) model and ``history``, the epoch logs
       averaged over the ranks.

    Each feature column is one model input, reshaped per row to that input's shape (or to
    ``input_shapes``); each label column is one model output. The driver's model is never
    modified. Saves and loads with Spark ML persistence, also in a Pipeline.
    """

    framework = "keras"
    fitted_class = KerasModel
    worker_modules = WORKER_MODULES
    rank_environment = RANK_ENVIRONMENT
    rank_preload = ("tensorflow", "keras", "spark_hvd.keras", "spark_hvd.spark.keras.training")

    # ---- checks ---------------------------------------------------------------------------------
    def _check_model(self) -> _Keras:
        model = self.getModel()
        checks.check_model(model)
        compiled = checks.compiled_settings(model)
        optimizer = checks.check_optimizer(self.getOptimizer() if self.getOptimizer() is not None
                                           else compiled.get("optimizer"), model)
        optimizer = checks.with_learning_rate(optimizer, self.getLearningRate())
        return _Keras(model, optimizer, compiled)

    def _check_training(self, own: _Keras, feature_cols: List[str], label_cols: List[str]) -> None:
        compiled = own.compiled
        loss = self.getLoss() if self.getLoss() is not None else compiled.get("loss")
        weights = self.getLossWeights() if self.getLossWeights() is not None else compiled.get("loss_weights")
        own.losses, own.loss_weights = checks.check_losses(loss, weights, label_cols, own.model)
        own.metrics = checks.check_metrics(self.getMetrics() if self.getMetrics() is not None
                                           else compiled.get("metrics"))
        if self.getTrainMinibatchFn() is not None:
            raise ValueError("train_minibatch_fn is not supported by KerasEstimator: Keras runs its own train_step; "
                             "fix: override train_step in a keras.Model subclass, or use TorchEstimator")
        callback = self.getCheckpointCallback()
        keras = keras_of(own.model)
        if callback is not None and not isinstance(callback, keras.callbacks.ModelCheckpoint):
            raise ValueError(f"checkpoint_callback={callback!r} is not valid: expected a "
                             f"{keras.__name__}.callbacks.ModelCheckpoint (the model's Keras), e.g. "
                             f"{keras.__name__}.callbacks.ModelCheckpoint('best.keras', save_best_only=True)")
        checks.check_input_count(own.model, feature_cols)

    def _model_dtype(self, own: _Keras) -> str:
        return checks.model_dtype(own.model)

    def _loss_names(self, fit: Fit[_Keras]) -> List[Optional[str]]:
        losses = fit.own.losses
        return [checks.loss_name(fn)[0] for fn in (losses * len(fit.label_cols) if len(losses) == 1 else losses)]

    def _infer_task(self, own: _Keras, label_cols: List[str]) -> str:
        return checks.infer_task(self.getTask(), own.losses, label_cols)

    def _working_copy(self, own: _Keras) -> Any:
        return _copy_model(own.model, self.getCustomObjects())

    # ---- dry runs -------------------------------------------------------------------------------
    def _try_model(self, fit: Fit[_Keras], sizes: List[int]) -> None:
        """Feature shapes from the columns' sizes, then two rows of zeros through the model (which
        builds a model without defined inputs): the outputs must match the labels and the task."""
        fit.shapes = checks.feature_shapes(self.getInputShapes(), fit.model, fit.feature_cols, sizes)
        fit.own.output_shapes = fit.output_shapes = checks.dry_run(fit.model, fit.shapes, len(fit.label_cols),
                                                                   fit.dtype)
        check_task(fit.task, fit.own.output_shapes)

    def _try_batch(self, fit: Fit[_Keras], batch: Dict[str, Any], sizes: List[int]) -> None:
        fit.shapes = checks.feature_shapes(self.getInputShapes(), fit.model, fit.feature_cols, sizes)
        fit.own.output_shapes = fit.output_shapes = checks.dry_run_batch(
            fit.model, fit.own.losses, batch, fit.feature_cols, fit.label_cols, fit.shapes, fit.dtype, task=fit.task)

    # ---- the run --------------------------------------------------------------------------------
    def _run_fingerprint(self, df: Any, fit: Fit[_Keras], columns: List[str]) -> Dict[str, str]:
        own = fit.own
        return run_fingerprint(fit.model, own.optimizer, own.losses, own.loss_weights, df, columns, self.getValidation())

    def _checkpoint_path(self, store: Store, run_id: str) -> str:
        return posixpath.join(store.get_run_path(run_id), CHECKPOINT_NAME)

    def _read_checkpoint(self, data: bytes) -> Checkpoint:
        state = read_checkpoint(data)
        return Checkpoint(epoch=state.epoch, history=list(state.history), fingerprint=state.fingerprint,
                          batch=state.batch, seed=state.seed, state=state)

    def _restore(self, fit: Fit[_Keras], checkpoint: Checkpoint) -> None:
        fit.model.set_weights(load_model_bytes(checkpoint.state.model, self.getCustomObjects()).get_weights())

    def _spec(self, fit: Fit[_Keras], common: TrainingSpec, resume: Optional[Checkpoint]) -> KerasTrainingSpec:
        own = fit.own
        assert own.output_shapes is not None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            data = model_bytes(fit.model)  # holds any resumed weights
        return KerasTrainingSpec.extending(
            common, model=data, optimizer=keras_of(own.optimizer).optimizers.serialize(own.optimizer),
            keras2=is_keras2(fit.model), losses=own.losses,
            loss_weights=own.loss_weights, metrics=own.metrics, custom_objects=self.getCustomObjects(),
            output_shapes=own.output_shapes, dtype=fit.dtype,
            optimizer_variables=resume.state.optimizer_variables if resume is not None else None,
            backward_passes_per_step=self.getBackwardPassesPerStep(), scale_lr=self.getScaleLr(),
            callbacks=list(self.getCallbacks() or []), checkpoint_callback=self.getCheckpointCallback(),
            checkpoint_every_steps=self.getCheckpointEverySteps(),
            start_batch=resume.batch if resume is not None else 0,
            partial=dict(resume.state.partial) if resume is not None and resume.batch else None)

    def _rank_function(self) -> Callable[[Any], Any]:
        return train_on_rank

    def _rank_env(self) -> Optional[Dict[str, str]]:
        return {**RANK_ENVIRONMENT, **(self.getBackendEnv() or {})}

    def _load_result(self, fit: Fit[_Keras], result: Dict[str, Any]) -> None:
        fit.model.set_weights(result["weights"])

    def _fitted_params(self, fit: Fit[_Keras]) -> Dict[str, Any]:
        custom = self.getCustomObjects()
        return {} if custom is None else {"custom_objects": custom}

    # ---- MLflow ---------------------------------------------------------------------------------
    def _mlflow_params(self, fit: Fit[_Keras]) -> Tuple[Dict[str, Any], Optional[float]]:
        own = fit.own
        lr = own.optimizer.get_config().get("learning_rate")
        return ({"model": fit.model, "optimizer": type(own.optimizer).__name__, "loss": own.losses},
                lr if isinstance(lr, (int, float)) else None)

    def _log_model(self, mlflow: Any, fitted: Any) -> None:
        """The model as ``model/model.keras`` among the run's artifacts."""
        import os
        import tempfile

        with tempfile.TemporaryDirectory(prefix="spark-hvd-mlflow-") as tmp:
            path = os.path.join(tmp, "model.keras")
            fitted.getModel().save(path)
            mlflow.log_artifact(path, artifact_path="model")
