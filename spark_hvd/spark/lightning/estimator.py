"""LightningEstimator: data-parallel training of a LightningModule on a DataFrame, as a Spark ML Estimator."""

from __future__ import annotations

import copy
import dataclasses
import io
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytorch_lightning as pl
import torch
from pyspark.ml import Estimator
from pyspark.ml.util import MLReadable, MLWritable

from spark_hvd.spark.data import PreparedData, plan_columns, prepare_data, sample_batch
from spark_hvd.spark.lightning import checks as lightning_checks
from spark_hvd.spark.lightning.model import LightningModel
from spark_hvd.spark.lightning.params import LightningEstimatorParams
from spark_hvd.spark.lightning.training import CHECKPOINT_FORMAT, CHECKPOINT_KEY, LightningSpec, fit_on_rank, module_batch
from spark_hvd.spark.outputs import check_task
from spark_hvd.spark.reader import steps_for
from spark_hvd.spark.retry import run_with_retries
from spark_hvd.spark.runner import run
from spark_hvd.spark.session import session_info
from spark_hvd.spark.store import Store
from spark_hvd.spark.torch import checks
from spark_hvd.spark.torch.batches import model_dtype
# One default store and one materialization lock per process, shared with TorchEstimator: both
# estimators cache the same prepared datasets.
from spark_hvd.spark.torch.estimator import _local_default_store, _prepare_lock
from spark_hvd.spark.fingerprint import start_over_or_refuse
from spark_hvd.spark.torch.fingerprint import changed_parts, run_fingerprint
from spark_hvd.spark.torch.persistence import ParamsReader, ParamsWriter
from spark_hvd.spark.torch.progress import ProgressPrinter
from spark_hvd.spark.torch.training import OptimizerSpec

__all__ = ["LightningEstimator"]

log = logging.getLogger("spark_hvd.spark")

_PROBE_ROWS = 64
"""Rows of real data the driver puts through forward and training_step before materializing."""


@dataclass
class _Checked:
    """The Params of one fit after the driver-side checks."""

    model: pl.LightningModule
    trainer_args: Dict[str, Any]
    callbacks: List[Any]
    feature_cols: List[str]
    label_cols: List[str]
    num_proc: int
    store: Store
    run_id: str
    task: str
    optimizer: OptimizerSpec
    """What configure_optimizers builds, for the run's fingerprint."""


class LightningEstimator(Estimator, LightningEstimatorParams, MLReadable, MLWritable):
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
    (``forward`` and ``training_step`` on one real batch) and the cluster's task slots are checked
    before any data is written; the columns are materialized as Parquet in ``store``; ``num_proc``
    barrier tasks each build ``pytorch_lightning.Trainer(strategy=SparkHvdStrategy(), devices=1,
    max_epochs=epochs, **trainer_args)`` (accelerator 'gpu' with ``use_gpu`` and CUDA, else 'cpu')
    and fit on their shard. After each epoch what the module logged with ``self.log`` (epoch values,
    ``val_`` metrics included) is averaged over the ranks into ``history`` (with ``loss``, the mean
    of training_step's losses, when the module does not log one) and rank 0 writes a Lightning
    checkpoint to the store under ``run_id``; a fit with the ``run_id`` of an unfinished run
    resumes after its last completed epoch, optimizer and schedulers included. The driver's module
    is never modified. Saves and loads with Spark ML persistence, also in a Pipeline.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    # ---- checks before any Spark job --------------------------------------------------------
    def _check(self, df: Any) -> _Checked:
        model = self.getModel()
        checks.require("model", model, "a pytorch_lightning.LightningModule", "MyModule()")
        lightning_checks.check_module(model, self.getValidation())
        trainer_args = lightning_checks.check_trainer_args(self.getTrainerArgs())
        callbacks = lightning_checks.check_callbacks(self.getCallbacks())
        feature_cols = self.getFeatureCols()
        checks.require("feature_cols", feature_cols, "the list of input columns", "['features']")
        label_cols = self.getLabelCols()
        checks.require("label_cols", label_cols, "the list of target columns", "['label']")
        checks.check_compression(self.getGradientCompression())
        checks.check_feature_count(model, feature_cols)
        checks.feature_shapes(self.getInputShapes(), feature_cols, [None] * len(feature_cols))
        weight_col = self.getSampleWeightCol()
        if weight_col is not None and weight_col in list(feature_cols) + list(label_cols):
            raise ValueError(f"sample_weight_col={weight_col!r} is also a feature or label column: expected a "
                             "separate column of per-row weights")
        plan_columns(df, feature_cols, label_cols, weight_col, self.getValidation(), "float32")
        optimizer = self._optimizer_spec(model)

        session = df.sparkSession
        info = session_info(session)
        store = self.getStore()
        if store is None:
            if not info.local:
                raise ValueError("store=None is not valid on a cluster: expected storage every executor can read; "
                                 "pass e.g. store=Store.create('hdfs:///user/me/spark-hvd')")
            store = _local_default_store()
        num_proc = self.getNumProc() or info.default_parallelism
        checks.check_slots(session, num_proc)
        checks.ensure_executor_python(session, info)
        store.check_writable()
        run_id = self.getRunId() or f"lightning-{uuid.uuid4().hex[:12]}"
        store.get_run_path(run_id)  # checks the name
        return _Checked(model, trainer_args, callbacks, list(feature_cols), list(label_cols), num_proc, store,
                        run_id, self.getTask(), optimizer)

    @staticmethod
    def _optimizer_spec(model: pl.LightningModule) -> OptimizerSpec:
        optimizer = lightning_checks.configured_optimizer(model)
        if optimizer is not None:
            try:
                return OptimizerSpec.of(optimizer, model)
            except ValueError:  # over parameters of another module: still a class and hyperparameters
                return OptimizerSpec(type(optimizer), dict(optimizer.defaults), [])
        return OptimizerSpec(type(None), {}, [])

    def _check_early_dry_run(self, df: Any, c: _Checked) -> None:
        """When the schema tells every feature's size, try forward on rows of zeros before any Spark job."""
        shapes = checks.feature_shapes(self.getInputShapes(), c.feature_cols,
                                       checks.schema_row_sizes(df.schema, c.feature_cols))
        if shapes is not None:
            check_task(c.task, checks.dry_run(c.model, shapes, len(c.label_cols), model_dtype(c.model)))

    def _check_real_batch(self, df: Any, c: _Checked) -> None:
        """One batch of real rows through forward and training_step on the driver (one small Spark
        job, before anything is written), so a wrong column, shape or dtype fails at once."""
        dtype = model_dtype(c.model)
        weight_col = self.getSampleWeightCol()
        columns = c.feature_cols + c.label_cols + ([weight_col] if weight_col else [])
        batch = sample_batch(df, columns, min(self.getBatchSize(), _PROBE_ROWS),
                             "float64" if dtype == torch.float64 else "float32")
        if self.getTransformationFn() is not None:
            batch = self.getTransformationFn()(batch)
        if not batch or len(next(iter(batch.values()))) == 0:
            return  # no complete row: the materialization names the nulls, or the empty frame
        sizes = [max(1, int(np.prod(np.asarray(batch[col]).shape[1:]))) for col in c.feature_cols]
        shapes = checks.feature_shapes(self.getInputShapes(), c.feature_cols, sizes)
        assert shapes is not None, "a batch knows every size"
        check_task(c.task, checks.dry_run(c.model, shapes, len(c.label_cols), dtype))
        tensors = module_batch(batch, c.feature_cols, c.label_cols, weight_col, shapes, dtype)
        lightning_checks.dry_run_training_step(c.model, tensors)

    # ---- resume --------------------------------------------------------------------------------
    def _resume_state(self, c: _Checked, model_copy: torch.nn.Module,
                      fingerprint: Dict[str, str]) -> Optional[Dict[str, Any]]:
        """The record of the run's checkpoint (completed epochs, history), its weights loaded into
        ``model_copy``; None for a new run."""
        path = c.store.get_checkpoint_path(c.run_id)
        if not c.store.exists(path):
            return None
        record: Optional[Dict[str, Any]] = None
        try:
            # A Lightning checkpoint holds pickled loop and hyperparameter state: the store is trusted,
            # as the ranks that wrote it were.
            checkpoint = torch.load(io.BytesIO(c.store.read(path)), map_location="cpu", weights_only=False)
            record = checkpoint.get(CHECKPOINT_KEY) if isinstance(checkpoint, dict) else None
            if not isinstance(record, dict) or record.get("format") != CHECKPOINT_FORMAT:
                raise ValueError("not a LightningEstimator checkpoint")
        except Exception as exc:
            record, changed = None, [f"checkpoint format ({exc})"]
        else:
            changed = changed_parts(record.get("fingerprint"), fingerprint)
        if changed:
            start_over_or_refuse(c.store, c.run_id, changed, self.getOverwriteRun(),
                                 int(record["epochs_done"]) if record else None)
            return None
        assert record is not None
        try:
            model_copy.load_state_dict(checkpoint["state_dict"])
        except Exception as exc:
            raise ValueError(
                f"run_id={c.run_id!r} has a checkpoint at {path} that does not fit this module ({exc}); fix: use a "
                "new run_id, or pass overwrite_run=True to start this run over") from None
        return record

    # ---- fit -----------------------------------------------------------------------------------
    def _fit(self, dataset: Any) -> LightningModel:
        timings: Dict[str, float] = {}
        started = time.monotonic()
        c = self._check(dataset)
        self._check_early_dry_run(dataset, c)
        self._check_real_batch(dataset, c)
        trained = copy.deepcopy(c.model).cpu()
        weight_col = self.getSampleWeightCol()
        fingerprint = run_fingerprint(c.model, c.optimizer, [type(c.model).training_step], [1.0], dataset,
                                      c.feature_cols + c.label_cols + [weight_col or ""], self.getValidation())
        resume = self._resume_state(c, trained, fingerprint)
        timings["validation"] = time.monotonic() - started

        mark = time.monotonic()
        dtype = model_dtype(c.model)
        seed = self.getRandomSeed()
        with _prepare_lock:
            prepared = prepare_data(
                dataset, c.store, c.feature_cols, c.label_cols, weight_col, self.getValidation(), c.num_proc,
                seed=seed if seed is not None else 0, vector_dtype="float64" if dtype == torch.float64 else "float32",
                skip_invalid=self.getInvalidRows() == "skip")
        sizes = [max(1, int(np.prod(prepared.column(col).shape))) for col in c.feature_cols]
        shapes = checks.feature_shapes(self.getInputShapes(), c.feature_cols, sizes)
        assert shapes is not None, "prepared data knows every size"
        timings["materialization"] = time.monotonic() - mark

        epochs = self.getEpochs()
        start_epoch = int(resume["epochs_done"]) if resume else 0
        history: List[Dict[str, Any]] = list(resume["history"]) if resume else []
        if start_epoch >= epochs:
            log.warning("run_id=%r has already trained %d of epochs=%d with this module and data; returning its "
                        "model without training (raise epochs to continue it, or use a new run_id)",
                        c.run_id, start_epoch, epochs)
            if self.getVerbose():
                print(f"run {c.run_id!r} has already trained {start_epoch} of epochs={epochs}: returning its model "
                      "without training (raise epochs to continue, or use a new run_id)")
            return self._model(trained, c, shapes, history, timings)

        spec = self._spec(c, trained, prepared, shapes, start_epoch, history, resume is not None, seed)
        spec.fingerprint = fingerprint
        printer = ProgressPrinter(self.getVerbose())
        mark_wall = time.time()
        session = dataset.sparkSession
        current = [spec]

        def launch(attempt: int) -> List[Any]:
            return run(fit_on_rank, args=(current[0],), num_proc=c.num_proc, stdout=printer.stdout,  # type: ignore[arg-type]
                       stderr=printer.stderr, verbose=1, use_gpu=self.getUseGpu(), store=c.store, spark=session)

        def resume_point() -> str:
            """Set the next attempt to start Lightning from the run's last checkpoint (this fit's own)."""
            record = self._latest(c, fingerprint)
            if record is None:
                return "the start"
            done = int(record["epochs_done"])
            current[0] = dataclasses.replace(spec, resume=True, start_epoch=done, history=list(record["history"]))
            return f"the end of epoch {done}" if done else "the start"

        try:
            results = run_with_retries(launch, session=session, num_proc=c.num_proc, max_retries=self.getMaxRetries(),
                                       report=printer.note if self.getVerbose() else log.warning,
                                       resume_point=resume_point)
        finally:
            printer.close()
        done = time.time()
        launched = printer.rank_started_at or done
        last_epoch = printer.rank_last_epoch_at or done
        timings["launch"] = max(0.0, launched - mark_wall)
        timings["training"] = max(0.0, last_epoch - launched)
        result = results[0]
        trained.load_state_dict(result["model"])
        timings["collection"] = max(0.0, time.time() - last_epoch)
        if self.getCleanupIntermediate():
            c.store.remove_intermediate([prepared.key])
        return self._model(trained, c, shapes, list(result["history"]), timings)

    def _latest(self, c: _Checked, fingerprint: Dict[str, str]) -> Optional[Dict[str, Any]]:
        """The record of the run's checkpoint when it is this fit's (same fingerprint), for a retry."""
        path = c.store.get_checkpoint_path(c.run_id)
        if not c.store.exists(path):
            return None
        try:
            checkpoint = torch.load(io.BytesIO(c.store.read(path)), map_location="cpu", weights_only=False)
        except Exception:  # a checkpoint cut short by the failure: resume from where this fit began
            return None
        record = checkpoint.get(CHECKPOINT_KEY) if isinstance(checkpoint, dict) else None
        if not isinstance(record, dict) or record.get("format") != CHECKPOINT_FORMAT:
            return None
        return None if changed_parts(record.get("fingerprint"), fingerprint) else record

    def _spec(self, c: _Checked, model: torch.nn.Module, prepared: PreparedData, shapes: List[Tuple[int, ...]],
              start_epoch: int, history: List[Dict[str, Any]], resume: bool, seed: Optional[int]) -> LightningSpec:
        """The ranks' spec; ``model`` is the driver's copy (run() pickles it before the driver loads
        the trained weights into it)."""
        batch_size = self.getBatchSize()
        val_batch_size = self.getValBatchSize() or batch_size
        train_steps = self.getTrainStepsPerEpoch() or steps_for(prepared.train_rows, c.num_proc, batch_size)
        val_steps = 0
        if prepared.val_path is not None:
            val_steps = self.getValidationStepsPerEpoch() or steps_for(prepared.val_rows, c.num_proc, val_batch_size)
        store = c.store
        return LightningSpec(
            model=model, feature_cols=c.feature_cols, label_cols=c.label_cols,
            sample_weight_col=self.getSampleWeightCol(), feature_shapes=shapes, column_shapes=dict(prepared.shapes),
            train_url=store.url(prepared.train_path),
            val_url=store.url(prepared.val_path) if prepared.val_path else None,
            storage_options=store.storage_options, reader=self.getReader(), batch_size=batch_size,
            val_batch_size=val_batch_size, epochs=self.getEpochs(), start_epoch=start_epoch, train_steps=train_steps,
            val_steps=val_steps, shuffle=self.getShuffle(),
            seed=seed if seed is not None else int(np.random.SeedSequence().entropy % (2 ** 31)),
            torch_seed=seed, store=store, checkpoint_path=store.get_checkpoint_path(c.run_id), resume=resume,
            trainer_args=c.trainer_args, callbacks=c.callbacks, compression=self.getGradientCompression(),
            use_gpu=self.getUseGpu(), transformation_fn=self.getTransformationFn(),
            progress=self.getVerbose() > 0, history=history)

    def _model(self, trained: torch.nn.Module, c: _Checked, shapes: List[Tuple[int, ...]],
               history: List[Dict[str, Any]], timings: Dict[str, float]) -> LightningModel:
        model = LightningModel(model=trained, feature_cols=c.feature_cols, label_cols=c.label_cols,
                               input_shapes=[list(s) for s in shapes], run_id=c.run_id, history=history,
                               task=c.task, prediction_col=self.getPredictionCol(),
                               probability_col=self.getProbabilityCol(), raw_prediction_col=self.getRawPredictionCol())
        model.fit_timings = timings
        return model

    # ---- persistence ---------------------------------------------------------------------------
    def write(self) -> ParamsWriter:
        """A writer saving this estimator and its Params (``.save(path)``)."""
        return ParamsWriter(self)

    @classmethod
    def read(cls) -> ParamsReader["LightningEstimator"]:
        """A reader loading a saved LightningEstimator (``LightningEstimator.load(path)``)."""
        return ParamsReader(cls)
