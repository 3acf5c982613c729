"""Nothing a rank started outlives the job: launcher killed or stopped, a rank failing, normal completion.

Every rank starts three sleeping processes (runner_helpers.start_leftovers): a plain child, a
child that calls os.setsid(), and a double-forked daemon in a session of its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from runner_helpers import (
    LAUNCHER,
    is_alive,
    kill_leftovers,
    launch,
    leftover_pid_files,
    read_pids,
    start_leftovers,
    wait_until,
)

from spark_hvd.runner import RankFailedError, run

HELPERS_DIR = os.path.dirname(os.path.abspath(__file__))

# Ranks start their leftovers, report them running, then either sleep or end as the test says.
RANK_SCRIPT = """
import os, sys, time
sys.path.insert(0, {helpers!r})
from runner_helpers import leftover_pid_files, read_pids, start_leftovers
tag = "rank" + os.environ["SPARK_HVD_RANK"]
start_leftovers({directory!r}, tag)
read_pids(leftover_pid_files({directory!r}, [tag]), timeout=60)
print("leftovers started", flush=True)
if {then!r} == "sleep":
    time.sleep(1000)
"""


@pytest.fixture
def leftovers_dir(tmp_path):
    directory = tmp_path / "leftovers"
    directory.mkdir()
    yield str(directory)
    kill_leftovers(str(directory))


def _rank_script(script, directory: str, then: str) -> str:
    return script(RANK_SCRIPT.format(helpers=HELPERS_DIR, directory=directory, then=then))


def _alive(pids):
    return [pid for pid in pids if is_alive(pid)]


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_leftovers_die_with_the_launcher(script, leftovers_dir, signum):
    """SIGKILL (no cleanup possible), SIGTERM or SIGINT to spark-hvd-run ends every process its ranks started."""
    path = _rank_script(script, leftovers_dir, then="sleep")
    launcher = subprocess.Popen(LAUNCHER + ["-np", "2", sys.executable, path],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pids = read_pids(leftover_pid_files(leftovers_dir, ["rank0", "rank1"]), timeout=60)
        assert _alive(pids) == pids
        launcher.send_signal(signum)
        launcher.wait(timeout=30)
        assert wait_until(lambda: not _alive(pids), timeout=30), f"still running: {_alive(pids)}"
    finally:
        launcher.kill()
        launcher.wait(timeout=30)


def test_leftovers_of_a_normal_run_end_with_it(script, leftovers_dir):
    """Ranks that exit 0 leaving processes behind: the launcher exits 0 and none of them remains."""
    path = _rank_script(script, leftovers_dir, then="exit")
    done = launch(["-np", "2", sys.executable, path], timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(line for line in done.stdout.splitlines() if "leftovers" in line) == \
        ["[0]<stdout>:leftovers started", "[1]<stdout>:leftovers started"]
    pids = read_pids(leftover_pid_files(leftovers_dir, ["rank0", "rank1"]), timeout=5)
    assert _alive(pids) == []


def start_leftovers_and_fail_on_rank_one(directory: str) -> None:
    rank = os.environ["SPARK_HVD_RANK"]
    start_leftovers(directory, "rank" + rank)
    if rank == "1":
        # Fail only once rank 0's processes run too, so the failure has something to clean up.
        read_pids(leftover_pid_files(directory, ["rank0", "rank1"]), timeout=60)
        raise RuntimeError("rank 1 fails with processes running")
    import time

    time.sleep(1000)


def test_run_leaves_nothing_behind_when_a_rank_fails(leftovers_dir):
    """run() raising for rank 1's error has already ended both ranks' leftovers."""
    with pytest.raises(RankFailedError) as info:
        run(start_leftovers_and_fail_on_rank_one, args=(leftovers_dir,), np=2, timeout=120)
    assert info.value.rank == 1
    pids = read_pids(leftover_pid_files(leftovers_dir, ["rank0", "rank1"]), timeout=5)
    assert _alive(pids) == []
