"""spark-hvd-run end to end with real processes: output, failures, signals, output files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from runner_helpers import LAUNCHER, is_alive, launch, launcher_messages, wait_until


def test_console_script_prefixes_every_line_with_rank_and_stream(script):
    """Each rank's stdout and stderr lines come out as [r]<stdout>:... and [r]<stderr>:..."""
    path = script(
        """
        import os, sys
        rank = os.environ["SPARK_HVD_RANK"]
        print(f"out {rank}")
        print(f"err {rank}", file=sys.stderr)
        """
    )
    console_script = Path(sys.executable).parent / "spark-hvd-run"
    done = subprocess.run([str(console_script), "-np", "2", sys.executable, path],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:out {rank}" in done.stdout.splitlines()
        assert f"[{rank}]<stderr>:err {rank}" in done.stderr.splitlines()


def test_failing_rank_stops_the_others_and_is_reported_first(script):
    """Rank 1 exits 17 while rank 0 sleeps: the launcher ends, exits 17, root cause first."""
    path = script(
        """
        import os, sys, time
        if os.environ["SPARK_HVD_RANK"] == "1":
            print("rank 1 gives up")
            sys.exit(17)
        time.sleep(1000)
        """
    )
    done = launch(["-np", "2", sys.executable, path], timeout=30)
    assert done.returncode == 17
    messages = launcher_messages(done.stderr)
    assert messages[0] == "spark-hvd-run: rank 1 exited with code 17"
    assert "[1]<stdout>:rank 1 gives up" in done.stderr.splitlines()
    # Rank 0 died because the launcher stopped it: it is mentioned as stopped, not as a cause.
    assert not any("rank 0 was killed" in m or "rank 0 exited" in m for m in messages)
    assert messages[-1] == "spark-hvd-run: after rank 1 failed: rank 0 was stopped"


def test_rank_killed_by_signal_is_named(script):
    """A rank that SIGKILLs itself is reported as killed by SIGKILL; exit status 1."""
    path = script(
        """
        import os, signal, time
        if os.environ["SPARK_HVD_RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(1000)
        """
    )
    done = launch(["-np", "2", sys.executable, path], timeout=30)
    assert done.returncode == 1
    assert launcher_messages(done.stderr)[0] == "spark-hvd-run: rank 1 was killed by signal SIGKILL"


def test_output_filename_writes_each_rank_streams(script, tmp_path):
    """--output-filename DIR writes DIR/rank.<r>/stdout and stderr, unprefixed, next to the prefixed echo."""
    path = script(
        """
        import os, sys
        rank = os.environ["SPARK_HVD_RANK"]
        print(f"out {rank}")
        print(f"err {rank}", file=sys.stderr)
        """
    )
    out_dir = tmp_path / "logs" / "job"
    done = launch(["-np", "2", "--output-filename", str(out_dir), sys.executable, path])
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert (out_dir / f"rank.{rank}" / "stdout").read_text() == f"out {rank}\n"
        assert (out_dir / f"rank.{rank}" / "stderr").read_text() == f"err {rank}\n"
    assert "[1]<stdout>:out 1" in done.stdout.splitlines()


def test_settings_flags_reach_the_ranks(script, tmp_path):
    """Tuning flags arrive as SPARK_HVD_* settings (fusion threshold converted from MiB to bytes)."""
    path = script(
        """
        import os
        names = ["FUSION_THRESHOLD", "CYCLE_TIME", "CACHE_CAPACITY", "START_TIMEOUT", "TIMELINE"]
        print(" ".join(os.environ.get("SPARK_HVD_" + n, "-") for n in names))
        """
    )
    timeline = tmp_path / "timeline.json"
    done = launch(["-np", "1", "--fusion-threshold-mb", "2", "--cycle-time-ms", "3.5", "--cache-capacity", "7",
                   "--start-timeout", "9", "--timeline-filename", str(timeline), sys.executable, path])
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"[0]<stdout>:{2 * 1024 * 1024} 3.5 7 9.0 {timeline}"]


def test_sigterm_to_launcher_is_forwarded_to_ranks(script, tmp_path):
    """SIGTERM to the launcher reaches every rank's handler; the launcher exits 128 + SIGTERM."""
    path = script(
        f"""
        import os, signal, sys, time
        rank = os.environ["SPARK_HVD_RANK"]
        def stop(signum, frame):
            print(f"rank {{rank}} got", signal.Signals(signum).name)
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        open(os.path.join({str(tmp_path)!r}, "ready." + rank), "w").close()
        time.sleep(1000)
        """
    )
    launcher = subprocess.Popen(LAUNCHER + ["-np", "2", sys.executable, path],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: all((tmp_path / f"ready.{r}").exists() for r in (0, 1)), timeout=30)
        launcher.send_signal(signal.SIGTERM)
        stdout, stderr = launcher.communicate(timeout=30)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:rank {rank} got SIGTERM" in stdout.splitlines()


def test_ranks_die_when_the_launcher_is_killed(script, tmp_path):
    """After the launcher is SIGKILLed (no cleanup possible), its ranks die too (parent-death signal)."""
    path = script(
        f"""
        import os, time
        with open(os.path.join({str(tmp_path)!r}, "pid." + os.environ["SPARK_HVD_RANK"]), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(1000)
        """
    )
    launcher = subprocess.Popen(LAUNCHER + ["-np", "2", sys.executable, path],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pid_files = [tmp_path / f"pid.{r}" for r in (0, 1)]
    try:
        assert wait_until(lambda: all(p.exists() and p.read_text() for p in pid_files), timeout=30)
        pids = [int(p.read_text()) for p in pid_files]
        assert all(is_alive(pid) for pid in pids)
        launcher.kill()
        launcher.wait(timeout=10)
        assert wait_until(lambda: not any(is_alive(pid) for pid in pids), timeout=10)
    finally:
        launcher.kill()
        for p in pid_files:
            if p.exists() and p.read_text() and is_alive(int(p.read_text())):
                os.kill(int(p.read_text()), signal.SIGKILL)


def test_verbose_logs_what_is_started(script):
    """--verbose names the rendezvous address and each rank's pid and command."""
    path = script("print('ok')\n")
    done = launch(["--verbose", "-np", "2", sys.executable, path])
    assert done.returncode == 0, done.stderr
    messages = launcher_messages(done.stderr)
    assert any(m.startswith("spark-hvd-run: rendezvous server listening on 127.0.0.1:") for m in messages)
    for rank in (0, 1):
        assert any(m.startswith(f"spark-hvd-run: started rank {rank} (pid ") and m.endswith(path)
                   for m in messages)
