"""Driver-side pieces every estimator's fit() shares: the store of a fit (a temporary one on a local
master), the lock that serializes materialization, and the size of the driver's probe batch."""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from typing import Any, Optional

from spark_hvd.spark.store import Store

__all__ = ["PROBE_ROWS", "local_default_store", "fit_store", "prepare_lock"]

PROBE_ROWS = 64
"""Rows of real data the driver puts through the model and the loss before materializing."""

_default_store: Optional[Store] = None
_store_lock = threading.Lock()

prepare_lock = threading.Lock()
"""Serializes materialization: concurrent fits of one DataFrame (CrossValidator with parallelism
> 1) would otherwise write the same cached dataset at once."""


def local_default_store() -> Store:
    """A store in a temporary directory of this process, removed when it exits (local masters only)."""
    global _default_store
    with _store_lock:
        if _default_store is None:
            path = tempfile.mkdtemp(prefix="spark-hvd-store-")
            atexit.register(shutil.rmtree, path, True)
            _default_store = Store.create(path)
        return _default_store


def fit_store(store: Optional[Store], info: Any) -> Store:
    """The ``store`` Param, or on a local master a temporary store when it is unset; a ValueError
    on a cluster, whose executors cannot read the driver's temporary directory."""
    if store is not None:
        return store
    if not info.local:
        raise ValueError("store=None is not valid on a cluster: expected storage every executor can read; "
                         "pass e.g. store=Store.create('hdfs:///user/me/spark-hvd'), or on Databricks "
                         "store=Store.create('/Volumes/<catalog>/<schema>/<volume>/spark-hvd')")
    return local_default_store()
