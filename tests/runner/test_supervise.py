"""The rank supervisor on its own, started by the test as a launcher would: exit status, signals, bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from runner_helpers import wait_until

from spark_hvd.runner import RankProcesses, supervise


def _supervised(command, grace: float = 3.0, **popen) -> subprocess.Popen:
    return subprocess.Popen(supervise.command_line(command, os.getpid(), grace), **popen)


@pytest.mark.parametrize("shell, returncode", [
    ("exit 0", 0),
    ("exit 7", 7),
    ("kill -TERM $$", -signal.SIGTERM),
    ("kill -KILL $$", -signal.SIGKILL),
    ("kill -USR1 $$", -signal.SIGUSR1),
])
def test_supervisor_exits_as_its_rank_did(shell, returncode):
    """The supervisor's own exit status is the rank's: the same code, or death by the same signal."""
    proc = _supervised(["sh", "-c", shell])
    assert proc.wait(timeout=30) == returncode


def test_command_that_cannot_run_exits_127_naming_it():
    """A missing program ends with code 127 and a line on stderr naming it."""
    proc = _supervised(["no-such-program-here", "x"], stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 127
    assert "cannot run 'no-such-program-here'" in err


@pytest.mark.parametrize("argv", [[], ["12"], ["x", "1", "--", "true"], ["12", "-1", "--", "true"],
                                  ["12", "1", "true"]])
def test_malformed_command_line_exits_2_with_usage(argv):
    """Arguments other than LAUNCHER_PID GRACE -- COMMAND are refused with exit code 2 and the usage."""
    done = subprocess.run([sys.executable, supervise.__file__, *argv], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr.startswith("usage: supervise.py LAUNCHER_PID GRACE_SECONDS -- COMMAND")


def test_forwarded_signal_reaches_the_rank_and_its_process_group(tmp_path):
    """SIGUSR1 to the supervisor reaches the rank and a child in the rank's process group."""
    body = (
        "import os, signal, subprocess, sys, time\n"
        "d = sys.argv[1]\n"
        "if len(sys.argv) > 2:\n"
        "    def child_got(signum, frame):\n"
        "        open(os.path.join(d, 'child'), 'w').close()\n"
        "        os._exit(0)\n"
        "    signal.signal(signal.SIGUSR1, child_got)\n"
        "    open(os.path.join(d, 'child.ready'), 'w').close()\n"
        "    time.sleep(60)\n"
        "    sys.exit(3)\n"
        "def rank_got(signum, frame):\n"
        "    open(os.path.join(d, 'rank'), 'w').close()\n"
        "    child.wait(timeout=30)  # once the rank ends, what is left of its group is stopped\n"
        "    os._exit(0)\n"
        "signal.signal(signal.SIGUSR1, rank_got)\n"
        "child = subprocess.Popen([sys.executable, __file__, d, 'child'])\n"
        "time.sleep(60)\n"
        "sys.exit(3)\n"
    )
    program = tmp_path / "prog.py"
    program.write_text(body)
    proc = _supervised([sys.executable, str(program), str(tmp_path)])
    try:
        assert wait_until(lambda: (tmp_path / "child.ready").exists(), timeout=30)
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=30) == 0
        assert (tmp_path / "rank").exists() and (tmp_path / "child").exists()
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_kill_now_ends_a_rank_that_ignores_sigterm(tmp_path):
    """KILL_NOW makes the supervisor SIGKILL a rank that ignores SIGTERM; it exits killed by SIGKILL."""
    ready = tmp_path / "ready"
    code = f"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); open({str(ready)!r}, 'w').close(); " \
           "time.sleep(60)"
    proc = _supervised([sys.executable, "-c", code], grace=60.0)
    try:
        assert wait_until(ready.exists, timeout=30)
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)  # SIGTERM was passed on and ignored; the long grace keeps it running
        proc.send_signal(supervise.KILL_NOW)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_signals_that_cannot_be_passed_on_are_refused():
    """RankProcesses.send_signal refuses a signal the supervisor would not pass on, naming the ones it does."""
    processes = RankProcesses(sink=None)
    with pytest.raises(ValueError, match=r"signal SIGSTOP cannot be passed on to ranks; expected SIGKILL or one of "
                                         r"SIGHUP, SIGINT, .*SIGTERM"):
        processes.send_signal(signal.SIGSTOP)


def test_signals_it_does_not_pass_on_leave_supervisor_and_rank_running(tmp_path):
    """Signals whose default action would end a process are dropped: the rank runs on and its code comes back."""
    ready, go = tmp_path / "ready", tmp_path / "go"
    code = (f"import os, time; open({str(ready)!r}, 'w').close()\n"
            f"while not os.path.exists({str(go)!r}): time.sleep(0.02)\n"
            "raise SystemExit(5)")
    proc = _supervised([sys.executable, "-c", code])
    try:
        assert wait_until(ready.exists, timeout=30)
        for signum in (signal.SIGVTALRM, signal.SIGPROF, signal.SIGIO, signal.SIGRTMIN + 5):
            proc.send_signal(signum)
        go.touch()
        assert proc.wait(timeout=30) == 5
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_rank_status_comes_back_when_the_launcher_ignores_sigchld():
    """A supervisor that inherits an ignored SIGCHLD still sees its rank end and exits with its code."""
    argv = supervise.command_line(["sh", "-c", "exit 7"], os.getpid(), 3.0)
    ignoring = "import os, signal, sys; signal.signal(signal.SIGCHLD, signal.SIG_IGN); os.execv(sys.argv[1], sys.argv[1:])"
    proc = subprocess.Popen([sys.executable, "-c", ignoring, *argv])
    try:
        assert proc.wait(timeout=30) == 7
    finally:
        proc.kill()
        proc.wait(timeout=30)
