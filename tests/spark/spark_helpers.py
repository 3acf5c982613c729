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
