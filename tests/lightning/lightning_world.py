"""Helpers for spark_hvd.lightning checks run through the shared harness (tests/harness.py).

A check is ``check(hvd, rank, size)`` with ``hvd`` the spark_hvd.torch module; it builds its own
Trainers with :func:`trainer`. Every rank runs with one torch thread and the same seed before each check.
"""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence

import pytorch_lightning as pl
import torch

import harness
from harness import SIZES, assert_passed
from spark_hvd.lightning import SparkHvdStrategy

__all__ = ["SIZES", "launch", "assert_passed", "trainer", "shared_dir", "close"]


def launch(checks: Sequence[harness.Check], np: int, timeout: float = 300,
           env: Optional[Dict[str, str]] = None) -> List[Dict[str, Dict[str, Any]]]:
    """Launch a world of ``np`` ranks that runs ``checks`` under spark_hvd.torch."""
    return harness.launch(checks, np, framework="torch", timeout=timeout, env=env,
                          preload=harness.PRELOAD["torch"] + ("pytorch_lightning",))


def trainer(**options: Any) -> pl.Trainer:
    """A quiet CPU Trainer on SparkHvdStrategy that writes nothing unless asked to."""
    settings: Dict[str, Any] = dict(strategy=SparkHvdStrategy(), accelerator="cpu", devices=1, logger=False,
                                    enable_checkpointing=False, enable_progress_bar=False,
                                    enable_model_summary=False, num_sanity_val_steps=0)
    settings.update(options)
    return pl.Trainer(**settings)


@contextmanager
def shared_dir(hvd: Any) -> Iterator[str]:
    """A temporary directory made by rank 0, the same path on every rank, removed by rank 0 at the end."""
    path = tempfile.mkdtemp(prefix="spark-hvd-lightning-") if hvd.rank() == 0 else None
    path = hvd.broadcast_object(path, root_rank=0, name="tests.shared_dir")
    try:
        yield path
    finally:
        hvd.barrier()
        if hvd.rank() == 0:
            shutil.rmtree(path, ignore_errors=True)


def close(got: torch.Tensor, want: torch.Tensor, atol: float, what: str) -> None:
    """Assert equal shapes and values within ``atol``."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    assert diff <= atol, f"{what}: max difference {diff} > {atol}\n got  {got}\n want {want}"
