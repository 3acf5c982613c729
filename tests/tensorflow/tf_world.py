"""spark_hvd.tensorflow and spark_hvd.keras checks run through the shared harness (tests/harness.py).

A check is ``check(hvd, rank, size)`` with ``hvd`` the binding module; every rank runs with one
intra-op thread and the same Keras seed before each check.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np

import harness
from harness import SIZES, assert_passed

__all__ = ["SIZES", "launch", "assert_passed", "close"]

_QUIET = {"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore"}


def launch(checks: Sequence[harness.Check], np: int, framework: str = "tensorflow", timeout: float = 240,
           env: Optional[Dict[str, str]] = None) -> List[Dict[str, Dict[str, Any]]]:
    """Launch a world of ``np`` ranks that runs ``checks`` under ``framework`` (tensorflow or keras)."""
    return harness.launch(checks, np, framework=framework, timeout=timeout, env={**_QUIET, **(env or {})})


def close(got: Any, want: Any, atol: float = 0.0, what: str = "") -> None:
    """Assert equal shape and dtype and values within ``atol`` (exact by default)."""
    got_a = np.asarray(got.numpy() if hasattr(got, "numpy") else got)
    want_a = np.asarray(want.numpy() if hasattr(want, "numpy") else want)
    assert got_a.shape == want_a.shape, f"{what}: shape {got_a.shape} != expected {want_a.shape}"
    assert got_a.dtype == want_a.dtype, f"{what}: dtype {got_a.dtype} != expected {want_a.dtype}"
    if got_a.size:
        diff = np.max(np.abs(got_a.astype(np.float64) - want_a.astype(np.float64)))
        assert diff <= atol, f"{what}: max difference {diff} > {atol}\n got  {got_a}\n want {want_a}"
