"""Which rank a launcher names first: a rank that left early with code 0 comes before the failure it caused."""

from __future__ import annotations

import os
import sys
import time

import pytest
from runner_helpers import is_alive, launch, launcher_messages, read_pids, wait_until

from spark_hvd.runner import RankExit, RankFailedError, run
from spark_hvd.runtime.errors import CollectiveError

# Ranks 0 and 1 fail on their own once rank 2 has gone, a moment later, so the order of events
# does not depend on how fast the runtime notices a lost peer.
PEERS_LOSE_RANK_2 = """
import os, sys, time
sys.path.insert(0, {helpers!r})
from runner_helpers import is_alive, read_pids, wait_until
rank = os.environ["SPARK_HVD_RANK"]
pid_file = os.path.join({directory!r}, "rank2.pid")
if rank == "2":
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(pid_file + ".tmp", pid_file)
    print("rank 2 is done")
    sys.exit(0)
[rank2] = read_pids([pid_file], timeout=60)
wait_until(lambda: not is_alive(rank2), timeout=60)
time.sleep(0.5)
print(f"rank {{rank}} lost rank 2")
sys.exit(1)
"""


def test_cli_names_the_rank_that_left_first_then_the_reaction(script, tmp_path):
    """Rank 2 ends with code 0 while 0 and 1 still run, and they then fail: rank 2 is named first, then one of them."""
    helpers = os.path.dirname(os.path.abspath(__file__))
    path = script(PEERS_LOSE_RANK_2.format(helpers=helpers, directory=str(tmp_path)))
    done = launch(["-np", "3", sys.executable, path], timeout=120)
    assert done.returncode == 1
    messages = launcher_messages(done.stderr)
    assert messages[0] == "spark-hvd-run: rank 2 exited with code 0 while ranks 0 and 1 were still running"
    assert messages[1] == "spark-hvd-run: last 1 lines of output of rank 2:"
    assert "[2]<stdout>:rank 2 is done" in done.stderr.splitlines()
    reaction = [m for m in messages if m.startswith("spark-hvd-run: then ")]
    assert reaction in (["spark-hvd-run: then rank 0 exited with code 1"],
                        ["spark-hvd-run: then rank 1 exited with code 1"])
    reacting = reaction[0].split()[3]
    other = "1" if reacting == "0" else "0"
    assert f"[{reacting}]<stdout>:rank {reacting} lost rank 2" in done.stderr.splitlines()
    assert messages[-1] in (f"spark-hvd-run: after rank {reacting} failed: rank {other} was stopped",
                            f"spark-hvd-run: after rank {reacting} failed: rank {other} exited with code 1")


def _write_pid(directory: str) -> None:
    with open(os.path.join(directory, "rank2.pid.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(directory, "rank2.pid.tmp"), os.path.join(directory, "rank2.pid"))


def _wait_for_rank_2_to_end(directory: str) -> None:
    [rank2] = read_pids([os.path.join(directory, "rank2.pid")], timeout=60)
    assert wait_until(lambda: not is_alive(rank2), timeout=60)


def leave_early_on_rank_2(directory: str) -> str:
    if os.environ["SPARK_HVD_RANK"] == "2":
        _write_pid(directory)
        print("rank 2 returns at once")
        return "done"
    _wait_for_rank_2_to_end(directory)
    time.sleep(0.5)
    raise CollectiveError("lost rank 2")


def test_run_names_the_rank_that_returned_early_with_the_reaction_attached(tmp_path):
    """run(): RankFailedError names rank 2 (code 0, its output), with the reacting rank's error as .reaction."""
    with pytest.raises(RankFailedError) as info:
        run(leave_early_on_rank_2, args=(str(tmp_path),), np=3, timeout=120)
    error = info.value
    assert error.rank == 2
    assert error.exc_type is None
    assert "[2]<stdout>:rank 2 returns at once" in error.output_tail
    reaction = error.reaction
    assert reaction is not None and reaction.rank in (0, 1)
    assert reaction.exc_type == "spark_hvd.runtime.errors.CollectiveError"
    assert isinstance(reaction.original, CollectiveError)
    assert error.summary == (
        f"rank 2 exited with code 0 while ranks 0 and 1 were still running (after fn returned); "
        f"then rank {reaction.rank} raised spark_hvd.runtime.errors.CollectiveError: lost rank 2"
    )
    assert f"Traceback from rank {reaction.rank}:" in str(error)
    assert "Last 1 lines of output of rank 2:" in str(error)


def leave_the_world_early_on_rank_2(directory: str) -> str:
    import numpy as np

    import spark_hvd.runtime as hvd

    hvd.init()
    if hvd.rank() == 2:
        _write_pid(directory)
        return "left"  # the worker shuts the runtime down as it exits
    _wait_for_rank_2_to_end(directory)
    for _ in range(1000):
        hvd.allreduce(np.ones(4), op=hvd.Sum)
    return "never"


def test_run_names_a_rank_that_left_a_world_still_in_collectives(tmp_path):
    """Ranks 0 and 1 allreduce after rank 2 left the world: whatever they then report, rank 2 is named first."""
    with pytest.raises(RankFailedError) as info:
        run(leave_the_world_early_on_rank_2, args=(str(tmp_path),), np=3, timeout=120,
            settings={"start_timeout": 60})
    assert info.value.rank == 2
    assert info.value.summary.startswith("rank 2 exited with code 0 while ranks 0 and 1 were still running")
    assert info.value.reaction is not None and info.value.reaction.rank in (0, 1)


def fail_on_rank_1_after_rank_0_returned(directory: str) -> None:
    rank = os.environ["SPARK_HVD_RANK"]
    pid_file = os.path.join(directory, "rank0.pid")
    if rank == "0":
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(pid_file + ".tmp", pid_file)
        return
    [rank0] = read_pids([pid_file], timeout=60)
    assert wait_until(lambda: not is_alive(rank0), timeout=60)
    raise AssertionError("rank 1 got a wrong value")


def test_run_names_a_rank_failing_on_its_own_even_after_another_returned(tmp_path):
    """run(): rank 1 raising its own error after rank 0 returned is the root cause; rank 0 is no cause."""
    with pytest.raises(RankFailedError) as info:
        run(fail_on_rank_1_after_rank_0_returned, args=(str(tmp_path),), np=2, timeout=120)
    assert info.value.rank == 1
    assert info.value.exc_type == "AssertionError"
    assert info.value.reaction is None


# Rank 2 announces that it is leaving, as the runtime's shutdown tells peers, and exits only a
# moment later; its peers fail as soon as they hear of it, often before it has exited.
PEERS_FAIL_BEFORE_RANK_2_EXITS = """
import os, sys, time
sys.path.insert(0, {helpers!r})
from runner_helpers import wait_until
leaving = os.path.join({directory!r}, "rank2.leaving")
if os.environ["SPARK_HVD_RANK"] == "2":
    open(leaving, "w").close()
    time.sleep(0.3)
    sys.exit(0)
wait_until(lambda: os.path.exists(leaving), timeout=60)
sys.exit(1)
"""


def test_cli_names_a_leaver_whose_peers_failed_before_it_had_exited(script, tmp_path):
    """Ranks 0 and 1 fail as soon as rank 2 announces it leaves; rank 2 exits 0 after them and is still named first."""
    helpers = os.path.dirname(os.path.abspath(__file__))
    path = script(PEERS_FAIL_BEFORE_RANK_2_EXITS.format(helpers=helpers, directory=str(tmp_path)))
    done = launch(["-np", "3", sys.executable, path], timeout=120)
    assert done.returncode == 1
    messages = launcher_messages(done.stderr)
    assert messages[0] == "spark-hvd-run: rank 2 exited with code 0 while ranks 0 and 1 were still running"
    assert messages[1] in ("spark-hvd-run: then rank 0 exited with code 1", "spark-hvd-run: then rank 1 exited with code 1")


def return_at_different_times() -> int:
    rank = int(os.environ["SPARK_HVD_RANK"])
    if rank > 0:
        time.sleep(1.0)
    return rank


def test_ranks_that_finish_early_are_no_cause_when_nothing_fails():
    """Rank 0 returning long before the others is not a failure: every result comes back."""
    assert run(return_at_different_times, np=3, timeout=120) == [0, 1, 2]


@pytest.mark.parametrize("failure, text, status", [
    (RankExit(1, 17), "rank 1 exited with code 17", 17),
    (RankExit(1, -9), "rank 1 was killed by signal SIGKILL", 1),
    (RankExit(2, 0, running=(0, 1), reaction=RankExit(0, 3)),
     "rank 2 exited with code 0 while ranks 0 and 1 were still running", 3),
    (RankExit(3, 0, running=(1,), reaction=RankExit(1, -15)),
     "rank 3 exited with code 0 while rank 1 was still running", 1),
    (RankExit(3, 0, running=(0, 1, 2), reaction=RankExit(1, 1)),
     "rank 3 exited with code 0 while ranks 0, 1 and 2 were still running", 1),
])
def test_rank_exit_describes_itself_and_gives_the_exit_status(failure, text, status):
    """describe() names the rank and how it ended; a launcher exits with its code, its reaction's, or 1."""
    assert failure.describe() == text
    assert failure.exit_status == status
