"""What every framework's ranks get and share: the common part of the training spec, the readers
of a rank's shard, and the CPU threads a rank may use.

The estimator builds one spec per fit on the driver (:class:`TrainingSpec` extended by the
framework with its model, optimizer and loss) and ``run()`` hands it to every rank; a rank opens
its readers from it with :meth:`TrainingSpec.open_reader`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, TypeVar, Union

__all__ = ["TrainingSpec", "RunFiles", "adapt_batch", "close_readers", "rank_threads", "set_up_torch_cpu", "run_trainer", "record_epoch"]


_Spec = TypeVar("_Spec", bound="TrainingSpec")


@dataclass(kw_only=True)
class TrainingSpec:
    """The training settings every framework's ranks share; built by the estimator on the driver.
    A setting that comes from a Param has the Param's name."""

    feature_cols: List[str]
    label_cols: List[str]
    sample_weight_col: Optional[str]
    feature_shapes: List[Tuple[int, ...]]
    """Per-row shape of each feature column as the model receives it."""
    column_shapes: Dict[str, Tuple[int, ...]]
    """Per-row shape of every column as stored (for the reader)."""
    train_url: str
    val_url: Optional[str]
    storage_options: Dict[str, Any]
    reader: str
    """'builtin' or 'petastorm' (see ``make_reader``)."""
    batch_size: int
    val_batch_size: int
    epochs: int
    """Total epochs of the run (a resumed run counts the ones done before)."""
    start_epoch: int
    """Completed epochs: the first epoch this stage trains."""
    train_steps: int
    val_steps: int
    shuffle: bool
    seed: int
    """Seed of the readers' shuffle order (the same on every rank)."""
    random_seed: Optional[int]
    """Seeds the framework's generators (initialization, dropout) on every rank; None leaves them
    unseeded."""
    store: Any
    checkpoint_path: str
    run_path: str = ""
    """The run's directory of the store: where files of callbacks with relative paths go."""
    history: List[Dict[str, Any]] = field(default_factory=list)
    """Per-epoch logs of the epochs done before this stage."""
    compression: Any = None
    use_gpu: bool = True
    flush_denormal: bool = True
    """Whether the rank's PyTorch CPU math flushes subnormal floats to zero (see :func:`set_up_torch_cpu`)."""
    transformation_fn: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None
    callbacks: List[Any] = field(default_factory=list)
    progress: bool = True
    """Whether rank 0 reports steps while an epoch runs (epochs are always reported)."""
    progress_interval_s: float = 0.25
    fingerprint: Dict[str, str] = field(default_factory=dict)
    """What the run trains (see ``estimator.fingerprint``), recorded in every checkpoint."""
    shuffle_buffer_size: Optional[int] = None
    """Rows each rank holds to shuffle within; None: the reader's default."""
    label_shapes: Optional[List[Tuple[int, ...]]] = None
    """Per-row shape each label column is given to the loss in (``label_shapes``); None: as stored."""
    removed_fields: Tuple[str, ...] = ()
    """Columns dropped from every batch after ``transformation_fn``."""
    inmemory_cache_all: Union[bool, str] = "auto"
    """Keep the rows a rank reads in memory after the first epoch: True, False or 'auto'."""
    sharding: str = "reshuffle"
    """How row groups reach the ranks when shuffling: 'reshuffle' deals them anew every epoch,
    'fixed' keeps row group i on rank i % size."""

    @classmethod
    def extending(cls: Type[_Spec], common: TrainingSpec, **own: Any) -> _Spec:
        """A framework's spec (a subclass) made of ``common``'s shared settings and the framework's
        ``own`` fields, which win where both name one (``callbacks``)."""
        shared = {f.name: getattr(common, f.name) for f in fields(TrainingSpec)}
        return cls(**{**shared, **own})

    def adapt_batch(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        """A reader batch as the model's code receives it (see :func:`adapt_batch`)."""
        return adapt_batch(batch, self.transformation_fn, self.removed_fields, self.label_cols, self.label_shapes)

    def open_readers(self, rank: int, size: int, reporter: Any = None) -> Tuple[Any, Any]:
        """This rank's training reader and validation reader (None without held-out rows), with the
        progress ``reporter``, when given, told what the run will read. The training reader starts
        reading the first epoch at once, so its first batches are ready by the time the loop asks
        for them (while the model is set up and broadcast)."""
        train = self.open_reader(rank, size)
        train.prefetch(self.start_epoch)
        val = self.open_reader(rank, size, validation=True) if self.val_url else None
        if reporter is not None:
            reporter.start(epochs=self.epochs, start_epoch=self.start_epoch, steps=self.train_steps,
                           val_steps=self.val_steps if val else 0, size=size, batch_size=self.batch_size)
        return train, val

    def prefetch_next(self, train_reader: Any, epoch: int) -> None:
        """Start reading epoch ``epoch + 1`` of ``train_reader`` as soon as epoch ``epoch``'s
        training steps are done, so its first batches are ready while this epoch validates,
        averages its metrics and checkpoints (nothing after the run's last epoch)."""
        if epoch + 1 < self.epochs:
            train_reader.prefetch(epoch + 1)

    def open_reader(self, rank: int, size: int, validation: bool = False) -> Any:
        """This rank's reader of the training split (or, with ``validation``, of the held-out rows,
        never shuffled)."""
        from spark_hvd.spark.data.reader import make_reader

        url = self.val_url if validation else self.train_url
        if url is None:
            raise ValueError("the fit has no validation rows: expected validation to be set")
        extra: Dict[str, Any] = {"cache_all": self.inmemory_cache_all, "reshuffle": self.sharding == "reshuffle"}
        if self.shuffle_buffer_size is not None:
            extra["shuffle_buffer_rows"] = self.shuffle_buffer_size
        return make_reader(self.reader, url, rank=rank, size=size,
                           batch_size=self.val_batch_size if validation else self.batch_size,
                           feature_cols=self.feature_cols, label_cols=self.label_cols,
                           sample_weight_col=self.sample_weight_col, shuffle=self.shuffle and not validation,
                           seed=self.seed, steps_per_epoch=self.val_steps if validation else self.train_steps,
                           shapes=self.column_shapes, storage_options=self.storage_options, **extra)


def close_readers(*readers: Any) -> None:
    """Stop the reading threads of ``readers`` (None entries, such as a fit's missing validation
    reader, are skipped)."""
    for reader in readers:
        if reader is not None:
            reader.close()


class RunFiles:
    """Where files of a rank's callbacks go (TensorBoard logs, checkpoints of their own, CSV logs):
    a relative path means a path under the run's directory of the store. A local store's directory
    is written directly; for another store the files are written to a local directory first and
    copied to the run's directory by :meth:`upload`."""

    def __init__(self, store: Any, run_path: str) -> None:
        import tempfile

        from spark_hvd.spark.data.store import LocalStore

        self.store = store
        self.run_path = run_path
        self.direct = isinstance(store, LocalStore)  # its paths are this host's (a shared mount on a cluster)
        self.local = run_path if self.direct else tempfile.mkdtemp(prefix="spark-hvd-run-files-")

    def path(self, path: str) -> str:
        """``path`` where the rank writes it: relative ones under the run's (local) directory."""
        if not path or os.path.isabs(path) or "://" in path:
            return path
        resolved = os.path.join(self.local, path)
        os.makedirs(os.path.dirname(resolved) or self.local, exist_ok=True)
        return resolved

    def upload(self) -> None:
        """Copy what was written locally to the run's directory of a remote store."""
        if self.direct:
            return
        import posixpath

        for folder, _, names in os.walk(self.local):
            for name in names:
                full = os.path.join(folder, name)
                relative = os.path.relpath(full, self.local).replace(os.sep, "/")
                with open(full, "rb") as f:
                    self.store.write(posixpath.join(self.run_path, relative), f.read())


def adapt_batch(batch: Dict[str, Any], transformation_fn: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]],
                removed_fields: Sequence[str], label_cols: Sequence[str],
                label_shapes: Optional[Sequence[Sequence[int]]]) -> Dict[str, Any]:
    """``transformation_fn`` applied to ``batch``, then ``removed_fields`` dropped, then each label
    reshaped to its ``label_shapes`` entry per row (-1 filled from the row's size): the same on
    the driver's dry run and on the ranks."""
    if transformation_fn is not None:
        batch = transformation_fn(batch)
    if removed_fields:
        batch = {k: v for k, v in batch.items() if k not in removed_fields}
    if label_shapes is not None:
        import numpy as np

        from spark_hvd.spark.estimator.checks import resolve_shape

        if len(label_shapes) != len(label_cols):
            raise ValueError(f"label_shapes has {len(label_shapes)} shape(s) for {len(label_cols)} label column(s) "
                             f"{list(label_cols)}: expected one shape per label column, e.g. label_shapes=[[1]]")
        batch = dict(batch)
        for col, shape in zip(label_cols, label_shapes):
            values = np.asarray(batch[col])
            per_row = max(1, values.size // max(1, len(values)))
            batch[col] = values.reshape((len(values),) + resolve_shape(shape, per_row, col))
    return batch


def rank_threads(local_size: int) -> int:
    """Threads for a rank's math library: the CPUs Spark gave the rank's task (``spark.task.cpus``,
    passed as ``SPARK_HVD_TASK_CPUS``) when it runs on Spark, never more than the CPUs this process
    may run on shared by the ranks of its host (oversubscribed threads slow every rank down)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    from spark_hvd.runtime import config

    shared = max(1, cpus // max(1, local_size))
    given = config.read_setting("task_cpus")
    return min(shared, given) if given is not None and given > 0 else shared


def set_up_torch_cpu(spec: TrainingSpec, local_size: int) -> None:
    """A torch or Lightning rank's CPU math, set on its training thread before training: the threads
    of :func:`rank_threads`, and subnormal floats flushed to zero as ``spec.flush_denormal`` says
    (for this thread and the threads it starts later, such as the math library's pool)."""
    import torch

    torch.set_num_threads(rank_threads(local_size))
    torch.set_flush_denormal(spec.flush_denormal)


def run_trainer(hvd: Any, trainer_class: Callable[[Any, Any], Any], spec: Any) -> Any:
    """On a rank: ``init()`` the framework binding ``hvd``, run ``trainer_class(spec, hvd).run()``
    and shut the binding down, also when training fails; what ``run()`` returned."""
    hvd.init()
    try:
        return trainer_class(spec, hvd).run()
    finally:
        hvd.shutdown()


def record_epoch(history: List[Dict[str, Any]], epoch: int, logs: Dict[str, Any], *, rows: int, trained_s: float,
                 seconds: float, profile: Any, hvd: Any, size: int, name: str) -> Dict[str, Any]:
    """An epoch's end, as every framework's trainer records it: ``rows_per_s`` (the ``rows``
    trained over ``trained_s``) and ``seconds`` (the whole epoch, validation included) are added
    to ``logs``; the history entry (``epoch`` from 1, the logs, and every rank's step profile
    when ``profile`` is enabled, gathered under ``name``) is appended to ``history`` and returned.
    Every rank calls it (the profile gathering is a collective)."""
    logs["rows_per_s"] = rows / trained_s if trained_s > 0 else math.inf
    logs["seconds"] = seconds
    entry = {"epoch": epoch + 1, **logs}
    if profile.enabled:
        entry["profile"] = profile.gathered(hvd, size, name)
    history.append(entry)
    return entry
