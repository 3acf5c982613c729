"""Faults found by probing running jobs: each one reproduced with real processes.

Stalls in every phase are reported and end at the shutdown deadline; nothing is left in /dev/shm;
Ctrl-C reaches user code as KeyboardInterrupt; the runtime re-initializes any number of times;
mixed asynchronous collectives through tiny response caches stay correct.
"""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness import is_alive, wait_until
from spark_hvd.runner import RankFailedError, run

ROOT = Path(__file__).resolve().parents[2]


def test_mixed_async_soak_through_tiny_caches(tmp_path):
    """3,000 mixed asynchronous collectives per rank, in a different order on every rank, through
    response caches of 0, 1 and 16 entries: no wrong result, no error, no crash."""
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--np", "3", "--ops", "3000", "--capacities", "0",
         "1", "16", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for capacity in ("0", "1", "16"):
        world = report["worlds"][capacity]
        assert world["status"] == "ok", world
        assert all(r["ops"] == 3000 and r["wrong_count"] == 0 and r["error_count"] == 0 for r in world["ranks"])


def _stop_in_data_phase():
    import os
    import signal
    import threading
    import time

    import numpy as np

    import spark_hvd.runtime as rt

    rt.init()
    # 256 MiB summed in place: moving the data is nearly all of each step, nothing happens after it.
    data = np.ones(64 << 20, np.float32)
    rt.allreduce(data, out=data, op=rt.Sum, name="warm-up")
    started = time.monotonic()
    try:
        # Rank 1 stops itself shortly after it has submitted 'big', early in a step of 0.15-0.2 s
        # here: a stop timed from before the submission could land between two steps, where rank 0
        # waits for a submission instead of for data.
        handle = rt.allreduce_async(data, out=data, op=rt.Sum, name="big")
        if rt.rank() == 1:
            def stop() -> None:
                time.sleep(0.03)
                os.kill(os.getpid(), signal.SIGSTOP)
            threading.Thread(target=stop, daemon=True).start()
        rt.synchronize(handle)
        while True:
            rt.allreduce(data, out=data, op=rt.Sum, name="big")
    except rt.CollectiveError as exc:
        raise RuntimeError(f"failed after {time.monotonic() - started:.1f} s: {exc}") from None


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_rank_stopped_during_a_large_allreduce_is_reported_then_ends_the_job(shm):
    """SIGSTOP of rank 1 in the middle of 256 MiB allreduces: rank 0 warns, naming the operation and
    rank 1, after the stall-check time, and fails at the shutdown deadline instead of hanging."""
    settings = {"stall_check_seconds": 1.0, "stall_shutdown_seconds": 4.0, "shm": shm}
    with pytest.raises(RankFailedError) as info:
        run(_stop_in_data_phase, np=2, settings=settings, timeout=120)
    error = info.value
    assert error.rank == 0, error
    output = "\n".join(error.output_tail)
    assert "stall" in output and "'big'" in output and "[1]" in output, output
    message = str(error)
    assert "rank(s) [1]" in message and "SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS=4.0" in message, message
    if not shm:  # over sockets the step is long enough to be stopped in its data phase for sure
        assert "received nothing from rank(s) [1]" in message, message


def _stop_coordinator(blocking):
    import os
    import signal
    import time

    import numpy as np

    import spark_hvd.runtime as rt

    rt.init()
    rt.allreduce(np.ones(4), name="before")
    rt.barrier()
    if rt.rank() == 0:
        os.kill(os.getpid(), signal.SIGSTOP)
    started = time.monotonic()
    try:
        if blocking:
            rt.allreduce(np.ones(4), name="after")
        else:
            rt.allreduce_async(np.ones(4), name="after").wait()
    except rt.CollectiveError as exc:
        raise RuntimeError(f"failed after {time.monotonic() - started:.1f} s: {exc}") from None


@pytest.mark.parametrize("blocking", [False, True], ids=["negotiated", "program-order"])
def test_stopped_coordinator_is_reported_by_the_workers_then_ends_the_job(blocking):
    """SIGSTOP of rank 0 between small allreduces: the workers warn, naming the operation and rank 0
    (negotiated: the coordinator does not answer; a blocking allreduce in program order: rank 0 has
    not issued it), and give up at the shutdown deadline."""
    settings = {"stall_check_seconds": 1.0, "stall_shutdown_seconds": 4.0}
    with pytest.raises(RankFailedError) as info:
        run(_stop_coordinator, args=(blocking,), np=3, settings=settings, timeout=120)
    error = info.value
    assert error.rank in (1, 2), error
    output = "\n".join(error.output_tail)
    if blocking:
        assert "missing rank(s) [0]" in output and "'after'" in output, output
        assert "exceeded SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS=4.0" in str(error), error
    else:
        assert "no answer from the coordinator (rank 0)" in output and "'after'" in output, output
        assert "within SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS=4.0" in str(error), error


SHM_JOB = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    import spark_hvd.runtime as rt

    out = sys.argv[1]
    rt.init()
    rt.allreduce(np.ones(1 << 20, np.float32), name="warm-up")
    with open(os.path.join(out, f"ready.{rt.rank()}"), "w") as f:
        f.write(str(os.getpid()))
    while True:
        rt.allreduce(np.ones(1 << 16, np.float32), name="loop")
    """
)


def _shm_entries():
    return {name for name in os.listdir("/dev/shm") if "spark-hvd" in name}


def test_nothing_in_dev_shm_during_start_up_or_after_a_killed_launcher(tmp_path):
    """While a 3-rank job starts and runs, no file of it appears in /dev/shm; after its launcher is
    SIGKILLed, its ranks are gone and /dev/shm holds nothing of it either."""
    before = _shm_entries()
    script = tmp_path / "job.py"
    script.write_text(SHM_JOB)
    launcher = subprocess.Popen([str(Path(sys.executable).with_name("spark-hvd-run")), "-np", "3", sys.executable,
                                 str(script), str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen = set()
    pids = {}
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 3 and time.monotonic() < deadline:
            seen |= _shm_entries() - before
            for rank in range(3):
                ready = tmp_path / f"ready.{rank}"
                if rank not in pids and ready.exists() and ready.read_text():
                    pids[rank] = int(ready.read_text())
            time.sleep(0.002)
        assert len(pids) == 3, "the job did not start"
        assert seen == set(), f"files appeared in /dev/shm during start-up: {sorted(seen)}"
    finally:
        launcher.kill()
        launcher.wait()
    assert wait_until(lambda: not any(is_alive(pid) for pid in pids.values()), 20), \
        f"ranks outlived the launcher: {pids}"
    assert _shm_entries() - before == set()


def _interrupted_rounds(rounds: int):
    import signal
    import threading
    import time

    import numpy as np

    import spark_hvd.runtime as rt

    # A job started in the background inherits SIGINT ignored; give this rank Python's own handler,
    # as an interactive session has it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    outcomes = []
    for round_no in range(rounds):
        rt.init()
        if rt.rank() == 1:
            timer = threading.Timer(0.2 + 0.05 * round_no, lambda: signal.raise_signal(signal.SIGINT))
            timer.start()
            try:
                while True:
                    rt.allreduce(np.ones(4), op=rt.Sum, name="tick")
            except KeyboardInterrupt:
                outcomes.append("KeyboardInterrupt")
            except BaseException as exc:  # the failure this test exists to catch
                outcomes.append(f"{type(exc).__name__}: {exc}")
            timer.join()
        else:
            try:
                while True:
                    rt.allreduce(np.ones(4), op=rt.Sum, name="tick")
            except rt.CollectiveError:
                outcomes.append("peer left")
        rt.shutdown()
        time.sleep(0.1)
    return outcomes


def test_ctrl_c_reaches_user_code_as_keyboard_interrupt():
    """SIGINT landing while a rank waits in (and drives) allreduces surfaces as KeyboardInterrupt in
    the user's code, never as a CollectiveError about a failed engine; the runtime then shuts down
    and initializes again."""
    results = run(_interrupted_rounds, args=(4,), np=2, timeout=180)
    assert results[1] == ["KeyboardInterrupt"] * 4, results[1]
    assert results[0] == ["peer left"] * 4, results[0]


def _reinit_cycles(cycles: int):
    import os
    import time

    import numpy as np

    import spark_hvd.runtime as rt

    def ring_maps() -> int:
        with open("/proc/self/maps") as f:
            return sum(1 for line in f if "spark-hvd-ring" in line)

    fds = []
    for cycle in range(cycles):
        rt.init()
        rank, size = rt.rank(), rt.size()
        got = rt.allreduce(np.full(1000, float(rank + cycle)), op=rt.Sum, name="check")
        assert got[0] == sum(r + cycle for r in range(size)), (cycle, got[0])
        if rank == cycle % size:
            time.sleep(0.05)  # arrive late at the next generation, a different rank each time
        rt.shutdown()
        assert ring_maps() == 0, f"cycle {cycle}: shared-memory rings still mapped after shutdown()"
        fds.append(len(os.listdir("/proc/self/fd")))
    return fds


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_init_after_shutdown_works_many_times_in_any_arrival_order(shm):
    """Thirty init -> allreduce -> shutdown cycles at np=3, a different rank late each time: every
    cycle forms a fresh world, and neither mappings nor file descriptors accumulate."""
    results = run(_reinit_cycles, args=(30,), np=3, settings={"shm": shm, "start_timeout": 30.0}, timeout=240)
    for fds in results:
        assert fds[-1] <= fds[2], f"file descriptors grew across re-initializations: {fds}"
