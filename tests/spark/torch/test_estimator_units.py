"""TorchEstimator and TorchModel without Spark: Params, driver-side checks, tensor rules, progress
lines, and the rank training loop in two real local processes (spark_hvd.runner.run)."""

from __future__ import annotations

import io
import os
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from spark_hvd.runner import run as run_local
from spark_hvd.spark.data.store import Store
from spark_hvd.spark.torch import TorchEstimator, TorchModel
from spark_hvd.spark.estimator import checks as common
from spark_hvd.spark.torch import batches, checks
from spark_hvd.spark.estimator.progress import PROGRESS_PREFIX, ProgressPrinter, ProgressReporter, format_epoch
from spark_hvd.spark.torch.training import (OptimizerSpec, TorchTrainingSpec, checkpoint_bytes, load_checkpoint,
                                            train_on_rank)

ISSUE_PARAMS = [
    "num_proc", "model", "optimizer", "loss", "loss_weights", "metrics", "feature_cols", "label_cols",
    "sample_weight_col", "validation", "batch_size", "val_batch_size", "epochs", "train_steps_per_epoch",
    "validation_steps_per_epoch", "shuffle", "random_seed", "store", "run_id", "callbacks",
    "gradient_compression", "backward_passes_per_step", "input_shapes", "transformation_fn",
    "train_minibatch_fn", "use_gpu", "verbose", "reader",
]


class TwoInputs(torch.nn.Module):
    """forward(a, b): two feature columns."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)

    def forward(self, a, b):
        return self.linear(torch.cat([a, b], dim=1))


# -- Params ------------------------------------------------------------------------------------


def test_estimator_has_every_issue_param_with_accessors_and_keyword_constructor():
    """Each Param named by the issue is settable by keyword and readable by its generated getter."""
    est = TorchEstimator(num_proc=3, epochs=4, feature_cols=["f"], label_cols=["y"], reader="petastorm")
    for name in ISSUE_PARAMS:
        camel = "".join(part.capitalize() for part in name.split("_"))
        assert est.hasParam(name)
        assert callable(getattr(est, "get" + camel)) and callable(getattr(est, "set" + camel))
    assert (est.getNumProc(), est.getEpochs(), est.getFeatureCols(), est.getReader()) == (3, 4, ["f"], "petastorm")
    assert est.setBatchSize(8) is est and est.getBatchSize() == 8
    with pytest.raises(TypeError):
        TorchEstimator(2)  # keyword-only


def test_estimator_defaults_and_bad_values():
    """Defaults follow Horovod; invalid values fail with the Param name and the value."""
    est = TorchEstimator()
    assert (est.getBatchSize(), est.getEpochs(), est.getShuffle(), est.getScaleLr(), est.getReader(),
            est.getBackwardPassesPerStep(), est.getVerbose()) == (32, 1, True, True, "builtin", 1, 1)
    with pytest.raises(ValueError, match=r"epochs=0"):
        TorchEstimator(epochs=0)
    with pytest.raises(ValueError, match=r"reader='arrow'.*'builtin'"):
        est.setReader("arrow")
    with pytest.raises(ValueError, match=r"unknown parameter 'epoch'.*did you mean 'epochs'"):
        TorchEstimator(epoch=2)


def test_estimator_copy_and_pickle_keep_params():
    """copy(extra) (used by CrossValidator) and pickling keep every Param, the model included."""
    model = torch.nn.Linear(2, 1)
    est = TorchEstimator(model=model, batch_size=4, label_cols=["y"])
    other = est.copy({est.getParam("batch_size"): 16})
    assert other.getBatchSize() == 16 and est.getBatchSize() == 4 and other.getModel() is model
    loaded = pickle.loads(pickle.dumps(est))
    assert loaded.getLabelCols() == ["y"] and isinstance(loaded.getModel(), torch.nn.Linear)


def test_model_output_cols_default_to_label_output():
    """TorchModel writes <label>__output unless output_cols is set."""
    model = TorchModel(label_cols=["y", "z"])
    assert model.getOutputCols() == ["y__output", "z__output"]
    assert pickle.loads(pickle.dumps(model)).getLabelCols() == ["y", "z"]
    model.setOutputCols(["p", "q"])
    assert model.getOutputCols() == ["p", "q"]


# -- driver-side checks ------------------------------------------------------------------------


def test_feature_count_is_checked_against_forward():
    """Too many or too few feature columns for forward() name the counts and the VectorAssembler fix."""
    checks.check_feature_count(TwoInputs(), ["a", "b"])
    with pytest.raises(ValueError, match=r"gives 1 input\(s\) but TwoInputs.forward takes 2.*VectorAssembler"):
        checks.check_feature_count(TwoInputs(), ["a"])
    with pytest.raises(ValueError, match=r"gives 3 input\(s\)"):
        checks.check_feature_count(torch.nn.Linear(2, 1), ["a", "b", "c"])


def test_losses_and_weights_are_matched_to_label_columns():
    """One loss may serve all labels; lists must have one entry per label."""
    mse = torch.nn.MSELoss()
    assert checks.check_losses(mse, None, ["a", "b"]) == ([mse, mse], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"loss has 1 entries for 2 label column"):
        checks.check_losses([mse], None, ["a", "b"])
    with pytest.raises(ValueError, match=r"loss_weights=\[1.0\] has 1 entries for 2"):
        checks.check_losses(mse, [1.0], ["a", "b"])
    with pytest.raises(ValueError, match=r"loss=None.*BCEWithLogitsLoss"):
        checks.check_losses(None, None, ["a"])


def test_dry_run_reports_wrong_input_size_and_output_count():
    """The model is tried on zeros: a size mismatch or a missing output is a clear ValueError."""
    model = torch.nn.Linear(4, 2)
    assert checks.dry_run(model, [(4,)], 1, torch.float32) == [(2,)]
    with pytest.raises(ValueError, match=r"cannot take the features: Linear\(\(2, 3\)\) raised"):
        checks.dry_run(model, [(3,)], 1, torch.float32)
    with pytest.raises(ValueError, match=r"returned 1 output\(s\) for 2 label column"):
        checks.dry_run(model, [(4,)], 2, torch.float32)
    assert model.training  # the mode is restored


def test_input_shapes_are_resolved_against_column_sizes():
    """-1 is filled in from the column's size; sizes that do not match are refused."""
    assert common.feature_shapes([[2, -1]], ["img"], [6]) == [(2, 3)]
    assert common.feature_shapes(None, ["x", "v"], [1, 5]) == [(1,), (5,)]
    assert common.feature_shapes(None, ["v"], [None]) is None
    with pytest.raises(ValueError, match=r"holds 4 values per row but the column has 6"):
        common.feature_shapes([[2, 2]], ["img"], [6])
    with pytest.raises(ValueError, match=r"input_shapes has 1 shape\(s\) for 2 feature"):
        common.feature_shapes([[2]], ["a", "b"], [2, 2])


def test_optimizer_spec_rebuilds_groups_over_another_model_copy():
    """Hyperparameters, per-group parameters and state move to a copy; foreign parameters are refused."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.5},
                           {"params": model[1].parameters(), "momentum": 0.9}], lr=0.1)
    spec = pickle.loads(pickle.dumps(OptimizerSpec.of(opt, model)))
    copy = pickle.loads(pickle.dumps(model))
    rebuilt = spec.build(copy)
    assert [g["lr"] for g in rebuilt.param_groups] == [0.5, 0.1]
    assert rebuilt.param_groups[1]["momentum"] == 0.9
    assert rebuilt.param_groups[1]["params"][0] is copy[1].weight
    with pytest.raises(ValueError, match=r"1 parameter\(s\) that are not parameters of the model"):
        OptimizerSpec.of(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), model)


# -- tensors, losses, metrics ------------------------------------------------------------------


def test_labels_follow_their_outputs():
    """Same-size labels take the output's shape and dtype; others become int64 class ids."""
    out = torch.zeros(4, 1)
    label = torch.tensor([0, 1, 1, 0], dtype=torch.int32)
    assert batches.align_labels([out], [label])[0].shape == (4, 1)
    assert batches.align_labels([out], [label])[0].dtype == torch.float32
    classes = batches.align_labels([torch.zeros(4, 3)], [label.double().reshape(4, 1)])[0]
    assert classes.dtype == torch.int64 and classes.shape == (4,)


def test_sample_weights_scale_each_rows_loss():
    """With weights, the loss is the mean of weight * per-row loss, for modules and functions alike."""
    out = torch.tensor([[0.5], [1.0], [2.0]])
    lab = torch.tensor([[1.0], [0.0], [1.0]])
    w = torch.tensor([1.0, 2.0, 0.0])
    expected = ((out - lab).reshape(-1) ** 2 * w).mean()
    for loss in (torch.nn.MSELoss(), torch.nn.functional.mse_loss):
        assert torch.isclose(batches.LossFunction([loss], [1.0])([out], [lab], w), expected)
    assert torch.isclose(batches.LossFunction([torch.nn.MSELoss()], [3.0])([out], [lab]),
                         3 * torch.nn.functional.mse_loss(out, lab))
    with pytest.raises(ValueError, match=r"one value per row"):
        batches.LossFunction([lambda o, l: ((o - l) ** 2).mean()], [1.0])([out], [lab], w)



def test_weighted_loss_is_the_same_at_every_step_and_leaves_the_users_loss_alone():
    """The per-row form of a loss is made once and reused: every step gives the hand-computed value
    and gradient, for one value per row and for several (averaged per row first), while the
    user's loss module keeps its own reduction and shares its tensors (pos_weight) with that form."""
    pos_weight = torch.tensor([2.0])
    module = torch.nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    loss = batches.LossFunction([module], [1.0])
    for step in range(3):
        out = torch.linspace(-1.0, 1.0, 4).reshape(4, 1).requires_grad_(True)
        lab = torch.tensor([[1.0], [0.0], [1.0], [0.0]])
        w = torch.tensor([1.0, 2.0, 0.5, float(step)])
        value = loss([out], [lab], w)
        value.backward()
        reference = out.detach().clone().requires_grad_(True)
        per_row = torch.nn.functional.binary_cross_entropy_with_logits(reference, lab, pos_weight=pos_weight,
                                                                       reduction="none").reshape(-1)
        (per_row * w).mean().backward()
        assert torch.equal(value.detach(), (per_row * w).mean().detach())
        assert torch.equal(out.grad, reference.grad)
    assert module.reduction == "mean"
    pos_weight.fill_(5.0)  # the user changes the tensor in place: the loss follows
    out, lab = torch.zeros(2, 1), torch.ones(2, 1)
    assert torch.isclose(loss([out], [lab], torch.ones(2)), 5.0 * torch.log(torch.tensor(2.0)))
    several = batches.LossFunction([torch.nn.MSELoss()], [1.0])
    out3, lab3, w2 = torch.arange(6.0).reshape(2, 3), torch.zeros(2, 3), torch.tensor([1.0, 3.0])
    assert torch.isclose(several([out3], [lab3], w2), ((out3 ** 2).mean(dim=1) * w2).mean())

def test_feature_tensors_cast_to_model_dtype_and_shape():
    """Read-only float64 arrays become (rows, *shape) tensors of the model's dtype."""
    values = np.arange(12, dtype=np.float64).reshape(2, 6)
    values.flags.writeable = False
    (tensor,) = batches.feature_tensors({"x": values}, ["x"], [(2, 3)], torch.float32, torch.device("cpu"))
    assert tensor.shape == (2, 2, 3) and tensor.dtype == torch.float32
    assert batches.model_dtype(torch.nn.Linear(2, 1).double()) == torch.float64


def test_metric_names_are_unique_and_per_label():
    """Metric keys come from function names, per label when several, never clashing with 'loss'."""
    def acc(o, l):
        return o

    assert batches.metric_names([acc, lambda o, l: o, acc], ["y"]) == ["acc", "metric", "acc_2"]
    assert batches.metric_names([acc], ["y", "z"]) == ["y_acc", "z_acc"]


# -- progress ----------------------------------------------------------------------------------


def test_progress_is_due_once_per_interval_and_always_when_forced():
    """The training loop asks due() before computing a step's values: only rank 0 with steps on,
    at most once per interval, and always for a forced (last) step."""
    out = io.StringIO()
    reporter = ProgressReporter(True, steps=True, interval_s=60.0, out=out)
    assert reporter.due()  # nothing reported yet
    reporter.step(0, 1, 0.5)
    assert not reporter.due() and reporter.due(force=True)
    assert not ProgressReporter(False, steps=True, interval_s=0.0).due(force=True)
    assert not ProgressReporter(True, steps=False, interval_s=0.0).due(force=True)
    assert out.getvalue().count('"event": "step"') == 1


def test_progress_lines_become_epoch_lines_on_the_driver():
    """Rank 0's progress events print one line per epoch; other rank output passes through."""
    rank_out = io.StringIO()
    reporter = ProgressReporter(True, steps=True, interval_s=0.0, out=rank_out)
    reporter.start(epochs=2, start_epoch=0, steps=3, val_steps=0, size=2, batch_size=4)
    reporter.step(0, 1, 0.9)
    reporter.epoch(0, {"loss": 0.5, "acc": 0.75, "rows_per_s": 1234.0, "seconds": 0.5})
    out, err = io.StringIO(), io.StringIO()
    printer = ProgressPrinter(1, out=out, err=err, bar=False)
    for line in rank_out.getvalue().splitlines():
        printer.stdout.write(f"[0]<stdout>:{line}\n")
    printer.stdout.write("[1]<stdout>:hello from rank 1\n")
    printer.stderr.write("[0]<stderr>:a warning\n")
    assert out.getvalue().splitlines() == ["epoch 1/2: loss 0.5000, acc 0.7500, 1,234 rows/s, 0.5 s",
                                           "[1]<stdout>:hello from rank 1"]
    assert err.getvalue() == "[0]<stderr>:a warning\n"
    assert printer.started_at is not None and printer.last_epoch_at is not None
    assert PROGRESS_PREFIX not in out.getvalue()
    quiet = ProgressPrinter(0, out=out, err=err, bar=False)
    quiet.stdout.write("[1]<stdout>:not shown\n")
    assert "not shown" not in out.getvalue()


def test_format_epoch_orders_metrics_then_speed():
    """The epoch line lists loss and metrics, then rows per second and seconds."""
    line = format_epoch(2, 5, {"loss": 1.0, "val_loss": 2.0, "rows_per_s": 10.0, "seconds": 3.0})
    assert line == "epoch 3/5: loss 1.0000, val_loss 2.0000, 10 rows/s, 3.0 s"


# -- the rank loop in two local processes ------------------------------------------------------


def _write_shards(path, rows_per_file, files, seed=0):
    """Parquet like prepare_data writes: a float32 array column 'features' and a float label 'y'."""
    os.makedirs(path)
    rng = np.random.default_rng(seed)
    for i in range(files):
        x = rng.normal(size=(rows_per_file, 3)).astype(np.float32)
        y = (x @ np.array([1.0, -1.0, 0.5]) > 0).astype(np.float64)
        pq.write_table(pa.table({"features": pa.array(list(x)), "y": y}), os.path.join(path, f"part-{i}.parquet"))


def _spec(tmp_path, model, optimizer, **overrides):
    store = Store.create(str(tmp_path / "store"))
    values = dict(
        model=model, optimizer=OptimizerSpec.of(optimizer, model), losses=[torch.nn.BCEWithLogitsLoss()],
        loss_weights=[1.0], metrics=[], metric_names=[], feature_cols=["features"], label_cols=["y"],
        sample_weight_col=None, feature_shapes=[(3,)], column_shapes={"features": (3,), "y": ()},
        train_url=str(tmp_path / "train"), val_url=None, storage_options={}, reader="builtin", batch_size=8,
        val_batch_size=8, epochs=1, start_epoch=0, train_steps=1, val_steps=0, shuffle=False, seed=0,
        random_seed=0, store=store, checkpoint_path=store.get_checkpoint_path("run"), progress=False)
    values.update(overrides)
    return TorchTrainingSpec(**values), store


def _one_sgd_step_expected(tmp_path, model, lr):
    """Weights after one SGD step on the gradient averaged over both ranks' first batches."""
    grads = []
    for rank in range(2):
        table = pq.read_table(str(tmp_path / "train" / f"part-{rank}.parquet"))
        x = torch.tensor(np.stack(table.column("features").to_pylist())[:8], dtype=torch.float32)
        y = torch.tensor(table.column("y").to_numpy()[:8], dtype=torch.float32).reshape(8, 1)
        copy = pickle.loads(pickle.dumps(model))
        torch.nn.functional.binary_cross_entropy_with_logits(copy(x), y).backward()
        grads.append(copy.weight.grad.clone())
    return model.weight.detach() - lr * (grads[0] + grads[1]) / 2


@pytest.mark.parametrize("scale_lr, factor", [(True, 2.0), (False, 1.0)])
def test_one_step_averages_gradients_and_scales_lr_by_world_size(tmp_path, scale_lr, factor):
    """After one step each rank holds weights moved by lr * size (or lr) times the mean gradient."""
    _write_shards(tmp_path / "train", rows_per_file=8, files=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    spec, _ = _spec(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1), scale_lr=scale_lr)
    results = run_local(train_on_rank, args=(spec,), np=2)
    expected = _one_sgd_step_expected(tmp_path, model, 0.1 * factor)
    assert results[1] is None
    assert torch.allclose(results[0]["model"]["weight"], expected, atol=1e-6)


def test_checkpoint_every_epoch_and_resume_continues_the_count(tmp_path):
    """Rank 0 stores model, optimizer (unscaled lr) and epoch; a spec resuming it trains the rest."""
    _write_shards(tmp_path / "train", rows_per_file=16, files=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def acc(out, lab):
        return ((out > 0).float() == lab).float().mean()

    spec, store = _spec(tmp_path, model, opt, epochs=2, train_steps=2, metrics=[acc], metric_names=["acc"],
                        val_url=str(tmp_path / "train"), val_steps=1)
    first = run_local(train_on_rank, args=(spec,), np=2)[0]
    saved = load_checkpoint(store.read(spec.checkpoint_path))
    assert saved["epoch"] == 2 and [h["epoch"] for h in saved["history"]] == [1, 2]
    assert set(saved["history"][0]) == {"epoch", "loss", "acc", "val_loss", "val_acc", "rows_per_s", "seconds"}
    assert saved["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.01)
    assert torch.equal(saved["model"]["weight"], first["model"]["weight"])

    resumed_spec, _ = _spec(tmp_path, model, opt, epochs=3, train_steps=2, start_epoch=2,
                            history=saved["history"], resume_model=saved["model"],
                            resume_optimizer=saved["optimizer"])
    resumed = run_local(train_on_rank, args=(resumed_spec,), np=2)[0]
    assert [h["epoch"] for h in resumed["history"]] == [1, 2, 3]
    assert resumed["history"][:2] == saved["history"]
    assert load_checkpoint(store.read(spec.checkpoint_path))["epoch"] == 3
    assert not torch.equal(resumed["model"]["weight"], first["model"]["weight"])


def test_checkpoint_bytes_round_trip():
    """A checkpoint loads back (tensors only) with its epoch, history and state."""
    model = torch.nn.Linear(2, 1)
    data = checkpoint_bytes(3, model, torch.optim.SGD(model.parameters(), lr=0.1).state_dict(), [{"epoch": 3}])
    loaded = load_checkpoint(data)
    assert loaded["epoch"] == 3 and loaded["history"] == [{"epoch": 3}]
    assert torch.equal(loaded["model"]["weight"], model.weight.detach())


def test_callbacks_transformation_fn_compression_and_accumulation(tmp_path):
    """Callbacks see every hook in order and can stop all ranks early; transformation_fn changes
    the batches; fp16 compression and two backward passes per step run; metrics are averaged
    over the ranks."""
    _write_shards(tmp_path / "train", rows_per_file=16, files=2)

    class Recorder:
        def __init__(self):
            self.calls = []

        def on_train_begin(self, state):
            self.calls.append("train_begin")

        def on_epoch_begin(self, epoch, state):
            self.calls.append(f"epoch_begin:{epoch}")

        def on_batch_end(self, step, logs, state):
            self.calls.append(f"batch_end:{step}")

        def on_epoch_end(self, epoch, logs, state):
            self.calls.append(f"epoch_end:{epoch}")
            state.stop_training = state.rank == 1  # one rank asks; both must stop

        def on_train_end(self, state):
            self.calls.append("train_end")
            state.history[-1]["calls"] = list(self.calls)

    def labels_to_two(batch):
        return {**batch, "y": batch["y"] * 0 + 2.0}

    def rank_metric(out, lab):
        import spark_hvd.torch as hvd

        return torch.tensor(float(hvd.rank()))

    import spark_hvd.torch as hvd_torch

    model = torch.nn.Linear(3, 1)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    spec, _ = _spec(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.0), losses=[torch.nn.MSELoss()],
                    epochs=3, train_steps=4, backward_passes_per_step=2, compression=hvd_torch.Compression.fp16,
                    transformation_fn=labels_to_two, callbacks=[Recorder()], metrics=[rank_metric],
                    metric_names=["rank_metric"])
    history = run_local(train_on_rank, args=(spec,), np=2)[0]["history"]
    assert len(history) == 1
    assert history[0]["loss"] == 4.0  # zero outputs against labels of 2
    assert history[0]["rank_metric"] == 0.5  # ranks 0 and 1, averaged
    assert history[0]["calls"] == ["train_begin", "epoch_begin:0", "batch_end:0", "batch_end:1", "batch_end:2",
                                   "batch_end:3", "epoch_end:0", "train_end"]


class _SubnormalProbe:
    """Records what the rank's training thread computes for a subnormal float32 times one."""

    def on_train_end(self, state):
        state.history[-1]["subnormal"] = float(torch.tensor([1e-39], dtype=torch.float32)[0] * 1.0)


@pytest.mark.parametrize("flush", [True, False])
def test_ranks_flush_subnormal_floats_unless_told_not_to(tmp_path, flush):
    """flush_denormal=True (the default) makes the rank's math treat subnormal floats as zero, which
    keeps a model whose values drift there at full speed; False keeps IEEE subnormals."""
    _write_shards(tmp_path / "train", rows_per_file=8, files=2)
    model = torch.nn.Linear(3, 1)
    spec, _ = _spec(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[_SubnormalProbe()],
                    flush_denormal=flush)
    history = run_local(train_on_rank, args=(spec,), np=2)[0]["history"]
    if flush:
        assert history[0]["subnormal"] == 0.0
    else:
        assert history[0]["subnormal"] == pytest.approx(1e-39, rel=1e-3)


def test_train_minibatch_fn_replaces_the_step(tmp_path):
    """A train_minibatch_fn gets Horovod's arguments and its returned loss is what is reported."""
    _write_shards(tmp_path / "train", rows_per_file=8, files=2)

    def minibatch(model, optimizer, transform_outputs, loss_fn, inputs, labels, sample_weights):
        optimizer.zero_grad()
        outputs, aligned = transform_outputs(model(*inputs), labels)
        loss = loss_fn(outputs, aligned, sample_weights)
        loss.backward()
        optimizer.step()
        assert sample_weights is None and len(inputs) == 1 and inputs[0].shape == (8, 3)
        return outputs, loss.detach() * 0 + 7.0

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    spec, _ = _spec(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1), train_minibatch_fn=minibatch)
    result = run_local(train_on_rank, args=(spec,), np=2)[0]
    assert result["history"][0]["loss"] == 7.0
    assert not torch.equal(result["model"]["weight"], model.weight.detach())


def test_local_master_uses_the_driver_python_when_the_configured_one_lacks_spark_hvd():
    """On a local master, a PYSPARK_PYTHON that cannot import spark_hvd is replaced by the
    driver's interpreter."""
    import sys

    from spark_hvd.spark.session import SessionInfo

    class FakeContext:
        master = "local[2]"
        pythonExec = "/nonexistent/bin/python3"

    class FakeSession:
        sparkContext = FakeContext()

        class conf:
            @staticmethod
            def get(key, default=None):
                return "/nonexistent/bin/python3" if key == "spark.pyspark.python" else default

    session = FakeSession()
    classic = SessionInfo(connect=False, master="local[2]", slots=2, default_parallelism=2, client_is_local=True)
    common.ensure_executor_python(session, classic, ("torch",))
    assert session.sparkContext.pythonExec == sys.executable
    # A Spark Connect server started with its Python already: the fix is named instead.
    connect = SessionInfo(connect=True, master="local[2]", slots=2, default_parallelism=2, client_is_local=True)
    with pytest.raises(ValueError, match=r"/nonexistent/bin/python3.*PYSPARK_PYTHON=.*local_session\(connect=True\)"):
        common.ensure_executor_python(session, connect, ("torch",))
    # A remote cluster's executors are not this machine's: nothing to probe here.
    remote = SessionInfo(connect=True, master="spark://h:7077", slots=None, default_parallelism=2, client_is_local=False)
    common.ensure_executor_python(session, remote, ("torch",))


class _Recorder:
    """A reader that logs prefetch and iter_epoch calls (with its name) before passing them on."""

    def __init__(self, reader, name, log):
        self.reader, self.name, self.log = reader, name, log
        self.steps_per_epoch = reader.steps_per_epoch

    def prefetch(self, epoch):
        self.log.append((self.name, "prefetch", epoch))
        self.reader.prefetch(epoch)

    def iter_epoch(self, epoch):
        self.log.append((self.name, "iter", epoch))
        yield from self.reader.iter_epoch(epoch)

    def close(self):
        self.reader.close()


class _RecordingSpec(TorchTrainingSpec):
    """Opens readers that log into ``log`` (a class attribute, set by the test)."""

    log: list = []

    def open_reader(self, rank, size, validation=False):
        return _Recorder(super().open_reader(rank, size, validation), "val" if validation else "train", self.log)


class _NoPrefetchSpec(TorchTrainingSpec):
    """Reads each epoch only when it starts."""

    def prefetch_next(self, train_reader, epoch):
        pass


def test_the_next_epoch_is_read_while_this_one_validates_and_none_after_the_last(tmp_path):
    """Epoch e+1's reading starts right after epoch e's last step, before its validation, and
    the last epoch starts no reading; the weights equal those of a fit that reads each epoch when
    it starts (one process, a world of one)."""
    _write_shards(tmp_path / "train", rows_per_file=32, files=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    spec, _ = _spec(tmp_path, model, opt, epochs=3, train_steps=4, shuffle=True,
                    val_url=str(tmp_path / "train"), val_steps=1)

    def fields(model_copy):
        return {**{f: getattr(spec, f) for f in spec.__dataclass_fields__}, "model": model_copy}

    _RecordingSpec.log = log = []
    trained = train_on_rank(_RecordingSpec(**fields(pickle.loads(pickle.dumps(model)))))["model"]
    assert log == [("train", "prefetch", 0),
                   ("train", "iter", 0), ("train", "prefetch", 1), ("val", "iter", 0),
                   ("train", "iter", 1), ("train", "prefetch", 2), ("val", "iter", 1),
                   ("train", "iter", 2), ("val", "iter", 2)]
    plain = train_on_rank(_NoPrefetchSpec(**fields(pickle.loads(pickle.dumps(model)))))["model"]
    assert not torch.equal(trained["weight"], model.weight.detach())
    assert torch.equal(plain["weight"], trained["weight"]) and torch.equal(plain["bias"], trained["bias"])


def test_early_stopping_follows_keras_rule():
    """Patience counts epochs in a row without an improvement larger than min_delta; 'auto' reads
    accuracy and AUC as higher-is-better; a NaN never improves; the state round-trips."""
    from spark_hvd.spark.torch.params import ToEarlyStopping
    from spark_hvd.spark.torch.stopping import EarlyStopping, monitor_mode

    assert monitor_mode("val_accuracy") == "max" and monitor_mode("val_auc") == "max"
    assert monitor_mode("val_loss") == "min" and monitor_mode("val_loss", "max") == "max"
    rule = EarlyStopping(ToEarlyStopping().bind("early_stopping")({"patience": 2, "min_delta": 0.1}))
    assert [rule.update(e, {"val_loss": v}) for e, v in enumerate([1.0, 0.95, 0.85, float("nan")], 1)] == \
        [True, False, True, False]
    assert not rule.stopped and rule.best_epoch == 3
    again = EarlyStopping(ToEarlyStopping()({"patience": 2, "min_delta": 0.1}), rule.state())
    assert not again.update(5, {"val_loss": 0.8}) and again.stopped and again.best == pytest.approx(0.85)
    assert "did not improve by more than 0.1 for 2 epoch(s) after epoch 3" in again.describe()
    with pytest.raises(KeyError, match="early_stopping monitors 'val_loss'"):
        again.update(6, {"loss": 0.1})


@pytest.mark.parametrize("value", [{"patience": -1}, {"monitor": ""}, {"mode": "up"}, {"patiance": 2}, "val_loss",
                                   {"restore_best_weights": 1}])
def test_early_stopping_param_refuses_bad_settings(value):
    with pytest.raises(ValueError, match=r"early_stopping=.* is not valid: expected a dict with some of monitor"):
        TorchEstimator(early_stopping=value)
