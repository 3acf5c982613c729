"""The program-order path between two hosts of the test cluster: ranks on two network-namespace
hosts reduce their gradient buffers over the TCP links (bit-equal to the negotiated allreduce), and
leave them on a mismatch and on a join, as `tests/runtime/test_lockstep.py` checks on one machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_hosts import MACHINE_ADDRESS

RUNTIME_TESTS = Path(__file__).resolve().parents[1] / "runtime"
if str(RUNTIME_TESTS) not in sys.path:
    sys.path.insert(0, str(RUNTIME_TESTS))

import test_lockstep  # noqa: E402
from harness import assert_passed, rank_processes  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _world(hosts, tmp_path: Path, checks) -> list:
    """Rank r on host r runs ``checks`` (test_lockstep's); each rank's outcomes."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "job.py"
    script.write_text(test_lockstep.ACROSS_HOSTS)
    command = [sys.executable, str(script), str(tmp_path), ",".join(c.__name__ for c in checks), str(RUNTIME_TESTS)]

    def on_host(rank):
        host = hosts.hosts[rank]
        return dict(local_rank=0, local_size=1, cross_rank=rank, cross_size=2, hostname=host.address,
                    host_key=host.name)

    with rank_processes(2, command, rank_options=on_host, address=MACHINE_ADDRESS,
                        spawn=lambda rank, argv, **popen: hosts.hosts[rank].popen(argv, **popen),
                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as procs:
        for rank, proc in enumerate(procs):
            out, _ = proc.communicate(timeout=180)
            assert proc.returncode == 0, f"rank {rank}: {out.decode(errors='replace')[-3000:]}"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_two_hosts_reduce_over_the_links_and_leave_them_on_a_mismatch(hosts, tmp_path):
    """The links are the path between the hosts, the results are the negotiated ones bit for bit, and a
    mismatch raises on both ranks naming the other request, after which the negotiated path works."""
    checks = [test_lockstep.over_the_links, test_lockstep.matches_the_negotiated_allreduce,
              test_lockstep.many_steps_in_a_row, test_lockstep.mismatch_fails_every_rank]
    results = _world(hosts, tmp_path, checks)
    assert assert_passed(results, test_lockstep.over_the_links) == ["LinkLockstep"] * 2
    assert assert_passed(results, test_lockstep.matches_the_negotiated_allreduce) == [24, 24]
    assert assert_passed(results, test_lockstep.many_steps_in_a_row) == [1000, 1000]
    for message in assert_passed(results, test_lockstep.mismatch_fails_every_rank):
        assert "different request" in message and "program-order path" in message, message


def test_two_hosts_leave_the_links_when_a_rank_joins(hosts, tmp_path):
    """Rank 0 joins: rank 1's reduction returns to the negotiated path (rank 0 contributing zeros) and
    the links stay unused on both ranks."""
    results = _world(hosts, tmp_path, [test_lockstep.over_the_links, test_lockstep.join_falls_back_everywhere])
    assert assert_passed(results, test_lockstep.over_the_links) == ["LinkLockstep"] * 2
    assert assert_passed(results, test_lockstep.join_falls_back_everywhere) == [True, True]
