"""Helpers for launcher tests: the launcher command line, its messages, process liveness, leftovers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import List, Sequence

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS not in sys.path:  # rank scripts import this module with only its own folder on the path
    sys.path.insert(0, _TESTS)

from harness import is_alive, wait_until  # noqa: E402,F401  (shared by every test folder)

LAUNCHER = [sys.executable, "-m", "spark_hvd.runner.cli"]


def launch(args: Sequence[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run spark-hvd-run with ``args`` to completion, capturing its output as text."""
    return subprocess.run(LAUNCHER + list(args), capture_output=True, text=True, timeout=timeout)


def launcher_messages(stderr: str) -> List[str]:
    """The launcher's own lines (not the ranks' output), in order."""
    return [line for line in stderr.splitlines() if line.startswith("spark-hvd-run:")]


# A process that sleeps until something ends it, after writing its pid to argv[1] (atomically).
# kind "session" calls os.setsid() first; kind "daemon" also double-forks, so it is orphaned
# while the rank that started it still runs.
_SLEEPER = (
    "import os, sys, time\n"
    "path, kind = sys.argv[1], sys.argv[2]\n"
    "if kind == 'daemon' and os.fork():\n"
    "    os._exit(0)\n"
    "if kind in ('session', 'daemon'):\n"
    "    os.setsid()\n"
    "with open(path + '.tmp', 'w') as f:\n"
    "    f.write(str(os.getpid()))\n"
    "os.replace(path + '.tmp', path)\n"
    "time.sleep(1000)  # spark-hvd test leftover\n"
)
_SLEEPER_MARK = b"spark-hvd test leftover"

LEFTOVER_KINDS = ("plain", "session", "daemon")


def start_leftovers(directory: str, tag: str) -> None:
    """Start one process of each of LEFTOVER_KINDS that would outlive its starter if nothing ended it.

    Each writes its pid to ``directory/<tag>.<kind>.pid`` once running. The plain one keeps
    the starter's stdout and stderr, as a forgotten child would.
    """
    for kind in LEFTOVER_KINDS:
        quiet = {} if kind == "plain" else {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        subprocess.Popen([sys.executable, "-c", _SLEEPER, os.path.join(directory, f"{tag}.{kind}.pid"), kind],
                         stdin=subprocess.DEVNULL, **quiet)


def leftover_pid_files(directory: str, tags: Sequence[str]) -> List[str]:
    """The pid files ``start_leftovers(directory, tag)`` writes for each tag."""
    return [os.path.join(directory, f"{tag}.{kind}.pid") for tag in tags for kind in LEFTOVER_KINDS]


def read_pids(paths: Sequence[str], timeout: float) -> List[int]:
    """The pids in ``paths`` once every file exists; AssertionError after ``timeout`` seconds."""
    assert wait_until(lambda: all(os.path.exists(p) for p in paths), timeout), \
        f"missing pid files: {[p for p in paths if not os.path.exists(p)]}"
    pids = []
    for path in paths:
        with open(path) as f:
            pids.append(int(f.read()))
    return pids


def kill_leftovers(directory: str) -> None:
    """SIGKILL the test leftovers recorded in ``directory`` that still run (test cleanup only).

    A pid is signalled only while its command line is still the sleeper's, so a pid reused by
    another process is left alone.
    """
    for name in os.listdir(directory):
        if not name.endswith(".pid"):
            continue
        with open(os.path.join(directory, name)) as f:
            pid = int(f.read())
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                mine = _SLEEPER_MARK in f.read()
        except OSError:
            continue
        if mine:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
