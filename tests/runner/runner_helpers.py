"""Helpers for launcher tests: the launcher command line, its messages, process liveness."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import List, Sequence

LAUNCHER = [sys.executable, "-m", "spark_hvd.runner.cli"]


def launch(args: Sequence[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run spark-hvd-run with ``args`` to completion, capturing its output as text."""
    return subprocess.run(LAUNCHER + list(args), capture_output=True, text=True, timeout=timeout)


def launcher_messages(stderr: str) -> List[str]:
    """The launcher's own lines (not the ranks' output), in order."""
    return [line for line in stderr.splitlines() if line.startswith("spark-hvd-run:")]


def is_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie waiting to be reaped counts as dead."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; return whether it held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
