"""SparkHvdStrategy inside spark_hvd.spark.run: the barrier tasks of a local[2] session train as one job."""

from typing import Iterator

import pytest
import torch

from test_lightning_training import BATCH, STEPS, Classifier, _loader, _reference, _rows


@pytest.fixture(scope="module")
def spark() -> Iterator["object"]:
    """A local[2] SparkSession on loopback for this module."""
    from spark_hvd.spark.session import LOCAL_ENVIRONMENT, local_session

    with pytest.MonkeyPatch.context() as patch:
        for name, value in LOCAL_ENVIRONMENT.items():
            patch.setenv(name, value)
        session = local_session("spark-hvd-lightning-tests")
        try:
            yield session
        finally:
            session.stop()


def _fit_on_rank(size):
    """Runs on every Spark task: fit the classifier on SparkHvdStrategy, return what the driver checks."""
    import torch

    from lightning_world import trainer

    torch.set_num_threads(1)
    x, y = _rows(size * BATCH * STEPS)
    t = trainer(max_steps=STEPS)
    module = Classifier(seed=t.global_rank)  # different on purpose: the strategy starts every rank from rank 0's
    t.fit(module, _loader(x, y))
    return {"rank": t.global_rank, "size": t.world_size, "zero": t.is_global_zero,
            "params": [p.detach().clone() for p in module.net.parameters()]}


def test_trains_inside_spark_run(spark):
    """Two barrier tasks of spark_hvd.spark.run form one Lightning job (ranks 0 and 1 of 2, rank 0
    alone global zero) whose parameters, identical on both, are within 1e-5 of one process trained
    on the global batch."""
    from spark_hvd.spark import run

    results = run(_fit_on_rank, args=(2,), num_proc=2, use_gpu=False, verbose=0)
    assert [(r["rank"], r["size"], r["zero"]) for r in results] == [(0, 2, True), (1, 2, False)]
    x, y = _rows(2 * BATCH * STEPS)
    want, _ = _reference(x, y, 2 * BATCH)
    for got, expected, other in zip(results[0]["params"], want.parameters(), results[1]["params"]):
        assert torch.equal(got, other), "the ranks' parameters differ"
        assert (got - expected.detach()).abs().max().item() <= 1e-5
