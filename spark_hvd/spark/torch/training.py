"""The training loop TorchEstimator runs on every rank: read the shard, step, validate, checkpoint.

:func:`train_on_rank` is the function ``run()`` calls on each barrier task. Everything it needs
arrives in one :class:`TorchTrainingSpec` of plain values and torch objects. Each rank builds its
optimizer over its own copy of the model, wraps it in ``spark_hvd.torch.DistributedOptimizer``,
and runs the same number of steps per epoch as every other rank (the readers guarantee it),
so gradient allreduces always match. After each epoch the metrics are averaged over the ranks
and rank 0 writes a checkpoint (model, optimizer, completed epochs, history) to the store; with
``checkpoint_every_steps`` also every that many optimizer steps within an epoch, with the batches
done so far and the epoch's running sums, so a resumed run goes on at the next batch of the
same (seeded) order and the epoch's metrics count every batch once.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from spark_hvd.spark.torch.batches import (LossFunction, feature_tensors, label_tensors, metric_tensors, metric_values,
                                           model_dtype, transform_outputs, weight_tensor)
from spark_hvd.spark.torch.callbacks import TrainingState, call_hook
from spark_hvd.spark.torch.stopping import EarlyStopping, restore_scheduler, step_scheduler
from spark_hvd.spark.estimator.progress import ProgressReporter
from spark_hvd.spark.estimator.step_profile import TORCH_PHASES, step_profile
from spark_hvd.spark.estimator.training import TrainingSpec, close_readers, record_epoch, run_trainer, set_up_torch_cpu

__all__ = ["OptimizerSpec", "TorchTrainingSpec", "train_on_rank", "CHECKPOINT_FORMAT", "checkpoint_bytes",
           "load_checkpoint"]

CHECKPOINT_FORMAT = 1
"""Version of the checkpoint layout; a checkpoint of another version is not resumed."""


@dataclass
class OptimizerSpec:
    """An optimizer without its parameters: rebuilt on each rank over that rank's model.

    ``groups`` holds, per param group, the indices of its parameters in
    ``list(model.parameters())`` and its hyperparameters.
    """

    cls: type
    defaults: Dict[str, Any]
    groups: List[Tuple[List[int], Dict[str, Any]]]
    state: Optional[Dict[str, Any]] = None
    """``optimizer.state_dict()`` to restore (moment buffers, step counts), or None."""

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> "OptimizerSpec":
        """The spec of ``optimizer``, whose parameters must all belong to ``model``."""
        index = {id(p): i for i, p in enumerate(model.parameters())}
        groups = []
        foreign = 0
        for group in optimizer.param_groups:
            ids = []
            for p in group["params"]:
                if id(p) not in index:
                    foreign += 1
                else:
                    ids.append(index[id(p)])
            groups.append((ids, {k: v for k, v in group.items() if k != "params"}))
        if foreign:
            raise ValueError(f"the optimizer holds {foreign} parameter(s) that are not parameters of the model: "
                             "expected an optimizer built over the model's parameters; fix: create it as "
                             "e.g. torch.optim.Adam(model.parameters(), lr=1e-3) with the same model object")
        state = optimizer.state_dict() if optimizer.state else None
        return cls(type(optimizer), dict(optimizer.defaults), groups, _to_cpu(state) if state else None)

    def with_learning_rate(self, lr: Optional[float]) -> "OptimizerSpec":
        """This spec with every parameter group's learning rate (and its defaults', and its saved
        state's) set to ``lr``; itself when ``lr`` is None."""
        if lr is None:
            return self
        groups = [(ids, {**hyper, "lr": lr, **({"initial_lr": lr} if "initial_lr" in hyper else {})})
                  for ids, hyper in self.groups]
        state = self.state
        if state is not None:
            state = {**state, "param_groups": [{**group, "lr": lr} for group in state.get("param_groups", [])]}
        return OptimizerSpec(self.cls, {**self.defaults, "lr": lr}, groups, state)

    def build(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """A fresh optimizer of the same class and hyperparameters over ``model``'s parameters."""
        params = list(model.parameters())
        groups = [{"params": [params[i] for i in ids], **hyper} for ids, hyper in self.groups]
        try:
            optimizer = self.cls(groups, **self.defaults)
        except TypeError:  # optimizers whose defaults are not all constructor arguments
            optimizer = self.cls(groups)
        if self.state is not None:
            optimizer.load_state_dict(self.state)
        return optimizer


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


@dataclass(kw_only=True)
class TorchTrainingSpec(TrainingSpec):
    """Everything one fit's ranks need: the shared settings, and the torch model, optimizer and loss."""

    model: torch.nn.Module
    optimizer: OptimizerSpec
    losses: List[Callable[..., Any]]
    loss_weights: List[float]
    metrics: List[Callable[..., Any]]
    metric_names: List[str]
    resume_model: Optional[Dict[str, torch.Tensor]] = None
    resume_optimizer: Optional[Dict[str, Any]] = None
    backward_passes_per_step: int = 1
    scale_lr: bool = True
    train_minibatch_fn: Optional[Callable[..., Any]] = None
    start_batch: int = 0
    """Batches of epoch ``start_epoch`` already trained (a mid-epoch checkpoint): skipped."""
    partial: Optional[Dict[str, float]] = None
    """The running sums of epoch ``start_epoch`` at ``start_batch``, averaged over the ranks."""
    checkpoint_every_steps: Optional[int] = None
    """Rank 0 also checkpoints every this many optimizer steps within an epoch; None: per epoch only."""
    early_stopping: Optional[Dict[str, Any]] = None
    """The ``early_stopping`` Param's settings, or None."""
    lr_scheduler_fn: Optional[Callable[[Any], Any]] = None
    lr_scheduler_interval: str = "epoch"
    resume_extra: Optional[Dict[str, Any]] = None
    """From the checkpoint resumed: ``early_stopping`` state, ``best_model`` and ``scheduler`` state."""


def checkpoint_bytes(epoch: int, model: torch.nn.Module, optimizer_state: Dict[str, Any],
                     history: List[Dict[str, Any]], fingerprint: Optional[Dict[str, str]] = None, *,
                     batch: int = 0, partial: Optional[Dict[str, float]] = None,
                     seed: Optional[int] = None, extra: Optional[Dict[str, Any]] = None) -> bytes:
    """A checkpoint as stored: ``torch.save`` of a dict of plain values and tensors; ``fingerprint``
    identifies the model architecture, optimizer, loss and data the run trains. ``epoch`` counts
    completed epochs; a mid-epoch checkpoint also has ``batch`` (batches of the next epoch done),
    ``partial`` (that epoch's running sums) and ``seed`` (of the shuffle order). ``extra`` adds
    the early-stopping state (``early_stopping``), the best weights (``best_model``) and the
    learning-rate scheduler's state (``scheduler``) where the run has them."""
    buf = io.BytesIO()
    torch.save({"format": CHECKPOINT_FORMAT, "epoch": epoch, "model": _to_cpu(model.state_dict()),
                "optimizer": _to_cpu(optimizer_state), "history": history,
                "fingerprint": dict(fingerprint or {}), "batch": batch, "partial": dict(partial or {}),
                "seed": seed, **_to_cpu(dict(extra or {}))}, buf)
    return buf.getvalue()


def load_checkpoint(data: bytes) -> Dict[str, Any]:
    """Inverse of :func:`checkpoint_bytes` (tensors only: nothing else is unpickled)."""
    loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if not isinstance(loaded, dict) or loaded.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint format {loaded.get('format') if isinstance(loaded, dict) else '?'} is "
                         f"not {CHECKPOINT_FORMAT}")
    return loaded


def _device(use_gpu: bool) -> torch.device:
    # run() exposes only this rank's GPU through CUDA_VISIBLE_DEVICES, so it is device 0.
    if use_gpu and torch.cuda.is_available():
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


class _Trainer:
    """The loop of one rank; a class only so the pieces of state stay together."""

    def __init__(self, spec: TorchTrainingSpec, hvd: Any) -> None:
        self.spec = spec
        self.hvd = hvd
        self.rank, self.size = hvd.rank(), hvd.size()
        set_up_torch_cpu(spec, hvd.local_size())
        self.reporter = ProgressReporter(self.rank == 0, spec.progress, spec.progress_interval_s)
        # Opened first: the first epoch's rows are read while the model is set up and broadcast.
        self.train_reader, self.val_reader = spec.open_readers(self.rank, self.size, self.reporter)
        try:
            self._set_up(spec, hvd)
        except BaseException:
            close_readers(self.train_reader, self.val_reader)
            raise

    def _set_up(self, spec: TorchTrainingSpec, hvd: Any) -> None:
        if spec.random_seed is not None:
            torch.manual_seed(spec.random_seed)
        self.device = _device(spec.use_gpu)
        self.model = spec.model.to(self.device)
        if spec.resume_model is not None:
            self.model.load_state_dict(spec.resume_model)
        self.dtype = model_dtype(self.model)
        optimizer = spec.optimizer.build(self.model)
        if spec.resume_optimizer is not None:
            optimizer.load_state_dict(spec.resume_optimizer)
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        # Horovod's rule: the batch across ranks is size times larger, so is the learning rate.
        self.lr_scale = float(self.size) if spec.scale_lr else 1.0
        if self.lr_scale != 1.0:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * self.lr_scale
        kwargs: Dict[str, Any] = {"named_parameters": self.model.named_parameters(),
                                  "backward_passes_per_step": spec.backward_passes_per_step}
        if spec.compression is not None:
            kwargs["compression"] = spec.compression
        self.optimizer = hvd.DistributedOptimizer(optimizer, **kwargs)
        extra = spec.resume_extra or {}
        self.scheduler = spec.lr_scheduler_fn(self.optimizer) if spec.lr_scheduler_fn is not None else None
        if self.scheduler is not None and extra.get("scheduler") is not None:
            restore_scheduler(self.scheduler, self.optimizer, extra["scheduler"])
        self.stopper = EarlyStopping(spec.early_stopping, extra.get("early_stopping")) \
            if spec.early_stopping is not None else None
        self.best_model: Optional[Dict[str, torch.Tensor]] = extra.get("best_model")
        self.loss_fn = LossFunction(spec.losses, spec.loss_weights)
        self.profile = step_profile(TORCH_PHASES)
        self.state = TrainingState(model=self.model, optimizer=self.optimizer, rank=self.rank, size=self.size,
                                   epoch=spec.start_epoch, epochs=spec.epochs, history=list(spec.history))

    def _tensors(self, batch: Dict[str, Any]) -> Tuple[List[torch.Tensor], List[torch.Tensor], Optional[torch.Tensor]]:
        spec = self.spec
        batch = spec.adapt_batch(batch)
        self.profile.mark("assemble")
        inputs = feature_tensors(batch, spec.feature_cols, spec.feature_shapes, self.dtype, self.device)
        labels = label_tensors(batch, spec.label_cols, self.device)
        weights = weight_tensor(batch, spec.sample_weight_col, self.dtype, self.device)
        return inputs, labels, weights

    # -- one step --------------------------------------------------------------------------------
    def _train_step(self, step: int, inputs: List[torch.Tensor], labels: List[torch.Tensor],
                    weights: Optional[torch.Tensor]) -> Tuple[List[torch.Tensor], List[torch.Tensor], torch.Tensor]:
        spec = self.spec
        if spec.train_minibatch_fn is not None:
            outputs, loss = spec.train_minibatch_fn(self.model, self.optimizer, transform_outputs, self.loss_fn,
                                                    inputs, labels, weights)
            outs, labs = transform_outputs(outputs, labels)
            if self.scheduler is not None and spec.lr_scheduler_interval == "step":
                self.scheduler.step()
            self.profile.mark("optimizer")  # the user's whole step
            return outs, labs, loss
        passes = spec.backward_passes_per_step
        profile = self.profile
        if step % passes == 0:
            self.optimizer.zero_grad()
        outs, labs = transform_outputs(self.model(*inputs), labels)
        loss = self.loss_fn(outs, labs, weights)
        profile.mark("forward")
        # Scaled so that k accumulated passes give the gradient of one k-times-larger batch.
        (loss / passes if passes > 1 else loss).backward()
        profile.mark("backward")
        if (step + 1) % passes == 0:
            if profile.enabled:
                self.optimizer.synchronize()
                profile.mark("allreduce")
                with self.optimizer.skip_synchronize():
                    self.optimizer.step()
            else:
                self.optimizer.step()
            if self.scheduler is not None and spec.lr_scheduler_interval == "step":
                self.scheduler.step()
        profile.mark("optimizer")
        return outs, labs, loss

    # -- epochs ----------------------------------------------------------------------------------
    def _run_epoch(self, epoch: int, reader: Any, start_batch: int = 0,
                   partial: Optional[Dict[str, float]] = None) -> Dict[str, float]:
        spec = self.spec
        self.model.train()
        partial = partial or {}
        # Running sums stay on the model's device: no synchronization per step (a GPU keeps its
        # queue full); they become floats when progress is reported and at the end of the epoch.
        loss_sum = torch.tensor(float(partial.get("loss", 0.0)), dtype=torch.float64, device=self.device)
        metric_sums: Dict[str, Any] = {name: float(partial.get(name, 0.0)) for name in spec.metric_names}
        steps = int(partial.get("steps", 0))
        profile = self.profile
        profile.start()
        for step, batch in enumerate(reader.iter_epoch(epoch)):
            if step < start_batch:
                continue  # trained before the checkpoint this run resumed from; the order is seeded
            profile.mark("wait")
            inputs, labels, weights = self._tensors(batch)
            profile.mark("to_tensor")
            outs, labs, loss = self._train_step(step, inputs, labels, weights)
            batch_loss = loss.detach()
            loss_sum += batch_loss
            steps += 1
            if spec.metrics:
                with torch.no_grad():
                    for name, value in metric_tensors(spec.metrics, spec.metric_names, outs, labs).items():
                        metric_sums[name] = metric_sums[name] + value
            if spec.callbacks:
                call_hook(spec.callbacks, "on_batch_end", step, {"loss": float(batch_loss)}, self.state)
            last = step + 1 == reader.steps_per_epoch
            if self.reporter.due(last):
                self.reporter.step(epoch, step + 1, float(loss_sum) / steps, force=last)
            if self._mid_epoch_checkpoint_due(step, reader.steps_per_epoch):
                sums = {"loss": float(loss_sum), **{k: float(v) for k, v in metric_sums.items()}, "steps": float(steps)}
                self._checkpoint(epoch, batch=step + 1, partial=self._average(sums, f"{epoch}.{step}"))
            profile.mark("bookkeeping")
            profile.step_done()
        steps = max(steps, 1)
        logs = {"loss": float(loss_sum) / steps}
        logs.update({name: float(total) / steps for name, total in metric_sums.items()})
        return logs

    def _validate(self, epoch: int, reader: Any) -> Dict[str, float]:
        spec = self.spec
        self.model.eval()
        loss_sum = 0.0
        metric_sums: Dict[str, float] = {name: 0.0 for name in spec.metric_names}
        steps = 0
        with torch.no_grad():
            for batch in reader.iter_epoch(epoch):
                inputs, labels, weights = self._tensors(batch)
                outs, labs = transform_outputs(self.model(*inputs), labels)
                loss_sum += float(self.loss_fn(outs, labs, weights))
                for name, value in metric_values(spec.metrics, spec.metric_names, outs, labs).items():
                    metric_sums[name] += value
                steps += 1
        steps = max(steps, 1)
        logs = {"val_loss": loss_sum / steps}
        logs.update({f"val_{name}": total / steps for name, total in metric_sums.items()})
        return logs

    def _mid_epoch_checkpoint_due(self, step: int, steps_per_epoch: int) -> bool:
        every = self.spec.checkpoint_every_steps
        passes = self.spec.backward_passes_per_step
        if not every or (step + 1) % passes != 0 or step + 1 >= steps_per_epoch:
            return False  # the end of the epoch has its own checkpoint
        return ((step + 1) // passes) % every == 0

    def _average(self, logs: Dict[str, float], epoch: Any) -> Dict[str, float]:
        """The logs averaged over all ranks (every rank has the same keys in the same order)."""
        if self.size == 1:
            return logs
        values = torch.tensor([logs[k] for k in logs], dtype=torch.float64)
        averaged = self.hvd.allreduce(values, name=f"spark_hvd.fit.metrics.{epoch}", op=self.hvd.Average)
        return {k: float(v) for k, v in zip(logs, averaged.tolist())}

    def _checkpoint(self, completed: int, batch: int = 0, partial: Optional[Dict[str, float]] = None) -> None:
        """Rank 0 writes the checkpoint (atomically: a resume sees the old one or this one)."""
        if self.rank != 0:
            return
        state = self.optimizer.state_dict()
        if self.lr_scale != 1.0:
            # The store keeps the learning rate as the user gave it; a resume scales it again.
            state = {**state, "param_groups": [{**group, "lr": group["lr"] / self.lr_scale}
                                               for group in state["param_groups"]]}
        extra: Dict[str, Any] = {}
        if self.stopper is not None:
            extra["early_stopping"] = self.stopper.state()
            if self.best_model is not None:
                extra["best_model"] = self.best_model
        if self.scheduler is not None:
            extra["scheduler"] = self.scheduler.state_dict()
        self.spec.store.write(self.spec.checkpoint_path,
                              checkpoint_bytes(completed, self.model, state, self.state.history,
                                               self.spec.fingerprint, batch=batch, partial=partial,
                                               seed=self.spec.seed, extra=extra))

    def run(self) -> Optional[Dict[str, Any]]:
        spec = self.spec
        train_reader, val_reader = self.train_reader, self.val_reader
        call_hook(spec.callbacks, "on_train_begin", self.state)
        try:
            for epoch in range(spec.start_epoch, spec.epochs):
                self.state.epoch = epoch
                call_hook(spec.callbacks, "on_epoch_begin", epoch, self.state)
                started = time.monotonic()
                resumed = epoch == spec.start_epoch and spec.start_batch > 0
                logs = self._run_epoch(epoch, train_reader, spec.start_batch if resumed else 0,
                                       spec.partial if resumed else None)
                train_seconds = time.monotonic() - started
                spec.prefetch_next(train_reader, epoch)
                if val_reader is not None:
                    logs.update(self._validate(epoch, val_reader))
                logs = self._average(logs, epoch)
                self._epoch_end(epoch, logs)
                done = spec.train_steps - (spec.start_batch if resumed else 0)
                record_epoch(self.state.history, epoch, logs, rows=done * spec.batch_size * self.size,
                             trained_s=train_seconds, seconds=time.monotonic() - started, profile=self.profile,
                             hvd=self.hvd, size=self.size, name=f"spark_hvd.fit.profile.{epoch}")
                self._checkpoint(epoch + 1)
                self.reporter.epoch(epoch, logs)
                call_hook(spec.callbacks, "on_epoch_end", epoch, dict(logs), self.state)
                if self._stop_requested(epoch):
                    break
        finally:
            close_readers(self.train_reader, self.val_reader)
        stopper = self.stopper
        if stopper is not None and stopper.restore_best_weights and self.best_model is not None:
            self.model.load_state_dict(self.best_model)
        call_hook(spec.callbacks, "on_train_end", self.state)
        if self.rank != 0:
            return None
        return {"model": _to_cpu(self.model.state_dict()), "history": self.state.history,
                "early_stopping": stopper.describe() if stopper is not None else ""}

    def _epoch_end(self, epoch: int, logs: Dict[str, Any]) -> None:
        """The learning-rate schedule's epoch step, and early stopping, on the averaged ``logs``
        (the same on every rank, so every rank decides alike); logs the rate the epoch trained at."""
        if self.scheduler is not None:
            logs["lr"] = self.optimizer.param_groups[0]["lr"] / self.lr_scale
            if self.spec.lr_scheduler_interval == "epoch":
                step_scheduler(self.scheduler, logs)
        stopper = self.stopper
        if stopper is None:
            return
        if stopper.update(epoch + 1, logs) and stopper.restore_best_weights:
            self.best_model = _to_cpu({k: v.clone() for k, v in self.model.state_dict().items()})
        if stopper.stopped:
            self.state.stop_training = True

    def _stop_requested(self, epoch: int) -> bool:
        # One rank's callback may ask to stop; all ranks must agree, or the next epoch's
        # collectives would wait for ranks that left.
        flag = torch.tensor([1.0 if self.state.stop_training else 0.0])
        if self.size > 1:
            flag = self.hvd.allreduce(flag, name=f"spark_hvd.fit.stop.{epoch}", op=self.hvd.Max)
        return bool(flag.item() > 0)


def train_on_rank(spec: TorchTrainingSpec) -> Optional[Dict[str, Any]]:
    """Train on this rank; rank 0 returns ``{"model": state_dict, "history": [...]}``, others None."""
    import spark_hvd.torch as hvd

    return run_trainer(hvd, _Trainer, spec)
