"""LightningEstimator and LightningModel end to end on a local[2] session: checks before any job,
a Pipeline on real data with rank-averaged logged metrics, resume by run_id, transform, save/load,
and CrossValidator. Each fit starts real rank processes, so the frames and epochs are tiny."""

from __future__ import annotations

import os
import signal

import numpy as np
import pandas as pd
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import BinaryClassificationEvaluator, MulticlassClassificationEvaluator
from pyspark.ml.feature import VectorAssembler
from pyspark.ml.linalg import VectorUDT
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder
from pyspark.sql import functions as F_sql

from spark_hvd.spark import Store
from spark_hvd.spark.lightning import LightningEstimator, LightningModel, checks
from spark_hvd.spark.lightning.training import _ShardBatches, history_entry
from spark_helpers import nothing_materialized, resumed_mid_epoch, spark_jobs

ROWS = 96


class Binary(pl.LightningModule):
    """One logit per row from the 3-value 'features' column; label 'y'."""

    def __init__(self, inputs: int = 3, lr: float = 0.05) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(inputs, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.lr = lr

    def forward(self, features):
        return self.net(features)

    def _loss(self, batch):
        return F.binary_cross_entropy_with_logits(self(batch["features"]).squeeze(1), batch["y"].float())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class NoTrainingStep(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(3, 1)

    def forward(self, features):
        return self.net(features)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class NoValidationStep(Binary):
    validation_step = pl.LightningModule.validation_step


class NoOptimizer(Binary):
    def configure_optimizers(self):
        return None


class WrongColumn(Binary):
    def training_step(self, batch, batch_idx):
        return F.mse_loss(self(batch["features"]).squeeze(1), batch["label"])


class Digits(pl.LightningModule):
    """An MLP over the 64 pixels (0 to 16, scaled inside); logs its loss and accuracy, and its rank twice: once
    rank-local and once with sync_dist, so the history shows how both are averaged."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def forward(self, pixels):
        return self.net(pixels / 16.0)

    def training_step(self, batch, batch_idx):
        logits = self(batch["pixels"])
        loss = F.cross_entropy(logits, batch["label"].long())
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        self.log("rank", float(self.global_rank), on_step=False, on_epoch=True)
        self.log("rank_synced", float(self.global_rank), on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        logits = self(batch["pixels"])
        self.log("val_acc", (logits.argmax(1) == batch["label"].long()).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.005)


class UsesTrainer(Binary):
    """Hooks that read self.trainer, which only the ranks' modules have."""

    def training_step(self, batch, batch_idx):
        return self._loss(batch) * (1 + self.trainer.current_epoch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1 / self.trainer.max_epochs)


class FloatLoss(Binary):
    def training_step(self, batch, batch_idx):
        return float(self._loss(batch))

    def configure_optimizers(self):
        return [torch.optim.SGD(self.parameters(), lr=0.1)], []


def test_driver_dry_runs_leave_trainer_hooks_to_the_ranks_and_refuse_a_loss_without_gradient():
    """configure_optimizers and training_step that read self.trainer are not run on the driver (no
    false refusal); Lightning's list forms yield their optimizer; a training_step returning a
    Python float is refused naming the type and the batch."""
    batch = {"features": torch.zeros(4, 3), "y": torch.ones(4, dtype=torch.float64)}
    assert checks.configured_optimizer(UsesTrainer()) is None
    checks.dry_run_training_step(UsesTrainer(), batch)
    assert isinstance(checks.configured_optimizer(FloatLoss()), torch.optim.SGD)
    with pytest.raises(ValueError, match=r"FloatLoss.training_step returned float .* on a batch of \{'features': "
                                         r"\(4, 3\) float32, 'y': \(4,\) float64\} \(one tensor per column, "
                                         r"rows first\): expected the loss"):
        checks.dry_run_training_step(FloatLoss(), batch)


def test_history_entry_keeps_epoch_values_of_what_was_logged():
    """'_step' values are dropped, 'name_epoch' becomes 'name', tensors and numbers become floats,
    and anything else is left out."""
    logged = {"loss_step": torch.tensor(9.0), "loss_epoch": torch.tensor(0.5), "loss": torch.tensor(9.0),
              "acc": torch.tensor([0.25, 0.75]), "lr": 1e-3, "name": "text"}
    assert history_entry(logged) == {"loss": 0.5, "acc": 0.5, "lr": 1e-3}


def test_the_training_loader_starts_the_next_epoch_before_handing_over_the_last_batch():
    """Lightning's training batches of an epoch: exactly the reader's, and the next epoch's reading
    is asked for once the last one is converted, before Lightning gets it (so it overlaps the
    epoch's validation); a loader without the hook asks for nothing."""
    log = []

    class Reader:
        steps_per_epoch = 3

        def iter_epoch(self, epoch):
            log.append(("iter", epoch))
            for step in range(self.steps_per_epoch):
                yield {"x": np.full(2, 10 * epoch + step)}

    def convert(batch):
        log.append(("convert", int(batch["x"][0])))
        return {"x": torch.from_numpy(batch["x"])}

    reader = Reader()
    loader = _ShardBatches(reader, convert, 1, lambda r, e: log.append(("prefetch", e, r is reader)))
    handed = []
    for _ in range(2):
        for batch in loader:
            handed.append(int(batch["x"][0]))
            log.append(("handed", handed[-1]))
    assert handed == [10, 11, 12, 20, 21, 22]
    assert log[:8] == [("iter", 1), ("convert", 10), ("handed", 10), ("convert", 11), ("handed", 11),
                       ("convert", 12), ("prefetch", 1, True), ("handed", 12)]
    assert ("prefetch", 2, True) in log and log.index(("prefetch", 2, True)) < log.index(("handed", 22))
    log.clear()
    assert [int(b["x"][0]) for b in _ShardBatches(reader, convert, 0)] == [0, 1, 2]
    assert not [e for e in log if e[0] == "prefetch"]


@pytest.fixture(scope="module")
def frame(spark):
    """x1..x3, a 0/1 label y, and the assembled Vector 'features'."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 3))
    pdf = pd.DataFrame(x, columns=["x1", "x2", "x3"])
    pdf["y"] = (x @ np.array([1.5, -2.0, 0.5]) > 0).astype(np.float64)
    return VectorAssembler(inputCols=["x1", "x2", "x3"], outputCol="features").transform(
        spark.createDataFrame(pdf)).cache()


def make_estimator(tmp_path, **overrides):
    torch.manual_seed(0)
    params = dict(num_proc=2, model=Binary(), feature_cols=["features"], label_cols=["y"], batch_size=8, epochs=1,
                  store=Store.create(str(tmp_path / "store")), random_seed=3, verbose=0, task="binary")
    params.update(overrides)
    return LightningEstimator(**params)


# -- checks before any Spark job ---------------------------------------------------------------

BAD_FITS = [
    ({"model": torch.nn.Linear(3, 1)}, r"model=Linear is a plain torch.nn.Module and optimizer=None: expected a "
                                       r"torch.optim.Optimizer over its parameters \(with loss=...\)"),
    ({"model": "module"}, r"model='module' is not valid: expected a pytorch_lightning.LightningModule"),
    ({"model": NoTrainingStep()}, r"NoTrainingStep does not define training_step.*fix: implement "
                                  r"NoTrainingStep.training_step"),
    ({"model": NoValidationStep(), "validation": 0.25}, r"validation=0.25 holds rows out for validation, but "
                                                        r"NoValidationStep does not define validation_step"),
    ({"model": NoOptimizer()}, r"NoOptimizer.configure_optimizers returned None: expected an optimizer"),
    ({"trainer_args": {"strategy": "ddp"}}, r"trainer_args sets strategy='ddp', which the estimator sets itself.*"
                                            r"remove 'strategy'"),
    ({"trainer_args": {"devices": 2}}, r"trainer_args sets devices=2.*set num_proc"),
    ({"trainer_args": {"num_nodes": 2}}, r"trainer_args sets num_nodes=2"),
    ({"trainer_args": {"max_epochs": 9}}, r"max_epochs=9.*set epochs instead"),
    ({"trainer_args": {"gradient_clip": 1.0}}, r"trainer_args has \['gradient_clip'\], which pytorch_lightning.Trainer"),
    ({"trainer_args": ["x"]}, r"trainer_args=\['x'\] is not valid: expected a dict"),
    ({"callbacks": [object()]}, r"callbacks\[0\]=<object.*expected pytorch_lightning.Callback"),
    ({"feature_cols": ["nope"]}, r"column 'nope' is not in the DataFrame; available columns: x1, x2"),
    ({"model": Binary(inputs=5)}, r"cannot take the features: Binary\(\(2, 3\)\)"),
    ({"task": "multiclass"}, r"task='multiclass' needs one output value per class"),
    ({"num_proc": 3}, r"num_proc=3 but the cluster has 2 task slots"),
]


@pytest.mark.parametrize("overrides, message", BAD_FITS)
def test_fit_refuses_bad_input_before_any_spark_job(spark, frame, tmp_path, overrides, message):
    """Each mistake raises a ValueError naming the value and the fix; no Spark job ran and nothing
    was written to the store."""
    def call():
        with pytest.raises(ValueError, match=message):
            make_estimator(tmp_path, **overrides).fit(frame)

    assert spark_jobs(spark, call) in ([], None)
    assert nothing_materialized(make_estimator(tmp_path))


def test_a_training_step_that_reads_a_missing_column_fails_on_the_driver(frame, tmp_path):
    """training_step runs once on the driver, on two rows of zeros where the schema tells the
    columns' sizes (before any Spark job); its KeyError is named with the batch's columns, shapes
    and dtypes, before any data is materialized."""
    est = make_estimator(tmp_path, model=WrongColumn())
    with pytest.raises(ValueError, match=r"WrongColumn.training_step raised KeyError: 'label' \(at .*"
                                         r"test_lightning_estimator.py.*on a batch of \{'features': \(2, 3\) "
                                         r"float32, 'y': \(2,\) float64\}"):
        est.fit(frame)
    assert nothing_materialized(est)


# -- fit, resume, transform, save, load --------------------------------------------------------


# Each fit starts rank processes that import torch and Lightning (about 10 s on an idle machine,
# several times that on a busy one); these tests make one and three rounds of fits.
@pytest.mark.timeout(600)
def test_pipeline_on_real_data_averages_logged_metrics_transforms_saves_and_loads(spark, tmp_path):
    """Pipeline([VectorAssembler, LightningEstimator]) on the bundled digits (real 8x8 images), two
    ranks: the history holds each epoch's logged values averaged over the ranks (the rank-local
    'rank' and the sync_dist 'rank_synced' are both 0.5) and the validation accuracy; the model's
    multiclass columns score held-out rows; the fitted pipeline saves and loads with identical
    predictions, and the raw output column is available with task 'none'."""
    from spark_hvd.datasets import load_digits

    images, labels = load_digits()
    columns = [f"p{i}" for i in range(images.shape[1])]
    pdf = pd.DataFrame(images.astype(np.float64), columns=columns)
    pdf["label"] = labels
    train, test = spark.createDataFrame(pdf).randomSplit([0.8, 0.2], seed=5)
    test = test.withColumn("row_id", F_sql.monotonically_increasing_id())
    torch.manual_seed(0)
    module = Digits()
    initial = [p.detach().clone() for p in module.parameters()]
    est = LightningEstimator(num_proc=2, model=module, feature_cols=["pixels"], label_cols=["label"],
                             batch_size=32, epochs=3, validation=0.2, task="multiclass",
                             store=Store.create(str(tmp_path / "store")), random_seed=0, verbose=0)
    fitted = Pipeline(stages=[VectorAssembler(inputCols=columns, outputCol="pixels"), est]).fit(train)
    model = fitted.stages[-1]
    assert isinstance(model, LightningModel) and model.getRunId().startswith("lightning-")
    history = model.getHistory()
    assert [h["epoch"] for h in history] == [1, 2, 3]
    assert all(h["rank"] == 0.5 and h["rank_synced"] == 0.5 for h in history), history
    assert set(history[0]) >= {"train_loss", "val_acc", "rows_per_s", "seconds"}
    assert history[2]["train_loss"] < history[0]["train_loss"] and history[2]["val_acc"] > 0.85, history
    assert all(torch.equal(a, b) for a, b in zip(initial, module.parameters()))  # the driver's module is untouched
    scored = fitted.transform(test)
    accuracy = MulticlassClassificationEvaluator(labelCol="label", metricName="accuracy").evaluate(scored)
    assert accuracy > 0.85, accuracy

    path = str(tmp_path / "pipeline")
    fitted.write().overwrite().save(path)
    loaded = PipelineModel.load(path)
    assert isinstance(loaded.stages[-1], LightningModel) and loaded.stages[-1].getHistory() == history
    before = [(r["prediction"], r["probability"]) for r in scored.orderBy("row_id").collect()]
    after = [(r["prediction"], r["probability"]) for r in loaded.transform(test).orderBy("row_id").collect()]
    assert before == after
    raw = loaded.stages[-1].copy().setTask("none").transform(loaded.stages[0].transform(test))
    assert isinstance(raw.schema["label__output"].dataType, VectorUDT)
    assert len(raw.orderBy("row_id").first()["label__output"]) == 10  # one logit per class


def test_same_run_id_resumes_with_its_optimizer_state_and_a_saved_estimator_returns_the_finished_run(
        frame, tmp_path):
    """A second fit with the run_id and more epochs continues the epoch count from the checkpoint
    (the first epoch's entry kept, the weights trained further); the estimator, saved and loaded,
    returns the complete run from its checkpoint without launching training."""
    est = make_estimator(tmp_path, run_id="resumable", num_proc=1, epochs=1, validation=0.25,
                         callbacks=[pl.callbacks.LearningRateMonitor()])
    first = est.fit(frame)
    # Given no logger, the Trainer logs to TensorBoard under the run's directory, as Horovod's does
    # (so callbacks that need a logger, such as LearningRateMonitor, work).
    logs = est.getStore().get_logs_path("resumable")
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(logs)), os.listdir(logs)
    second = est.setEpochs(2).fit(frame)
    history = second.getHistory()
    assert [h["epoch"] for h in history] == [1, 2] and history[0] == first.getHistory()[0]
    assert "val_loss" in history[1] and "train_loss" in history[1]
    assert not torch.equal(first.getModel().net[0].weight, second.getModel().net[0].weight)
    checkpoint = torch.load(est.getStore().get_checkpoint_path("resumable"), weights_only=False)
    assert checkpoint["epoch"] == 1 and checkpoint["optimizer_states"][0]["state"]  # Adam's moments were kept

    path = str(tmp_path / "estimator")
    est.write().overwrite().save(path)
    reloaded = LightningEstimator.load(path)
    assert reloaded.getEpochs() == 2 and reloaded.getRunId() == "resumable" and isinstance(reloaded.getModel(), Binary)
    again = reloaded.fit(frame)
    assert again.getHistory() == history and "launch" not in again.fit_timings
    assert torch.equal(again.getModel().net[0].weight, second.getModel().net[0].weight)


@pytest.mark.timeout(600)
def test_a_plain_module_with_optimizer_and_loss_trains_as_torch_estimator_does(frame, tmp_path):
    """Horovod's Lightning estimator takes a plain torch.nn.Module with optimizer, loss and metrics:
    it trains to the weights TorchEstimator reaches on the same rows, seed and batches, logs the
    loss and the metric per epoch, and the fitted model scores with the module's forward. Both
    estimators' ranks flush subnormal floats to zero by default (flush_denormal)."""
    from spark_hvd.spark.torch import TorchEstimator

    def accuracy(out, lab):
        return ((out > 0).float() == lab).float().mean()

    def subnormal(out, lab):  # a subnormal float32 times one, as the rank's training thread computes it
        return torch.tensor(1e-39, dtype=torch.float32) * 1.0

    def plain(cls, **extra):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        return cls(num_proc=1, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                   loss=torch.nn.BCEWithLogitsLoss(), metrics=[accuracy, subnormal], feature_cols=["features"], label_cols=["y"],
                   batch_size=8, epochs=2, store=Store.create(str(tmp_path / cls.__name__)), random_seed=3, verbose=0,
                   validation=0.25, **extra)

    lightning = plain(LightningEstimator, task="binary").fit(frame)
    torch_model = plain(TorchEstimator).fit(frame)
    for a, b in zip(lightning.getModel().parameters(), torch_model.getModel().parameters()):
        torch.testing.assert_close(a, b)
    last = lightning.getHistory()[-1]
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(last)
    assert last["loss"] == pytest.approx(torch_model.getHistory()[-1]["loss"], rel=1e-5)
    assert last["subnormal"] == torch_model.getHistory()[-1]["subnormal"] == 0.0
    assert lightning.transform(frame).select("prediction").distinct().count() >= 1


def test_labels_outside_the_declared_binary_task_are_refused_before_training(frame, tmp_path):
    """task='binary' declares the module's loss binary: 0/2 labels are named before any rank starts."""
    with pytest.raises(ValueError, match=rf"label column 'y' holds values outside \[0, 1\] in "
                                         rf"{frame.filter('y = 1').count()} rows \(the first: 2.0\), but "
                                         r"task='binary' takes labels in \[0, 1\]"):
        make_estimator(tmp_path).fit(frame.withColumn("y", F_sql.col("y") * 2))


def test_set_learning_rate_keeps_a_schedulers_factor_and_sets_its_base():
    """The learning_rate Param on what configure_optimizers built: a LambdaLR at factor 0.5 keeps
    its factor of the new base rate, and its later steps follow the new base."""
    from spark_hvd.spark.lightning.training import set_learning_rate

    net = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.5 ** (epoch + 1))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    set_learning_rate([optimizer], [scheduler], 0.4)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    assert scheduler.get_last_lr() == [pytest.approx(0.2)]
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)


def test_cross_validator_fits_folds_and_picks_a_model(frame, tmp_path):
    """CrossValidator over two learning rates (two one-rank fits at a time) gives a metric per
    grid point and a LightningModel that transforms; the learning_rate Param replaces the rate
    configure_optimizers gives (0.0 leaves the module's weights as they were)."""
    est = make_estimator(tmp_path, num_proc=1)
    initial = [p.detach().clone() for p in est.getModel().parameters()]
    grid = ParamGridBuilder().addGrid(est.learning_rate, [0.0, 0.05]).build()
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid, evaluator=BinaryClassificationEvaluator(labelCol="y"),
                        numFolds=2, parallelism=2, seed=1, collectSubModels=True)
    cv_model = cv.fit(frame)
    assert len(cv_model.avgMetrics) == 2 and all(0.0 <= m <= 1.0 for m in cv_model.avgMetrics)
    for still, moved in cv_model.subModels:
        assert all(torch.equal(a, b) for a, b in zip(initial, still.getModel().parameters()))
        assert not all(torch.equal(a, b) for a, b in zip(initial, moved.getModel().parameters()))
    best = cv_model.bestModel
    assert isinstance(best, LightningModel) and best.getTask() == "binary"
    assert best.transform(frame).select("prediction").distinct().count() >= 1


class KillRankOnce(pl.Callback):
    """Rank 1 kills its own process (SIGKILL) as epoch ``epoch`` (from 0) starts, once: a marker
    file keeps the retried stage from doing it again."""

    def __init__(self, marker, epoch):
        self.marker, self.epoch = str(marker), epoch

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.global_rank == 1 and trainer.current_epoch == self.epoch and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.timeout(600)
def test_a_killed_rank_is_retried_from_the_last_epoch_checkpoint(frame, tmp_path, capsys):
    """Rank 1 dies as epoch 2 starts: fit reports the retry, Lightning resumes from the epoch-1
    checkpoint, the history has each epoch once; cleanup_intermediate removes the materialized data."""
    marker = tmp_path / "killed"
    est = make_estimator(tmp_path, epochs=2, verbose=1, run_id="killed", callbacks=[KillRankOnce(marker, 1)],
                         cleanup_intermediate=True)
    model = est.fit(frame)
    printed = capsys.readouterr().out
    assert marker.exists()
    assert "retry 1/3 (attempt 2) after the barrier stage failed" in printed, printed[-3000:]
    assert "resuming from the end of epoch 1" in printed, printed[-3000:]
    assert [h["epoch"] for h in model.getHistory()] == [1, 2]
    assert est.getStore().list_intermediate() == []


class KillRankAfterBatch(pl.Callback):
    """Rank 1 kills its own process after batch ``batch`` of epoch ``epoch`` (both from 0), once;
    rank 0 logs its pid and epoch for every batch it trains."""

    def __init__(self, marker, log, epoch, batch):
        self.marker, self.batch_log, self.epoch, self.batch = str(marker), str(log), epoch, batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 0:
            with open(self.batch_log, "a") as f:
                f.write(f"{os.getpid()} {trainer.current_epoch}\n")
        if (trainer.global_rank == 1 and (trainer.current_epoch, batch_idx) == (self.epoch, self.batch)
                and not os.path.exists(self.marker)):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.timeout(600)
def test_a_retry_resumes_within_the_epoch_from_a_mid_epoch_checkpoint(frame, tmp_path, capsys):
    """checkpoint_every_steps=2: rank 1 dies after the 3rd batch of epoch 2, so the retry resumes
    Lightning from the checkpoint at that epoch's step 2, trains the epoch's other batches and the
    last epoch; each epoch is in the history once, with the losses and the very weights of an
    uninterrupted run of the same seed (whose mid-epoch checkpoints do not change its training)."""
    resumed, baseline = resumed_mid_epoch(make_estimator, frame, tmp_path, capsys, KillRankAfterBatch,
                                          steps=ROWS // (2 * 8))
    history, want = resumed.getHistory(), baseline.getHistory()
    for got, expected in zip(history, want):
        # The loss training_step returned, over every batch of each epoch once.
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5), (history, want)
    # What the module logged with on_epoch=True: Lightning's own running values are not in its
    # checkpoints, so the resumed epoch's covers the batches after the resume.
    for got, expected in (history[0], want[0]), (history[2], want[2]):
        assert got["train_loss"] == pytest.approx(expected["train_loss"], rel=1e-5), (history, want)
    for a, b in zip(resumed.getModel().parameters(), baseline.getModel().parameters()):
        assert torch.equal(a, b)
