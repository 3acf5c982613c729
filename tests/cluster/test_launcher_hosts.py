"""`spark-hvd-run -np 4 -H a:2,b:2` across two hosts over SSH: an OpenSSH server on each
network-namespace host (keys made here), the launcher on the machine, as horovodrun users run it.

Each test checks what a user relies on: the ranks land on the hosts in order with Horovod's local
and cross ranks and reduce together; the job's environment reaches them, the job secret never on a
command line; every rank's output comes back with its rank; a host that does not answer is named
before anything starts; a failing rank, Ctrl-C and a launcher killed with SIGKILL stop every rank on
every host, and nothing is left running there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

from cluster_hosts import Hosts  # noqa: E402  (tests/cluster is on sys.path: conftest.py)
from cluster_spark import wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(300)

LAUNCHER = str(Path(sys.executable).with_name("spark-hvd-run"))
SSHD = "/usr/sbin/sshd"
MARK = "spark_hvd_ssh_rank"
"""In every rank script's path: how a test finds the ranks' processes on a host."""

RANK_SCRIPT = textwrap.dedent("""
    import json, os, signal, socket, sys, time
    import numpy as np
    from spark_hvd import runtime as hvd

    mode = sys.argv[1]
    hvd.init()
    total = hvd.allreduce(np.array([float(hvd.rank() + 1)]), op=hvd.Sum)
    print(json.dumps({"rank": hvd.rank(), "size": hvd.size(), "host": socket.gethostname(),
                      "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
                      "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
                      "sum": float(total[0]), "forwarded": os.environ.get("SPARK_HVD_TEST_FORWARDED"),
                      "cwd": os.getcwd()}), flush=True)
    print(f"to stderr from {hvd.rank()}", file=sys.stderr, flush=True)
    if mode == "fail" and hvd.rank() == 3:
        sys.exit(3)
    if mode in ("fail", "wait"):
        def interrupted(signum, frame):
            print(f"rank {hvd.rank()} got {signal.Signals(signum).name}", flush=True)
            sys.exit(130)
        signal.signal(signal.SIGINT, interrupted)
        print("waiting", flush=True)
        time.sleep(120)
    hvd.shutdown()
""")


def _sshd_config(directory: str, address: str) -> str:
    path = os.path.join(directory, f"sshd_config_{address}")
    with open(path, "w") as f:
        f.write(textwrap.dedent(f"""\
            ListenAddress {address}
            Port 22
            HostKey {directory}/host_key
            AuthorizedKeysFile {directory}/authorized_keys
            PermitRootLogin prohibit-password
            PasswordAuthentication no
            KbdInteractiveAuthentication no
            UsePAM no
            StrictModes no
            PidFile none
            PrintMotd no
            """))
    return path


@pytest.fixture(scope="module")
def ssh_hosts(hosts: Hosts) -> Iterator[Dict[str, str]]:
    """An sshd on each host that accepts a key made here; the launcher's environment to reach them."""
    directory = tempfile.mkdtemp(prefix="spark-hvd-ssh-")
    for name in ("client_key", "host_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{directory}/{name}"], check=True,
                       timeout=30)
    Path(directory, "authorized_keys").write_text(Path(directory, "client_key.pub").read_text())
    host_key = Path(directory, "host_key.pub").read_text().split()
    Path(directory, "known_hosts").write_text(
        "".join(f"{h.address},{h.name} {host_key[0]} {host_key[1]}\n" for h in hosts.hosts))
    Path(directory, "ssh_config").write_text(textwrap.dedent(f"""\
        Host *
          IdentityFile {directory}/client_key
          UserKnownHostsFile {directory}/known_hosts
          StrictHostKeyChecking yes
          LogLevel ERROR
        """))
    servers = []
    for host in hosts.hosts:
        # A /run of its own: sshd's privilege-separation directory, nothing written on the machine.
        script = (f"mount -t tmpfs -o size=1m tmpfs /run && mkdir -p /run/sshd && "
                  f"exec {SSHD} -D -e -f {_sshd_config(directory, host.address)}")
        servers.append(host.popen(["sh", "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    env = dict(os.environ, SPARK_HVD_SSH_COMMAND=f"ssh -F {directory}/ssh_config",
               SPARK_HVD_TEST_FORWARDED="from the launcher")
    ssh = ["ssh", "-F", f"{directory}/ssh_config", "-o", "BatchMode=yes"]
    for host in hosts.hosts:
        wait_for(lambda: subprocess.run([*ssh, host.address, "true"], capture_output=True, timeout=20).returncode == 0,
                 20.0, f"sshd on {host.name}")
    yield env
    for server in servers:
        server.terminate()
        server.wait(10)


def _script(tmp_path: Path) -> str:
    path = tmp_path / f"{MARK}.py"
    path.write_text(RANK_SCRIPT)
    return str(path)


def _ranks_on(hosts: Hosts) -> Dict[str, List[int]]:
    """The rank processes on each host that has any (their supervisors left out)."""
    found = {}
    for host in hosts.hosts:
        pids = []
        for pid in host.processes_running(MARK.encode()):
            try:
                if b"supervise" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                    pids.append(pid)
            except OSError:
                pass
        if pids:
            found[host.name] = pids
    return found


def _records(stdout: str) -> Dict[int, dict]:
    records = {}
    for line in stdout.splitlines():
        prefix, _, rest = line.partition(":")
        if prefix.endswith("<stdout>") and rest.startswith("{"):
            records[int(prefix[1:prefix.index("]")])] = json.loads(rest)
    return records


def test_ranks_fill_the_hosts_in_order_and_reduce_together(hosts, ssh_hosts, tmp_path):
    """-np 4 -H h1:2,h2:2: ranks 0-1 on the first host, 2-3 on the second, with Horovod's local and
    cross ranks; one allreduce over all four; the launcher's environment and working directory reach
    every rank; every line comes back labelled with its rank and stream. The same with --hostfile."""
    first, second = hosts.hosts
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"# two hosts\n{first.address} slots=2\n{second.address}:2\n")
    # The first as horovodrun is usually called (-p: the SSH port), only the program renamed.
    for placement in (["-H", f"{first.address}:2,{second.address}:2", "-p", "22", "--gloo"],
                      ["--hostfile", str(hostfile)]):
        done = subprocess.run([LAUNCHER, "-np", "4", *placement, sys.executable, _script(tmp_path), "ok"],
                              env=ssh_hosts, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        records = _records(done.stdout)
        assert sorted(records) == [0, 1, 2, 3]
        assert [records[r]["host"] for r in range(4)] == [first.name, first.name, second.name, second.name]
        assert [(records[r]["local_rank"], records[r]["local_size"]) for r in range(4)] == [(0, 2), (1, 2), (0, 2),
                                                                                              (1, 2)]
        assert [(records[r]["cross_rank"], records[r]["cross_size"]) for r in range(4)] == [(0, 2), (0, 2), (1, 2),
                                                                                              (1, 2)]
        assert {records[r]["sum"] for r in range(4)} == {10.0}
        assert {records[r]["forwarded"] for r in range(4)} == {"from the launcher"}
        assert {records[r]["cwd"] for r in range(4)} == {str(tmp_path)}
        for r in range(4):
            assert f"[{r}]<stderr>:to stderr from {r}" in done.stderr.splitlines()
    assert _ranks_on(hosts) == {}


def test_the_job_secret_is_not_on_any_command_line(hosts, ssh_hosts, tmp_path):
    """While ranks run, no process on the machine or the hosts has the job secret in its command
    line (it travels on the SSH channel)."""
    first, second = hosts.hosts
    launcher = subprocess.Popen([LAUNCHER, "-np", "2", "-H", f"{first.address}:1,{second.address}:1",
                                 sys.executable, _script(tmp_path), "wait"],
                                env=ssh_hosts, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: len(_ranks_on(hosts)) == 2, 60.0, "a rank on each host")
        pid = next(iter(_ranks_on(hosts)[first.name]))
        secret = [v for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                  if v.startswith(b"SPARK_HVD_SECRET=")][0].split(b"=", 1)[1]
        assert len(secret) >= 16
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    assert secret not in Path(f"/proc/{entry}/cmdline").read_bytes(), f"process {entry}"
                except OSError:
                    pass
    finally:
        launcher.send_signal(signal.SIGINT)
        launcher.communicate(timeout=60)
    wait_for(lambda: _ranks_on(hosts) == {}, 30.0, "the ranks ending")


def test_a_host_that_does_not_answer_is_named_before_anything_starts(hosts, ssh_hosts, tmp_path):
    """One host without sshd (a name no resolver knows): exit 1 at once, the host and SSH's reason
    named with the fix; no rank started on the host that answered."""
    first, _ = hosts.hosts
    started = time.monotonic()
    done = subprocess.run([LAUNCHER, "-np", "4", "-H", f"{first.address}:2,no-such-host.invalid:2", sys.executable,
                           _script(tmp_path), "ok"], env=ssh_hosts, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 of 2 host(s) did not answer over SSH (no-such-host.invalid: exit code 255" in done.stderr
    assert "ssh-copy-id" in done.stderr
    assert first.address not in done.stderr.split("did not answer")[1].split("expected")[0]
    assert _records(done.stdout) == {}
    assert time.monotonic() - started < 30
    assert _ranks_on(hosts) == {}


def test_a_failing_rank_stops_every_rank_on_every_host(hosts, ssh_hosts, tmp_path):
    """Rank 3 (second host) exits with code 3 while the others wait: the launcher exits 3, names
    rank 3 as the cause, and nothing is left on either host."""
    first, second = hosts.hosts
    done = subprocess.run([LAUNCHER, "-np", "4", "-H", f"{first.address}:2,{second.address}:2", sys.executable,
                           _script(tmp_path), "fail"], env=ssh_hosts, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    assert "rank 3 exited with code 3" in done.stderr
    wait_for(lambda: _ranks_on(hosts) == {}, 30.0, "the other ranks ending")


def test_ctrl_c_reaches_every_rank_on_every_host(hosts, ssh_hosts, tmp_path):
    """SIGINT to the launcher: every rank, here and there, gets SIGINT (its handler runs), the
    launcher exits 130, and nothing is left running."""
    first, second = hosts.hosts
    launcher = subprocess.Popen([LAUNCHER, "-np", "4", "-H", f"{first.address}:2,{second.address}:2",
                                 sys.executable, _script(tmp_path), "wait"],
                                env=ssh_hosts, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: sum(len(p) for p in _ranks_on(hosts).values()) == 4, 60.0, "four ranks running")
        time.sleep(1.0)  # every rank past its print of "waiting" (its handler is installed first)
        launcher.send_signal(signal.SIGINT)
        stdout, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, stdout[-2000:] + stderr[-2000:]
    for r in range(4):
        assert f"[{r}]<stdout>:rank {r} got SIGINT" in stdout.splitlines(), stdout[-3000:]
    wait_for(lambda: _ranks_on(hosts) == {}, 30.0, "the ranks ending")


def test_a_launcher_killed_with_sigkill_leaves_nothing_on_the_hosts(hosts, ssh_hosts, tmp_path):
    """The launcher dies without a word: its SSH clients die with it, each host sees its connection
    close and stops its ranks."""
    first, second = hosts.hosts
    launcher = subprocess.Popen([LAUNCHER, "-np", "4", "-H", f"{first.address}:2,{second.address}:2",
                                 sys.executable, _script(tmp_path), "wait"],
                                env=ssh_hosts, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: sum(len(p) for p in _ranks_on(hosts).values()) == 4, 60.0, "four ranks running")
    finally:
        launcher.kill()
        launcher.wait(30)
    wait_for(lambda: _ranks_on(hosts) == {}, 30.0, "the ranks on the hosts ending after the launcher's death")


def test_mpi_gets_the_host_list_and_the_same_ssh(hosts, ssh_hosts, tmp_path):
    """--mpi -H h1:2,h2:2: the hosts are checked as without --mpi, then MPICH's mpiexec starts the
    ranks there through the same SSH command; they reduce over MPI, labelled as usual."""
    first, second = hosts.hosts
    done = subprocess.run([LAUNCHER, "--mpi", "--verbose", "-np", "4", "-H", f"{first.address}:2,{second.address}:2",
                           sys.executable, _script(tmp_path), "ok"], env=ssh_hosts, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"-hosts {first.address}:2,{second.address}:2 -launcher ssh" in done.stderr
    records = _records(done.stdout)
    assert [records[r]["host"] for r in range(4)] == [first.name, first.name, second.name, second.name]
    assert {records[r]["sum"] for r in range(4)} == {10.0}
    assert {records[r]["forwarded"] for r in range(4)} == {"from the launcher"}
    # Every control message is received before MPI finalizes (UCX reports any left unmatched).
    assert "unexpected tag-receive" not in done.stdout + done.stderr
    bad = subprocess.run([LAUNCHER, "--mpi", "-np", "2", "-H", f"{first.address}:1,no-such-host.invalid:1",
                          sys.executable, _script(tmp_path), "ok"], env=ssh_hosts, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 1 and "no-such-host.invalid: exit code 255" in bad.stderr, bad.stderr
    wait_for(lambda: _ranks_on(hosts) == {}, 30.0, "the ranks ending")


def test_this_machine_and_other_hosts_in_one_job(hosts, ssh_hosts, tmp_path):
    """-H localhost:1,h1:1,h2:1: rank 0 starts here without SSH, ranks 1 and 2 over SSH; the three
    reduce together (this machine's rank listens on its address on the hosts' network)."""
    import socket

    first, second = hosts.hosts
    done = subprocess.run([LAUNCHER, "-np", "3", "-H", f"localhost:1,{first.address}:1,{second.address}:1",
                           sys.executable, _script(tmp_path), "ok"], env=ssh_hosts, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = _records(done.stdout)
    assert [records[r]["host"] for r in range(3)] == [socket.gethostname(), first.name, second.name]
    assert {records[r]["sum"] for r in range(3)} == {6.0}
    assert [records[r]["cross_rank"] for r in range(3)] == [0, 1, 2]
