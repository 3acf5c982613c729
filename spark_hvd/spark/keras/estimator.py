"""KerasEstimator: data-parallel training of a Keras 3 model on a DataFrame, as a Spark ML Estimator."""

from __future__ import annotations

import logging
import posixpath
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import keras
import numpy as np
from pyspark.ml import Estimator
from pyspark.ml.util import MLReadable, MLWritable

from spark_hvd.spark import checks as common
from spark_hvd.spark.data import PreparedData, plan_columns, prepare_data, sample_batch
from spark_hvd.spark.fingerprint import changed_parts, start_over_or_refuse
from spark_hvd.spark.fitting import PROBE_ROWS, fit_store, prepare_lock
from spark_hvd.spark.keras import checks
from spark_hvd.spark.keras.checkpoint import (CHECKPOINT_NAME, KerasCheckpoint, load_model_bytes, model_bytes,
                                              read_checkpoint)
from spark_hvd.spark.keras.environment import RANK_ENVIRONMENT
from spark_hvd.spark.keras.fingerprint import run_fingerprint
from spark_hvd.spark.keras.model import WORKER_MODULES, KerasModel
from spark_hvd.spark.keras.training import KerasTrainingSpec, train_on_rank
from spark_hvd.spark.mlflow_log import params_for_logging, start_logging
from spark_hvd.spark.outputs import check_task
from spark_hvd.spark.params import KerasEstimatorParams
from spark_hvd.spark.persistence import ParamsReader, ParamsWriter
from spark_hvd.spark.progress import ProgressPrinter
from spark_hvd.spark.reader import steps_for
from spark_hvd.spark.retry import run_with_retries
from spark_hvd.spark.runner import run
from spark_hvd.spark.session import session_info
from spark_hvd.spark.store import Store

__all__ = ["KerasEstimator"]

log = logging.getLogger("spark_hvd.spark")

_SHUFFLE_BUFFER_ROWS = 10_000
"""Default of ``shuffle_buffer_size``."""


@dataclass
class _Checked:
    """The Params of one fit after the driver-side checks."""

    model: Any
    """The driver's working copy of the model (built after the dry run); the user's is untouched."""
    optimizer: Any
    losses: List[Any]
    loss_weights: Optional[List[float]]
    metrics: List[Any]
    feature_cols: List[str]
    label_cols: List[str]
    num_proc: int
    store: Store
    run_id: str
    task: str
    dtype: str = "float32"
    shapes: Optional[List[Tuple[int, ...]]] = None
    output_shapes: Optional[List[Tuple[int, ...]]] = None


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


class KerasEstimator(Estimator, KerasEstimatorParams, MLReadable, MLWritable):
    """Trains a Keras 3 model on a Spark DataFrame with data-parallel ranks on barrier tasks.

    Construct with keyword arguments (``KerasEstimator(model=..., optimizer=..., loss=...,
    feature_cols=[...], label_cols=[...], num_proc=2, ...)``) or the generated setters; every
    Param is listed by ``explainParams()``. Horovod's KerasEstimator names and meanings apply.
    A compiled model brings its optimizer, loss, loss weights and metrics; the Params override
    them.

    ``fit(df)`` works as TorchEstimator's:

    1. checks the Params, the columns and their types, the feature and label counts and sizes
       against the model's inputs and outputs, one batch of real rows through the model and
       the loss, and the cluster's task slots (errors name the value and the fix; nothing is
       written before they pass);
    2. materializes the needed columns as Parquet in ``store`` (reused for the same DataFrame);
    3. trains on ``num_proc`` barrier tasks, in processes with ``KERAS_BACKEND=tensorflow``:
       each rank reads its shard and runs ``model.fit`` with the optimizer wrapped in
       ``spark_hvd.keras.DistributedOptimizer``, ``BroadcastGlobalVariablesCallback(0)``,
       ``MetricAverageCallback()`` and ``callbacks``. With ``scale_lr`` (default True) a
       constant learning rate is multiplied by ``num_proc`` (a schedule is used as given);
    4. after each epoch rank 0 writes a checkpoint (``checkpoint.keras`` in the run's directory
       of ``store``: a ``.keras`` file ``keras.saving.load_model`` reads, holding also the
       optimizer's state, the epoch count and the history). A fit with the ``run_id`` of an
       earlier one resumes after its last completed epoch (``epochs`` is the run's total);
    5. prints a line per epoch and a progress bar, per ``verbose``, and returns a
       :class:`KerasModel` with the trained (uncompiled) model and ``history``, the epoch logs
       averaged over the ranks.

    Each feature column is one model input, reshaped per row to that input's shape (or to
    ``input_shapes``); each label column is one model output. The driver's model is never
    modified. Saves and loads with Spark ML persistence, also in a Pipeline.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    # ---- checks before any Spark job --------------------------------------------------------
    def _check(self, df: Any) -> _Checked:
        model = self.getModel()
        checks.check_model(model)
        compiled = checks.compiled_settings(model)
        optimizer = checks.check_optimizer(self.getOptimizer() if self.getOptimizer() is not None
                                           else compiled.get("optimizer"))
        feature_cols = self.getFeatureCols()
        common.require("feature_cols", feature_cols, "the list of input columns", "['features']")
        label_cols = self.getLabelCols()
        common.require("label_cols", label_cols, "the list of target columns", "['label']")
        loss = self.getLoss() if self.getLoss() is not None else compiled.get("loss")
        weights = self.getLossWeights() if self.getLossWeights() is not None else compiled.get("loss_weights")
        losses, loss_weights = checks.check_losses(loss, weights, label_cols)
        metrics = checks.check_metrics(self.getMetrics() if self.getMetrics() is not None else compiled.get("metrics"))
        if self.getTrainMinibatchFn() is not None:
            raise ValueError("train_minibatch_fn is not supported by KerasEstimator: Keras runs its own train_step; "
                             "fix: override train_step in a keras.Model subclass, or use TorchEstimator")
        if self.getCheckpointEverySteps() is not None:
            raise ValueError(f"checkpoint_every_steps={self.getCheckpointEverySteps()!r} is not supported by "
                             "KerasEstimator, which checkpoints after every epoch (a retry resumes from the last one); "
                             "fix: leave it unset, or use shorter epochs with train_steps_per_epoch")
        checks.check_input_count(model, feature_cols)
        weight_col = self.getSampleWeightCol()
        if weight_col is not None and weight_col in list(feature_cols) + list(label_cols):
            raise ValueError(f"sample_weight_col={weight_col!r} is also a feature or label column: expected a "
                             "separate column of per-row weights")
        dtype = checks.model_dtype(model)
        plan_columns(df, feature_cols, label_cols, weight_col, self.getValidation(), dtype)
        task = checks.infer_task(self.getTask(), losses, label_cols)

        session = df.sparkSession
        info = session_info(session)
        store = fit_store(self.getStore(), info)
        num_proc = self.getNumProc() or info.default_parallelism
        common.check_slots(session, num_proc)
        common.ensure_executor_python(session, info, WORKER_MODULES)
        store.check_writable()
        run_id = self.getRunId() or f"keras-{uuid.uuid4().hex[:12]}"
        store.get_run_path(run_id)  # checks the name
        working = _copy_model(model, self.getCustomObjects())
        return _Checked(working, optimizer, losses, loss_weights, metrics, list(feature_cols), list(label_cols),
                        num_proc, store, run_id, task, dtype)

    def _check_shapes(self, c: _Checked, sizes: List[int]) -> None:
        """Feature shapes from the columns' sizes, then two rows of zeros through the model (which
        builds a model without defined inputs): the outputs must match the labels and the task."""
        c.shapes = checks.feature_shapes(self.getInputShapes(), c.model, c.feature_cols, sizes)
        c.output_shapes = checks.dry_run(c.model, c.shapes, len(c.label_cols), c.dtype)
        check_task(c.task, c.output_shapes)

    def _check_early(self, df: Any, c: _Checked) -> None:
        """When the schema tells every feature's size, try the model before any Spark job."""
        sizes = common.schema_row_sizes(df.schema, c.feature_cols)
        if all(size is not None for size in sizes):
            self._check_shapes(c, [int(s) for s in sizes])  # type: ignore[arg-type]

    def _check_real_batch(self, df: Any, c: _Checked) -> None:
        """One batch of real rows through the model and the loss on the driver (one small Spark
        job, before anything is written), so shape mismatches fail at once with the shapes named."""
        batch = sample_batch(df, c.feature_cols + c.label_cols, min(self.getBatchSize(), PROBE_ROWS), c.dtype)
        if self.getTransformationFn() is not None:
            batch = self.getTransformationFn()(batch)
        if not batch or len(next(iter(batch.values()))) == 0:
            return  # no complete row: the materialization names the nulls, or the empty frame
        sizes = [max(1, int(np.prod(np.asarray(batch[col]).shape[1:]))) for col in c.feature_cols]
        self._check_shapes(c, sizes)
        assert c.shapes is not None
        checks.dry_run_batch(c.model, c.losses, batch, c.feature_cols, c.label_cols, c.shapes, c.dtype)

    # ---- resume --------------------------------------------------------------------------------
    def _checkpoint_path(self, c: _Checked) -> str:
        return posixpath.join(c.store.get_run_path(c.run_id), CHECKPOINT_NAME)

    def _resume_state(self, c: _Checked, fingerprint: Dict[str, str]) -> Optional[KerasCheckpoint]:
        path = self._checkpoint_path(c)
        if not c.store.exists(path):
            return None
        try:
            state: Optional[KerasCheckpoint] = read_checkpoint(c.store.read(path))
        except ValueError as exc:
            state, changed = None, [f"checkpoint format ({exc})"]
        else:
            changed = changed_parts(state.fingerprint, fingerprint)
        if changed:
            start_over_or_refuse(c.store, c.run_id, changed, self.getOverwriteRun(),
                                 state.epoch if state else None)
            return None
        assert state is not None
        try:
            c.model.set_weights(load_model_bytes(state.model, self.getCustomObjects()).get_weights())
        except Exception as exc:
            raise ValueError(
                f"run_id={c.run_id!r} has a checkpoint at {path} that does not fit this model ({exc}); fix: use a new "
                "run_id, or pass overwrite_run=True to start this run over") from None
        return state

    # ---- fit -----------------------------------------------------------------------------------
    def _fit(self, dataset: Any) -> KerasModel:
        timings: Dict[str, float] = {}
        started = time.monotonic()
        c = self._check(dataset)
        self._check_early(dataset, c)
        self._check_real_batch(dataset, c)
        fingerprint = run_fingerprint(c.model, c.optimizer, c.losses, c.loss_weights, dataset,
                                      c.feature_cols + c.label_cols + [self.getSampleWeightCol() or ""],
                                      self.getValidation())
        resume = self._resume_state(c, fingerprint)
        timings["validation"] = time.monotonic() - started

        mark = time.monotonic()
        seed = self.getRandomSeed()
        with prepare_lock:
            prepared = prepare_data(
                dataset, c.store, c.feature_cols, c.label_cols, self.getSampleWeightCol(), self.getValidation(),
                c.num_proc, seed=seed if seed is not None else 0, vector_dtype=c.dtype,
                skip_invalid=self.getInvalidRows() == "skip")
        self._check_shapes(c, [max(1, int(np.prod(prepared.column(col).shape))) for col in c.feature_cols])
        timings["materialization"] = time.monotonic() - mark

        epochs = self.getEpochs()
        start_epoch = resume.epoch if resume else 0
        history: List[Dict[str, Any]] = list(resume.history) if resume else []
        verbose = self.getVerbose()
        if start_epoch >= epochs:
            log.warning("run_id=%r has already trained %d of epochs=%d with this model, optimizer, loss and data; "
                        "returning its model without training (raise epochs to continue it, or use a new run_id)",
                        c.run_id, start_epoch, epochs)
            if verbose:
                print(f"run {c.run_id!r} has already trained {start_epoch} of epochs={epochs} with this model, "
                      "optimizer, loss and data: returning its model without training (raise epochs to continue, "
                      "or use a new run_id)")
            return self._finish(self._model(c, history, timings), c)

        current = [self._spec(c, prepared, start_epoch, history, resume, seed, fingerprint)]
        printer = ProgressPrinter(verbose)
        mark_wall = time.time()
        session = dataset.sparkSession

        def launch(attempt: int) -> List[Any]:
            return run(train_on_rank, args=(current[0],), num_proc=c.num_proc, env=RANK_ENVIRONMENT,  # type: ignore[arg-type]
                       stdout=printer.stdout, stderr=printer.stderr, verbose=1, use_gpu=self.getUseGpu(),
                       store=c.store, spark=session)

        def resume_point() -> str:
            """Set the next attempt to start from the run's last checkpoint (this fit's own)."""
            latest = self._latest(c, fingerprint)
            if latest is None:
                return "the start"
            c.model.set_weights(load_model_bytes(latest.model, self.getCustomObjects()).get_weights())
            current[0] = self._spec(c, prepared, latest.epoch, list(latest.history), latest, seed, fingerprint)
            return f"the end of epoch {latest.epoch}" if latest.epoch else "the start"

        try:
            results = run_with_retries(launch, session=session, num_proc=c.num_proc, max_retries=self.getMaxRetries(),
                                       report=printer.note if verbose else log.warning, resume_point=resume_point)
        finally:
            printer.close()
        # Phases by the ranks' own clock (a Connect client receives their output in bursts).
        done = time.time()
        launched = printer.rank_started_at or done
        last_epoch = printer.rank_last_epoch_at or done
        timings["launch"] = max(0.0, launched - mark_wall)
        timings["training"] = max(0.0, last_epoch - launched)
        result = results[0]
        c.model.set_weights(result["weights"])
        model = self._model(c, list(result["history"]), timings)
        timings["collection"] = max(0.0, time.time() - last_epoch)
        if self.getCleanupIntermediate():
            c.store.remove_intermediate([prepared.key])
        return self._finish(model, c)

    def _latest(self, c: _Checked, fingerprint: Dict[str, str]) -> Optional[KerasCheckpoint]:
        """The run's checkpoint when it is this fit's (same fingerprint), for a retry to resume from."""
        path = self._checkpoint_path(c)
        if not c.store.exists(path):
            return None
        try:
            state = read_checkpoint(c.store.read(path))
        except ValueError:
            return None
        return None if changed_parts(state.fingerprint, fingerprint) else state

    def _spec(self, c: _Checked, prepared: PreparedData, start_epoch: int, history: List[Dict[str, Any]],
              resume: Optional[KerasCheckpoint], seed: Optional[int], fingerprint: Dict[str, str]) -> KerasTrainingSpec:
        assert c.shapes is not None and c.output_shapes is not None
        batch_size = self.getBatchSize()
        val_batch_size = self.getValBatchSize() or batch_size
        train_steps = self.getTrainStepsPerEpoch() or steps_for(prepared.train_rows, c.num_proc, batch_size)
        val_steps = 0
        if prepared.val_path is not None:
            val_steps = self.getValidationStepsPerEpoch() or steps_for(prepared.val_rows, c.num_proc, val_batch_size)
        buffer = self.getShuffleBufferSize()
        store = c.store
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            data = model_bytes(c.model)
        return KerasTrainingSpec(
            model=data, optimizer=keras.optimizers.serialize(c.optimizer), losses=c.losses,
            loss_weights=c.loss_weights, metrics=c.metrics, custom_objects=self.getCustomObjects(),
            feature_cols=c.feature_cols, label_cols=c.label_cols, sample_weight_col=self.getSampleWeightCol(),
            feature_shapes=c.shapes, output_shapes=c.output_shapes, column_shapes=dict(prepared.shapes),
            dtype=c.dtype, train_url=store.url(prepared.train_path),
            val_url=store.url(prepared.val_path) if prepared.val_path else None,
            storage_options=store.storage_options, reader=self.getReader(), batch_size=batch_size,
            val_batch_size=val_batch_size, epochs=self.getEpochs(), start_epoch=start_epoch,
            train_steps=train_steps, val_steps=val_steps, shuffle=self.getShuffle(),
            shuffle_buffer_rows=_SHUFFLE_BUFFER_ROWS if buffer is None else buffer,
            seed=seed if seed is not None else int(np.random.SeedSequence().entropy % (2 ** 31)),
            keras_seed=seed, store=store, checkpoint_path=self._checkpoint_path(c), history=history,
            optimizer_variables=resume.optimizer_variables if resume else None,
            backward_passes_per_step=self.getBackwardPassesPerStep(), compression=self.getGradientCompression(),
            scale_lr=self.getScaleLr(), use_gpu=self.getUseGpu(), transformation_fn=self.getTransformationFn(),
            callbacks=list(self.getCallbacks() or []), progress=self.getVerbose() > 0, fingerprint=fingerprint)

    def _model(self, c: _Checked, history: List[Dict[str, Any]], timings: Dict[str, float]) -> KerasModel:
        assert c.shapes is not None
        model = KerasModel(model=c.model, feature_cols=c.feature_cols, label_cols=c.label_cols,
                           input_shapes=[list(s) for s in c.shapes], run_id=c.run_id, history=history, task=c.task,
                           prediction_col=self.getPredictionCol(), probability_col=self.getProbabilityCol(),
                           raw_prediction_col=self.getRawPredictionCol())
        if self.getCustomObjects() is not None:
            model.setCustomObjects(self.getCustomObjects())
        model.fit_timings = timings
        return model

    def _finish(self, model: KerasModel, c: _Checked) -> KerasModel:
        """Log the fit to MLflow when asked or when a run is active (see ``log_to_mlflow``): the
        Params, the history, the timings, and the model as a ``.keras`` artifact."""
        logger = start_logging(self.getLogToMlflow())
        if logger is None:
            return model
        try:
            json_params = {s.name: self.getOrDefault(s.name) for s in self.param_specs() if s.json}
            objects = {"model": c.model, "optimizer": type(c.optimizer).__name__, "loss": c.losses}
            lr = c.optimizer.get_config().get("learning_rate")
            logger.log_params({**params_for_logging(json_params, objects), "num_proc": c.num_proc,
                               "run_id": c.run_id, "task": c.task,
                               "lr": lr if isinstance(lr, (int, float)) else None})
            logger.log_history(model.getHistory() or [])
            logger.log_timings(model.fit_timings)
            keras_model = model.getModel()
            logger.log_model(lambda mlflow: _log_keras_model(mlflow, keras_model))
            model.mlflow_run_id = logger.run_id
        finally:
            logger.close()
        return model

    # ---- persistence ---------------------------------------------------------------------------
    def write(self) -> ParamsWriter:
        """A writer saving this estimator and its Params (``.save(path)``)."""
        return ParamsWriter(self)

    @classmethod
    def read(cls) -> ParamsReader["KerasEstimator"]:
        """A reader loading a saved KerasEstimator (``KerasEstimator.load(path)``)."""
        return ParamsReader(cls)


def _log_keras_model(mlflow: Any, model: Any) -> None:
    """The model as ``model/model.keras`` among the run's artifacts."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory(prefix="spark-hvd-mlflow-") as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        mlflow.log_artifact(path, artifact_path="model")
