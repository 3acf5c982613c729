"""Fault tolerance on a real two-executor cluster (``local-cluster[2,1,1024]``): TorchEstimator
retries after a killed rank process and a killed executor JVM and resumes from its checkpoints
(mid-epoch ones too), run_elastic re-forms worlds after a lost rank and grows into free slots,
the dataset cache key is the same in a fresh process, stores list and remove materialized data,
and rank work directories of dead tasks are removed.

Processes are killed by pid from inside the training, once each (a marker file guards against a
second kill in the retry).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest
import torch

from spark_hvd.runner.errors import RankFailedError
from spark_hvd.runtime.errors import CollectiveError
from spark_hvd.spark import Store, prepare_data, run_elastic
from spark_hvd.spark.launch.task import WORKDIR_PREFIX, remove_stale_workdirs
from spark_hvd.spark.data.identity import data_identity, dataset_key, normalize_ids
from spark_hvd.spark.launch.retry import is_recoverable, run_with_retries
from spark_hvd.spark.launch.elastic import restartable
from spark_hvd.spark.session import task_max_failures
from spark_hvd.spark.launch.barrier import StageLostError
from spark_hvd.spark.torch import TorchEstimator

pytestmark = pytest.mark.timeout(900)  # a cluster of three JVMs starts slowly on a busy two-core machine

ROWS = 256
BATCH = 16
EPOCHS = int(os.environ.get("SPARK_HVD_TEST_FAULT_EPOCHS", "3"))
"""Epochs of the fits; the issue's 20-epoch run is ``SPARK_HVD_TEST_FAULT_EPOCHS=20 pytest ... -k killed``."""
STEPS = ROWS // (2 * BATCH)  # per epoch, on each of the 2 ranks


_KEY_SCRIPT = """
import json, sys
from spark_hvd.spark.session import local_session
from spark_hvd.spark.data.identity import data_identity, dataset_key
spark = local_session("key-check", num_cores=1)
df = spark.read.parquet(sys.argv[1])
memory = spark.createDataFrame([(1.0, 2.0), (3.0, 4.0)], ["p", "q"])
print(json.dumps([dataset_key(df, {"s": 1}), dataset_key(memory, {"s": 1}), data_identity(memory, ["p", "q"])]))
spark.stop()
"""


@pytest.fixture(scope="module")
def fresh_keys(tmp_path_factory):
    """Dataset keys computed by another process's local session, started before the cluster so
    both JVMs start at once: (parquet path, the process)."""
    path = str(tmp_path_factory.mktemp("keys") / "data.parquet")
    pd.DataFrame({"u": np.arange(10.0), "v": np.arange(10.0) * 2}).to_parquet(path)
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}
    process = subprocess.Popen([sys.executable, "-c", _KEY_SCRIPT, path], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        yield path, process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


@pytest.fixture(scope="module")
def cluster(fresh_keys):
    """A Spark standalone cluster of 2 one-core executors in separate JVMs, on loopback."""
    from spark_hvd.spark.session import LOCAL_ENVIRONMENT, local_session

    with pytest.MonkeyPatch.context() as patch:
        for name, value in LOCAL_ENVIRONMENT.items():
            patch.setenv(name, value)
        session = local_session("spark-hvd-fault-tolerance", conf={
            "spark.master": "local-cluster[2,1,1024]",
            "spark.executorEnv.PYSPARK_PYTHON": sys.executable,
            "spark.executorEnv.SPARK_LOCAL_IP": "127.0.0.1",
            "spark.executor.memory": "512m",
            "spark.task.maxFailures": "2",  # run_elastic restarts a rank's task once after its code raised
            # Short-lived JVMs on a busy machine: the C1 compiler alone starts them sooner.
            "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
            "spark.executor.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        })
        try:
            from spark_hvd.spark.launch.retry import wait_for_free_slots

            wait_for_free_slots(session, 2, 120.0)
            yield session
        finally:
            session.stop()


@pytest.fixture(scope="module")
def frame(cluster, tmp_path_factory):
    """A regression frame read from Parquet: a 4-wide Vector 'x' and a label 'y'."""
    from pyspark.ml.feature import VectorAssembler

    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 4))
    pdf = pd.DataFrame(x, columns=["a", "b", "c", "d"])
    pdf["y"] = x @ np.array([1.0, -2.0, 0.5, 0.25]) + 0.01 * rng.normal(size=ROWS)
    path = str(tmp_path_factory.mktemp("data") / "frame.parquet")
    pdf.to_parquet(path)
    df = cluster.read.parquet(path)
    return VectorAssembler(inputCols=["a", "b", "c", "d"], outputCol="x").transform(df).select("x", "y")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return Store.create(str(tmp_path_factory.mktemp("store")))


def estimator(store, run_id, **overrides):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    params = dict(num_proc=2, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.02),
                  loss=torch.nn.MSELoss(), feature_cols=["x"], label_cols=["y"], batch_size=BATCH, epochs=EPOCHS,
                  store=store, run_id=run_id, random_seed=5, verbose=1)
    params.update(overrides)
    return TorchEstimator(**params)


class BatchLog:
    """Records (pid, epoch, step) of every training batch of each rank, one file per rank."""

    def __init__(self, directory):
        self.directory = str(directory)
        self.epoch = 0

    def on_epoch_begin(self, epoch, state):
        self.epoch = epoch

    def on_batch_end(self, step, logs, state):
        with open(os.path.join(self.directory, f"rank{state.rank}.log"), "a") as f:
            f.write(f"{os.getpid()} {self.epoch} {step}\n")


class KillOnce:
    """Kills rank 1's own process (or its executor JVM) after batch ``step`` of epoch ``epoch``, once."""

    def __init__(self, marker, epoch, step, executor=False):
        self.marker, self.at, self.executor = str(marker), (epoch, step), executor
        self.epoch = 0

    def on_epoch_begin(self, epoch, state):
        self.epoch = epoch

    def on_batch_end(self, step, logs, state):
        if state.rank != 1 or (self.epoch, step) != self.at or os.path.exists(self.marker):
            return
        open(self.marker, "w").close()
        os.kill(executor_pid() if self.executor else os.getpid(), signal.SIGKILL)
        time.sleep(60)  # the executor's death takes this process with it


def parent_pid(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def executor_pid():
    """The pid of the executor JVM this process descends from (rank -> Python worker -> daemon -> JVM)."""
    pid = os.getpid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"CoarseGrainedExecutorBackend" in f.read():
                return pid
        pid = parent_pid(pid)
    raise RuntimeError(f"process {os.getpid()} does not descend from a Spark executor JVM")


@pytest.fixture(scope="module")
def baseline(frame, store):
    """An uninterrupted fit (mid-epoch checkpoints on: they do not change the training)."""
    model = estimator(store, "baseline", checkpoint_every_steps=2).fit(frame)
    return model.getHistory()


def check_history(history, baseline):
    assert [entry["epoch"] for entry in history] == list(range(1, EPOCHS + 1))
    assert history[-1]["loss"] == pytest.approx(baseline[-1]["loss"], rel=0.05, abs=1e-3)


class FailingCallback:
    """Raises on rank 0 after its second batch, as a bug in training code would."""

    def on_batch_end(self, step, logs, state):
        if state.rank == 0 and step == 1:
            raise ArithmeticError("this training code always fails")


def test_code_errors_are_not_retried(frame, store, capsys):
    """An error raised by the code fails the fit at once with the rank's traceback, without a retry."""
    with pytest.raises(Exception, match="this training code always fails") as raised:
        estimator(store, "bad-code", epochs=1, callbacks=[FailingCallback()]).fit(frame)
    assert "Traceback from rank 0" in str(raised.value)
    assert "retry" not in capsys.readouterr().out


def test_fit_retries_after_a_killed_rank_and_a_killed_executor(frame, store, baseline, tmp_path, capsys):
    """A rank process killed in epoch 2 after its 4th batch (before the checkpoint at batch 4), then
    the executor JVM of rank 1 killed in epoch 3 after its 2nd batch: fit reports both retries,
    resumes at epoch 2 step 2 and at the end of epoch 2, returns epochs 1..E with the uninterrupted
    run's loss, trains every batch exactly once after the rollbacks (same seeded order), and with
    cleanup_intermediate removes its materialized data."""
    log = BatchLog(tmp_path)
    kills = [KillOnce(tmp_path / "rank-killed", epoch=1, step=3),
             KillOnce(tmp_path / "executor-killed", epoch=2, step=1, executor=True)]
    model = estimator(store, "killed", checkpoint_every_steps=2, callbacks=[*kills, log],
                      cleanup_intermediate=True).fit(frame)
    printed = capsys.readouterr().out
    assert "retry 1/3 (attempt 2) after the barrier stage failed: rank 1 was killed by signal SIGKILL" in printed
    assert f"resuming from epoch 2, step 2 of {STEPS}" in printed
    assert "retry 2/3 (attempt 3) after the barrier stage failed" in printed
    assert "resuming from the end of epoch 2" in printed
    check_history(model.getHistory(), baseline)
    assert store.list_intermediate() == []

    lines = [line.split() for line in (tmp_path / "rank0.log").read_text().splitlines()]
    pids = list(dict.fromkeys(pid for pid, _, _ in lines))
    assert len(pids) == 3, "rank 0 ran in three attempts"
    attempts = [[(int(e), int(s)) for pid, e, s in lines if pid == attempt] for attempt in pids]
    kept = [p for p in attempts[0] if p < (1, 2)] + [p for p in attempts[1] if p < (2, 0)] + attempts[2]
    assert kept == [(e, s) for e in range(EPOCHS) for s in range(STEPS)]


def elastic_training(marker, total):
    """An hvd.elastic.run loop of ``total`` committed steps; rank 1 of the second world kills
    itself once; the one-rank first world waits for the driver to grow it."""
    import spark_hvd.torch as hvd

    hvd.init()
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    state = hvd.elastic.TorchState(model, optimizer, step=0, worlds=[], steps=[])

    @hvd.elastic.run
    def train(state):
        state.worlds = state.worlds + [hvd.size()]
        while state.step < total:
            if hvd.size() == 1:
                time.sleep(0.5)  # a one-rank world waits here until the driver grows it
            hvd.allreduce(torch.ones(1), name="elastic.step")
            state.step += 1
            state.steps = state.steps + [state.step]
            if hvd.size() == 2 and hvd.rank() == 1 and state.step == total // 2 and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            state.commit()
        return list(state.worlds), list(state.steps)

    return train(state)


def test_run_elastic_grows_into_free_slots_and_survives_a_killed_rank(cluster, store, tmp_path, capsys):
    """A first world of 1 grows to 2 (a slot is free); the second world loses rank 1 and a third
    world of 2 resumes from the last commit: every step is committed exactly once."""
    total = 200
    results = run_elastic(elastic_training, args=(str(tmp_path / "killed"), total), num_proc=1, min_num_proc=1,
                          max_num_proc=2, store=store, spark=cluster, reset_limit=4)
    worlds, steps = results[0]
    assert results[1] == results[0]
    assert worlds == [1, 2, 2]
    assert steps == list(range(1, total + 1))
    printed = capsys.readouterr().err
    assert "starting world 2 with 2 ranks" in printed and "starting world 3 with 2 ranks" in printed


def failing_training(markers, total):
    """An hvd.elastic.run loop of ``total`` committed steps that raises, as Horovod's own elastic test
    does, in the (rank, step) named by each marker file still present (removing it); returns the
    steps committed and the worlds it ran in."""
    import spark_hvd.torch as hvd

    hvd.init()
    state = hvd.elastic.ObjectState(step=0, worlds=0, steps=[])

    @hvd.elastic.run
    def train(state):
        state.worlds += 1
        while state.step < total:
            marker = os.path.join(markers, f"rank_{hvd.rank()}_step_{state.step}")
            if os.path.exists(marker):
                if not marker.endswith("_always"):
                    os.unlink(marker)
                raise Exception("training failed, restart the task")
            if os.path.exists(marker + "_always"):
                raise Exception("training failed every time")
            hvd.allreduce(torch.ones(1), name="elastic.step")
            state.step += 1
            state.steps = state.steps + [state.step]
            state.commit()
        return state.worlds, list(state.steps)

    return train(state)


def test_run_elastic_restarts_after_a_ranks_exception_up_to_sparks_task_failures(cluster, store, tmp_path, capsys):
    """A rank's exception starts a new world from the last commit, named on stderr, once per task
    failure Spark allows (spark.task.maxFailures=2 here); a rank that keeps failing ends the run
    with its own exception and a note naming the limit."""
    total = 12
    markers = tmp_path / "markers"
    markers.mkdir()
    (markers / "rank_1_step_4").touch()
    (markers / "rank_0_step_9").touch()
    results = run_elastic(failing_training, args=(str(markers), total), num_proc=2, min_num_proc=2,
                          max_num_proc=2, store=store, spark=cluster)
    assert results[0] == results[1] == (3, list(range(1, total + 1)))
    printed = capsys.readouterr().err
    assert ("rank 1 raised Exception: training failed, restart the task (failure 1 of the 2 Spark allows rank 1's "
            "task); starting world 2 with 2 ranks") in printed
    assert "rank 0 raised Exception: training failed, restart the task (failure 1 of the 2" in printed
    assert not list(markers.iterdir())

    (markers / "rank_1_step_3_always").touch()
    with pytest.raises(RankFailedError, match="training failed every time") as raised:
        run_elastic(failing_training, args=(str(markers), total), num_proc=2, min_num_proc=2, max_num_proc=2,
                    store=store, spark=cluster)
    assert raised.value.rank == 1
    assert "the task of rank 1 failed 2 time(s), Spark's limit for a task (spark.task.maxFailures=2)" in \
        "".join(raised.value.__notes__)
    (markers / "rank_1_step_3_always").unlink()
    (markers / "rank_0_step_2").touch()
    with pytest.raises(RankFailedError, match="restart the task") as raised:
        run_elastic(failing_training, args=(str(markers), total), num_proc=2, min_num_proc=2, max_num_proc=2,
                    store=store, spark=cluster, reset_limit=0)
    assert "run_elastic needed new world number 1 but reset_limit=0" in "".join(raised.value.__notes__)


def test_dataset_key_is_the_same_in_a_fresh_process(cluster, fresh_keys, tmp_path):
    """The cache key of a Parquet-read frame and of an in-memory frame, and the data part of a run's
    fingerprint, are the same in another process's session; other files or other rows get another key."""
    path, process = fresh_keys
    df = cluster.read.parquet(path)
    memory = cluster.createDataFrame([(1.0, 2.0), (3.0, 4.0)], ["p", "q"])
    other = cluster.createDataFrame([(1.0, 2.0), (3.0, 5.0)], ["p", "q"])
    copy = str(tmp_path / "copy.parquet")
    pd.read_parquet(path).to_parquet(copy)
    assert dataset_key(memory, {"s": 1}) != dataset_key(other, {"s": 1})
    assert dataset_key(df, {"s": 1}) == dataset_key(cluster.read.parquet(path), {"s": 1})
    assert dataset_key(df, {"s": 1}) != dataset_key(cluster.read.parquet(copy), {"s": 1})
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1]) == [dataset_key(df, {"s": 1}), dataset_key(memory, {"s": 1}),
                                                        data_identity(memory, ["p", "q"])]


def test_plan_ids_are_renumbered_by_first_appearance():
    """Session-specific expression ids become 0, 1, ... in order; distinct ids stay distinct."""
    assert normalize_ids("Join (x#812L = x#815L)\n:- Project [x#812L, y#813]") == \
        "Join (x#0L = x#1L)\n:- Project [x#0L, y#2]"


def test_store_lists_and_removes_intermediate_data(frame, tmp_path):
    """list_intermediate names each materialized dataset; remove_intermediate keeps the newest
    ``keep`` and honors ``older_than``."""
    store = Store.create(str(tmp_path / "store"))
    first = prepare_data(frame, store, ["x"], ["y"], num_proc=2)
    second = prepare_data(frame, store, ["x"], ["y"], validation=0.25, num_proc=2)
    os.utime(store.get_data_metadata_path(first.key), (time.time() - 3600, time.time() - 3600))
    for path in (first.train_path,):
        os.utime(path, (time.time() - 3600, time.time() - 3600))
    listed = store.list_intermediate()
    assert [item.key for item in listed] == [first.key, second.key] and all(item.complete for item in listed)
    assert store.remove_intermediate(older_than=7200) == []
    assert store.remove_intermediate(keep=1) == [first.key]
    assert [item.key for item in store.list_intermediate()] == [second.key]
    assert store.remove_intermediate() == [second.key] and store.list_intermediate() == []


def test_stale_rank_workdirs_are_removed(tmp_path):
    """A work directory whose owner pid is dead goes; a live owner's and foreign names stay."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{WORKDIR_PREFIX}1-{dead.pid}-abc123"
    live = tmp_path / f"{WORKDIR_PREFIX}0-{os.getpid()}-def456"
    foreign = tmp_path / f"{WORKDIR_PREFIX}-other"
    for path in (stale, live, foreign):
        path.mkdir()
        (path / "call").write_bytes(b"x")
    assert remove_stale_workdirs(str(tmp_path)) == [str(stale)]
    assert live.exists() and foreign.exists() and not stale.exists()


RECOVERABLE = [
    (RankFailedError(1, "rank 1 was killed by signal SIGKILL"), True),
    (RankFailedError(1, "rank 1 failed", exc_type="Died"), True),
    (RankFailedError(0, "lost", original=CollectiveError("rank 1 was lost")), True),
    (StageLostError("ExecutorLostFailure (executor 1 exited)"), True),
    (RankFailedError(0, "rank 0 raised ValueError: bad", exc_type="ValueError"), False),
    (RankFailedError(1, "returned early", reaction=RankFailedError(0, "lost", exc_type="x.CollectiveError")), False),
    (RuntimeError("the barrier stage failed: something else"), False),
    (ValueError("num_proc=3 but the cluster has 2 task slots"), False),
]


@pytest.mark.parametrize("error, expected", [
    (RankFailedError(1, "rank 1 raised Exception: x", exc_type="Exception", original=Exception("x")), True),
    (RankFailedError(1, "rank 1 raised KeyError: 'x'", exc_type="KeyError"), True),
    (RankFailedError(0, "no module", exc_type="ModuleNotFoundError"), False),
    (RankFailedError(0, "pickling", original=pickle.PicklingError("cannot pickle")), False),
    (RankFailedError(1, "killed", exc_type=None), False),
    (RankFailedError(1, "returned early", reaction=RankFailedError(0, "lost", exc_type="ValueError")), False),
    (ValueError("num_proc=3 but the cluster has 2 task slots"), False),
])
def test_run_elastic_restarts_code_errors_but_not_ones_a_new_world_repeats(error, expected):
    """A rank's exception is worth a new world; import and pickling errors, a rank that returned
    early and driver-side errors are not (lost processes are handled as recoverable, apart)."""
    assert restartable(error) is expected


@pytest.mark.parametrize("master, conf, expected", [
    ("local[2]", {}, 1), ("local", {}, 1), ("local[2,3]", {}, 3), ("local[*, 5]", {}, 5),
    ("spark://h:7077", {}, 4), ("yarn", {"spark.task.maxFailures": "8"}, 8),
    ("local-cluster[2,1,1024]", {"spark.task.maxFailures": "2"}, 2),
])
def test_task_max_failures_reads_the_master_and_the_setting(master, conf, expected):
    from types import SimpleNamespace

    session = SimpleNamespace(sparkContext=SimpleNamespace(master=master),
                              conf=SimpleNamespace(get=lambda key, default=None: conf.get(key, default)))
    assert task_max_failures(session) == expected


@pytest.mark.parametrize("error, expected", RECOVERABLE)
def test_recoverable_failures_are_lost_processes_not_code_errors(error, expected):
    """A dead process, a lost peer or a lost executor is worth a retry; an exception of the code is not."""
    assert is_recoverable(error) is expected


def test_slot_waits_of_retries_and_of_elastic_worlds_share_one_loop(monkeypatch):
    """A retry and run_elastic's next world wait for free slots the same way: the slots once there
    are enough (bounded by max_num_proc for a world), the fallback where the cluster does not tell,
    and a TimeoutError naming both numbers and the caller's own fix."""
    from types import SimpleNamespace

    from spark_hvd.spark.launch import elastic, retry

    seen = iter([1, 1, 3])
    monkeypatch.setattr(retry, "_POLL_S", 0.01)
    monkeypatch.setattr(retry, "session_info", lambda session: SimpleNamespace(slots=next(seen)))
    assert retry.wait_for_free_slots(None, 2, 5.0) == 3
    seen = iter([5])
    assert elastic._wait_for_world(None, 2, 4, 5.0, last=2) == 4
    seen = iter([None])
    assert elastic._wait_for_world(None, 2, None, 5.0, last=3) == 3
    seen = iter([None])
    assert retry.wait_for_free_slots(None, 2, 5.0) == 2
    monkeypatch.setattr(retry, "session_info", lambda session: SimpleNamespace(slots=1))
    with pytest.raises(TimeoutError, match=r"waited 0 s for 2 free task slots \(min_num_proc=2\) for run_elastic's "
                                           r"next world, but the cluster has 1: .*lower min_num_proc"):
        elastic._wait_for_world(None, 2, None, 0.05, last=2)
    with pytest.raises(TimeoutError, match=r"2 free task slots to run the barrier stage again, .*same run_id"):
        retry.wait_for_free_slots(None, 2, 0.05)


def test_retry_loop_reports_each_retry_and_stops_at_max_retries():
    """Recoverable failures are retried with one line each, up to max_retries; then the last is
    raised with a note; a code error is raised at once."""
    calls, lines = [], []

    def flaky(attempt):
        calls.append(attempt)
        if attempt < 3:
            raise StageLostError(f"executor lost in attempt {attempt}")
        return "trained"

    assert run_with_retries(flaky, session=None, num_proc=2, max_retries=3, report=lines.append,
                            resume_point=lambda: "epoch 2, step 4 of 8") == "trained"
    assert calls == [1, 2, 3] and len(lines) == 2
    assert lines[0].startswith("spark-hvd: retry 1/3 (attempt 2) after the barrier stage failed: executor lost in "
                               "attempt 1; resuming from epoch 2, step 4 of 8")
    with pytest.raises(StageLostError) as raised:
        run_with_retries(lambda attempt: flaky(1), session=None, num_proc=2, max_retries=1, report=lines.append)
    assert "gave up after 2 attempts (max_retries=1)" in "".join(raised.value.__notes__)
    code_calls = []

    def buggy(attempt):
        code_calls.append(attempt)
        raise RankFailedError(0, "rank 0 raised KeyError: 'x'", exc_type="KeyError")

    with pytest.raises(RankFailedError, match="KeyError"):
        run_with_retries(buggy, session=None, num_proc=2, max_retries=3, report=lines.append)
    assert code_calls == [1]
    with pytest.raises(ValueError, match=r"max_retries=-1 is not valid: expected an integer >= 0"):
        run_with_retries(buggy, session=None, num_proc=2, max_retries=-1, report=lines.append)


def test_torch_state_snapshot_carries_the_last_commit():
    """A TorchState's snapshot (what run_elastic persists) restores model, optimizer and values of
    the last commit into a fresh state, not what changed after it."""
    import pickle

    import spark_hvd.torch as hvd

    torch.manual_seed(1)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    state = hvd.elastic.TorchState(model, optimizer, step=7)
    state.save()
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    state.step = 8
    snapshot = pickle.loads(pickle.dumps(state.snapshot()))

    fresh_model = torch.nn.Linear(3, 1)
    fresh = hvd.elastic.TorchState(fresh_model, torch.optim.Adam(fresh_model.parameters(), lr=0.1), step=0)
    fresh.load_snapshot(snapshot)
    assert fresh.step == 7
    assert all(torch.equal(fresh_model.state_dict()[k], v) for k, v in committed.items())
    assert fresh.optimizer.state_dict()["state"][0]["step"] == 1
