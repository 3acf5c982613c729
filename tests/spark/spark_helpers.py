"""Helpers the Spark tests of several folders share."""

from __future__ import annotations

import uuid

from spark_hvd.spark.session import is_connect

__all__ = ["spark_jobs", "nothing_materialized"]


def spark_jobs(spark, call):
    """Run ``call()``; the ids of the Spark jobs it started on a classic session, None on Connect
    (whose client cannot see jobs; the tests then check that nothing was written instead)."""
    if is_connect(spark):
        call()
        return None
    sc = spark.sparkContext
    group = f"probe-{uuid.uuid4().hex[:8]}"
    sc.setJobGroup(group, "fit checks")
    try:
        call()
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    return list(sc.statusTracker().getJobIdsForGroup(group))


def nothing_materialized(est):
    store = est.getStore()
    try:
        return not any(n.startswith("intermediate_") for n in store.listdir(store.prefix))
    except OSError:
        return True


def resumed_mid_epoch(make_estimator, frame, tmp_path, capsys, kill_callback, steps):
    """Fit a 3-epoch run with ``checkpoint_every_steps=2`` twice: uninterrupted, and with
    ``kill_callback(marker, log, epoch=1, batch=2)`` (rank 1 kills itself after the 3rd batch of
    epoch 2, once; rank 0 logs ``pid epoch`` per trained batch). Asserts the retry resumed from
    that epoch's step 2, that the retried attempt trained the epoch's other batches and the last
    epoch, each once, and that the history has each epoch once; returns (resumed, baseline) models."""
    baseline = make_estimator(tmp_path / "baseline", epochs=3, checkpoint_every_steps=2).fit(frame)
    log, marker = tmp_path / "batches.log", tmp_path / "rank-killed"
    resumed = make_estimator(tmp_path / "retried", epochs=3, checkpoint_every_steps=2, verbose=1,
                             callbacks=[kill_callback(marker, log, epoch=1, batch=2)]).fit(frame)
    printed = capsys.readouterr().out
    assert marker.exists()
    assert "retry 1/3 (attempt 2) after the barrier stage failed" in printed, printed[-3000:]
    assert f"resuming from epoch 2, step 2 of {steps}" in printed, printed[-3000:]
    assert [h["epoch"] for h in resumed.getHistory()] == [1, 2, 3]
    lines = [line.split() for line in log.read_text().splitlines()]
    attempts = list(dict.fromkeys(pid for pid, _ in lines))
    assert len(attempts) == 2
    retried = [int(epoch) for pid, epoch in lines if pid == attempts[1]]
    assert retried == [1] * (steps - 2) + [2] * steps, retried
    return resumed, baseline
