"""spark_hvd.torch checks run through the shared harness (tests/harness.py), and their tensor helpers.

A check is ``check(hvd, rank, size)`` with ``hvd`` the spark_hvd.torch module; every rank runs with
one torch thread and the same seed before each check.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

import harness
from harness import SIZES, assert_passed

__all__ = ["SIZES", "launch", "assert_passed", "close", "tolerance"]


def launch(checks: Sequence[harness.Check], np: int, timeout: float = 180, env: Optional[Dict[str, str]] = None,
           settings: Optional[Dict[str, object]] = None) -> List[Dict[str, Dict[str, Any]]]:
    """Launch a world of ``np`` ranks that runs ``checks`` under spark_hvd.torch."""
    return harness.launch(checks, np, framework="torch", timeout=timeout, env=env, settings=settings)


def close(got: torch.Tensor, want: torch.Tensor, atol: float = 0.0, what: str = "") -> None:
    """Assert equal shape and dtype and values within ``atol`` (exact by default)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != expected {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != expected {want.dtype}"
    diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    assert diff <= atol, f"{what}: max difference {diff} > {atol}\n got  {got}\n want {want}"


def tolerance(dtype: torch.dtype) -> float:
    """Absolute tolerance for small integer-valued data averaged over up to three ranks."""
    return {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-5, torch.float64: 1e-12}.get(dtype, 0.0)
