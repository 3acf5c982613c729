"""Faults of a real cluster during TorchEstimator.fit on two hosts (one rank each): a host's links
cut while the ranks start, during training and while the results are collected, and every process
of a worker host killed mid-fit. Each fit completes once the host is back (or its slots return)
with every epoch in its history, or a retry's message names the host and says what happened to it;
a lost network path is not reported as a process that exited. After each test no rank process runs
and no host's /dev/shm holds anything (the fixture in conftest.py checks it)."""

from __future__ import annotations

import os
import time

import numpy as np
import pandas as pd
import pytest
import torch

from cluster_faults import CutWhenRankStarts, FaultThread, PauseAt, paused_host, release
from spark_hvd.spark import Store
from spark_hvd.spark.launch.backend import SparkBackend
from spark_hvd.spark.torch import TorchEstimator

pytestmark = pytest.mark.timeout(600)

ROWS = 256
BATCH = 16
EPOCHS = 3
CUT_S = 7.0
"""How long a cut lasts: longer than the cluster's SPARK_HVD_PEER_TIMEOUT (conftest.PEER_TIMEOUT_S, 4 s),
so connections in use break."""
START_TIMEOUT_S = 4.0
"""SPARK_HVD_START_TIMEOUT of the fit that a cut at start-up must fail: shorter than CUT_S."""
RESTART_AFTER_S = 5.0
"""How long a killed host stays down before its worker starts again."""


@pytest.fixture(scope="module")
def frame(cluster, tmp_path_factory):
    """A regression frame read from Parquet on the cluster: a 4-wide Vector 'x' and a label 'y'."""
    from pyspark.ml.feature import VectorAssembler

    spark = cluster.use("2x1")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 4))
    pdf = pd.DataFrame(x, columns=["a", "b", "c", "d"])
    pdf["y"] = x @ np.array([1.0, -2.0, 0.5, 0.25]) + 0.01 * rng.normal(size=ROWS)
    path = str(tmp_path_factory.mktemp("data") / "frame.parquet")
    pdf.to_parquet(path)
    return VectorAssembler(inputCols=["a", "b", "c", "d"], outputCol="x").transform(spark.read.parquet(path)) \
        .select("x", "y")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A store on the file system every host shares (the hosts differ in network only)."""
    return Store.create(str(tmp_path_factory.mktemp("store")))


def estimator(store, run_id, **overrides):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    params = dict(num_proc=2, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.02),
                  loss=torch.nn.MSELoss(), feature_cols=["x"], label_cols=["y"], batch_size=BATCH, epochs=EPOCHS,
                  store=store, run_id=run_id, random_seed=5, verbose=1, checkpoint_every_steps=2)
    params.update(overrides)
    if "backend" in params:
        del params["num_proc"]  # the backend says how many
    return TorchEstimator(**params)


def assert_continuous(model):
    history = model.getHistory()
    assert [entry["epoch"] for entry in history] == list(range(1, EPOCHS + 1))
    assert history[-1]["loss"] < history[0]["loss"]


def retry_lines(printed):
    return [line for line in printed.splitlines() if "spark-hvd: retry" in line]


def fit_with_harm_in_epoch_2(harm, run_id, store, frame, hosts, directory, capsys):
    """Fit while ``harm`` runs once rank 1 paused after its third batch of epoch 2; the fit must
    complete with every epoch after one retry from the checkpoint whose report names the harmed host.
    The retry's report line."""
    fault = FaultThread(harm)
    fault.start()
    model = estimator(store, run_id, callbacks=[PauseAt(directory, rank=1, epoch=1, step=2)]).fit(frame)
    fault.finish()
    host = paused_host(directory, hosts, timeout=0)
    assert_continuous(model)
    (retry,) = retry_lines(capsys.readouterr().out)
    assert "retry 1/3" in retry and "resuming from epoch 2, step" in retry
    assert host.name in retry or host.address in retry
    return retry


def cut_when_paused(directory, hosts, seconds=CUT_S):
    def harm():
        host = paused_host(directory, hosts)
        host.cut()
        try:
            release(directory)
            time.sleep(seconds)
        finally:
            host.restore()
    return harm


class SlowToLoadOnRank1(torch.nn.Sequential):
    """A model whose copy on rank 1 takes a second to unpickle, before that rank's init(): the cut
    lands before rank 1 meets its peers however fast its (warm-forked) process starts."""

    def __setstate__(self, state):
        super().__setstate__(state)
        if os.environ.get("SPARK_HVD_RANK") == "1":
            time.sleep(1.0)


def slow_to_load_estimator(store, run_id, **overrides):
    """``estimator`` with the default model's layers and seed in a :class:`SlowToLoadOnRank1`."""
    torch.manual_seed(0)
    model = SlowToLoadOnRank1(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return estimator(store, run_id, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.02),
                     **overrides)


def test_a_host_cut_off_while_the_ranks_start_delays_the_start(spark_2x1, hosts, frame, store, capsys):
    """Rank 1's host loses its links the moment rank 1's process starts, for CUT_S: rank 1's init()
    keeps trying to reach the rendezvous and rank 0 until the links are back (well within the start
    timeout), and the fit trains every epoch without a retry."""
    cutter = CutWhenRankStarts(hosts, rank=1, seconds=CUT_S)
    fault = FaultThread(cutter)
    fault.start()
    model = slow_to_load_estimator(store, "cut-at-start").fit(frame)
    fault.finish()
    assert len(cutter.cut) == 1
    assert_continuous(model)
    assert retry_lines(capsys.readouterr().out) == []


def test_a_host_cut_off_longer_than_the_start_timeout_fails_naming_it(spark_2x1, hosts, frame, store):
    """With a start timeout shorter than the cut and no retries, a cut at start-up fails the fit
    within the timeout (not later) with a PeerUnreachableError that names the cut host's address
    and says its network path is down, not that a process exited."""
    cutter = CutWhenRankStarts(hosts, rank=1, seconds=CUT_S)
    fault = FaultThread(cutter)
    fault.start()
    backend = SparkBackend(num_proc=2, env={"SPARK_HVD_START_TIMEOUT": str(START_TIMEOUT_S)})
    with pytest.raises(Exception) as raised:
        slow_to_load_estimator(store, "cut-too-long", backend=backend, max_retries=0).fit(frame)
    fault.finish()
    (name,) = cutter.cut
    host = next(h for h in hosts.hosts if h.name == name)
    text = str(raised.value)
    assert "PeerUnreachableError" in text or "RendezvousTimeout" in text
    assert host.address in text and "exited or was killed" not in text


def test_a_host_cut_off_during_training_is_retried_from_the_checkpoint(spark_2x1, hosts, frame, store, tmp_path,
                                                                       capsys):
    """Rank 1's host loses its links after rank 1's third batch of epoch 2, for CUT_S: the ranks give
    up on each other, the retry report names the host and says its network path was lost (not that
    a process exited), and the next attempt resumes from the checkpoint once the host is back."""
    retry = fit_with_harm_in_epoch_2(cut_when_paused(tmp_path, hosts), "cut-in-training", store, frame, hosts,
                                     tmp_path, capsys)
    assert "network path" in retry and "exited or was killed" not in retry


def test_a_host_cut_off_while_results_are_collected_still_completes(spark_2x1, hosts, frame, store, tmp_path,
                                                                    capsys):
    """Rank 0's host (it serves the rendezvous and returns the model) loses its links when training
    has ended, before the ranks return and shut down, for CUT_S: the fit returns the model with every
    epoch's history once the host is back (retrying at most from the last checkpoint, which trains
    nothing more)."""
    fault = FaultThread(cut_when_paused(tmp_path, hosts))
    fault.start()
    model = estimator(store, "cut-at-end", callbacks=[PauseAt(tmp_path, rank=0, at_end=True)]).fit(frame)
    fault.finish()
    assert_continuous(model)
    for retry in retry_lines(capsys.readouterr().out):
        assert "resuming from the end of epoch 3" in retry and "exited or was killed" not in retry


def test_a_worker_host_whose_processes_are_all_killed_is_replaced_when_it_returns(spark_2x1, cluster, hosts, frame,
                                                                                  store, tmp_path, capsys):
    """Every process of rank 1's host (worker, executor, Python workers, rank) is killed after rank 1's
    third batch of epoch 2; the worker starts again 5 s later: the retry report names the host, the
    fit waits for the slot to return, resumes from the checkpoint and trains every epoch."""
    def harm():
        host = paused_host(tmp_path, hosts)
        killed = host.kill_all()
        assert killed, f"nothing was running on {host.name}"
        time.sleep(RESTART_AFTER_S)
        cluster.start_worker(host)
        cluster.wait_worker(host)

    fit_with_harm_in_epoch_2(harm, "host-killed", store, frame, hosts, tmp_path, capsys)
