"""Driver-side state every estimator's fit() shares: the default store of a local session, and
the lock that serializes materialization."""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from typing import Optional

from spark_hvd.spark.store import Store

__all__ = ["local_default_store", "prepare_lock"]

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
