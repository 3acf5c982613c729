"""Ranks forked from a warm process (spark_hvd.runner.warm) behave as fresh interpreters would.

Each test starts a real warm process and real rank processes through RankProcesses, with a
sealed call written where ``python -m spark_hvd.runner.worker DIR`` reads it.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time

import pytest
from harness import is_alive, wait_until

from spark_hvd.runner import warm
from spark_hvd.runner.payload import FUNCTION_FILE, dumps_call, read_sealed, result_file, write_sealed
from spark_hvd.runner.processes import RankProcesses, rank_environment
from spark_hvd.runtime import config



def _call(tmp_path, name, fn, *args):
    """A worker directory holding the sealed call ``fn(*args)``; (directory, secret)."""
    workdir = tmp_path / name
    workdir.mkdir()
    secret = config.new_secret()
    call = {"sys_path": [p for p in sys.path if isinstance(p, str)], "call": dumps_call(fn, args, {})}
    write_sealed(workdir / FUNCTION_FILE, secret, pickle.dumps(call))
    return str(workdir), secret


def _env(secret, rank=0, size=1, **extra):
    return rank_environment(rank=rank, size=size, rendezvous_addr="127.0.0.1:9", secret=secret, extra=extra)


def _outcome(workdir, secret, rank=0):
    return pickle.loads(read_sealed(os.path.join(workdir, result_file(rank)), secret))


def _argv(workdir):
    return [sys.executable, "-m", "spark_hvd.runner.worker", workdir]


def _describe(tag):
    import random

    print(f"out {tag}")
    print(f"err {tag}", file=sys.stderr)
    return {"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "cwd": os.getcwd(),
            "mine": os.environ.get("MINE"), "zygote_only": os.environ.get("ZYGOTE_ONLY"),
            "rank": os.environ.get("SPARK_HVD_RANK"), "preloaded": "json.tool" in sys.modules,
            "argv": sys.argv, "draw": random.random(), "stdin": sys.stdin.read(),
            "name": open(f"/proc/{os.getpid()}/comm").read().strip()}


@pytest.fixture
def starter(tmp_path):
    started = warm.WarmStarter(sys.executable, ["json.tool"], dict(os.environ, MINE="warm", ZYGOTE_ONLY="1"),
                               cwd=str(tmp_path))
    yield started
    started.close()
    assert started._proc.returncode == 0


def test_a_warm_rank_runs_with_its_own_environment_directory_session_and_output(tmp_path, starter):
    """The rank sees exactly the environment and directory it was given (not the warm process's),
    leads a session of its own, reads nothing on stdin, has the preloaded modules, is named
    hvd-rank<r> in ps, and its output
    lines and result come back as a fresh interpreter's would; two ranks draw different numbers."""
    lines = []
    seen = []
    for rank in (0, 1):
        workdir, secret = _call(tmp_path, f"r{rank}", _describe, rank)
        env = _env(secret, MINE="rank")
        with RankProcesses(sink=lambda r, stream, line: lines.append((stream, line))) as procs:
            pid = procs.spawn(0, _argv(workdir), env, cwd=str(tmp_path / f"r{rank}"), starter=starter)
            assert procs.wait(timeout=60) is None
        status, value = _outcome(workdir, secret)
        assert status == "ok"
        assert value["pid"] == pid and value["ppid"] == starter.pid and value["sid"] == pid
        assert value["cwd"] == str(tmp_path / f"r{rank}")
        assert (value["mine"], value["zygote_only"], value["rank"]) == ("rank", None, "0")
        assert value["preloaded"] and value["stdin"] == "" and value["name"] == "hvd-rank0"
        assert value["argv"][1:] == [workdir] and value["argv"][0].endswith("worker.py")
        seen.append(value)
    assert ("stdout", "out 0") in lines and ("stderr", "err 0") in lines and ("stdout", "out 1") in lines
    assert seen[0]["draw"] != seen[1]["draw"]


def _fail():
    raise KeyError("missing thing")


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_warm_rank_reports_its_error_and_its_signal_as_a_fresh_one_would(tmp_path, starter):
    """An exception gives exit code 1 and the sealed error; a rank killed by a signal is named by it."""
    workdir, secret = _call(tmp_path, "fail", _fail)
    with RankProcesses(sink=None) as procs:
        procs.spawn(0, _argv(workdir), _env(secret), starter=starter)
        failure = procs.wait(timeout=60)
    assert failure is not None and failure.returncode == 1
    status, details = _outcome(workdir, secret)
    assert status == "error" and details["type"] == "KeyError" and "missing thing" in details["message"]

    workdir, secret = _call(tmp_path, "die", _die)
    with RankProcesses(sink=None) as procs:
        procs.spawn(0, _argv(workdir), _env(secret), starter=starter)
        failure = procs.wait(timeout=60)
    assert failure is not None and failure.describe() == "rank 0 was killed by signal SIGKILL"


def _sleep_with_a_child(path):
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(path, "w") as out:
        out.write(str(child.pid))
    time.sleep(600)


def test_terminate_stops_a_warm_rank_and_what_it_started(tmp_path, starter):
    """RankProcesses.terminate reaches the rank's process group: the rank and its child both end."""
    pid_file = tmp_path / "child.pid"
    workdir, secret = _call(tmp_path, "sleep", _sleep_with_a_child, str(pid_file))
    with RankProcesses(sink=None) as procs:
        pid = procs.spawn(0, _argv(workdir), _env(secret), starter=starter)
        assert wait_until(lambda: pid_file.exists() and pid_file.read_text(), timeout=60)
        child = int(pid_file.read_text())
        assert procs.terminate(grace=5) == [0]
        assert procs.returncodes[0] == -signal.SIGTERM
    assert wait_until(lambda: not is_alive(pid) and not is_alive(child), timeout=10)


def test_closing_the_starter_ends_the_warm_process_and_its_running_ranks(tmp_path):
    """A launcher that lets go of its warm process takes the ranks it forked with it."""
    starter = warm.WarmStarter(sys.executable, [], dict(os.environ), cwd=str(tmp_path))
    pid_file = tmp_path / "child.pid"
    workdir, secret = _call(tmp_path, "sleep", _sleep_with_a_child, str(pid_file))
    procs = RankProcesses(sink=None)
    pid = procs.spawn(0, _argv(workdir), _env(secret), starter=starter)
    assert wait_until(lambda: pid_file.exists() and pid_file.read_text(), timeout=60)
    child = int(pid_file.read_text())
    starter.close()
    assert not is_alive(starter.pid)
    assert wait_until(lambda: not is_alive(pid) and not is_alive(child), timeout=10)
    assert procs.wait(timeout=10) is not None  # the rank's exit reached its launcher
    procs.close()


def test_a_warm_process_whose_modules_do_not_import_says_which_and_why(tmp_path):
    """WarmStartError names the module and the import error; nothing is left running."""
    with pytest.raises(warm.WarmStartError, match=r"could not import no_such_module_xyz: ModuleNotFoundError: "
                                                  r"No module named 'no_such_module_xyz'"):
        warm.WarmStarter(sys.executable, ["no_such_module_xyz"], dict(os.environ), cwd=str(tmp_path))


def test_start_refuses_a_command_other_than_the_worker(tmp_path, starter):
    with pytest.raises(ValueError, match=r"cannot start warm: expected \[python, '-m', 'spark_hvd.runner.worker'"):
        starter.start([sys.executable, "-c", "pass"], dict(os.environ))


def test_starter_for_keeps_one_warm_process_per_environment_less_the_jobs_variables(tmp_path):
    """Jobs that differ only in SPARK_HVD_*/HOROVOD_*/CUDA_VISIBLE_DEVICES share a warm process; a
    different variable of the import's environment gets its own; a dead one is replaced."""
    base = dict(os.environ, SPARK_HVD_RANK="0", HOROVOD_RANK="0")
    try:
        first = warm.starter_for(sys.executable, ["json"], base, cwd=str(tmp_path))
        same = warm.starter_for(sys.executable, ["json"], dict(base, SPARK_HVD_RANK="1", CUDA_VISIBLE_DEVICES="1"),
                                cwd=str(tmp_path))
        other = warm.starter_for(sys.executable, ["json"], dict(base, OMP_NUM_THREADS="1"), cwd=str(tmp_path))
        assert same is first and other is not first
        os.kill(first.pid, signal.SIGKILL)
        assert wait_until(lambda: not first.alive, timeout=10)
        again = warm.starter_for(sys.executable, ["json"], base, cwd=str(tmp_path))
        assert again is not first and again.alive
    finally:
        warm.close_starters()


def _whoami():
    return {"pid": os.getpid(), "ppid": os.getppid(), "preloaded": "json.tool" in sys.modules,
            "rank": os.environ.get("SPARK_HVD_RANK"), "name": open(f"/proc/{os.getpid()}/comm").read().strip()}


def test_run_with_preload_forks_every_rank_from_one_warm_process_kept_for_the_next_call(capfd):
    """spark_hvd.runner.run(preload=...): each rank is its own process, named hvd-rank<r>, with the
    module already imported; a second call forks from the same warm process; SPARK_HVD_WARM_START=0
    starts fresh interpreters instead."""
    from spark_hvd.runner import run

    try:
        first = run(_whoami, np=2, preload=["json.tool"], timeout=120)
        second = run(_whoami, np=2, preload=("json.tool",), timeout=120)
        assert [r["rank"] for r in first] == ["0", "1"]
        assert [r["name"] for r in first] == ["hvd-rank0", "hvd-rank1"]
        assert all(r["preloaded"] for r in first + second)
        assert len({r["pid"] for r in first + second}) == 4
        assert len({r["ppid"] for r in first + second}) == 1, "both calls fork from one warm process"
        cold = run(_whoami, np=2, preload=["json.tool"], env={"SPARK_HVD_WARM_START": "0"}, timeout=120)
        assert not any(r["preloaded"] for r in cold)
        assert not any(r["name"].startswith("hvd-rank") for r in cold)
    finally:
        warm.close_starters()


def test_run_with_a_preload_that_does_not_import_starts_fresh_interpreters_and_says_why(capfd):
    from spark_hvd.runner import run

    try:
        results = run(_whoami, np=2, preload=["no_such_module_xyz"], timeout=120)
    finally:
        warm.close_starters()
    assert [r["rank"] for r in results] == ["0", "1"]
    assert not any(r["name"].startswith("hvd-rank") for r in results)
    err = capfd.readouterr().err
    assert "ranks start fresh interpreters" in err and "no_such_module_xyz" in err


@pytest.mark.parametrize("preload", ["torch", [""], [1], {"torch": 1}])
def test_run_refuses_a_preload_that_is_not_a_sequence_of_module_names(preload):
    from spark_hvd.runner import run

    with pytest.raises(ValueError, match=r"preload=.* is not valid: expected a sequence of module names"):
        run(_whoami, np=1, preload=preload)


def _ctrl_c():
    handler = signal.getsignal(signal.SIGINT)
    return "ignored" if handler is signal.SIG_IGN else "python" if handler is signal.default_int_handler else repr(handler)


@pytest.mark.parametrize("launcher", ["ignored", "python"])
def test_a_warm_rank_takes_ctrl_c_as_a_fresh_one_would(tmp_path, launcher):
    """A launcher with SIGINT ignored (started in the background, under nohup) gives its ranks SIGINT
    ignored, warm or fresh; a launcher that takes Ctrl-C gives both Python's handler."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN if launcher == "ignored" else signal.default_int_handler)
    try:
        started = warm.WarmStarter(sys.executable, ["json.tool"], dict(os.environ), cwd=str(tmp_path))
        try:
            seen = {}
            for kind, starter in (("warm", started), ("fresh", None)):
                workdir, secret = _call(tmp_path, kind, _ctrl_c)
                with RankProcesses(sink=lambda r, stream, line: None) as procs:
                    procs.spawn(0, _argv(workdir), _env(secret), cwd=str(tmp_path), starter=starter)
                    assert procs.wait(timeout=60) is None
                seen[kind] = _outcome(workdir, secret)
        finally:
            started.close()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == {"warm": ("ok", launcher), "fresh": ("ok", launcher)}
