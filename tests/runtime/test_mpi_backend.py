"""The MPI backend: the runtime checks in worlds started by `spark-hvd-run --mpi` (the mpich
wheel's mpiexec), negotiation and data through mpi4py; the PyTorch example trains there too."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import runtime_checks as checks
from spark_hvd.runner.cli import UsageError, parse_options

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = str(Path(sys.executable).with_name("spark-hvd-run"))


def _run(args, timeout, **kwargs):
    """Run a launcher command in a session of its own; past ``timeout`` every process of it is
    killed (the ranks included, so a hung world cannot outlive the test and slow the rest)."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s:\n{out[-3000:]}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


@pytest.mark.parametrize("np", [2, 3])
def test_runtime_checks_pass_under_mpi(tmp_path, np):
    """Every runtime check passes on every rank of an MPI world of 2 and 3 ranks, including the
    dtypes MPI cannot reduce itself (float16, bfloat16, bool), process sets, join, re-init."""
    done = _run([LAUNCHER, "--mpi", "-np", str(np), sys.executable, str(Path(__file__).with_name("mpi_entry.py")),
                 str(tmp_path)], timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in range(np):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["mpi"] is True and report["size"] == np
        for check in checks.ALL:
            outcome = report["outcomes"].get(check.__name__)
            assert outcome is not None, f"rank {rank} did not run {check.__name__}"
            assert outcome["error"] is None, f"{check.__name__} failed on rank {rank}:\n{outcome['error']}"


def test_pytorch_example_trains_under_mpi(tmp_path):
    """examples/pytorch_train.py under `spark-hvd-run --mpi -np 2` reaches the accuracy it reaches
    on the built-in rings."""
    result = tmp_path / "result.json"
    done = _run([LAUNCHER, "--mpi", "-np", "2", sys.executable, str(ROOT / "examples" / "pytorch_train.py"),
                 "--epochs", "12", "--result-json", str(result)], timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(result.read_text())
    assert report["size"] == 2 and report["accuracy"] >= 0.93, report


def test_mpi_flag_is_checked():
    """--mpi refuses elastic options with a message saying so."""
    with pytest.raises(UsageError, match="--mpi cannot be combined"):
        parse_options(["-np", "2", "--mpi", "--min-np", "1", sys.executable, "x.py"])
    assert parse_options(["-np", "2", "--mpi", sys.executable, "x.py"]).mpiexec.endswith("mpiexec")
    assert os.path.basename(LAUNCHER) == "spark-hvd-run"


def test_mpi_output_is_labelled_line_by_line(tmp_path):
    """Under --mpi every line of every rank arrives whole, with its rank and stream in front, also
    when lines are written in pieces while the other rank writes; --output-filename keeps each
    rank's raw output."""
    script = tmp_path / "talk.py"
    script.write_text(
        "import os, sys, time\n"
        "rank = int(os.environ['PMI_RANK'])\n"
        "for i in range(20):\n"
        "    sys.stdout.write(f'rank {rank} line {i}'); sys.stdout.flush(); time.sleep(0.002)\n"
        "    sys.stdout.write('\\n'); sys.stdout.flush()\n"
        "print(f'rank {rank} says goodbye', file=sys.stderr)\n"
        "sys.stdout.write('no newline at the end')\n")
    done = _run([LAUNCHER, "--mpi", "-np", "2", "--output-filename", str(tmp_path / "out"), sys.executable,
                 str(script)], timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(2):
        lines = [line for line in done.stdout.splitlines() if line.startswith(f"[{rank}]<stdout>:")]
        assert lines == [f"[{rank}]<stdout>:rank {rank} line {i}" for i in range(20)] + \
            [f"[{rank}]<stdout>:no newline at the end"], done.stdout
        assert f"[{rank}]<stderr>:rank {rank} says goodbye" in done.stderr.splitlines()
        assert (tmp_path / "out" / f"rank.{rank}" / "stderr").read_text() == f"rank {rank} says goodbye\n"
    assert all(line.startswith(("[0]<stdout>:", "[1]<stdout>:")) for line in done.stdout.splitlines())


def test_control_send_does_not_wait_for_a_peer_inside_a_collective():
    """A large control frame sent to a rank that is inside a collective waiting for the sender
    does not block the sender (it would wait for the receive forever); it arrives whole, in order."""
    done = _run([LAUNCHER, "--mpi", "-np", "2", sys.executable, str(Path(__file__).with_name("mpi_link_entry.py"))],
                timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[0]<stdout>:rank 0: ok" in done.stdout and "[1]<stdout>:rank 1: ok" in done.stdout
