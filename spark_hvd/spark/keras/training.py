"""The training KerasEstimator runs on every rank: read the shard, ``model.fit``, checkpoint.

:func:`train_on_rank` is the function ``run()`` calls on each barrier task, in a process started
with :data:`~spark_hvd.spark.keras.environment.RANK_ENVIRONMENT` (the TensorFlow backend).
Each rank loads the model from ``.keras`` bytes, compiles it with the optimizer wrapped in
``spark_hvd.keras.DistributedOptimizer`` (learning rate times ``num_proc`` with ``scale_lr``),
and runs one ``model.fit`` over all remaining epochs, fed from its reader: every rank runs the
same number of steps per epoch, so the gradient allreduces always match. The callbacks are
``BroadcastGlobalVariablesCallback(0)`` (rank 0's weights and optimizer state everywhere),
``MetricAverageCallback`` (epoch logs averaged over the ranks), the recorder that keeps the
history, reports progress and makes rank 0 write a checkpoint each epoch (and with
``checkpoint_every_steps`` within epochs, with the epoch's running metrics; a run resumed within
an epoch trains the rest of it as a fit of its own, at the next batch of the same seeded order,
and its epoch logs cover every batch once), then the user's.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from spark_hvd.spark.keras import checks
from spark_hvd.spark.keras.flavor import keras_named, optimizer_values
from spark_hvd.spark.keras.checkpoint import checkpoint_bytes, load_model_bytes
from spark_hvd.spark.estimator.progress import ProgressReporter
from spark_hvd.spark.estimator.step_profile import KERAS_PHASES, step_profile
from spark_hvd.spark.estimator.training import RunFiles, TrainingSpec, close_readers, rank_threads, record_epoch, run_trainer

__all__ = ["KerasTrainingSpec", "train_on_rank", "scaled_optimizer"]


@dataclass(kw_only=True)
class KerasTrainingSpec(TrainingSpec):
    """Everything one fit's ranks need: the shared settings, and the Keras model, optimizer and loss."""

    model: bytes
    """The model as ``.keras`` bytes, holding any resumed weights."""
    optimizer: Dict[str, Any]
    """The optimizer, serialized (``keras.optimizers.serialize``): each rank builds its own."""
    keras2: bool = False
    """Whether the model is Keras 2's (``tf_keras``), which then builds the optimizer and callbacks."""
    losses: List[Any]
    loss_weights: Optional[List[float]]
    metrics: List[Any]
    custom_objects: Optional[Dict[str, Any]]
    output_shapes: List[Tuple[int, ...]]
    """Per-row shape of each model output (labels of as many values are reshaped to it)."""
    dtype: str
    optimizer_variables: Optional[List[np.ndarray]] = None
    """The resumed optimizer's variables, in order, or None for a new run."""
    backward_passes_per_step: int = 1
    scale_lr: bool = True
    checkpoint_callback: Any = None
    """Horovod's ModelCheckpoint for rank 0 (``checkpoint_callback``), or None."""
    checkpoint_every_steps: Optional[int] = None
    """Also checkpoint every this many optimizer steps within an epoch."""
    start_batch: int = 0
    """Batches of epoch ``start_epoch`` trained before the checkpoint this run resumes from."""
    partial: Optional[Dict[str, float]] = None
    """The running means of epoch ``start_epoch``'s metrics at ``start_batch``, averaged over the ranks."""


def scaled_optimizer(config: Dict[str, Any], factor: float, custom_objects: Optional[Dict[str, Any]] = None,
                     keras2: bool = False) -> Any:
    """The optimizer of ``config`` (Keras 2's with ``keras2``) with its learning rate times
    ``factor``; a learning-rate schedule is kept as it is (scale it in the schedule itself)."""
    config = copy.deepcopy(config)
    inner = config.get("config", {})
    if factor != 1.0 and isinstance(inner.get("learning_rate"), (int, float)):
        inner["learning_rate"] = float(inner["learning_rate"]) * factor
    return keras_named(keras2).optimizers.deserialize(config, custom_objects=custom_objects)


def _is_learning_rate(variable: Any) -> bool:
    name = str(getattr(variable, "path", getattr(variable, "name", "")))
    return name.split(":")[0].endswith("learning_rate")  # Keras 2 names end in ":0"


class _Trainer:
    """The fit of one rank; a class only so the pieces of state stay together."""

    def __init__(self, spec: KerasTrainingSpec, hvd: Any) -> None:
        import tensorflow as tf

        self.spec = spec
        self.hvd = hvd
        self.rank, self.size = hvd.rank(), hvd.size()
        self.reporter = ProgressReporter(self.rank == 0, spec.progress, spec.progress_interval_s)
        # Opened first: the first epoch's rows are read while the model is built and compiled.
        self.train_reader, self.val_reader = spec.open_readers(self.rank, self.size, self.reporter)
        try:
            self._set_up(spec, hvd, tf)
        except BaseException:
            close_readers(self.train_reader, self.val_reader)
            raise

    def _set_up(self, spec: KerasTrainingSpec, hvd: Any, tf: Any) -> None:
        threads = rank_threads(hvd.local_size())
        try:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(threads)
        except RuntimeError:  # TensorFlow already started: it keeps its pools
            pass
        if not spec.use_gpu:
            tf.config.set_visible_devices([], "GPU")
        if spec.random_seed is not None:
            keras_named(spec.keras2).utils.set_random_seed(spec.random_seed)
        self.model = load_model_bytes(spec.model, spec.custom_objects)
        self.lr_scale = float(self.size) if spec.scale_lr else 1.0
        self.base_lr = spec.optimizer.get("config", {}).get("learning_rate")
        optimizer = scaled_optimizer(spec.optimizer, self.lr_scale, spec.custom_objects, spec.keras2)
        kwargs: Dict[str, Any] = {"backward_passes_per_step": spec.backward_passes_per_step}
        if spec.compression is not None:
            kwargs["compression"] = spec.compression
        self.optimizer = hvd.DistributedOptimizer(optimizer, **kwargs)
        self.model.compile(optimizer=self.optimizer, loss=spec.losses if len(spec.losses) > 1 else spec.losses[0],
                           loss_weights=spec.loss_weights, metrics=spec.metrics or None, jit_compile=False)
        if spec.optimizer_variables is not None:
            self._restore_optimizer(spec.optimizer_variables)
        self.profile = step_profile(KERAS_PHASES)
        self.history: List[Dict[str, Any]] = list(spec.history)

    def _restore_optimizer(self, values: List[np.ndarray]) -> None:
        from spark_hvd.keras.callbacks import optimizer_variables

        if hasattr(self.optimizer, "build"):
            self.optimizer.build(self.model.trainable_variables)
        else:  # Keras 2's legacy optimizers make their slots on demand
            self.optimizer._create_all_weights(self.model.trainable_variables)
        variables = optimizer_variables(self.optimizer)
        if len(variables) != len(values) or any(tuple(v.shape) != tuple(np.shape(x)) for v, x in zip(variables, values)):
            raise ValueError(f"the checkpoint holds {len(values)} optimizer variables that do not fit this optimizer's "
                             f"{len(variables)}: expected the optimizer the run was started with")
        for variable, value in zip(variables, values):
            if not _is_learning_rate(variable):  # this run's (scaled) rate, not the stored one
                variable.assign(value)

    # -- data ------------------------------------------------------------------------------------
    def _keras_batch(self, batch: Dict[str, Any]) -> Tuple[Any, ...]:
        spec = self.spec
        batch = spec.adapt_batch(batch)
        inputs = [np.asarray(batch[c]).reshape((len(batch[c]),) + tuple(s)).astype(spec.dtype, copy=False)
                  for c, s in zip(spec.feature_cols, spec.feature_shapes)]
        labels = checks.label_arrays(batch, spec.label_cols, spec.output_shapes, spec.dtype)
        x = inputs[0] if len(inputs) == 1 else tuple(inputs)
        y = labels[0] if len(labels) == 1 else tuple(labels)
        if spec.sample_weight_col is None:
            return x, y
        return x, y, np.asarray(batch[spec.sample_weight_col]).reshape(-1).astype(spec.dtype, copy=False)

    def _blocks(self, reader: Any, epoch: int, skip: int = 0) -> Iterator[List[np.ndarray]]:
        """The reader's blocks of batches of ``epoch`` after its first ``skip`` batches, each batch
        as Keras takes it and the block's batches stacked: one flat list of ``(batches,
        batch_size, ...)`` arrays per block."""
        import tensorflow as tf

        for block in reader.iter_epoch_blocks(epoch):
            if skip >= len(block):
                skip -= len(block)
                continue
            flat = [tf.nest.flatten(self._keras_batch(batch)) for batch in block[skip:]]
            skip = 0
            yield [np.stack(parts) for parts in zip(*flat)]

    def _dataset(self, reader: Any, per_pass: bool = False, epochs: Optional[range] = None, skip: int = 0) -> Any:
        """A tf.data pipeline of the rank's batches: Python hands over whole blocks, tf.data cuts
        them into batches, so a step costs no call into Python (a generator of single batches
        made each step wait for one).

        Training data is one stream over every remaining epoch: given steps_per_epoch, Keras keeps
        one iterator and takes that many batches each epoch. Validation data (``per_pass``) is
        iterated afresh every epoch, and a fresh iterator drops what the last one had read ahead,
        so each pass over that dataset is the next epoch's data and nothing more. ``epochs``
        (default: every remaining one) and ``skip`` (batches of the first of them already trained)
        choose the training batches."""
        import itertools

        import tensorflow as tf

        epochs = epochs if epochs is not None else range(self.spec.start_epoch, self.spec.epochs)
        streams = [self._blocks(reader, epoch, skip if i == 0 else 0) for i, epoch in enumerate(epochs)]
        first = next(streams[0])
        structure = self._keras_batch_structure()
        signature = tuple(tf.TensorSpec((None,) + a.shape[1:], tf.as_dtype(a.dtype)) for a in first)
        streams[0] = itertools.chain([first], streams[0])
        if per_pass:
            passes = iter(streams)

            def source() -> Iterator[Tuple[np.ndarray, ...]]:
                return (tuple(b) for b in next(passes, ()))
        else:
            stream = itertools.chain(*streams)

            def source() -> Iterator[Tuple[np.ndarray, ...]]:
                return (tuple(b) for b in stream)
        dataset = tf.data.Dataset.from_generator(source, output_signature=signature)
        dataset = dataset.flat_map(lambda *parts: tf.data.Dataset.from_tensor_slices(parts))
        return dataset.map(lambda *parts: tf.nest.pack_sequence_as(structure, list(parts))).prefetch(1)

    def _keras_batch_structure(self) -> Any:
        """The nesting of what :meth:`_keras_batch` returns ((x, y) or (x, y, weights), x and y a
        tuple when there are several), with placeholders."""
        spec = self.spec
        x: Any = 0 if len(spec.feature_cols) == 1 else tuple(0 for _ in spec.feature_cols)
        y: Any = 0 if len(spec.label_cols) == 1 else tuple(0 for _ in spec.label_cols)
        return (x, y) if spec.sample_weight_col is None else (x, y, 0)

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoint(self, completed: int, batch: int = 0, partial: Optional[Dict[str, float]] = None) -> None:
        """Rank 0: the model, its optimizer's variables and the run's state to the store (within
        epoch ``completed`` after ``batch`` batches, with that epoch's running ``partial`` logs)."""
        scaled = self.lr_scale != 1.0 and isinstance(self.base_lr, (int, float))
        if scaled:
            # The store keeps the learning rate as the user gave it; a resume scales it again.
            self.optimizer.learning_rate = float(self.base_lr)
        try:
            data = checkpoint_bytes(self.model, completed, self.history, self.spec.fingerprint,
                                    optimizer_values(self.optimizer),
                                    batch=batch, partial=partial, seed=self.spec.seed)
        finally:
            if scaled:
                self.optimizer.learning_rate = float(self.base_lr) * self.lr_scale
        self.spec.store.write(self.spec.checkpoint_path, data)

    # -- fit -------------------------------------------------------------------------------------
    def run(self) -> Optional[Dict[str, Any]]:
        spec = self.spec
        train_reader, val_reader = self.train_reader, self.val_reader
        files = RunFiles(spec.store, spec.run_path)
        callbacks = [self.hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                     self.hvd.callbacks.MetricAverageCallback(), _recorder(self),
                     *_rank_callbacks(spec, self.rank, files)]
        validation = self._dataset(val_reader, per_pass=True) if val_reader is not None else None
        fit = dict(validation_data=validation, validation_steps=spec.val_steps if val_reader is not None else None,
                   callbacks=callbacks, shuffle=False, verbose=0)  # the reader shuffles
        try:
            first = spec.start_epoch
            if spec.start_batch:
                # The rest of an epoch resumed within: Keras takes one number of steps for every
                # epoch of a fit, so this epoch is a fit of its own.
                self.model.fit(self._dataset(train_reader, epochs=range(first, first + 1), skip=spec.start_batch),
                               epochs=first + 1, initial_epoch=first, steps_per_epoch=spec.train_steps - spec.start_batch,
                               **fit)
                first += 1
            if first < spec.epochs:
                self.model.fit(self._dataset(train_reader, epochs=range(first, spec.epochs)), epochs=spec.epochs,
                               initial_epoch=first, steps_per_epoch=spec.train_steps, **fit)
        finally:
            close_readers(self.train_reader, self.val_reader)
        if self.rank != 0:
            return None
        weights = self._checkpointed_weights() or self.model.get_weights()
        files.upload()
        return {"weights": weights, "history": self.history}

    def _checkpointed_weights(self) -> Optional[List[np.ndarray]]:
        """As in Horovod, the fitted model is what ``checkpoint_callback`` saved last (with
        ``save_best_only``, the best epoch's); None when it saved nothing or to a templated name."""
        callback = self.spec.checkpoint_callback
        path = getattr(callback, "filepath", None) if callback is not None else None
        if not isinstance(path, str) or "{" in path or not os.path.exists(path):
            return None
        final = self.model.get_weights()
        try:
            self.model.load_weights(path)
            return self.model.get_weights()
        finally:
            self.model.set_weights(final)


_FILE_ATTRIBUTES = {"TensorBoard": "log_dir", "ModelCheckpoint": "filepath", "CSVLogger": "filename",
                    "BackupAndRestore": "backup_dir"}
"""Keras callbacks that write files, and the attribute that says where."""


def _rank_callbacks(spec: KerasTrainingSpec, rank: int, files: RunFiles) -> List[Any]:
    """The user's callbacks on this rank: those that write files only on rank 0, a relative path
    under the run's directory of the store; the rest (EarlyStopping, ReduceLROnPlateau, ...) on
    every rank, where they see the same averaged logs and so decide alike."""
    chosen = []
    checkpoint = spec.checkpoint_callback
    if checkpoint is not None and not getattr(checkpoint, "filepath", None):
        # Horovod's BestModelCheckpoint() names no file: the run's directory holds it.
        checkpoint.filepath = "checkpoint.weights.h5" if checkpoint.save_weights_only else "checkpoint.keras"
    for callback in list(spec.callbacks) + ([checkpoint] if checkpoint is not None else []):
        attribute = next((a for cls, a in _FILE_ATTRIBUTES.items()
                          if any(k.__name__ == cls for k in type(callback).__mro__)), None)
        if attribute is None:
            chosen.append(callback)
        elif rank == 0:
            value = getattr(callback, attribute, None)
            if isinstance(value, str):
                setattr(callback, attribute, files.path(value))
            chosen.append(callback)
    return chosen


def _recorder(trainer: _Trainer) -> Any:
    """The callback that keeps the history, reports progress and checkpoints (after the logs
    were averaged over the ranks)."""

    class Recorder(keras_named(trainer.spec.keras2).callbacks.Callback):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.started = 0.0
            self.trained = 0.0
            self.epoch = 0
            self.skipped = 0

        def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
            spec = trainer.spec
            self.epoch = epoch
            # Batches of this epoch trained before the checkpoint it resumes from.
            self.skipped = spec.start_batch if epoch == spec.start_epoch else 0
            self.started = time.monotonic()
            self.trained = 0.0
            trainer.profile.start()

        def on_train_batch_begin(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
            trainer.profile.mark("input")

        def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
            trainer.profile.mark("train_step")
            loss = float(np.asarray((logs or {}).get("loss", float("nan"))))
            spec = trainer.spec
            done = self.skipped + batch + 1
            trainer.reporter.step(self.epoch, done, loss, force=done == spec.train_steps)
            every, passes = spec.checkpoint_every_steps, spec.backward_passes_per_step
            if every and done < spec.train_steps and done % passes == 0 and (done // passes) % every == 0:
                # Every rank is here after the same batch: the epoch's running means so far,
                # averaged over the ranks (as MetricAverageCallback does at the epoch's end).
                running = self._with_earlier(_scalars(logs), batch + 1)
                names = sorted(running)
                averaged = trainer.hvd.allreduce(np.array([running[k] for k in names], dtype=np.float64),
                                                 name=f"spark_hvd.keras.partial.{self.epoch}.{done}")
                if trainer.rank == 0:
                    trainer.checkpoint(self.epoch, batch=done, partial=dict(zip(names, averaged.tolist())))
            trainer.profile.mark("bookkeeping")
            trainer.profile.step_done()

        def _with_earlier(self, running: Dict[str, float], batches: int) -> Dict[str, float]:
            """``running`` (means over this fit's ``batches`` batches of the epoch) as means over
            every batch of the epoch so far: a resumed epoch adds the means its checkpoint kept,
            weighted by their batches (exact for means and sums of per-batch values)."""
            partial = trainer.spec.partial
            if not self.skipped or not partial:
                return running
            return {k: (partial[k] * self.skipped + v * batches) / (self.skipped + batches) if k in partial else v
                    for k, v in running.items()}

        def on_test_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
            if not self.trained:
                self.trained = time.monotonic() - self.started

        def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
            spec = trainer.spec
            seconds = time.monotonic() - self.started
            trained = self.trained or seconds
            values = self._with_earlier(_scalars(logs), spec.train_steps - self.skipped)
            if logs is not None:
                logs.update({k: v for k, v in values.items() if k in logs})  # later callbacks see the whole epoch
            rows = (spec.train_steps - self.skipped) * spec.batch_size * trainer.size
            record_epoch(trainer.history, epoch, values, rows=rows,
                         trained_s=trained, seconds=seconds, profile=trainer.profile, hvd=trainer.hvd,
                         size=trainer.size, name=f"spark_hvd.keras.profile.{epoch}")
            if trainer.rank == 0:
                trainer.checkpoint(epoch + 1)
            trainer.reporter.epoch(epoch, values)

    return Recorder()


def _scalars(logs: Optional[Dict[str, Any]]) -> Dict[str, float]:
    """The numbers of Keras's ``logs`` (the learning rate left out)."""
    return {k: float(np.asarray(v)) for k, v in (logs or {}).items() if np.ndim(v) == 0 and k != "learning_rate"}


def train_on_rank(spec: KerasTrainingSpec) -> Optional[Dict[str, Any]]:
    """Train on this rank; rank 0 returns ``{"weights": [...], "history": [...]}``, others None."""
    import spark_hvd.keras as hvd

    return run_trainer(hvd, _Trainer, spec)
