"""What every framework's ranks get and share: the common part of the training spec, the readers
of a rank's shard, and the CPU threads a rank may use.

The estimator builds one spec per fit on the driver (:class:`TrainingSpec` extended by the
framework with its model, optimizer and loss) and ``run()`` hands it to every rank; a rank opens
its readers from it with :meth:`TrainingSpec.open_reader`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ["TrainingSpec", "rank_threads"]


@dataclass(kw_only=True)
class TrainingSpec:
    """The training settings every framework's ranks share; built by the estimator on the driver."""

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
    model_seed: Optional[int]
    """The ``random_seed`` Param: seeds the framework's generators (initialization, dropout) on every
    rank; None leaves them unseeded."""
    store: Any
    checkpoint_path: str
    history: List[Dict[str, Any]] = field(default_factory=list)
    """Per-epoch logs of the epochs done before this stage."""
    compression: Any = None
    use_gpu: bool = True
    transformation_fn: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None
    callbacks: List[Any] = field(default_factory=list)
    progress: bool = True
    """Whether rank 0 reports steps while an epoch runs (epochs are always reported)."""
    progress_interval_s: float = 0.25
    fingerprint: Dict[str, str] = field(default_factory=dict)
    """What the run trains (see ``estimator.fingerprint``), recorded in every checkpoint."""
    shuffle_buffer_rows: Optional[int] = None
    """Rows each rank holds to shuffle within; None: the reader's default."""

    def open_reader(self, rank: int, size: int, validation: bool = False) -> Any:
        """This rank's reader of the training split (or, with ``validation``, of the held-out rows,
        never shuffled)."""
        from spark_hvd.spark.data.reader import make_reader

        url = self.val_url if validation else self.train_url
        if url is None:
            raise ValueError("the fit has no validation rows: expected validation to be set")
        extra: Dict[str, Any] = {}
        if self.shuffle_buffer_rows is not None:
            extra["shuffle_buffer_rows"] = self.shuffle_buffer_rows
        return make_reader(self.reader, url, rank=rank, size=size,
                           batch_size=self.val_batch_size if validation else self.batch_size,
                           feature_cols=self.feature_cols, label_cols=self.label_cols,
                           sample_weight_col=self.sample_weight_col, shuffle=self.shuffle and not validation,
                           seed=self.seed, steps_per_epoch=self.val_steps if validation else self.train_steps,
                           shapes=self.column_shapes, storage_options=self.storage_options, **extra)


def rank_threads(local_size: int) -> int:
    """Threads for a rank's math library: the CPUs this process may run on, shared by the ranks of
    its host (oversubscribed threads slow every rank down)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, local_size))
