"""What LightningEstimator runs on every rank: a ``pytorch_lightning.Trainer`` on SparkHvdStrategy.

:func:`fit_on_rank` is the function ``run()`` calls on each barrier task. The rank reads its
shard of the prepared Parquet with the same readers as the torch estimator and hands the
LightningModule one dict per batch, keyed by column name (Horovod's convention). Every rank runs
the same number of steps per epoch, so the strategy's gradient averages always match. At the end
of each epoch :class:`_EpochEnd` averages what the module logged over the ranks into the history,
reports progress, and has rank 0 write a Lightning checkpoint (with the history and the run's
fingerprint) to the store; a resumed fit starts Lightning from that checkpoint.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from pytorch_lightning.callbacks import Callback, Checkpoint, ModelCheckpoint

from spark_hvd.spark.torch.batches import feature_tensors, model_dtype, weight_tensor
from spark_hvd.spark.estimator.progress import ProgressReporter
from spark_hvd.spark.estimator.step_profile import LIGHTNING_PHASES, step_profile
from spark_hvd.spark.estimator.training import RunFiles, TrainingSpec, close_readers, record_epoch, set_up_torch_cpu

__all__ = ["LightningTrainingSpec", "fit_on_rank", "CHECKPOINT_KEY", "history_entry", "set_learning_rate"]

CHECKPOINT_KEY = "spark_hvd"
"""Key of the estimator's own record (format, completed epochs, history, fingerprint) in a Lightning checkpoint."""

CHECKPOINT_FORMAT = 1
"""Version of that record; a checkpoint of another version is not resumed."""

_QUIET_WARNINGS = (
    r".*does not have many workers.*",  # the reader prefetches on its own thread
    r".*IterableDataset.*__len__.*",  # our datasets know their exact length
    r".*`self.log\(.*sync_dist=True.*",  # metrics are averaged over the ranks at epoch end
    r".*LeafSpec.*is deprecated.*",  # Lightning's own use of torch's pytree, not the user's
)


@dataclass(kw_only=True)
class LightningTrainingSpec(TrainingSpec):
    """Everything one fit's ranks need: the shared settings, and the LightningModule and Trainer's."""

    model: torch.nn.Module
    resume: bool = False
    """Whether ``checkpoint_path`` holds the checkpoint to continue from."""
    trainer_args: Dict[str, Any] = field(default_factory=dict)
    learning_rate: Optional[float] = None
    """The ``learning_rate`` Param: set on every optimizer configure_optimizers returns, or None."""
    checkpoint_every_steps: Optional[int] = None
    """Also checkpoint every this many optimizer steps within an epoch."""


def module_batch(batch: Dict[str, np.ndarray], feature_cols: List[str], label_cols: List[str],
                 sample_weight_col: Optional[str], shapes: List[Tuple[int, ...]], dtype: torch.dtype,
                 adapt: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None) -> Dict[str, torch.Tensor]:
    """A reader batch as the LightningModule receives it: ``{column: tensor}`` with the features
    shaped ``(rows, *shape)`` in the module's dtype, the labels in their stored dtype and the
    sample weights (if any) in the module's dtype, after ``adapt`` (the spec's ``adapt_batch``). The
    driver's dry run uses it too."""
    if adapt is not None:
        batch = adapt(batch)
    cpu = torch.device("cpu")
    out: Dict[str, torch.Tensor] = dict(zip(feature_cols, feature_tensors(batch, feature_cols, shapes, dtype, cpu)))
    for col in label_cols:
        if col not in out:
            values = np.asarray(batch[col])
            out[col] = torch.from_numpy(np.array(values, order="C") if not values.flags.writeable else values)
    if sample_weight_col is not None:
        weights = weight_tensor(batch, sample_weight_col, dtype, cpu)
        assert weights is not None, "a weight column gives weights"
        out[sample_weight_col] = weights
    return out


class _ShardBatches(torch.utils.data.IterableDataset):
    """One epoch of this rank's batches per iteration, exactly ``steps_per_epoch`` of them (after
    a mid-epoch resume, the epoch's batches after those trained before)."""

    def __init__(self, reader: Any, convert: Callable[[Dict[str, np.ndarray]], Dict[str, torch.Tensor]],
                 first_epoch: int, prefetch_next: Optional[Callable[[Any, int], None]] = None) -> None:
        self.reader = reader
        self.convert = convert
        self.epoch = first_epoch
        self.prefetch_next = prefetch_next
        """Called with the reader and the epoch once the epoch's last batch is converted, before it
        is handed over (the training loader's: the next epoch is read while this one validates)."""
        self.skip = 0
        """Batches of the next epoch to pass over: trained before the checkpoint resumed from."""

    def __len__(self) -> int:
        return int(self.reader.steps_per_epoch)

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        # One pass per epoch: the epoch number seeds the shuffle, the same on every rank.
        epoch, self.epoch = self.epoch, self.epoch + 1
        skip, self.skip = self.skip, 0
        left = int(self.reader.steps_per_epoch)
        for batch in self.reader.iter_epoch(epoch):
            left -= 1
            if skip:
                skip -= 1
                continue
            if left == 0 and self.prefetch_next is not None:
                converted = self.convert(batch)
                self.prefetch_next(self.reader, epoch)
                yield converted
            else:
                yield self.convert(batch)


def _number(value: Any) -> Optional[float]:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().mean().cpu()) if value.numel() else None
    if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
        return float(value)
    return None


def history_entry(logged: Dict[str, Any]) -> Dict[str, float]:
    """The epoch's values from what the module logged (Lightning's ``callback_metrics``):
    ``name_step`` values are left out, and ``name_epoch`` becomes ``name``."""
    entry: Dict[str, float] = {}
    for key, value in logged.items():
        if key.endswith("_step"):
            continue
        number = _number(value)
        if number is None:
            continue
        name = key[:-len("_epoch")] if key.endswith("_epoch") else key
        if key.endswith("_epoch") or name not in entry:
            entry[name] = number
    return entry


def set_learning_rate(optimizers: List[Any], schedulers: List[Any], lr: float) -> None:
    """Make ``lr`` every parameter group's base learning rate: a group's current rate keeps its ratio to
    its base (a scheduler's factor at the start), and the schedulers' base rates become ``lr``."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            base = group.get("initial_lr", group["lr"])
            group["lr"] = group["lr"] * (lr / base) if base else lr
            if "initial_lr" in group:
                group["initial_lr"] = lr
    for scheduler in schedulers:
        if hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
            optimizer = getattr(scheduler, "optimizer", None)
            if optimizer is not None and hasattr(scheduler, "_last_lr"):
                scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


class _LearningRate(Callback):
    """Sets the ``learning_rate`` Param on the optimizers the Trainer built, before the first step (and
    before a resumed run's optimizer state, which holds the same rate, is loaded)."""

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        set_learning_rate(list(trainer.optimizers), [c.scheduler for c in trainer.lr_scheduler_configs], self.lr)


class _EpochEnd(Checkpoint):
    """Per epoch: rank-averaged history entry, progress events, and rank 0's checkpoint in the store.

    A :class:`Checkpoint` so that Lightning calls it after the module's own ``on_train_epoch_end``
    (with every epoch-level metric, validation ones included) and accepts it as the run's
    checkpointing.
    """

    def __init__(self, spec: LightningTrainingSpec, hvd: Any, workdir: str) -> None:
        self.spec = spec
        self.hvd = hvd
        self.workdir = workdir
        self.rank, self.size = 0, 1
        self.history: List[Dict[str, Any]] = list(spec.history)
        self.reporter = ProgressReporter(False)
        self._started = 0.0
        self._loss_sum = 0.0
        self._steps = 0
        self.profile = step_profile(LIGHTNING_PHASES)
        self.train_loader: Optional[_ResumableLoader] = None
        self._batch = 0
        """Batches of the current epoch trained when the next checkpoint is written (0 at an epoch's end)."""
        self._resumed_epoch = False
        """The current epoch was resumed within (from a mid-epoch checkpoint)."""
        self._partial_loss = 0.0
        """The ranks' mean of the epoch's loss sum at the mid-epoch checkpoint being written."""

    @property
    def state_key(self) -> str:
        return "spark_hvd_epoch_end"

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # The Trainer joined the job when it was built, after this callback was.
        self.rank, self.size = self.hvd.rank(), self.hvd.size()
        self.reporter = ProgressReporter(self.rank == 0, self.spec.progress, self.spec.progress_interval_s)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        spec = self.spec
        self.reporter.start(epochs=spec.epochs, start_epoch=trainer.current_epoch, steps=spec.train_steps,
                            val_steps=spec.val_steps if spec.val_url else 0, size=self.size,
                            batch_size=spec.batch_size)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._started = time.monotonic()
        if not self._resumed_epoch:
            self._loss_sum, self._steps = 0.0, 0
        self.profile.start()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.profile.mark("input")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self.profile.mark("forward")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self.profile.mark("backward")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.profile.mark("optimizer")
        self._record_batch(trainer, outputs, batch_idx)
        spec = self.spec
        every, passes, done = spec.checkpoint_every_steps, max(1, trainer.accumulate_grad_batches), batch_idx + 1
        if every and done < spec.train_steps and done % passes == 0 and (done // passes) % every == 0:
            self._batch = done
            # Every rank resumes from rank 0's checkpoint: it keeps the ranks' mean of the sums.
            self._partial_loss = self._loss_sum if self.size == 1 else float(self.hvd.allreduce(
                torch.tensor([self._loss_sum], dtype=torch.float64), name=f"spark_hvd.lightning.partial.{done}",
                op=self.hvd.Average)[0])
            try:
                self._checkpoint(trainer, epoch=trainer.current_epoch, batches=done)
            finally:
                self._batch = 0
        self.profile.mark("bookkeeping")
        self.profile.step_done()

    def _record_batch(self, trainer: Any, outputs: Any, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        value = _number(loss)
        if value is not None:
            self._loss_sum += value
            self._steps += 1
        running = self._loss_sum / self._steps if self._steps else math.nan
        self.reporter.step(trainer.current_epoch, batch_idx + 1, running, force=batch_idx + 1 == self.spec.train_steps)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        epoch = trainer.current_epoch
        logs = history_entry(dict(trainer.callback_metrics))
        if "loss" not in logs and self._steps:
            logs = {"loss": self._loss_sum / self._steps, **logs}  # what training_step returned, when not logged
        logs = self._average(logs)
        logs = {k: logs[k] for k in sorted(logs, key=lambda k: k.startswith("val_"))}  # training values first
        seconds = time.monotonic() - self._started
        record_epoch(self.history, epoch, logs, rows=self.spec.train_steps * self.spec.batch_size * self.size,
                     trained_s=seconds, seconds=seconds, profile=self.profile, hvd=self.hvd, size=self.size,
                     name=f"spark_hvd.lightning.profile.{len(self.history)}")
        self._resumed_epoch = False
        self._checkpoint(trainer)
        self.reporter.epoch(epoch, logs)

    def _average(self, logs: Dict[str, float]) -> Dict[str, float]:
        """Each value's mean over the ranks that logged it (ranks may log different names)."""
        if self.size == 1:
            return logs
        gathered = self.hvd.allgather_object(logs, name=f"spark_hvd.lightning.logs.{len(self.history)}")
        names: List[str] = []
        for part in gathered:
            names.extend(k for k in part if k not in names)
        return {k: float(np.mean([part[k] for part in gathered if k in part])) for k in names}

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = {"format": CHECKPOINT_FORMAT, "epochs_done": len(self.history),
                                      "history": list(self.history), "fingerprint": dict(self.spec.fingerprint),
                                      "batch": self._batch, "seed": self.spec.seed,
                                      "loss_sum": self._partial_loss if self._batch else 0.0,
                                      "steps": self._steps if self._batch else 0}

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Dict[str, Any]) -> None:
        record = checkpoint.get(CHECKPOINT_KEY) or {}
        if record.get("batch"):
            # Resumed within an epoch, whose start Lightning does not announce again: the epoch's
            # loss goes on from what training_step returned before the checkpoint.
            self._loss_sum, self._steps = float(record.get("loss_sum") or 0.0), int(record.get("steps") or 0)
            self._started = time.monotonic()
            self._resumed_epoch = True

    def _checkpoint(self, trainer: Any, epoch: Optional[int] = None, batches: int = 0) -> None:
        # Every rank calls save_checkpoint (it ends in a barrier); the strategy writes on rank 0 only.
        if self.train_loader is not None:
            self.train_loader.trained = (epoch, batches) if batches else (trainer.current_epoch + 1, 0)
        local = os.path.join(self.workdir, "epoch.ckpt")
        trainer.save_checkpoint(local, weights_only=False)
        if self.rank == 0:
            with open(local, "rb") as f:
                self.spec.store.write(self.spec.checkpoint_path, f.read())  # atomic: old or new, never partial


class _ResumableLoader(torch.utils.data.DataLoader):
    """The training loader, resumable within an epoch the way Lightning asks (``state_dict`` /
    ``load_state_dict``, saved in its checkpoints): the state is the epoch and the batches of it
    trained when the checkpoint was written (``trained``, set by :class:`_EpochEnd`; the loader
    itself may have handed out more, read ahead)."""

    trained = (0, 0)
    """(epoch, batches trained of it) at the last checkpoint."""

    def state_dict(self) -> Dict[str, int]:
        epoch, batches = self.trained
        return {"epoch": epoch, "batches": batches}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        dataset = self.dataset
        assert isinstance(dataset, _ShardBatches)
        dataset.epoch, dataset.skip = int(state["epoch"]), int(state["batches"])


def _loader(dataset: _ShardBatches, resumable: bool = False) -> torch.utils.data.DataLoader:
    # Batches come whole from the reader: no sampler or collation, and so no DistributedSampler either.
    return (_ResumableLoader if resumable else torch.utils.data.DataLoader)(dataset, batch_size=None, num_workers=0)


def default_logger(logs_dir: str) -> Any:
    """The logger of a fit given none, as Horovod's: a TensorBoardLogger writing under the run's
    ``logs`` directory (rank 0 writes; Lightning keeps the other ranks' calls silent), or a
    CSVLogger there where neither tensorboard nor tensorboardX is installed.

    Writing event files needs no TensorFlow, but tensorboard imports it when it is installed (about
    3 s a rank): unless the rank has imported TensorFlow already, tensorboard is pointed at its
    own stand-in (the ``tensorboard.compat.notf`` switch tensorboard provides for this)."""
    import importlib.util
    import types

    from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger

    if importlib.util.find_spec("tensorboardX") is not None:
        return TensorBoardLogger(logs_dir, name="", version="")
    if importlib.util.find_spec("tensorboard") is not None:
        if "tensorflow" not in sys.modules:
            sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
        return TensorBoardLogger(logs_dir, name="", version="")
    return CSVLogger(logs_dir, name="", version="")


def fit_on_rank(spec: LightningTrainingSpec) -> Optional[Dict[str, Any]]:
    """Fit on this rank; rank 0 returns ``{"model": state_dict, "history": [...]}``, others None."""
    import pytorch_lightning as pl

    import spark_hvd.torch as hvd
    from spark_hvd.lightning import SparkHvdStrategy

    for pattern in _QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for name in ("pytorch_lightning", "lightning_fabric", "lightning.pytorch"):
        logging.getLogger(name).setLevel(logging.WARNING)  # no GPU/TPU banners from every rank
    if spec.random_seed is not None:
        torch.manual_seed(spec.random_seed)
    module = spec.model
    dtype = model_dtype(module)
    strategy = SparkHvdStrategy(compression=spec.compression) if spec.compression is not None else SparkHvdStrategy()
    use_gpu = spec.use_gpu and torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="spark-hvd-lightning-") as workdir:
        files = RunFiles(spec.store, spec.run_path)
        kwargs: Dict[str, Any] = {"enable_progress_bar": False, "enable_model_summary": False,
                                  "num_sanity_val_steps": 0, "default_root_dir": workdir}
        kwargs.update(spec.trainer_args)
        if "logger" not in kwargs:
            kwargs["logger"] = default_logger(files.path("logs"))
        # Given at construction, the epoch-end checkpoint keeps Lightning from adding its own ModelCheckpoint.
        epoch_end = _EpochEnd(spec, hvd, workdir)
        for callback in spec.callbacks:
            # A ModelCheckpoint of the user's writes under the run's directory of the store (its
            # default, the Trainer's root, is this rank's temporary directory).
            if isinstance(callback, ModelCheckpoint):
                callback.dirpath = files.path(callback.dirpath or "checkpoints")
        trainer = pl.Trainer(strategy=strategy, accelerator="gpu" if use_gpu else "cpu", devices=1, num_nodes=1,
                             max_epochs=spec.epochs, enable_checkpointing=True,
                             callbacks=list(spec.callbacks) + [epoch_end] + (
                                 [_LearningRate(spec.learning_rate)] if spec.learning_rate is not None else []),
                             **kwargs)
        try:
            rank, size = hvd.rank(), hvd.size()
            set_up_torch_cpu(spec, hvd.local_size())

            def convert(batch: Dict[str, np.ndarray]) -> Dict[str, torch.Tensor]:
                return module_batch(batch, spec.feature_cols, spec.label_cols, spec.sample_weight_col,
                                    spec.feature_shapes, dtype, spec.adapt_batch)

            # The progress reporter starts in on_train_start, from the epoch Lightning resumes at.
            train_reader, val_reader = spec.open_readers(rank, size)
            try:
                ckpt_path = None
                if spec.resume:
                    ckpt_path = os.path.join(workdir, "resume.ckpt")
                    with open(ckpt_path, "wb") as f:
                        f.write(spec.store.read(spec.checkpoint_path))
                val_loader = _loader(_ShardBatches(val_reader, convert, spec.start_epoch)) if val_reader else None
                train_loader = _loader(_ShardBatches(train_reader, convert, spec.start_epoch, spec.prefetch_next),
                                       resumable=True)
                epoch_end.train_loader = train_loader
                trainer.fit(module, train_dataloaders=train_loader,
                            val_dataloaders=val_loader, ckpt_path=ckpt_path, weights_only=False if ckpt_path else None)
            finally:
                close_readers(train_reader, val_reader)
            if rank != 0:
                return None
            files.upload()
            state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
            return {"model": state, "history": epoch_end.history}
        finally:
            hvd.shutdown()
