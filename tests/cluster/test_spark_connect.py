"""Spark Connect against the cluster: a Connect server started with spark-submit on the standalone
master (one task slot per host), and a client that reaches only that server. run() places one rank
on each host and returns their results in rank order; their output reaches the client through the
store; a TorchEstimator fits and its model scores rows, all through the DataFrame API."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from spark_hvd.spark import Store, run
from spark_hvd.spark.torch import TorchEstimator

pytestmark = pytest.mark.timeout(600)


def where_am_i():
    import socket

    import spark_hvd.runtime as hvd

    hvd.init()
    try:
        print(f"rank {hvd.rank()} runs on {socket.gethostname()}")
        total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum, name="total")
        return hvd.rank(), socket.gethostname(), hvd.local_size(), [link.transport for link in hvd.peer_links()], \
            float(total[0])
    finally:
        hvd.shutdown()


def test_run_through_a_connect_server_on_the_cluster(spark_connect, hosts, tmp_path, capsys):
    """Two ranks on the two hosts, over TCP, one result each in rank order; the ranks' printed lines
    reach this client through the store."""
    results = run(where_am_i, num_proc=2, store=Store.create(str(tmp_path / "store")), spark=spark_connect)
    assert [r[0] for r in results] == [0, 1]
    assert sorted(r[1] for r in results) == sorted(h.name for h in hosts.hosts)
    assert all(r[2:] == (1, ["tcp"], 3.0) for r in results)
    printed = capsys.readouterr().out
    for rank, hostname, *_ in results:
        assert f"rank {rank} runs on {hostname}" in printed


def test_a_torch_estimator_fits_and_scores_through_connect(spark_connect, tmp_path):
    """fit() on a Connect DataFrame trains two epochs on the two hosts and the model scores every row (a
    prediction column without gaps)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 2))
    pdf = pd.DataFrame({"x": list(x), "y": x @ np.array([1.0, -1.0])})
    path = str(tmp_path / "frame.parquet")
    pdf.to_parquet(path)
    df = spark_connect.read.parquet(path)
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    est = TorchEstimator(num_proc=2, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         loss=torch.nn.MSELoss(), feature_cols=["x"], label_cols=["y"], batch_size=16, epochs=2,
                         store=Store.create(str(tmp_path / "store")), random_seed=1, verbose=0)
    fitted = est.fit(df)
    assert [entry["epoch"] for entry in fitted.getHistory()] == [1, 2]
    scored = fitted.transform(df).toPandas()
    assert len(scored) == 128 and scored["prediction"].notna().all()
