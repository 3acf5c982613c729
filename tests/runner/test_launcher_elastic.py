"""Elastic jobs of spark-hvd-run: a killed worker is replaced, discovered slots grow the world,
limits and timeouts end a job that cannot go on; examples/pytorch_elastic.py is the training."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from spark_hvd.runner.cli import UsageError, parse_options
from spark_hvd.runner.elastic import ElasticOptions, parse_discovery

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "pytorch_elastic.py")
LAUNCHER = str(Path(sys.executable).with_name("spark-hvd-run"))
SAMPLES = 1797  # the bundled digits data set


def _run(launcher_args: List[str], script_args: List[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([LAUNCHER, *launcher_args, sys.executable, EXAMPLE, *script_args],
                          capture_output=True, text=True, timeout=timeout)


def _reports(stdout: str) -> Dict[int, dict]:
    """The JSON line each rank of the final world printed, by rank."""
    found = {}
    for line in stdout.splitlines():
        _, sep, text = line.partition("<stdout>:")
        if sep and text.startswith("{"):
            report = json.loads(text)
            found[report["rank"]] = report
    return found


def test_a_killed_worker_is_replaced_and_training_ends_as_if_nothing_happened():
    """Worker 1 is SIGKILLed in the middle of epoch 1 of 2: the survivors roll back to their last
    commit, a replacement joins, and the job ends with every sample trained on exactly once per
    epoch and the very weights of an uninterrupted run, on every rank; the reset is reported."""
    killed = _run(["-np", "3", "--min-np", "2", "--max-np", "3"], ["--epochs", "2", "--kill-worker", "w1",
                                                                   "--kill-at", "1:3"])
    assert killed.returncode == 0, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert "worker 1 (rank 1) was killed by signal SIGKILL" in killed.stderr
    assert "1 reset(s): (1) world 2" in killed.stderr and "3 -> 3 workers" in killed.stderr
    reports = _reports(killed.stdout)
    assert sorted(reports) == [0, 1, 2] and all(r["size"] == 3 for r in reports.values())
    assert all(r["seen_times"] == {"1": 2 * SAMPLES} for r in reports.values()), reports
    assert len({r["weights"] for r in reports.values()}) == 1
    plain = _run(["-np", "3"], ["--epochs", "2"])
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert {r["weights"] for r in _reports(plain.stdout).values()} == {reports[0]["weights"]}


def test_discovered_slots_grow_the_world(tmp_path):
    """Once the first epoch is done, the discovery script offers a third slot: a new worker starts,
    the running ones learn of it at their next commit, and training goes on in a world of three
    without skipping or repeating a sample. Epochs last at least 1.5 s, so the rest of the training
    outlasts the new worker's start even on a busy machine."""
    more = tmp_path / "more"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\nif [ -e {more} ]; then echo localhost:3; else echo localhost:2; fi\n")
    script.chmod(0o755)
    proc = subprocess.Popen([LAUNCHER, "-np", "2", "--min-np", "2", "--max-np", "3", "--host-discovery-script",
                             str(script), sys.executable, EXAMPLE, "--epochs", "8", "--min-epoch-seconds", "1.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "epoch 0 done in a world of 2 workers" in line:
                more.touch()
        output = "".join(lines)
        assert proc.wait(timeout=240) == 0, output[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "1 worker(s) added; 2 -> 3 workers" in output, output[-2000:]
    reports = _reports(output)
    assert sorted(reports) == [0, 1, 2]
    assert all(r["seen_times"] == {"1": 8 * SAMPLES} for r in reports.values()), reports
    assert len({r["weights"] for r in reports.values()}) == 1


def test_the_reset_limit_ends_the_job():
    """With --reset-limit 0 a lost worker ends the job with the limit named, and nothing is left running."""
    done = _run(["-np", "2", "--min-np", "1", "--max-np", "2", "--reset-limit", "0"],
                ["--epochs", "2", "--kill-worker", "w1", "--kill-at", "0:2"])
    assert done.returncode == 1
    assert "--reset-limit 0 reached" in done.stderr and "worker 1 (rank 1) was killed by signal SIGKILL" in done.stderr


def test_too_few_slots_end_the_job_after_the_elastic_timeout(tmp_path):
    """The discovery script offers one slot where --min-np asks for two: after --elastic-timeout the
    launcher gives up, saying how many workers ran and how many were needed."""
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:1\n")
    script.chmod(0o755)
    done = _run(["-np", "2", "--min-np", "2", "--max-np", "2", "--host-discovery-script", str(script),
                 "--elastic-timeout", "3"], ["--epochs", "1"], timeout=120)
    assert done.returncode == 1
    assert "1 worker(s) running (at least 2 needed)" in done.stderr, done.stderr[-2000:]


def test_discovery_output_is_parsed_and_checked():
    """HOST:SLOTS lines add up (a bare host is one slot); other machines and bad counts are refused."""
    names = ["localhost", "127.0.0.1"]
    assert parse_discovery("localhost:2\n# comment\n127.0.0.1:1\nlocalhost\n", names) == 4
    with pytest.raises(ValueError, match="not this machine"):
        parse_discovery("node7:4", names)
    with pytest.raises(ValueError, match="whole number"):
        parse_discovery("localhost:many", names)


def test_elastic_options_are_validated_before_anything_starts():
    """min-np <= np <= max-np, a non-negative reset limit, an executable discovery script, and no -H."""
    with pytest.raises(ValueError, match="min-np 3, -np 2"):
        ElasticOptions(num_proc=2, min_np=3, max_np=4)
    with pytest.raises(UsageError, match="not an executable program"):
        parse_options(["-np", "2", "--host-discovery-script", "/nonexistent/discover", sys.executable, "x.py"])
    with pytest.raises(UsageError, match="-H and --hostfile cannot be combined"):
        parse_options(["-np", "2", "-H", "localhost:2", "--min-np", "1", sys.executable, "x.py"])
    options = parse_options(["-np", "2", "--max-np", "4", sys.executable, "x.py"])
    assert options.elastic == ElasticOptions(num_proc=2, min_np=2, max_np=4)
