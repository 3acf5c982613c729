"""The one estimator: what every framework's ``fit`` does, in order, and the hooks a framework fills in.

:class:`DistributedEstimator` runs ``fit(df)`` once through these steps, the same for PyTorch,
Keras and Lightning:

1. checks: the framework's model and optimizer, the columns and their types, the losses, the
   cluster's task slots, the executors' Python and the store (nothing runs on Spark before they
   pass);
2. the dry run: the model and its loss once, on rows of zeros when the schema tells every
   feature's and label's size (no Spark job), else on one batch of real rows (one small Spark job);
3. the run's fingerprint and resume point (a checkpoint of the same ``run_id``), before the
   materialization when the run has a checkpoint, else after it (its pass hashes rows held in
   memory for both);
4. the data's materialization as Parquet in the store (reused for the same DataFrame);
5. the training spec (every setting that comes from a Param under the Param's name), and the
   barrier stage with retries from the last checkpoint;
6. the fitted model, and MLflow.

A framework subclass supplies only the hooks (``_check_model``, ``_try_model``, ``_spec``, ...),
typed by its own checked values (``DistributedEstimator[_Torch]``, whose fits are ``Fit[_Torch]``),
so a Param or a step added here reaches every estimator.
"""

from __future__ import annotations

import atexit
import logging
import shutil
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, Generic, List, Mapping, Optional, Sequence, Tuple, TypeVar

import numpy as np
from pyspark.ml import Estimator
from pyspark.ml.util import MLReadable, MLWritable

from spark_hvd.spark.data.columns import STACKED_FEATURES, inspect_column, plan_columns, sample_batch, stacked_column
from spark_hvd.spark.data.identity import data_identity
from spark_hvd.spark.data.prepare import PreparedData, prepare_data
from spark_hvd.spark.data.reader import steps_for
from spark_hvd.spark.data.store import Store
from spark_hvd.spark.estimator import checks, tuning
from spark_hvd.spark.estimator.fingerprint import changed_parts, start_over_or_refuse
from spark_hvd.spark.estimator.labels import LabelRule, check_labels, probe_breaks, rule_for_loss, rule_for_task
from spark_hvd.spark.estimator.mlflow_log import active_run_id, params_for_logging, start_logging, under_tuning_run
from spark_hvd.spark.estimator.persistence import ParamsReader, ParamsWriter
from spark_hvd.spark.estimator.progress import ProgressPrinter
from spark_hvd.spark.estimator.training import TrainingSpec, adapt_batch
from spark_hvd.spark.launch.barrier import TimestampedLines, run
from spark_hvd.spark.launch.backend import run_options
from spark_hvd.spark.launch.retry import run_with_retries
from spark_hvd.spark.session import session_info

__all__ = ["PROBE_ROWS", "RANK_DATA_MODULES", "Checkpoint", "Fit", "DistributedEstimator", "local_default_store", "fit_store",
           "prepare_lock"]

log = logging.getLogger("spark_hvd.spark")

tuning.install()  # a grid over objects is refused when its tuning object is saved, naming the Param

PROBE_ROWS = 64
"""Rows of real data the driver puts through the model and the loss before materializing."""

RANK_DATA_MODULES = ("cloudpickle", "fsspec", "pandas", "pyarrow.parquet", "spark_hvd.spark.data.reader",
                     "spark_hvd.spark.data.store")
"""Modules every estimator's rank imports to run its call and read its shard, and pandas, which
the module defining a Spark user's model usually imports (about 300 modules): imported once in the
warm process, so a repeat fit's ranks do not import them again (0.5-0.7 s a rank here)."""

_default_store: Optional[Store] = None
_store_lock = threading.Lock()

_WARNED: set = set()
"""(estimator class, Param) pairs already warned about as having no effect here."""

prepare_lock = threading.Lock()
"""Serializes materialization: concurrent fits of one DataFrame (CrossValidator with parallelism
> 1) would otherwise write the same cached dataset at once."""


def local_default_store() -> Store:
    """A store in a temporary directory of this process, removed when it exits (local masters only)."""
    global _default_store
    with _store_lock:
        if _default_store is None:
            path = tempfile.mkdtemp(prefix="spark-hvd-store-")
            atexit.register(shutil.rmtree, path, True)
            _default_store = Store.create(path)
        return _default_store


def fit_store(store: Optional[Store], info: Any) -> Store:
    """The ``store`` Param, or on a local master a temporary store when it is unset; a ValueError
    on a cluster, whose executors cannot read the driver's temporary directory."""
    if store is not None:
        return store
    if not info.local:
        raise ValueError("store=None is not valid on a cluster: expected storage every executor can read; "
                         "pass e.g. store=Store.create('hdfs:///user/me/spark-hvd'), or on Databricks "
                         "store=Store.create('/Volumes/<catalog>/<schema>/<volume>/spark-hvd')")
    return local_default_store()


@dataclass
class Checkpoint:
    """What resuming needs of a run's checkpoint, whichever framework wrote it."""

    epoch: int
    """Completed epochs."""
    history: List[Dict[str, Any]]
    fingerprint: Dict[str, str]
    batch: int = 0
    """Batches of the next epoch already trained (a mid-epoch checkpoint), else 0."""
    seed: Optional[int] = None
    """The shuffle seed of that epoch, for a mid-epoch resume to keep its order."""
    finished: bool = False
    """The run ended before its last epoch and is complete (early stopping)."""
    state: Any = None
    """The framework's own content (weights, optimizer state, ...)."""


Own = TypeVar("Own")
"""The framework's checked values of a fit (its optimizer, losses, metrics, ...)."""


@dataclass
class Fit(Generic[Own]):
    """One fit after the driver's checks: what every framework has, and the framework's own values."""

    model: Any
    """The driver's working copy of the model (the user's object is never changed)."""
    own: Own
    """The framework's checked values (optimizer, losses, metrics, ...), from ``_check_model``."""
    feature_cols: List[str]
    label_cols: List[str]
    sample_weight_col: Optional[str]
    num_proc: int
    store: Store
    run_id: str
    task: str
    dtype: str
    """numpy name of the floating dtype the model takes ('float32' or 'float64')."""
    sizes: Optional[List[int]] = None
    """Values per row of each feature column that the model was last tried with."""
    shapes: Optional[List[Tuple[int, ...]]] = None
    """Per-row shape of each feature as the model receives it, once known."""
    output_shapes: Optional[List[Tuple[int, ...]]] = None
    """Per-row shape of the model's output for each label, from the last dry run."""
    fingerprint: Dict[str, str] = field(default_factory=dict)
    stacked_from: Optional[List[str]] = None
    """The ``feature_cols`` stacked into the one input column the model trains on, or None."""


def _sizes(batch: Mapping[str, Any], cols: Sequence[str]) -> List[int]:
    return [max(1, int(np.prod(np.asarray(batch[col]).shape[1:]))) for col in cols]


class DistributedEstimator(Estimator, MLReadable, MLWritable, Generic[Own]):
    """Base of the estimators: a Spark ML Estimator whose ``fit`` trains on barrier tasks.

    Subclasses mix in their Params (``params_mixin``) and implement the hooks below; the class
    attributes name what differs without code.
    """

    framework: ClassVar[str] = ""
    """Prefix of generated run ids, e.g. 'torch'."""
    worker_modules: ClassVar[Tuple[str, ...]] = ()
    """Modules Spark's Python workers need besides spark_hvd's own (e.g. ('torch',))."""
    rank_environment: ClassVar[Optional[Dict[str, str]]] = None
    """Variables every rank process starts with."""
    rank_preload: ClassVar[Tuple[str, ...]] = ()
    """Modules imported once per executor Python worker in a warm process that ranks are forked
    from (``preload`` of :func:`spark_hvd.spark.run`), besides :data:`RANK_DATA_MODULES`: the
    framework and its rank-side code; empty: each rank starts a fresh interpreter."""
    model_word: ClassVar[str] = "model"
    """What the user calls the model in messages ('module' for a LightningModule)."""
    fitted_class: ClassVar[type]
    """The FittedModel class fit returns."""
    label_rules_from_task: ClassVar[bool] = False
    """Check labels by the declared ``task`` where no loss names a rule (a LightningModule's loss is
    inside its training_step)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    # ---- hooks ----------------------------------------------------------------------------------
    def _check_model(self) -> Own:
        """The framework's model-level values (model, optimizer, ...), or a ValueError; no column
        is known yet."""
        raise NotImplementedError

    def _check_training(self, own: Own, feature_cols: List[str], label_cols: List[str]) -> None:
        """Checks that need the columns (losses per label, inputs per feature); may complete ``own``."""

    def _model_dtype(self, own: Own) -> str:
        """numpy name of the floating dtype the model takes."""
        return "float32"

    def _infer_task(self, own: Own, label_cols: List[str]) -> str:
        """The concrete prediction task (the ``task`` Param, or what the loss implies)."""
        return str(self.getOrDefault("task"))

    def _loss_names(self, fit: Fit[Own]) -> List[Optional[str]]:
        """The name of each label column's loss (class or function), where the framework knows it."""
        return [None] * len(fit.label_cols)

    def _stacked_features(self, df: Any) -> Optional[Tuple[List[str], str]]:
        """(feature columns, dtype) when several numeric columns are to be stacked into one input
        for a model that takes one; None to give the model one input per column."""
        return None

    def _working_copy(self, own: Own) -> Any:
        """The driver's copy of the model that fit trains and returns."""
        raise NotImplementedError

    def _try_model(self, fit: Fit[Own], sizes: List[int]) -> None:
        """Set ``fit.shapes`` for features of ``sizes`` values per row and call the model on rows of
        zeros: its outputs must match the labels and the task."""
        raise NotImplementedError

    def _try_batch(self, fit: Fit[Own], batch: Dict[str, Any], sizes: List[int]) -> None:
        """Like :meth:`_try_model`, with a batch of rows (features of ``sizes`` values per row, and
        labels) through the model and the loss."""
        raise NotImplementedError

    def _run_fingerprint(self, df: Any, fit: Fit[Own], columns: List[str]) -> Dict[str, str]:
        """One hash per part of the run: the model architecture, the optimizer, the loss, and the data
        (``df``'s ``columns``; see ``estimator.fingerprint``)."""
        raise NotImplementedError

    def _preload(self) -> Tuple[str, ...]:
        """What the warm process imports for this estimator's ranks: the framework's modules, then
        what every rank imports to read its data and run its call (none without a framework)."""
        return tuple(self.rank_preload) + RANK_DATA_MODULES if self.rank_preload else ()

    def _checkpoint_path(self, store: Store, run_id: str) -> str:
        """Where the checkpoint of run ``run_id`` is kept in ``store``."""
        return store.get_checkpoint_path(run_id)

    def _load_checkpoint(self, run_id: str, store: Optional[Store] = None) -> Optional[Checkpoint]:
        """The checkpoint of run ``run_id`` in ``store`` (default the ``store`` Param), or None when
        it has none; raises for a checkpoint of another format (Horovod's estimators call this
        step by the same name)."""
        store = store if store is not None else (self.getOrDefault("store") or local_default_store())
        path = self._checkpoint_path(store, run_id)
        if not store.exists(path):
            return None
        return self._read_checkpoint(store.read(path))

    def _read_checkpoint(self, data: bytes) -> Checkpoint:
        """The checkpoint in ``data``; a ValueError for one of another format."""
        raise NotImplementedError

    def _restore(self, fit: Fit[Own], checkpoint: Checkpoint) -> None:
        """Load the checkpoint's weights into ``fit.model``; raises when they do not fit it."""
        raise NotImplementedError

    def _spec(self, fit: Fit[Own], common: TrainingSpec, resume: Optional[Checkpoint]) -> TrainingSpec:
        """The ranks' spec: the framework's TrainingSpec subclass extending ``common`` (see
        :meth:`TrainingSpec.extending`), resuming ``resume``."""
        raise NotImplementedError

    def _rank_function(self) -> Callable[[Any], Any]:
        """The function ``run()`` calls with the spec on every rank."""
        raise NotImplementedError

    def _load_result(self, fit: Fit[Own], result: Dict[str, Any]) -> None:
        """Load rank 0's result (trained weights) into ``fit.model``."""
        raise NotImplementedError

    def _fitted_params(self, fit: Fit[Own]) -> Dict[str, Any]:
        """Params of the fitted model besides the shared ones (e.g. Keras's custom objects)."""
        return {}

    def _fitted(self, fit: Fit[Own], history: List[Dict[str, Any]]) -> Any:
        """The fitted model (of ``fitted_class``) around ``fit.model``."""
        assert fit.shapes is not None
        return self.fitted_class(
            model=fit.model, feature_cols=fit.stacked_from or fit.feature_cols, label_cols=fit.label_cols,
            input_shapes=[list(s) for s in fit.shapes], run_id=fit.run_id, history=history, task=fit.task,
            prediction_col=self.getOrDefault("prediction_col"), probability_col=self.getOrDefault("probability_col"),
            raw_prediction_col=self.getOrDefault("raw_prediction_col"), **self._fitted_params(fit))

    def _mlflow_params(self, fit: Fit[Own]) -> Tuple[Dict[str, Any], Optional[float]]:
        """The objects to describe among the logged Params (model, optimizer, loss) and the learning rate."""
        return {"model": fit.model}, None

    def _log_model(self, mlflow: Any, fitted: Any) -> None:
        """Log the trained model of ``fitted`` (the FittedModel fit returns) with MLflow."""

    def _rank_env(self) -> Optional[Dict[str, str]]:
        """Variables every rank process starts with (``rank_environment``, plus the framework's own)."""
        return self.rank_environment

    def _removed_fields(self) -> Tuple[str, ...]:
        return tuple(self.getOrDefault("transformation_removed_fields") or ())

    def _warn_unused(self, used: Sequence[str] = ()) -> None:
        """One warning per process for each set Horovod Param that means nothing here (``used``: those
        that this fit uses after all)."""
        for spec in self.param_specs():  # type: ignore[attr-defined]
            if spec.unused and self.isSet(spec.name) and spec.name not in used:
                key = (type(self).__name__, spec.name)
                if key not in _WARNED:
                    _WARNED.add(key)
                    warnings.warn(f"{type(self).__name__}: {spec.name}={self.getOrDefault(spec.name)!r} has no effect "
                                  f"in spark-hvd: {spec.unused}", UserWarning, stacklevel=4)

    def _backend(self) -> Any:
        """The ``backend`` Param, or None; a ValueError when ``num_proc`` is set too."""
        backend = self.getOrDefault("backend")
        if backend is not None and self.isSet("num_proc"):
            raise ValueError(f"backend={backend!r} and num_proc={self.getOrDefault('num_proc')!r} are both set: the "
                             "backend decides the number of processes; fix: set one of them, e.g. "
                             "backend=SparkBackend(num_proc=2)")
        return backend

    # ---- 1. checks ------------------------------------------------------------------------------
    def _check(self, df: Any, stacked: Optional[List[str]] = None) -> Fit[Own]:
        self._warn_unused()
        backend = self._backend()
        own = self._check_model()
        feature_cols = [STACKED_FEATURES] if stacked else self.getOrDefault("feature_cols")
        checks.require("feature_cols", feature_cols, "the list of input columns", "['features']")
        label_cols = self.getOrDefault("label_cols")
        checks.require("label_cols", label_cols, "the list of target columns", "['label']")
        feature_cols, label_cols = list(feature_cols), list(label_cols)
        self._check_training(own, feature_cols, label_cols)
        checks.feature_shapes(self.getOrDefault("input_shapes"), feature_cols, [None] * len(feature_cols))  # counts them
        weight_col = self.getOrDefault("sample_weight_col")
        if weight_col is not None and weight_col in feature_cols + label_cols:
            raise ValueError(f"sample_weight_col={weight_col!r} is also a feature or label column: expected a "
                             "separate column of per-row weights")
        dtype = self._model_dtype(own)
        plan_columns(df, feature_cols, label_cols, weight_col, self.getOrDefault("validation"), dtype)
        task = self._infer_task(own, label_cols)

        session = df.sparkSession
        info = session_info(session)
        store = fit_store(self.getOrDefault("store"), info)
        num_proc = backend.num_processes() if backend is not None else (self.getOrDefault("num_proc")
                                                                         or info.default_parallelism)
        checks.check_slots(session, num_proc)
        checks.ensure_executor_python(session, info, self.worker_modules)
        store.check_writable()
        run_id = self.getOrDefault("run_id") or f"{self.framework}-{uuid.uuid4().hex[:12]}"
        store.get_run_path(run_id)  # checks the name
        return Fit(model=self._working_copy(own), own=own, feature_cols=feature_cols, label_cols=label_cols,
                   sample_weight_col=weight_col, num_proc=num_proc, store=store, run_id=run_id, task=task, dtype=dtype,
                   stacked_from=stacked)

    # ---- 2. dry runs ----------------------------------------------------------------------------
    def _dry_run(self, df: Any, fit: Fit[Own]) -> None:
        """The model and its loss tried once before any data is written: on two rows of zeros when
        the schema tells every feature's and label's size (no Spark job; the labels' values are
        checked later from the ranges the write observes), else on one batch of real rows (one
        small job), whose labels are also checked against their losses. Where the schema tells
        only the features' sizes, ``forward`` alone meets rows of zeros first, before any job."""
        schema_sizes = checks.schema_row_sizes(df.schema, fit.feature_cols)
        if all(size is not None for size in schema_sizes):
            sizes = [int(s) for s in schema_sizes]  # type: ignore[arg-type]
            zeros = self._zero_batch(df, fit, sizes)
            self._try(fit, sizes, zeros)
            if zeros is not None:
                return  # model and loss ran on these sizes; real rows would add a job and nothing more
        batch = _probe_batch(df, self._columns(fit), min(self.getOrDefault("batch_size"), PROBE_ROWS), fit.dtype)
        batch = adapt_batch(batch, self.getOrDefault("transformation_fn"), self._removed_fields(), fit.label_cols,
                            self.getOrDefault("label_shapes"))
        if not batch or len(next(iter(batch.values()))) == 0:
            return  # no complete row: the materialization names the nulls, or the empty frame
        sizes = _sizes(batch, fit.feature_cols)
        self._probe_labels(df, fit, batch, sizes)
        self._try(fit, sizes, batch)

    def _columns(self, fit: Fit[Own]) -> List[str]:
        """The columns training reads: features, labels and the sample weight."""
        return fit.feature_cols + fit.label_cols + ([fit.sample_weight_col] if fit.sample_weight_col else [])

    def _probe_labels(self, df: Any, fit: Fit[Own], batch: Dict[str, Any], sizes: List[int]) -> None:
        """Labels of the probe batch that their loss cannot take are named with their counts over
        ``df`` (one Spark job, only then), before the loss meets them and fails less clearly."""
        rules = self._label_rules(df, fit)
        if any(rule.kind == "classes" for rule in rules) and fit.output_shapes is None:
            self._try(fit, sizes)  # the model's outputs say how many classes there are
            rules = self._label_rules(df, fit)
        if probe_breaks(batch, rules):
            check_labels(df, rules, {}, self._columns(fit), fit.dtype, self.getOrDefault("invalid_rows") == "skip")

    def _try(self, fit: Fit[Own], sizes: List[int], batch: Optional[Dict[str, Any]] = None) -> None:
        if batch is None:
            self._try_model(fit, sizes)
        else:
            self._try_batch(fit, batch, sizes)
        fit.sizes = sizes

    def _zero_batch(self, df: Any, fit: Fit[Own], sizes: List[int]) -> Optional[Dict[str, Any]]:
        """Two rows of zeros of every feature and label, when the schema tells the labels' sizes and
        no ``transformation_fn`` or ``label_shapes`` reshapes the batch; else None."""
        if self.getOrDefault("transformation_fn") is not None or self.getOrDefault("label_shapes") is not None:
            return None
        label_sizes = checks.schema_row_sizes(df.schema, fit.label_cols)
        if any(size is None for size in label_sizes):
            return None
        fields = {f.name: f.dataType for f in df.schema.fields}
        batch: Dict[str, Any] = {col: np.zeros((2, size), dtype=fit.dtype) for col, size in zip(fit.feature_cols, sizes)}
        for col, size in zip(fit.label_cols, label_sizes):
            stored = inspect_column(col, fields[col], fit.dtype)
            batch[col] = np.zeros((2,) if stored.kind == "scalar" else (2, int(size)), dtype=stored.dtype)  # type: ignore[arg-type]
        if fit.sample_weight_col is not None:
            batch[fit.sample_weight_col] = np.ones(2, dtype=fit.dtype)
        return batch

    def _label_rules(self, df: Any, fit: Fit[Own]) -> List[LabelRule]:
        """What each label column must hold for its loss (or, see ``label_rules_from_task``, its task);
        none when ``transformation_fn`` may change the labels before the loss sees them."""
        if self.getOrDefault("transformation_fn") is not None:
            return []
        fields = {f.name: f.dataType for f in df.schema.fields}
        names = self._loss_names(fit)
        rules = []
        for i, col in enumerate(fit.label_cols):
            scalar = inspect_column(col, fields[col], fit.dtype).kind == "scalar"
            shape = fit.output_shapes[i] if fit.output_shapes and i < len(fit.output_shapes) else None
            rule = rule_for_loss(col, names[i], shape, scalar) if names[i] else None
            if rule is None and self.label_rules_from_task and len(fit.label_cols) == 1:
                rule = rule_for_task(col, fit.task, shape, scalar)
            if rule is not None:
                rules.append(rule)
        return rules

    # ---- 3. fingerprint and resume --------------------------------------------------------------
    def _fingerprint(self, df: Any, fit: Fit[Own]) -> Dict[str, str]:
        return self._run_fingerprint(df, fit, fit.feature_cols + fit.label_cols + [fit.sample_weight_col or ""])

    def _resume_state(self, fit: Fit[Own]) -> Optional[Checkpoint]:
        """The run's checkpoint to continue from, its weights loaded into ``fit.model``; None for a
        new run (or one started over with ``overwrite_run``)."""
        store, path = fit.store, self._checkpoint_path(fit.store, fit.run_id)  # path: for the error below
        checkpoint: Optional[Checkpoint]
        try:
            checkpoint = self._load_checkpoint(fit.run_id, store)
        except Exception as exc:
            checkpoint, changed = None, [f"checkpoint format ({exc})"]
        else:
            if checkpoint is None:
                return None
            changed = changed_parts(checkpoint.fingerprint, fit.fingerprint)
        if changed:
            start_over_or_refuse(store, fit.run_id, changed, self.getOrDefault("overwrite_run"),
                                 checkpoint.epoch if checkpoint else None)
            return None
        assert checkpoint is not None
        try:
            self._restore(fit, checkpoint)
        except Exception as exc:
            raise ValueError(
                f"run_id={fit.run_id!r} has a checkpoint at {path} that does not fit this {self.model_word} ({exc}); "
                "fix: use a new run_id, or pass overwrite_run=True to start this run over") from None
        return checkpoint

    def _latest(self, fit: Fit[Own]) -> Optional[Checkpoint]:
        """The run's checkpoint when it is this fit's (same fingerprint), for a retry to resume from."""
        try:
            checkpoint = self._load_checkpoint(fit.run_id, fit.store)
        except Exception:  # not readable: resume from where this fit began
            return None
        return None if checkpoint is None or changed_parts(checkpoint.fingerprint, fit.fingerprint) else checkpoint

    # ---- 5. the spec ------------------------------------------------------------------------------
    def _step_multiple(self) -> int:
        """Training steps per epoch are rounded up to a multiple of this (1: as computed)."""
        return 1

    def _common_spec(self, fit: Fit[Own], prepared: PreparedData, resume: Optional[Checkpoint],
                     seed: Optional[int]) -> TrainingSpec:
        """The settings every framework's ranks share; each from a Param keeps the Param's name."""
        assert fit.shapes is not None, "the features' shapes are known once the data is prepared"
        batch_size = self.getOrDefault("batch_size")
        val_batch_size = self.getOrDefault("val_batch_size") or batch_size
        train_steps = self.getOrDefault("train_steps_per_epoch") or steps_for(prepared.train_rows, fit.num_proc,
                                                                              batch_size)
        multiple = self._step_multiple()
        train_steps = -(-train_steps // multiple) * multiple
        val_steps = 0
        if prepared.val_path is not None:
            val_steps = self.getOrDefault("validation_steps_per_epoch") or steps_for(prepared.val_rows, fit.num_proc,
                                                                                     val_batch_size)
        if resume is not None and resume.batch > 0 and resume.seed is not None:
            seed = resume.seed  # the rest of a resumed epoch keeps its shuffle order
        label_shapes = self.getOrDefault("label_shapes")
        store = fit.store
        return TrainingSpec(
            feature_cols=fit.feature_cols, label_cols=fit.label_cols, sample_weight_col=fit.sample_weight_col,
            feature_shapes=fit.shapes, column_shapes=dict(prepared.shapes), train_url=store.url(prepared.train_path),
            val_url=store.url(prepared.val_path) if prepared.val_path else None,
            storage_options=store.storage_options, reader=self.getOrDefault("reader"), batch_size=batch_size,
            val_batch_size=val_batch_size, epochs=self.getOrDefault("epochs"),
            start_epoch=resume.epoch if resume else 0, train_steps=train_steps, val_steps=val_steps,
            shuffle=self.getOrDefault("shuffle"),
            seed=seed if seed is not None else int(np.random.SeedSequence().entropy % (2 ** 31)),
            random_seed=self.getOrDefault("random_seed"), store=store,
            checkpoint_path=self._checkpoint_path(fit.store, fit.run_id),
            run_path=store.get_run_path(fit.run_id),
            history=list(resume.history) if resume else [], compression=self.getOrDefault("gradient_compression"),
            use_gpu=self.getOrDefault("use_gpu"), flush_denormal=self.getOrDefault("flush_denormal"),
            transformation_fn=self.getOrDefault("transformation_fn"),
            progress=self.getOrDefault("verbose") > 0, fingerprint=dict(fit.fingerprint),
            shuffle_buffer_size=self.getOrDefault("shuffle_buffer_size"),
            label_shapes=[tuple(s) for s in label_shapes] if label_shapes is not None else None,
            removed_fields=self._removed_fields(), inmemory_cache_all=self.getOrDefault("inmemory_cache_all"),
            sharding=self.getOrDefault("sharding"))

    # ---- the whole fit ------------------------------------------------------------------------------
    def _fit(self, dataset: Any) -> Any:
        timings: Dict[str, float] = {}
        started = time.monotonic()
        stacking = self._stacked_features(dataset)
        if stacking is not None:
            dataset = dataset.withColumn(STACKED_FEATURES, stacked_column(*stacking))
        fit = self._check(dataset, stacking[0] if stacking is not None else None)
        self._dry_run(dataset, fit)
        # A run with a checkpoint is checked against it before anything is written; a new run takes
        # its fingerprint after the write, whose pass hashes rows held in memory (no job of its own).
        resume: Optional[Checkpoint] = None
        known = fit.store.exists(self._checkpoint_path(fit.store, fit.run_id))
        if known:
            fit.fingerprint = self._fingerprint(dataset, fit)
            resume = self._resume_state(fit)
        timings["validation"] = time.monotonic() - started

        mark = time.monotonic()
        seed = self.getOrDefault("random_seed")
        with prepare_lock:
            prepared = prepare_data(
                dataset, fit.store, fit.feature_cols, fit.label_cols, fit.sample_weight_col,
                self.getOrDefault("validation"), fit.num_proc, seed=seed if seed is not None else 0,
                vector_dtype=fit.dtype, skip_invalid=self.getOrDefault("invalid_rows") == "skip",
                files_per_proc=self.getOrDefault("partitions_per_process"))
        if not known:
            fit.fingerprint = self._fingerprint(dataset, fit)
        sizes = [max(1, int(np.prod(prepared.column(col).shape))) for col in fit.feature_cols]
        if sizes != fit.sizes or fit.shapes is None:
            self._try(fit, sizes)  # the stored data's sizes, which the ranks will read
        check_labels(dataset, self._label_rules(dataset, fit), prepared.label_ranges, self._columns(fit), fit.dtype,
                     self.getOrDefault("invalid_rows") == "skip")
        timings["materialization"] = time.monotonic() - mark
        summary = {"train_rows": prepared.train_rows, "val_rows": prepared.val_rows,
                   "skipped_rows": prepared.skipped_rows}
        if prepared.skipped_rows:
            text = (f"invalid_rows='skip' left out {prepared.skipped_rows} rows with a null, NaN or infinite value; "
                    f"training on {prepared.train_rows} rows" + (f" and validating on {prepared.val_rows}"
                                                                 if prepared.val_path else ""))
            log.warning(text)
            if self.getOrDefault("verbose"):
                print(f"spark-hvd: {text}")

        epochs = self.getOrDefault("epochs")
        start_epoch = resume.epoch if resume else 0
        verbose = self.getOrDefault("verbose")
        if resume is not None and resume.finished:
            text = (f"run_id={fit.run_id!r} stopped early after epoch {start_epoch} (early_stopping); returning its "
                    "model without training (use a new run_id to train again)")
            log.warning(text)
            if verbose:
                print(text)
            model = self._fitted(fit, list(resume.history))
            model.fit_timings, model.fit_summary = timings, summary
            return self._finish(model, fit)
        if start_epoch >= epochs:
            log.warning("run_id=%r has already trained %d of epochs=%d with this %s, optimizer, loss and data; "
                        "returning its model without training (raise epochs to continue it, or use a new run_id)",
                        fit.run_id, start_epoch, epochs, self.model_word)
            if verbose:
                print(f"run {fit.run_id!r} has already trained {start_epoch} of epochs={epochs} with this "
                      f"{self.model_word}, optimizer, loss and data: returning its model without training (raise "
                      "epochs to continue, or use a new run_id)")
            model = self._fitted(fit, list(resume.history) if resume else [])
            model.fit_timings, model.fit_summary = timings, summary
            return self._finish(model, fit)

        current = [self._spec(fit, self._common_spec(fit, prepared, resume, seed), resume)]
        backend = self._backend()
        out, err = getattr(backend, "stdout", None), getattr(backend, "stderr", None)
        stamped = bool(getattr(backend, "prefix_output_with_timestamp", False))
        if stamped:  # the time goes on the lines printed, after the progress events are read
            out, err = TimestampedLines(out or sys.stdout), TimestampedLines(err or sys.stderr)
        printer = ProgressPrinter(verbose, out=out, err=err)
        mark_wall = time.time()
        session = dataset.sparkSession

        def launch(attempt: int) -> List[Any]:
            options = dict(env=self._rank_env(), stdout=printer.stdout, stderr=printer.stderr, verbose=1,
                           use_gpu=self.getOrDefault("use_gpu"), store=fit.store, spark=session)
            if backend is not None:
                # Horovod's Backend protocol: run(fn, args, env); the rest travels beside the call.
                env = dict(options.pop("env") or {})
                with run_options(prefix_output_with_timestamp=False, preload=self._preload(), **options):
                    return backend.run(self._rank_function(), args=(current[0],), env=env)
            return run(self._rank_function(), args=(current[0],), num_proc=fit.num_proc,  # type: ignore[arg-type]
                       preload=self._preload(), **options)

        def resume_point() -> str:
            """Set the next attempt to start from the run's last checkpoint (this fit's own)."""
            latest = self._latest(fit)
            if latest is None:
                return _describe_resume(resume, current[0].train_steps) if resume else "the start"
            self._restore(fit, latest)
            current[0] = self._spec(fit, self._common_spec(fit, prepared, latest, seed), latest)
            return _describe_resume(latest, current[0].train_steps)

        try:
            results = run_with_retries(launch, session=session, num_proc=fit.num_proc,
                                       max_retries=self.getOrDefault("max_retries"),
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
        self._load_result(fit, result)
        model = self._fitted(fit, list(result["history"]))
        timings["collection"] = max(0.0, time.time() - last_epoch)
        model.fit_timings, model.fit_summary = timings, summary
        if self.getOrDefault("cleanup_intermediate"):
            fit.store.remove_intermediate([prepared.key])
        if not fit.store.save_runs:
            fit.store.delete(fit.store.get_run_path(fit.run_id))  # the store keeps no runs (Horovod's save_runs)
        return self._finish(model, fit)

    # ---- 6. MLflow ------------------------------------------------------------------------------
    def _finish(self, model: Any, fit: Fit[Own]) -> Any:
        """Log the fit to MLflow when asked or when a run is active (see ``log_to_mlflow``)."""
        logger = start_logging(self.getOrDefault("log_to_mlflow"))
        if logger is None:
            return model
        try:
            json_params = {s.name: self.getOrDefault(s.name) for s in self.param_specs() if s.json}  # type: ignore[attr-defined]
            objects, lr = self._mlflow_params(fit)
            logger.log_params({**params_for_logging(json_params, objects), "num_proc": fit.num_proc,
                               "run_id": fit.run_id, "task": fit.task, "lr": lr})
            logger.log_history(model.getHistory() or [])
            logger.log_timings(model.fit_timings)
            logger.log_summary(model.fit_summary)
            logger.log_model(lambda mlflow: self._log_model(mlflow, model))
            model.mlflow_run_id = logger.run_id
        finally:
            logger.close()
        return model

    def fit_on_parquet(self, params: Optional[Dict[Any, Any]] = None, dataset_idx: Optional[str] = None) -> Any:
        """Horovod's ``fit_on_parquet``: train on Parquet already in the store, at
        ``store.get_train_data_path(dataset_idx)``, validating on ``store.get_val_data_path(dataset_idx)``
        when that holds data too; ``params`` overrides this estimator's Params for the fit.

        The files are read with the active Spark session and fitted as ``fit`` fits a DataFrame
        (checks, materialization, training); a ``validation`` Param is replaced by the held-out
        files, or, without them, applies to the training files.
        """
        from pyspark.sql import SparkSession
        from pyspark.sql import functions as F

        estimator = self.copy(params) if params else self
        store = estimator.getOrDefault("store")
        if store is None:
            raise ValueError("fit_on_parquet needs store=: expected the Store whose get_train_data_path() holds the "
                             "training Parquet; fix: pass store=Store.create('/path') (the same as where it was written)")
        train_path = store.get_train_data_path(dataset_idx)
        if not store.exists(train_path):
            raise ValueError(f"fit_on_parquet found no training data at {train_path} (dataset_idx={dataset_idx!r}): "
                             "expected Parquet written there, e.g. df.write.parquet(store.get_train_data_path()); fix: "
                             "write it first, or call fit(df)")
        spark = SparkSession.getActiveSession()
        if spark is None:
            raise ValueError("fit_on_parquet needs an active SparkSession to read the store's Parquet: fix: create "
                             "one first (spark_hvd.spark.local_session() or SparkSession.builder.getOrCreate())")
        train = spark.read.parquet(store.spark_url(train_path))
        val_path = store.get_val_data_path(dataset_idx)
        if not store.exists(val_path):
            return estimator.fit(train)
        marker = "__spark_hvd_from_val_path"
        both = train.withColumn(marker, F.lit(0)).unionByName(
            spark.read.parquet(store.spark_url(val_path)).withColumn(marker, F.lit(1)))
        return estimator.copy({estimator.getParam("validation"): marker}).fit(both)

    def fitMultiple(self, dataset: Any, paramMaps: Sequence[Any]) -> Any:
        """Spark ML's ``fitMultiple``: one model per Param map, as ``(index, model)`` pairs from a
        thread-safe iterator. Inside an active MLflow run each fit is logged as a child run of it,
        whichever thread takes the next model."""
        models = super().fitMultiple(dataset, paramMaps)
        parent = active_run_id()
        return models if parent is None else _UnderRun(models, parent)

    # ---- persistence ----------------------------------------------------------------------------
    def write(self) -> ParamsWriter:
        """A writer saving this estimator and its Params (``.save(path)``)."""
        return ParamsWriter(self)

    @classmethod
    def read(cls) -> ParamsReader[Any]:
        """A reader loading a saved estimator of this class (``<Class>.load(path)``)."""
        return ParamsReader(cls)


_PROBES: "OrderedDict[Tuple[Any, ...], Dict[str, Any]]" = OrderedDict()
_PROBES_KEPT = 8
_probes_lock = threading.Lock()


def _probe_batch(df: Any, columns: List[str], rows: int, dtype: str) -> Dict[str, Any]:
    """Up to ``rows`` real rows of ``columns`` (one small Spark job), remembered by the data's identity
    (``data_identity``: the same plan, files and in-memory rows), so the repeat fits of tuning and of a
    notebook skip the job."""
    identity = data_identity(df, columns)
    memo = (identity, tuple(columns), rows, dtype) if identity is not None else None
    with _probes_lock:
        found = _PROBES.get(memo) if memo is not None else None
        if found is not None:
            _PROBES.move_to_end(memo)
    if found is None:
        found = sample_batch(df, columns, rows, dtype)
        if memo is not None:
            with _probes_lock:
                _PROBES[memo] = found
                while len(_PROBES) > _PROBES_KEPT:
                    _PROBES.popitem(last=False)
    return {name: np.array(values, copy=True) for name, values in found.items()}


class _UnderRun:
    """A ``fitMultiple`` iterator whose fits log as child runs of MLflow run ``parent``."""

    def __init__(self, models: Any, parent: str) -> None:
        self.models, self.parent = models, parent

    def __iter__(self) -> "_UnderRun":
        return self

    def __next__(self) -> Any:
        return under_tuning_run(self.parent, lambda: next(self.models))


def _describe_resume(checkpoint: Optional[Checkpoint], train_steps: int) -> str:
    if checkpoint is None:
        return "the start"
    if checkpoint.batch:
        return f"epoch {checkpoint.epoch + 1}, step {checkpoint.batch} of {train_steps}"
    if checkpoint.epoch:
        return f"the end of epoch {checkpoint.epoch}"
    return "the start"
