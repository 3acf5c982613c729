"""A Horovod Spark program moves over by renaming its imports: Horovod's module paths, run() and
run_elastic() arguments, Store arguments, every estimator Param (effective, or accepted with one
warning), the fitted models' accessors and output columns, and Databricks' HorovodRunner."""

from __future__ import annotations

import inspect
import io
import os
import sys
import warnings
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import pytorch_lightning as pl
import torch
from pyspark.ml.functions import vector_to_array
from pyspark.ml.linalg import Vectors

from spark_hvd.spark.estimator import base

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "docs"))
import horovod_api  # noqa: E402  (docs/horovod_api.py: Horovod 0.28's Spark API as data)

pytestmark = pytest.mark.timeout(900)

HOROVOD_RUN, HOROVOD_RUN_ELASTIC = horovod_api.RUN, horovod_api.RUN_ELASTIC
HOROVOD_TORCH, HOROVOD_KERAS, HOROVOD_LIGHTNING = horovod_api.TORCH, horovod_api.KERAS, horovod_api.LIGHTNING


def test_horovods_module_paths_name_the_same_classes():
    """horovod.spark.common.store/backend, horovod.spark.torch/keras/lightning: each name is ours."""
    import spark_hvd.spark as spark
    from spark_hvd.spark import keras as spark_keras
    from spark_hvd.spark import lightning as spark_lightning
    from spark_hvd.spark import torch as spark_torch
    from spark_hvd.spark.common.backend import Backend, SparkBackend
    from spark_hvd.spark.common.store import DBFSLocalStore, FilesystemStore, HDFSStore, LocalStore, Store

    assert (Store, LocalStore, DBFSLocalStore, HDFSStore) == (spark.Store, spark.LocalStore, spark.DBFSLocalStore,
                                                              spark.HDFSStore)
    assert issubclass(spark.FsspecStore, FilesystemStore) and issubclass(spark.LocalStore, FilesystemStore)
    assert SparkBackend is spark.SparkBackend and Backend is spark.Backend
    assert spark_torch.TorchEstimator and spark_torch.TorchModel and spark_keras.KerasEstimator and spark_keras.KerasModel
    assert spark_lightning.TorchEstimator is spark_lightning.LightningEstimator
    assert spark_lightning.TorchModel is spark_lightning.LightningModel
    assert callable(spark.run) and callable(spark.run_elastic) and spark.HorovodRunner


def test_run_and_run_elastic_take_horovods_arguments_in_its_order():
    """A call written for horovod.spark.run binds the same way here, positional arguments too."""
    from spark_hvd.spark import run, run_elastic

    assert list(inspect.signature(run).parameters)[:len(HOROVOD_RUN)] == HOROVOD_RUN
    assert list(inspect.signature(run_elastic).parameters)[:len(HOROVOD_RUN_ELASTIC)] == HOROVOD_RUN_ELASTIC


@pytest.mark.parametrize("estimator, names", [("torch", HOROVOD_TORCH), ("keras", HOROVOD_KERAS),
                                              ("lightning", HOROVOD_LIGHTNING)])
def test_every_horovod_param_is_accepted(estimator, names):
    """Each of Horovod's Params is a Param here, with Horovod's accessors."""
    import importlib

    module = importlib.import_module(f"spark_hvd.spark.{estimator}")
    cls = module.TorchEstimator if estimator != "keras" else module.KerasEstimator
    specs = {s.name: s for s in cls.param_specs()}
    assert [n for n in names if n not in specs] == []
    for name in names:
        assert callable(getattr(cls, "get" + specs[name].camel)) and callable(getattr(cls, "set" + specs[name].camel))


def test_a_param_without_meaning_here_warns_once_and_changes_nothing():
    """mp_start_method and reader_pool_type are accepted with one warning each that says why; the
    second fit in this process says nothing more."""
    from spark_hvd.spark.torch import TorchEstimator

    base._WARNED.clear()
    est = TorchEstimator(mp_start_method="spawn", reader_pool_type="thread", batch_size=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est._warn_unused()
        est._warn_unused()
    texts = [str(w.message) for w in caught]
    assert len(texts) == 2, texts
    assert any("mp_start_method='spawn' has no effect" in t and "no worker processes" in t for t in texts)
    assert any("reader_pool_type='thread'" in t for t in texts)


def test_backend_and_num_proc_together_are_refused(spark, tmp_path):
    """Horovod's rule: the backend decides the processes, so num_proc with it is an error."""
    from spark_hvd.spark.common.backend import SparkBackend
    from spark_hvd.spark.torch import TorchEstimator

    est = TorchEstimator(backend=SparkBackend(num_proc=2), num_proc=2)
    with pytest.raises(ValueError, match=r"backend=.* and num_proc=2 are both set"):
        est._backend()


class _CallbackBackend:
    """Horovod's test backend (test/utils/spark_common.py): no base class, Horovod's run() signature,
    fn called in this process."""

    def __init__(self):
        self.calls = []

    def run(self, fn, args=(), kwargs={}, env={}):
        self.calls.append(sorted(env))
        return [fn(*args, **kwargs)] * self.num_processes()

    def num_processes(self):
        return 1


def _xor_frame(spark):
    return spark.createDataFrame([(Vectors.dense([a, b]), float(a != b)) for a in (0.0, 1.0) for b in (0.0, 1.0)] * 4,
                                 ["features", "y"])


def _xor_estimator(backend, store, **params):
    from spark_hvd.spark.torch import TorchEstimator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1), torch.nn.Sigmoid())
    return TorchEstimator(backend=backend, store=store, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss=torch.nn.BCELoss(), input_shapes=[[2]], feature_cols=["features"], label_cols=["y"],
                          batch_size=4, epochs=2, verbose=0, **params)


def test_min_pl_version_is_the_lightning_extras_lower_bound():
    """Horovod's tests skip below ``MIN_PL_VERSION``; ours is what the package's extra requires."""
    import re
    from pathlib import Path

    from spark_hvd.spark.lightning.estimator import MIN_PL_VERSION

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    lower = re.search(r'"pytorch-lightning>=([\d.]+)', pyproject).group(1)
    assert tuple(map(int, MIN_PL_VERSION.split("."))) == tuple(map(int, (lower + ".0.0").split(".")[:3]))


def test_any_object_with_horovods_backend_methods_is_a_backend(spark, tmp_path):
    """A backend written for Horovod (run(fn, args=(), kwargs={}, env={}) and num_processes(), no
    base class of ours) trains the fit: it is called with Horovod's arguments only, and here runs
    the one rank in this process. An object without those methods is refused, naming what is missing."""
    from spark_hvd.spark.common.store import LocalStore
    from spark_hvd.spark.torch import TorchEstimator

    backend = _CallbackBackend()
    model = _xor_estimator(backend, LocalStore(str(tmp_path)), run_id="callback").fit(_xor_frame(spark))
    assert [h["epoch"] for h in model.getHistory()] == [1, 2]
    assert len(backend.calls) == 1
    with pytest.raises(ValueError, match=r"backend=.* has no num_processes\(\) method; expected a Backend"):
        TorchEstimator(backend=type("OnlyRun", (), {"run": lambda self, fn, args=(), env=None: []})())


def test_a_sparkbackend_subclass_with_horovods_run_signature_trains_on_spark(spark, tmp_path, capsys):
    """Horovod's CallbackBackend pattern over SparkBackend: run(fn, args=(), kwargs={}, env=None)
    overridden to call the base and a callback. The fit's ranks run on Spark with the estimator's
    settings (their progress reaches the driver's printer) though the override passes none of them."""
    from spark_hvd.spark.common.backend import SparkBackend
    from spark_hvd.spark.common.store import LocalStore

    called = []

    class Callback(SparkBackend):
        def run(self, fn, args=(), kwargs={}, env=None):
            results = super().run(fn, args, kwargs, env)
            called.append(len(results))
            return results

    estimator = _xor_estimator(Callback(num_proc=2), LocalStore(str(tmp_path)), run_id="subclass")
    model = estimator.setVerbose(1).fit(_xor_frame(spark))
    assert called == [2] and [h["epoch"] for h in model.getHistory()] == [1, 2]
    out = capsys.readouterr().out
    assert "epoch 2/2" in out and "spark-hvd-progress" not in out


class _Square(torch.nn.Module):
    """Takes Horovod-style input_shapes [[-1, 2, 2]]: a (rows, 2, 2) tensor."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x):
        assert x.shape[1:] == (2, 2), x.shape
        return self.linear(x.reshape(len(x), 4))


class _SeeEnvironment:
    """Records what the ranks saw: their number and a variable of the backend's environment."""

    def on_epoch_end(self, epoch, logs, state):
        state.history[-1]["world"] = float(state.size)
        state.history[-1]["backend_env"] = float(os.environ.get("SPARK_HVD_TEST_BACKEND", "0"))


def test_a_horovod_style_torch_fit_with_backend_store_layout_and_params(spark, tmp_path):
    """SparkBackend(num_proc=2, env=...) runs two ranks with its environment; LocalStore's
    train_path and runs_path place the data and the run, save_runs=False removes the run after
    the fit; loss_constructors, label_shapes, input_shapes with the rows' -1 and
    partitions_per_process take effect; setOutputCols(['label_prob']) adds the raw output next
    to Spark ML's columns, and Horovod's accessors answer."""
    from spark_hvd.spark.common.backend import SparkBackend
    from spark_hvd.spark.common.store import LocalStore
    from spark_hvd.spark.torch import TorchEstimator

    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 4))
    rows = [(Vectors.dense(r.tolist()), float(r.sum() > 0)) for r in x]
    frame = spark.createDataFrame(rows, ["features", "label"])
    store = LocalStore(str(tmp_path / "store"), train_path="train_here", runs_path=str(tmp_path / "runs"),
                       save_runs=False)
    torch.manual_seed(0)
    net = _Square()
    est = TorchEstimator(backend=SparkBackend(num_proc=2, env={"SPARK_HVD_TEST_BACKEND": "7"}), store=store,
                         model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                         loss_constructors=[torch.nn.BCEWithLogitsLoss], label_shapes=[[1]],
                         input_shapes=[[-1, 2, 2]], feature_cols=["features"], label_cols=["label"], batch_size=8,
                         epochs=1, partitions_per_process=3, callbacks=[_SeeEnvironment()], run_id="horovod-style",
                         verbose=0)
    model = est.fit(frame)
    history = model.getHistory()[-1]
    assert (history["world"], history["backend_env"]) == (2.0, 7.0)
    written = [p for p in os.listdir(tmp_path / "store") if p.startswith("train_here.")]
    assert len(written) == 1
    files = [f for f in os.listdir(tmp_path / "store" / written[0]) if f.endswith(".parquet")]
    assert len(files) == 2 * 3
    assert not os.path.exists(tmp_path / "runs" / "horovod-style")  # save_runs=False
    assert model.getFeatureColumns() == ["features"] and model.getLabelColumns() == ["label"]
    assert model.getTask() == "binary"  # from the constructed BCEWithLogitsLoss

    model.setOutputCols(["label_prob"])
    out = model.transform(frame).select("features", "label_prob", "probability", "rawPrediction").collect()
    with torch.no_grad():
        logits = net.linear.weight.new_tensor(np.stack([r["features"].toArray() for r in out]))
        expected = model.getModel()(logits.reshape(len(out), 2, 2).float()).reshape(-1).numpy()
    np.testing.assert_allclose([r["label_prob"] for r in out], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose([r["rawPrediction"][1] for r in out], expected, rtol=1e-5, atol=1e-6)


def test_run_takes_horovods_positional_arguments_and_nics(spark):
    """run(fn, args, kwargs, num_proc, start_timeout, use_mpi, use_gloo, extra_mpi_args, env, stdout,
    stderr, verbose, nics, prefix_output_with_timestamp) as Horovod's: the ranks listen on the
    named interface's address, see env, and every output line starts with its time."""
    from spark_hvd.spark import run

    out = io.StringIO()
    results = run(_where, (), {"name": "SPARK_HVD_TEST_NICS"}, 2, 60, None, True, None,
                  {"SPARK_HVD_TEST_NICS": "yes"}, out, None, 1, ["lo"], True)
    assert results == [("127.0.0.1", "yes"), ("127.0.0.1", "yes")]
    printed = [line for line in out.getvalue().splitlines() if "rank says" in line]
    assert len(printed) == 2 and all(line[:3].isalpha() and ": [" in line for line in printed), printed
    with pytest.raises(ValueError, match=r"use_mpi=True is not supported on Spark"):
        run(_where, num_proc=2, use_mpi=True)
    with pytest.raises(Exception, match=r"network interface\(s\) \[.no-such-nic.\] not found"):
        run(_where, kwargs={"name": "X"}, num_proc=2, nics=["no-such-nic"])


def _where(name):
    from spark_hvd.runtime import config

    print("rank says hello", flush=True)
    return config.read_setting("hostname"), os.environ.get(name)


def _main(scale, offset=0):
    import spark_hvd.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    print(f"rank {hvd.rank()} of {hvd.size()}", flush=True)
    return hvd.rank() * 100 + scale * total + offset


def test_horovod_runner_runs_main_on_spark_tasks_and_on_the_driver(spark, capsys):
    """HorovodRunner(np=2) runs main on two barrier tasks, np=-2 on two local processes; main calls
    hvd.init() itself, its keyword arguments arrive, rank 0's return value comes back, and with
    driver_log_verbosity='all' every rank's lines reach the driver's output."""
    from spark_hvd.spark import HorovodRunner

    assert HorovodRunner(np=2, driver_log_verbosity="all").run(_main, scale=10, offset=1) == 31
    assert HorovodRunner(np=-2, driver_log_verbosity="all").run(_main, scale=1) == 3
    printed = capsys.readouterr().out
    assert "rank 1 of 2" in printed and "rank 0 of 2" in printed
    assert HorovodRunner(np=-2).run(_main, scale=1) == 3
    quiet = capsys.readouterr().out
    assert "rank 0 of 2" in quiet and "rank 1 of 2" not in quiet  # log_callback_only: rank 0's lines
    with pytest.raises(ValueError, match=r"np=0 is not valid"):
        HorovodRunner(np=0)
    with pytest.raises(ValueError, match=r"driver_log_verbosity='some'"):
        HorovodRunner(np=2, driver_log_verbosity="some")


def test_row_groups_are_dealt_anew_each_epoch_balanced_and_alike_on_every_rank():
    """Every epoch each row group goes to exactly one rank, ranks get about the same rows, the deal
    is the same wherever it is computed, and over the epochs every rank reads every row group;
    fixed sharding keeps group i on rank i % size."""
    from spark_hvd.spark.data.reader import RowGroup, deal_row_groups

    groups = [RowGroup(file=f"f{i}", index=0, num_rows=100 + 7 * i) for i in range(10)]
    seen = [set() for _ in range(3)]
    for epoch in range(24):
        shards = deal_row_groups(groups, 3, epoch, seed=5)
        assert sorted(i for s in shards for i in s) == list(range(10))
        rows = [sum(groups[i].num_rows for i in s) for s in shards]
        assert max(rows) - min(rows) <= max(g.num_rows for g in groups)
        assert shards == deal_row_groups(groups, 3, epoch, seed=5)
        for rank, shard in enumerate(shards):
            seen[rank].update(shard)
    assert all(s == set(range(10)) for s in seen)
    assert deal_row_groups(groups, 3, None, seed=5) == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]


def test_inmemory_cache_all_reads_the_files_once(tmp_path):
    """With cache_all the second epoch reads no file: it still gives every row after the files are gone."""
    import pyarrow as pa

    from spark_hvd.spark.data.reader import make_reader

    folder = tmp_path / "data"
    folder.mkdir()
    for i in range(2):
        pq.write_table(pa.table({"x": np.arange(i * 8, i * 8 + 8, dtype=np.float64)}), folder / f"part-{i}.parquet")
    with make_reader("builtin", str(folder), rank=0, size=1, batch_size=4, feature_cols=["x"], shuffle=True,
                     seed=1, cache_all=True) as reader:
        first = sorted(np.concatenate([b["x"] for b in reader.iter_epoch(0)]).tolist())
        for name in os.listdir(folder):
            os.remove(folder / name)
        second = sorted(np.concatenate([b["x"] for b in reader.iter_epoch(1)]).tolist())
    assert first == second == [float(v) for v in range(16)]


def test_keras_callbacks_run_as_in_horovod_with_files_under_the_run(spark, tmp_path):
    """TensorBoard, CSVLogger and ModelCheckpoint write under the run's directory of the store
    (rank 0 only), EarlyStopping runs on every rank on the averaged logs, checkpoint_callback
    (Horovod's BestModelCheckpoint) saves the best epoch there and that is the fitted model; the
    history reads as Horovod's dict of metric lists; one-hot SparseVector labels (OneHotEncoder,
    dropLast=False) train with categorical cross-entropy."""
    import keras
    from pyspark.ml.feature import OneHotEncoder

    from spark_hvd.spark import Store
    from spark_hvd.spark.keras import KerasEstimator
    from spark_hvd.tensorflow.keras.callbacks import BestModelCheckpoint

    rng = np.random.default_rng(1)
    x = rng.normal(size=(120, 3))
    y = (x[:, 0] > 0).astype(float) + (x[:, 1] > 0).astype(float)
    frame = spark.createDataFrame([(Vectors.dense(r.tolist()), float(c)) for r, c in zip(x, y)], ["features", "label"])
    frame = OneHotEncoder(inputCols=["label"], outputCols=["label_vec"], dropLast=False).fit(frame).transform(frame)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3, activation="softmax")])
    store = Store.create(str(tmp_path / "store"))
    est = KerasEstimator(num_proc=2, model=model, optimizer=keras.optimizers.Adam(0.05),
                         loss=keras.losses.categorical_crossentropy, metrics=["accuracy"], feature_cols=["features"],
                         label_cols=["label_vec"], batch_size=16, epochs=3, validation=0.2, store=store, run_id="kcb",
                         callbacks=[keras.callbacks.TensorBoard(log_dir="tensorboard"),
                                    keras.callbacks.CSVLogger("history.csv"),
                                    keras.callbacks.EarlyStopping(monitor="val_loss", patience=5),
                                    keras.callbacks.ModelCheckpoint("last.keras")],
                         checkpoint_callback=BestModelCheckpoint(monitor="val_loss"), verbose=0)
    fitted = est.fit(frame)
    run = tmp_path / "store" / "runs" / "kcb"
    assert (run / "last.keras").exists() and (run / "history.csv").exists()
    assert any(files for _, _, files in os.walk(run / "tensorboard"))
    assert len((run / "history.csv").read_text().strip().splitlines()) == 1 + 3
    history = fitted.getHistory()
    assert len(history) == 3 and len(history["val_loss"]) == 3 and "val_accuracy" in history.keys()
    # As in Horovod, the fitted model is the one checkpoint_callback saved (BestModelCheckpoint
    # names no file: the run's directory holds it).
    best = keras.saving.load_model(run / "checkpoint.keras")
    for got, want in zip(fitted.getModel().get_weights(), best.get_weights()):
        np.testing.assert_allclose(got, want)
    probs = fitted.setOutputCols(["label_prob"]).transform(frame).select(vector_to_array("label_prob").alias("p"))
    assert all(abs(sum(r["p"]) - 1.0) < 1e-4 for r in probs.collect())


class LitBinary(pl.LightningModule):
    """One logit per row from the 3-value 'features' column; label 'label'."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(3, 1)

    def forward(self, features):
        return self.net(features)

    def _loss(self, batch):
        return torch.nn.functional.binary_cross_entropy_with_logits(self(batch["features"]).squeeze(1),
                                                                    batch["label"].float())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_lambda_loss_and_lightning_callbacks_as_horovod_programs_pass_them(spark, tmp_path):
    """TorchEstimator takes Horovod's ``loss=lambda input, target: ...``; the Lightning
    TorchEstimator (Horovod's name) runs a user's ModelCheckpoint and EarlyStopping on the ranks,
    the checkpoint written under the run's directory of the store."""
    from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint

    from spark_hvd.spark import Store
    from spark_hvd.spark.lightning import TorchEstimator as LightningTorchEstimator
    from spark_hvd.spark.torch import TorchEstimator

    rng = np.random.default_rng(2)
    x = rng.normal(size=(96, 3))
    frame = spark.createDataFrame([(Vectors.dense(r.tolist()), float(r.sum() > 0)) for r in x], ["features", "label"])
    store = Store.create(str(tmp_path / "store"))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 1), torch.nn.Sigmoid())
    fitted = TorchEstimator(num_proc=2, store=store, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.5),
                            loss=lambda input, target: torch.nn.functional.binary_cross_entropy(input, target),
                            input_shapes=[[-1, 3]], label_shapes=[[1]], feature_cols=["features"],
                            label_cols=["label"], batch_size=8, epochs=3, verbose=0).fit(frame)
    losses = fitted.getHistory()["loss"]
    assert len(losses) == 3 and losses[-1] < losses[0]

    est = LightningTorchEstimator(num_proc=2, store=store, model=LitBinary(), feature_cols=["features"],
                                  label_cols=["label"], validation=0.25, batch_size=8, epochs=2, run_id="lit",
                                  callbacks=[ModelCheckpoint(monitor="val_loss", filename="best"),
                                             EarlyStopping(monitor="val_loss", patience=3)], verbose=0)
    est.fit(frame)
    saved = [f for _, _, files in os.walk(tmp_path / "store" / "runs" / "lit") for f in files if f.startswith("best")]
    assert saved == ["best.ckpt"]
