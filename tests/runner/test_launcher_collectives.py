"""spark-hvd-run with the runtime's collectives: a rank lost mid-training ends the whole job."""

from __future__ import annotations

import sys

from runner_helpers import launch, launcher_messages

from spark_hvd.runner import run


def test_rank_killed_during_allreduce_loop_is_named_as_root_cause(script):
    """3 ranks allreduce in a loop; rank 1 SIGKILLs itself mid-way: the launcher exits non-zero naming rank 1."""
    path = script(
        """
        import os, signal
        import numpy as np
        import spark_hvd.runtime as hvd

        hvd.init()
        for step in range(100000):
            total = hvd.allreduce(np.full(1000, hvd.rank() + 1, dtype=np.float32), op=hvd.Sum)
            if step == 0:
                print(f"first sum {total[0]:.0f}")
            if step == 50 and hvd.rank() == 1:
                print("rank 1 dies now")
                os.kill(os.getpid(), signal.SIGKILL)
        print("finished without noticing")
        """
    )
    done = launch(["-np", "3", sys.executable, path], timeout=60)
    assert done.returncode != 0
    assert launcher_messages(done.stderr)[0] == "spark-hvd-run: rank 1 was killed by signal SIGKILL"
    lines = done.stdout.splitlines()
    assert all(f"[{rank}]<stdout>:first sum 6" in lines for rank in range(3))
    assert "[1]<stdout>:rank 1 dies now" in lines
    assert not any("finished without noticing" in line for line in lines)


def allreduce_rank_values():
    import numpy as np

    import spark_hvd.runtime as hvd

    hvd.init()
    try:
        total = hvd.allreduce(np.arange(5, dtype=np.float64) * (hvd.rank() + 1), op=hvd.Sum)
        return hvd.rank(), hvd.size(), total.tolist()
    finally:
        hvd.shutdown()


def test_run_ranks_form_one_world_and_allreduce():
    """Ranks started by run() join one world through the launcher's rendezvous and reduce together."""
    results = run(allreduce_rank_values, np=3, timeout=60)
    expected = [0.0, 6.0, 12.0, 18.0, 24.0]
    assert results == [(0, 3, expected), (1, 3, expected), (2, 3, expected)]
