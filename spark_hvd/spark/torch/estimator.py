"""TorchEstimator: data-parallel training of a torch model on a DataFrame, as a Spark ML Estimator."""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from pyspark.ml import Estimator
from pyspark.ml.util import MLReadable, MLWritable

from spark_hvd.spark.data import PreparedData, _inspect_column, plan_columns, prepare_data, sample_batch
from spark_hvd.spark.fitting import local_default_store as _local_default_store
from spark_hvd.spark.fitting import prepare_lock as _prepare_lock
from spark_hvd.spark.mlflow_log import params_for_logging, start_logging
from spark_hvd.spark.outputs import check_task, infer_task
from spark_hvd.spark.params import EstimatorParams
from spark_hvd.spark.reader import steps_for
from spark_hvd.spark.retry import run_with_retries
from spark_hvd.spark.runner import run
from spark_hvd.spark.session import session_info
from spark_hvd.spark.store import Store
from spark_hvd.spark.torch import checks
from spark_hvd.spark.torch.batches import LossFunction, metric_names, model_dtype
from spark_hvd.spark.fingerprint import start_over_or_refuse
from spark_hvd.spark.torch.fingerprint import changed_parts, run_fingerprint
from spark_hvd.spark.torch.model import TorchModel
from spark_hvd.spark.torch.persistence import ParamsReader, ParamsWriter
from spark_hvd.spark.torch.progress import ProgressPrinter
from spark_hvd.spark.torch.training import OptimizerSpec, TrainingSpec, load_checkpoint, train_on_rank

__all__ = ["TorchEstimator"]

log = logging.getLogger("spark_hvd.spark")

_PROBE_ROWS = 64
"""Rows of real data the driver puts through forward and the loss before materializing."""

@dataclass
class _Checked:
    """The Params of one fit after the driver-side checks."""

    model: torch.nn.Module
    optimizer: OptimizerSpec
    losses: List[Any]
    loss_weights: List[float]
    metrics: List[Any]
    feature_cols: List[str]
    label_cols: List[str]
    num_proc: int
    store: Store
    run_id: str
    task: str


class TorchEstimator(Estimator, EstimatorParams, MLReadable, MLWritable):
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

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    # ---- checks before any Spark job --------------------------------------------------------
    def _check(self, df: Any) -> _Checked:
        model = self.getModel()
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model={model!r} is not valid: expected a torch.nn.Module; pass e.g. "
                             "model=torch.nn.Sequential(torch.nn.Linear(30, 1))")
        optimizer = self.getOptimizer()
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer={optimizer!r} is not valid: expected a torch.optim.Optimizer over the "
                             "model's parameters; pass e.g. optimizer=torch.optim.Adam(model.parameters(), lr=1e-3)")
        feature_cols = self.getFeatureCols()
        checks.require("feature_cols", feature_cols, "the list of input columns", "['features']")
        label_cols = self.getLabelCols()
        checks.require("label_cols", label_cols, "the list of target columns", "['label']")
        losses, weights = checks.check_losses(self.getLoss(), self.getLossWeights(), label_cols)
        metrics = checks.check_metrics(self.getMetrics())
        checks.check_compression(self.getGradientCompression())
        checks.check_feature_count(model, feature_cols)
        checks.feature_shapes(self.getInputShapes(), feature_cols, [None] * len(feature_cols))
        weight_col = self.getSampleWeightCol()
        if weight_col is not None and weight_col in list(feature_cols) + list(label_cols):
            raise ValueError(f"sample_weight_col={weight_col!r} is also a feature or label column: expected a "
                             "separate column of per-row weights")
        optimizer_spec = OptimizerSpec.of(optimizer, model)
        plan_columns(df, feature_cols, label_cols, weight_col, self.getValidation(), "float32")
        task = infer_task(self.getTask(), losses, label_cols)

        session = df.sparkSession
        info = session_info(session)
        store = self.getStore()
        if store is None:
            if not info.local:
                raise ValueError("store=None is not valid on a cluster: expected storage every executor can read; "
                                 "pass e.g. store=Store.create('hdfs:///user/me/spark-hvd'), or on Databricks "
                                 "store=Store.create('/Volumes/<catalog>/<schema>/<volume>/spark-hvd')")
            store = _local_default_store()
        num_proc = self.getNumProc() or info.default_parallelism
        checks.check_slots(session, num_proc)
        checks.ensure_executor_python(session, info)
        store.check_writable()
        run_id = self.getRunId() or f"torch-{uuid.uuid4().hex[:12]}"
        store.get_run_path(run_id)  # checks the name
        return _Checked(model, optimizer_spec, losses, weights, metrics, list(feature_cols), list(label_cols),
                        num_proc, store, run_id, task)

    def _check_early_dry_run(self, df: Any, c: _Checked) -> None:
        """When the schema tells every feature's size, try the model before any Spark job, and
        the loss too when it tells every label's size (rows of zeros stand in for the data)."""
        sizes = checks.schema_row_sizes(df.schema, c.feature_cols)
        shapes = checks.feature_shapes(self.getInputShapes(), c.feature_cols, sizes)
        if shapes is None:
            return
        dtype = model_dtype(c.model)
        check_task(c.task, checks.dry_run(c.model, shapes, len(c.label_cols), dtype))
        label_sizes = checks.schema_row_sizes(df.schema, c.label_cols)
        if any(size is None for size in label_sizes) or self.getTransformationFn() is not None:
            return
        fields = {f.name: f.dataType for f in df.schema.fields}
        batch = {col: np.zeros((2,) + tuple(shape), dtype=str(dtype).replace("torch.", ""))
                 for col, shape in zip(c.feature_cols, shapes)}
        for col, size in zip(c.label_cols, label_sizes):
            stored = _inspect_column(col, fields[col], "float32")
            batch[col] = np.zeros((2,) if stored.kind == "scalar" else (2, int(size)), dtype=stored.dtype)
        checks.dry_run_batch(c.model, LossFunction(c.losses, c.loss_weights), batch, c.feature_cols, c.label_cols,
                             shapes, dtype)

    def _check_real_batch(self, df: Any, c: _Checked) -> None:
        """One batch of real rows through forward and the loss on the driver (one small Spark job,
        before anything is written), so shape mismatches fail at once with the shapes named."""
        dtype = model_dtype(c.model)
        batch = sample_batch(df, c.feature_cols + c.label_cols, min(self.getBatchSize(), _PROBE_ROWS),
                             "float64" if dtype == torch.float64 else "float32")
        if self.getTransformationFn() is not None:
            batch = self.getTransformationFn()(batch)
        if not batch or len(next(iter(batch.values()))) == 0:
            return  # no complete row: the materialization names the nulls, or the empty frame
        sizes = [max(1, int(np.prod(np.asarray(batch[col]).shape[1:]))) for col in c.feature_cols]
        shapes = checks.feature_shapes(self.getInputShapes(), c.feature_cols, sizes)
        assert shapes is not None, "a batch knows every size"
        check_task(c.task, checks.dry_run(c.model, shapes, len(c.label_cols), dtype))
        checks.dry_run_batch(c.model, LossFunction(c.losses, c.loss_weights), batch, c.feature_cols, c.label_cols,
                             shapes, dtype)

    # ---- resume --------------------------------------------------------------------------------
    def _resume_state(self, c: _Checked, model_copy: torch.nn.Module,
                      fingerprint: Dict[str, str]) -> Optional[Dict[str, Any]]:
        path = c.store.get_checkpoint_path(c.run_id)
        if not c.store.exists(path):
            return None
        try:
            state = load_checkpoint(c.store.read(path))
        except Exception as exc:
            state, changed = None, [f"checkpoint format ({exc})"]
        else:
            changed = changed_parts(state.get("fingerprint"), fingerprint)
        if changed:
            start_over_or_refuse(c.store, c.run_id, changed, self.getOverwriteRun(),
                                 int(state["epoch"]) if state else None)
            return None
        try:
            model_copy.load_state_dict(state["model"])
        except Exception as exc:
            raise ValueError(
                f"run_id={c.run_id!r} has a checkpoint at {path} that does not fit this model ({exc}); fix: use a new "
                "run_id, or pass overwrite_run=True to start this run over") from None
        return state

    # ---- fit -----------------------------------------------------------------------------------
    def _fit(self, dataset: Any) -> TorchModel:
        timings: Dict[str, float] = {}
        started = time.monotonic()
        c = self._check(dataset)
        self._check_early_dry_run(dataset, c)
        self._check_real_batch(dataset, c)
        trained = copy.deepcopy(c.model).cpu()
        fingerprint = run_fingerprint(c.model, c.optimizer, c.losses, c.loss_weights, dataset,
                                      c.feature_cols + c.label_cols + [self.getSampleWeightCol() or ""],
                                      self.getValidation())
        resume = self._resume_state(c, trained, fingerprint)
        timings["validation"] = time.monotonic() - started

        mark = time.monotonic()
        dtype = model_dtype(c.model)
        seed = self.getRandomSeed()
        with _prepare_lock:
            prepared = prepare_data(
                dataset, c.store, c.feature_cols, c.label_cols, self.getSampleWeightCol(), self.getValidation(),
                c.num_proc, seed=seed if seed is not None else 0,
                vector_dtype="float64" if dtype == torch.float64 else "float32",
                skip_invalid=self.getInvalidRows() == "skip")
        shapes = self._feature_shapes(prepared, c.feature_cols)
        checks.dry_run(c.model, shapes, len(c.label_cols), dtype)
        timings["materialization"] = time.monotonic() - mark

        epochs = self.getEpochs()
        start_epoch = int(resume["epoch"]) if resume else 0
        history: List[Dict[str, Any]] = list(resume["history"]) if resume else []
        if resume and int(resume.get("batch") or 0) > 0 and resume.get("seed") is not None:
            seed = int(resume["seed"])  # the rest of a resumed epoch keeps its shuffle order
        verbose = self.getVerbose()
        if start_epoch >= epochs:
            log.warning("run_id=%r has already trained %d of epochs=%d with this model, optimizer, loss and data; "
                        "returning its model without training (raise epochs to continue it, or use a new run_id)",
                        c.run_id, start_epoch, epochs)
            if verbose:
                print(f"run {c.run_id!r} has already trained {start_epoch} of epochs={epochs} with this model, "
                      "optimizer, loss and data: returning its model without training (raise epochs to continue, "
                      "or use a new run_id)")
            return self._finish(self._model(trained, c, shapes, history, timings), c)

        spec = self._spec(c, trained, prepared, shapes, start_epoch, history, resume, seed)
        spec.fingerprint = fingerprint
        if resume:
            spec = _resumed(spec, resume)
        printer = ProgressPrinter(verbose)
        mark_wall = time.time()
        session = dataset.sparkSession
        current = [spec]

        def launch(attempt: int) -> List[Any]:
            return run(train_on_rank, args=(current[0],), num_proc=c.num_proc,  # type: ignore[arg-type]
                       stdout=printer.stdout, stderr=printer.stderr, verbose=1, use_gpu=self.getUseGpu(),
                       store=c.store, spark=session)

        def resume_point() -> str:
            current[0] = self._latest(c, spec)
            return _describe_resume(current[0])

        try:
            results = run_with_retries(launch, session=session, num_proc=c.num_proc, max_retries=self.getMaxRetries(),
                                       report=printer.note if verbose else log.warning, resume_point=resume_point)
        finally:
            printer.close()
        # Phases by the ranks' own clock where they are the ranks' (training on a remote
        # cluster reaches a Connect client in bursts, so arrival times would mislead).
        done = time.time()
        launched = printer.rank_started_at or done
        last_epoch = printer.rank_last_epoch_at or done
        timings["launch"] = max(0.0, launched - mark_wall)
        timings["training"] = max(0.0, last_epoch - launched)
        result = results[0]
        trained.load_state_dict(result["model"])
        model = self._model(trained, c, shapes, list(result["history"]), timings)
        timings["collection"] = max(0.0, time.time() - last_epoch)
        model.fit_timings = timings
        if self.getCleanupIntermediate():
            c.store.remove_intermediate([prepared.key])
        return self._finish(model, c)

    def _latest(self, c: _Checked, spec: TrainingSpec) -> TrainingSpec:
        """``spec`` advanced to the run's last checkpoint, for the next attempt of the stage."""
        path = c.store.get_checkpoint_path(c.run_id)
        if not c.store.exists(path):
            return spec
        state = load_checkpoint(c.store.read(path))
        if changed_parts(state.get("fingerprint"), spec.fingerprint):
            return spec  # not ours (a concurrent fit of the same run_id): start where this fit did
        return _resumed(spec, state)

    def _finish(self, model: TorchModel, c: _Checked) -> TorchModel:
        """Log the fit to MLflow when asked or when a run is active (see ``log_to_mlflow``)."""
        logger = start_logging(self.getLogToMlflow())
        if logger is None:
            return model
        try:
            json_params = {s.name: self.getOrDefault(s.name) for s in self.param_specs() if s.json}
            objects = {"model": c.model, "optimizer": c.optimizer.cls.__name__, "loss": c.losses}
            logger.log_params({**params_for_logging(json_params, objects), "num_proc": c.num_proc,
                               "run_id": c.run_id, "task": c.task, "lr": c.optimizer.defaults.get("lr")})
            logger.log_history(model.getHistory() or [])
            logger.log_timings(model.fit_timings)
            torch_model = model.getModel()
            shapes = [tuple(s) for s in model.getInputShapes() or []]
            logger.log_model(lambda mlflow: _log_torch_model(mlflow, torch_model, shapes))
            model.mlflow_run_id = logger.run_id
        finally:
            logger.close()
        return model

    def _feature_shapes(self, prepared: PreparedData, feature_cols: List[str]) -> List[Tuple[int, ...]]:
        sizes = [max(1, int(np.prod(prepared.column(col).shape))) for col in feature_cols]
        shapes = checks.feature_shapes(self.getInputShapes(), feature_cols, sizes)
        assert shapes is not None, "prepared data knows every size"
        return shapes

    def _spec(self, c: _Checked, model: torch.nn.Module, prepared: PreparedData, shapes: List[Tuple[int, ...]],
              start_epoch: int, history: List[Dict[str, Any]], resume: Optional[Dict[str, Any]],
              seed: Optional[int]) -> TrainingSpec:
        """The ranks' spec; ``model`` is the driver's copy, already holding any resumed weights
        (run() pickles it before the driver loads the trained weights into it)."""
        batch_size = self.getBatchSize()
        val_batch_size = self.getValBatchSize() or batch_size
        passes = self.getBackwardPassesPerStep()
        train_steps = self.getTrainStepsPerEpoch() or steps_for(prepared.train_rows, c.num_proc, batch_size)
        # Whole optimizer steps only: every epoch ends with the accumulated gradients applied.
        train_steps = -(-train_steps // passes) * passes
        val_steps = 0
        if prepared.val_path is not None:
            val_steps = self.getValidationStepsPerEpoch() or steps_for(prepared.val_rows, c.num_proc, val_batch_size)
        store = c.store
        return TrainingSpec(
            model=model, optimizer=c.optimizer, losses=c.losses, loss_weights=c.loss_weights,
            metrics=c.metrics, metric_names=metric_names(c.metrics, c.label_cols),
            feature_cols=c.feature_cols, label_cols=c.label_cols, sample_weight_col=self.getSampleWeightCol(),
            feature_shapes=shapes, column_shapes=dict(prepared.shapes),
            train_url=store.url(prepared.train_path),
            val_url=store.url(prepared.val_path) if prepared.val_path else None,
            storage_options=store.storage_options, reader=self.getReader(),
            batch_size=batch_size, val_batch_size=val_batch_size, epochs=self.getEpochs(), start_epoch=start_epoch,
            train_steps=train_steps, val_steps=val_steps, shuffle=self.getShuffle(),
            seed=seed if seed is not None else int(np.random.SeedSequence().entropy % (2 ** 31)),
            torch_seed=seed, store=store, checkpoint_path=store.get_checkpoint_path(c.run_id), history=history,
            resume_optimizer=resume["optimizer"] if resume else None,
            backward_passes_per_step=passes, compression=self.getGradientCompression(),
            scale_lr=self.getScaleLr(), use_gpu=self.getUseGpu(),
            transformation_fn=self.getTransformationFn(), train_minibatch_fn=self.getTrainMinibatchFn(),
            callbacks=list(self.getCallbacks() or []), progress=self.getVerbose() > 0,
            checkpoint_every_steps=self.getCheckpointEverySteps())

    def _model(self, trained: torch.nn.Module, c: _Checked, shapes: List[Tuple[int, ...]],
               history: List[Dict[str, Any]], timings: Dict[str, float]) -> TorchModel:
        model = TorchModel(model=trained, feature_cols=c.feature_cols, label_cols=c.label_cols,
                           input_shapes=[list(s) for s in shapes], run_id=c.run_id, history=history, task=c.task,
                           prediction_col=self.getPredictionCol(), probability_col=self.getProbabilityCol(),
                           raw_prediction_col=self.getRawPredictionCol())
        model.fit_timings = timings
        return model

    # ---- persistence ---------------------------------------------------------------------------
    def write(self) -> ParamsWriter:
        """A writer saving this estimator and its Params (``.save(path)``)."""
        return ParamsWriter(self)

    @classmethod
    def read(cls) -> ParamsReader["TorchEstimator"]:
        """A reader loading a saved TorchEstimator (``TorchEstimator.load(path)``)."""
        return ParamsReader(cls)


def _resumed(spec: TrainingSpec, state: Dict[str, Any]) -> TrainingSpec:
    """``spec`` set to continue from checkpoint ``state`` (epoch, batch within it, weights, sums)."""
    batch = int(state.get("batch") or 0)
    return dataclasses.replace(
        spec, start_epoch=int(state["epoch"]), start_batch=batch, partial=dict(state.get("partial") or {}) or None,
        history=list(state["history"]), resume_model=state["model"], resume_optimizer=state["optimizer"])


def _describe_resume(spec: TrainingSpec) -> str:
    if spec.start_batch:
        return f"epoch {spec.start_epoch + 1}, step {spec.start_batch} of {spec.train_steps}"
    if spec.start_epoch:
        return f"the end of epoch {spec.start_epoch}"
    return "the start"


def _log_torch_model(mlflow: Any, model: torch.nn.Module, shapes: List[Tuple[int, ...]]) -> None:
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
