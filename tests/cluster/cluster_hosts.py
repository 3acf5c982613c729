"""Hosts of a test cluster on this machine: network namespaces on a bridge, one per host.

Each host is a process that holds a network, UTS and mount namespace of its own (so it has its
own interfaces and addresses, its own hostname, its own ``/dev/shm`` and ``/etc/hosts``), joined to
the machine through veth pairs on two bridges: the cluster network ``10.213.0.0/25`` (the machine
itself is ``10.213.0.1`` there, hosts ``.11``, ``.12``, ...) and a second network
``10.213.0.128/25`` (``data0`` in each host) for tests of the interface choice. Links can be shaped
with ``tc ... tbf`` (this kernel has no netem) and cut (the machine's end of the veth goes down).

Programs run on a host with ``nsenter`` into its holder's namespaces. Nothing is written outside
a temporary directory: each host's ``/etc/hosts`` is a bind mount inside its own mount namespace,
so nothing under ``/etc/netns`` is needed. Closing :class:`Hosts` kills every process still in a
host's network namespace (all of them descend from what the harness started there), the holders
(their namespaces, and with them the host ends of the veths, vanish) and the bridges. A lock file
keeps two clusters from using the addresses at once; a bridge left by a run that was killed is
removed before a new one is made.

As root it needs nothing else. A user without root runs it inside an unprivileged user namespace
that has a network namespace of its own: ``unshare --user --map-root-user --net --mount --fork``
(see docs/cluster.md).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from spark_hvd.runner.warm import RANK_PROCESS_NAME

__all__ = ["Host", "Hosts", "SUBNET", "MACHINE_ADDRESS", "DATA_MACHINE_ADDRESS", "HarnessError", "rate_bits", "die_with_parent",
           "death_hook",
           "run_quietly"]

SUBNET = "10.213.0"
"""The private /24 of the harness; nothing else on this machine may use it."""
MACHINE_ADDRESS = f"{SUBNET}.1"
"""The machine's address on the cluster network: the Spark master and drivers listen here."""
DATA_MACHINE_ADDRESS = f"{SUBNET}.129"
"""The machine's address on the second network."""
_CLUSTER_PREFIX = 25
_BRIDGE = "shvd-br0"
_DATA_BRIDGE = "shvd-br1"
_LOCK = os.path.join(tempfile.gettempdir(), "spark-hvd-cluster-10.213.0.lock")
_LOCK_WAIT_S = 900.0
"""How long a cluster waits for another one on this machine (the same addresses) to finish."""
_COMMAND_TIMEOUT_S = 30.0
_READY_TIMEOUT_S = 20.0
_KILL_WAIT_S = 15.0
_PR_SET_PDEATHSIG = 1


class HarnessError(RuntimeError):
    """The machine cannot host the test cluster; the message says why and what to do."""


def run_quietly(argv: Sequence[str], check: bool = True, timeout: float = _COMMAND_TIMEOUT_S) -> str:
    """Run a short command; its stdout, or HarnessError with its stderr when it fails and ``check``."""
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise HarnessError(f"{' '.join(argv)} failed with exit code {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def die_with_parent() -> None:
    """In a child before exec: SIGKILL when the harness process dies, so nothing outlives a killed run."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def death_hook() -> Optional[Callable[[], None]]:
    """``preexec_fn`` for a child of the harness: :func:`die_with_parent` when this is the main thread.
    The kernel sends that signal when the *thread* that started the child ends, so a child started
    by a short-lived thread (a fault test restarting a worker) gets none; :meth:`Hosts.close` ends it."""
    return die_with_parent if threading.current_thread() is threading.main_thread() else None


def rate_bits(rate: str) -> int:
    """Bits per second of a tc rate such as ``1gbit`` or ``10gbit``."""
    units = {"kbit": 10 ** 3, "mbit": 10 ** 6, "gbit": 10 ** 9, "bit": 1}
    for unit, factor in units.items():
        if rate.endswith(unit) and rate[:-len(unit)].replace(".", "", 1).isdigit():
            return int(float(rate[:-len(unit)]) * factor)
    raise ValueError(f"rate={rate!r} is not a tc rate: expected e.g. '1gbit', '10gbit' or '100mbit'")


def _net_namespace(pid: int) -> Optional[int]:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


@dataclass
class Host:
    """One host of the cluster: a hostname, an address on each network, and the holder of its namespaces."""

    index: int
    name: str
    address: str
    data_address: str
    link: str
    """The machine's end of the veth to this host's ``eth0`` (cutting it cuts the host off)."""
    data_link: str
    """The machine's end of the veth to this host's ``data0``."""
    holder: Optional[subprocess.Popen] = None
    started: List[subprocess.Popen] = field(default_factory=list)

    @property
    def pid(self) -> int:
        assert self.holder is not None, f"host {self.name} is not up"
        return self.holder.pid

    def command(self, argv: Sequence[str]) -> List[str]:
        """``argv`` as a command that runs on this host."""
        return ["nsenter", f"--target={self.pid}", "--net", "--uts", "--mount", "--", *argv]

    def popen(self, argv: Sequence[str], env: Optional[Mapping[str, str]] = None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` on this host (it dies with the harness process); the harness stops it on close."""
        process = subprocess.Popen(self.command(argv), env=None if env is None else dict(env),
                                   preexec_fn=death_hook(), **kwargs)
        self.started.append(process)
        return process

    def run(self, argv: Sequence[str], check: bool = True, timeout: float = _COMMAND_TIMEOUT_S) -> str:
        """Run a short command on this host; its stdout."""
        return run_quietly(self.command(argv), check=check, timeout=timeout)

    def processes(self) -> List[int]:
        """Every process in this host's network namespace but its holder."""
        ns = _net_namespace(self.pid)
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != self.pid and _net_namespace(int(entry)) == ns:
                found.append(int(entry))
        return found

    def processes_running(self, needle: bytes) -> List[int]:
        """The processes of this host whose command line contains ``needle``."""
        found = []
        for pid in self.processes():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if needle in f.read():
                        found.append(pid)
            except OSError:
                pass
        return found

    def rank_processes(self) -> Dict[int, Optional[int]]:
        """The rank processes of this host and their ranks (None where it cannot be read): fresh
        interpreters (``python -m spark_hvd.runner.worker``, whose environment names the rank) and
        ranks forked from a warm process (named ``hvd-rank<r>``)."""
        found: Dict[int, Optional[int]] = {}
        for pid in self.processes():
            try:
                with open(f"/proc/{pid}/comm", "rb") as f:
                    comm = f.read().strip().decode(errors="replace")
                if comm.startswith(RANK_PROCESS_NAME):
                    found[pid] = int(comm[len(RANK_PROCESS_NAME):]) if comm[len(RANK_PROCESS_NAME):].isdigit() else None
                    continue
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"spark_hvd.runner.worker" not in f.read():
                        continue
                with open(f"/proc/{pid}/environ", "rb") as f:
                    ranks = [v[len(b"SPARK_HVD_RANK="):] for v in f.read().split(b"\0") if v.startswith(b"SPARK_HVD_RANK=")]
                found[pid] = int(ranks[0]) if ranks and ranks[0].isdigit() else None
            except OSError:
                pass
        return found

    def shm_entries(self) -> List[str]:
        """What is in this host's own /dev/shm."""
        return sorted(os.listdir(f"/proc/{self.pid}/root/dev/shm"))

    def cut(self) -> None:
        """Cut this host off the networks: the machine's ends of its links go down."""
        for link in (self.link, self.data_link):
            run_quietly(["ip", "link", "set", "dev", link, "down"])

    def restore(self) -> None:
        """Bring this host's links back up."""
        for link in (self.link, self.data_link):
            run_quietly(["ip", "link", "set", "dev", link, "up"])

    def kill_all(self) -> List[int]:
        """SIGKILL every process of this host (its holder stays): a host that lost power. The pids killed."""
        killed = []
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + _KILL_WAIT_S
        while self.processes() and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.05)
        self._reap()
        return killed

    def _reap(self) -> None:
        for process in self.started:
            process.poll()


class Hosts:
    """``count`` hosts on the two bridges; use as a context manager (or call :meth:`close`)."""

    def __init__(self, count: int = 2, prefix: str = "shvd-h") -> None:
        if not 1 <= count <= 9:
            raise ValueError(f"count={count} hosts is not supported: expected 1 to 9")
        self.count = count
        self.prefix = prefix
        self.hosts: List[Host] = []
        self.rate: Optional[str] = None
        self._lock_file: Optional[int] = None
        self._dir: Optional[str] = None
        self._bridges: List[str] = []

    # -- forming -----------------------------------------------------------------------------------
    def __enter__(self) -> "Hosts":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self._check_privileges()
        self._take_lock()
        self._dir = tempfile.mkdtemp(prefix="spark-hvd-cluster-")
        self._remove_stale_bridges()
        self._check_subnet_free()
        if "state DOWN" in run_quietly(["ip", "-o", "link", "show", "lo"]):
            run_quietly(["ip", "link", "set", "lo", "up"])  # a fresh network namespace (unprivileged runs)
        self._make_bridge(_BRIDGE, MACHINE_ADDRESS)
        self._make_bridge(_DATA_BRIDGE, DATA_MACHINE_ADDRESS)
        hosts_file = os.path.join(self._dir, "hosts")
        self.hosts = [Host(index=i, name=f"{self.prefix}{i + 1}", address=f"{SUBNET}.{11 + i}",
                           data_address=f"{SUBNET}.{139 + i}", link=f"shvd-h{i + 1}e", data_link=f"shvd-h{i + 1}d")
                      for i in range(self.count)]
        with open(hosts_file, "w") as f:
            f.write("127.0.0.1 localhost\n")
            f.write(f"{MACHINE_ADDRESS} shvd-machine\n")
            for host in self.hosts:
                f.write(f"{host.address} {host.name}\n")
        for host in self.hosts:
            self._start_holder(host, hosts_file)
            self._wire(host, host.link, _BRIDGE, "eth0", host.address)
            self._wire(host, host.data_link, _DATA_BRIDGE, "data0", host.data_address)
            host.run(["ip", "link", "set", "lo", "up"])

    def _check_privileges(self) -> None:
        missing = [tool for tool in ("ip", "tc", "nsenter", "unshare") if shutil.which(tool) is None]
        if missing:
            raise HarnessError(f"the cluster harness needs {missing} (iproute2 and util-linux); install them")
        if os.geteuid() != 0:
            raise HarnessError(
                f"the cluster harness makes network namespaces, which needs root (this is uid {os.geteuid()}); run "
                "the tests as root, or inside an unprivileged user namespace with its own network: unshare --user "
                "--map-root-user --net --mount --fork .venv/bin/pytest tests/cluster")

    def _take_lock(self) -> None:
        fd = os.open(_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
            if time.monotonic() >= deadline:
                os.close(fd)
                raise HarnessError(f"another test cluster has held {_LOCK} for {_LOCK_WAIT_S:.0f} s; wait for it to "
                                   "end, or end it (its process holds the lock)")
            time.sleep(0.5)
        self._lock_file = fd

    def _remove_stale_bridges(self) -> None:
        # Holding the lock, any bridge of ours is a leftover of a run that was killed.
        for bridge in (_BRIDGE, _DATA_BRIDGE):
            if run_quietly(["ip", "link", "show", "dev", bridge], check=False):
                run_quietly(["ip", "link", "delete", "dev", bridge])

    def _check_subnet_free(self) -> None:
        routes = run_quietly(["ip", "-4", "route", "show"])
        taken = [line for line in routes.splitlines() if line.startswith(SUBNET + ".")]
        if taken:
            raise HarnessError(f"this machine already routes {SUBNET}.0/24, which the cluster harness uses: {taken}; "
                               "free it, or change SUBNET in tests/cluster/cluster_hosts.py")

    def _make_bridge(self, name: str, address: str) -> None:
        run_quietly(["ip", "link", "add", "name", name, "type", "bridge", "stp_state", "0", "forward_delay", "0"])
        self._bridges.append(name)
        run_quietly(["ip", "addr", "add", f"{address}/{_CLUSTER_PREFIX}", "dev", name])
        run_quietly(["ip", "link", "set", "dev", name, "up"])

    def _start_holder(self, host: Host, hosts_file: str) -> None:
        script = (f"hostname {host.name} && mount -t tmpfs -o mode=1777,size=256m tmpfs /dev/shm && "
                  f"mount --bind {hosts_file} /etc/hosts && echo ready && exec sleep infinity")
        host.holder = subprocess.Popen(
            ["unshare", "--net", "--uts", "--mount", "--propagation", "private", "--", "sh", "-c", script],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, preexec_fn=death_hook())
        ready, _, _ = select.select([host.holder.stdout], [], [], _READY_TIMEOUT_S)
        line = host.holder.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            host.holder.kill()
            _, err = host.holder.communicate(timeout=_COMMAND_TIMEOUT_S)
            raise HarnessError(f"host {host.name} did not come up within {_READY_TIMEOUT_S:.0f} s: "
                               f"{err.decode(errors='replace').strip()}")

    def _wire(self, host: Host, outer: str, bridge: str, inner: str, address: str) -> None:
        peer = outer + "p"
        run_quietly(["ip", "link", "add", "name", outer, "type", "veth", "peer", "name", peer])
        run_quietly(["ip", "link", "set", "dev", peer, "netns", str(host.pid)])
        run_quietly(["ip", "link", "set", "dev", outer, "master", bridge, "up"])
        host.run(["ip", "link", "set", "dev", peer, "name", inner])
        host.run(["ip", "addr", "add", f"{address}/{_CLUSTER_PREFIX}", "dev", inner])
        host.run(["ip", "link", "set", "dev", inner, "up"])

    # -- shaping -------------------------------------------------------------------------------------
    def shape(self, rate: Optional[str]) -> None:
        """Limit every link of the cluster network to ``rate`` each way (``'1gbit'``), or unshape (None)."""
        burst = None if rate is None else max(512 * 1024, rate_bits(rate) // 8 // 250)
        for host in self.hosts:
            for run, dev in ((run_quietly, host.link), (host.run, "eth0")):
                if rate is None:
                    run(["tc", "qdisc", "del", "dev", dev, "root"], check=False)
                else:
                    run(["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst),
                         "latency", "20ms"])
        self.rate = rate

    # -- ending --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Kill what runs on the hosts, end the hosts, remove the bridges and the temporary files."""
        for host in self.hosts:
            if host.holder is None:
                continue
            for process in host.started:
                if process.poll() is None:
                    process.kill()
            host.kill_all()
            for process in host.started:
                try:
                    process.wait(timeout=_KILL_WAIT_S)
                except subprocess.TimeoutExpired:
                    pass
            host.holder.kill()
            host.holder.wait(timeout=_KILL_WAIT_S)
            for stream in (host.holder.stdout, host.holder.stderr):
                if stream is not None:
                    stream.close()
        for bridge in self._bridges:
            run_quietly(["ip", "link", "delete", "dev", bridge], check=False)
        self._bridges = []
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        if self._lock_file is not None:
            os.close(self._lock_file)
            self._lock_file = None

    def leftovers(self) -> Dict[str, str]:
        """What of the harness is still on this machine after :meth:`close`: bridges and veths, by name."""
        links = run_quietly(["ip", "-o", "link", "show"])
        return {name: "link" for name in (_BRIDGE, _DATA_BRIDGE, *(h.link for h in self.hosts),
                                          *(h.data_link for h in self.hosts)) if f": {name}" in links}
