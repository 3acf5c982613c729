"""A local SparkSession set up for fast, loopback-only runs (tests, examples, laptops)."""

from __future__ import annotations

import sys
from typing import Any, Dict, Mapping, Optional

__all__ = ["LOCAL_ENVIRONMENT", "local_spark_conf", "build_local_session"]

LOCAL_ENVIRONMENT: Dict[str, str] = {"SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}
"""Environment for a process that starts a local Spark JVM: loopback only, workers run this Python.
Launchers and test fixtures apply it; :func:`build_local_session` does not touch the environment."""


def local_spark_conf(num_cores: int = 2, shuffle_partitions: int = 4) -> Dict[str, str]:
    """Spark settings for a local session: ``local[num_cores]``, no UI, loopback addresses, few
    shuffle partitions, and barrier stages that fail at once when slots are missing."""
    return {
        "spark.master": f"local[{num_cores}]",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.sql.shuffle.partitions": str(shuffle_partitions),
        # By default a barrier stage with too few slots re-checks 40 times, 15 s apart.
        "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "1",
        "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "1s",
        "spark.pyspark.python": sys.executable,
        "spark.pyspark.driver.python": sys.executable,
    }


def build_local_session(app_name: str = "spark-hvd", num_cores: int = 2,
                        conf: Optional[Mapping[str, Any]] = None) -> Any:
    """A SparkSession with :func:`local_spark_conf` settings, plus ``conf`` on top.

    When a SparkContext is already running it is reused as it is (Spark allows one per process).
    """
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    creating = SparkContext._active_spark_context is None
    builder = SparkSession.builder.appName(app_name)
    for key, value in {**local_spark_conf(num_cores), **dict(conf or {})}.items():
        builder = builder.config(key, str(value))
    session = builder.getOrCreate()
    if creating:
        # pyspark's Python side takes the workers' interpreter from PYSPARK_PYTHON only, else
        # whatever 'python3' is on PATH, which need not have this environment's packages.
        session.sparkContext.pythonExec = session.sparkContext.getConf().get(
            "spark.pyspark.python", sys.executable)
    return session
