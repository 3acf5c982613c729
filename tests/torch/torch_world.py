"""Harness for spark_hvd.torch tests: one launched world per size runs a whole batch of checks.

A check is a function ``check(hvd, rank, size)`` that raises AssertionError when the behaviour
is wrong; its expected values come from ``(rank, size)`` alone, so one check serves sizes 1, 2
and 3. All ranks run the checks in the same order. The first failure on a rank ends that rank's
batch (its peers then fail fast instead of waiting on collectives it will never join).
"""

from __future__ import annotations

import traceback
from typing import Callable, Dict, List, Optional, Sequence

import torch

SIZES = (1, 2, 3)

Check = Callable[..., None]


def run_checks(checks: Sequence[Check]) -> Dict[str, Optional[str]]:
    """Run inside each rank: initialize, run every check, return {check name: None or traceback}."""
    import spark_hvd.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    outcome: Dict[str, Optional[str]] = {}
    try:
        for check in checks:
            try:
                torch.manual_seed(1234)
                check(hvd, hvd.rank(), hvd.size())
            except BaseException:
                outcome[check.__name__] = traceback.format_exc()
                break
            outcome[check.__name__] = None
    finally:
        hvd.shutdown()
    return outcome


def launch(checks: Sequence[Check], np: int, timeout: float = 120, env: Optional[Dict[str, str]] = None,
           settings: Optional[Dict[str, object]] = None) -> List[Dict[str, Optional[str]]]:
    """Launch a world of ``np`` ranks that runs ``checks``; return each rank's outcome."""
    from spark_hvd.runner import run

    return run(run_checks, args=(list(checks),), np=np, timeout=timeout, env=env, settings=settings)


def assert_passed(results: List[Dict[str, Optional[str]]], check: Check) -> None:
    """Fail with the rank's traceback unless ``check`` ran and passed on every rank."""
    name = check.__name__
    for rank, outcome in enumerate(results):
        if name not in outcome:
            failed = [k for k, v in outcome.items() if v is not None]
            raise AssertionError(f"rank {rank} did not run {name}: the earlier check {failed} failed")
        if outcome[name] is not None:
            raise AssertionError(f"{name} failed on rank {rank}:\n{outcome[name]}")


def close(got: torch.Tensor, want: torch.Tensor, atol: float = 0.0, what: str = "") -> None:
    """Assert equal shape and dtype and values within ``atol`` (exact by default)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != expected {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != expected {want.dtype}"
    diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    assert diff <= atol, f"{what}: max difference {diff} > {atol}\n got  {got}\n want {want}"


def tolerance(dtype: torch.dtype) -> float:
    """Absolute tolerance for small integer-valued data averaged over up to three ranks."""
    return {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-5, torch.float64: 1e-12}.get(dtype, 0.0)
