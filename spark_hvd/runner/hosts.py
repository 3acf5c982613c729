"""Hosts of a ``spark-hvd-run`` job: ``-H``, ``--hostfile``, where each rank goes, the SSH check.

Every other host must answer over SSH before any rank starts.

Ranks fill the hosts in the order given, each host's slots before the next host's, as horovodrun
does: ``-np 4 -H a:2,b:2`` puts ranks 0 and 1 on ``a`` and ranks 2 and 3 on ``b``. A host is this
machine when its name is one of this machine's names or resolves to an address this machine owns;
its ranks start here without SSH. Every other host is reached with the SSH command of
``SPARK_HVD_SSH_COMMAND`` (``ssh`` by default, so the user's own SSH configuration applies), in
batch mode: a host that would ask for a password or a host key confirmation fails the check with
SSH's own message instead of waiting for an answer nobody gives.
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = [
    "HostSlots",
    "Placement",
    "parse_hosts",
    "read_hostfile",
    "place_ranks",
    "assign_ranks",
    "is_this_machine",
    "local_names",
    "ssh_argv",
    "check_reachable",
    "address_towards",
    "UnreachableHostsError",
]

CHECK_CONNECT_TIMEOUT_S = 10
"""Seconds SSH may take to connect to a host during the check before it counts as unreachable."""


class UnreachableHostsError(RuntimeError):
    """One or more hosts did not answer the SSH check; the message names each one and why."""


@dataclass(frozen=True)
class HostSlots:
    """One host of ``-H`` or ``--hostfile`` and the ranks it may hold."""

    name: str
    slots: int


@dataclass(frozen=True)
class Placement:
    """Where one rank sits in the job."""

    rank: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def _entry(text: str, where: str) -> HostSlots:
    name, sep, slots = text.rpartition(":")
    if not sep:
        name, slots = text, "1"
    if not name:
        raise ValueError(f"{where} entry {text!r} has no host name; expected HOST:SLOTS, e.g. worker1:4")
    if not slots.isdigit() or int(slots) < 1:
        raise ValueError(f"{where} entry {text!r} has slot count {slots!r}; expected HOST:SLOTS with SLOTS >= 1")
    return HostSlots(name, int(slots))


def parse_hosts(text: str) -> List[HostSlots]:
    """``a:2,b:2`` (a host without ``:SLOTS`` has one slot) as hosts in order; ValueError on bad input."""
    entries = [entry.strip() for entry in text.split(",") if entry.strip()]
    if not entries:
        raise ValueError(f"-H {text!r} names no host; expected e.g. -H localhost:2 or -H worker1:2,worker2:2")
    return _merged([_entry(entry, "-H") for entry in entries], "-H")


def read_hostfile(path: str) -> List[HostSlots]:
    """The hosts of a host file: one per line as ``HOST slots=N`` (OpenMPI's form) or ``HOST:N`` or
    ``HOST``; ``#`` starts a comment. ValueError names the line that cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise ValueError(f"--hostfile {path!r} cannot be read: {exc.strerror}; expected a file of HOST slots=N "
                         "lines") from None
    hosts = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        where = f"--hostfile {path!r} line {number}"
        words = text.split()
        if len(words) == 1:
            hosts.append(_entry(words[0], where))
        elif len(words) == 2 and words[1].startswith("slots=") and ":" not in words[0]:
            hosts.append(_entry(f"{words[0]}:{words[1][len('slots='):]}", where))
        else:
            raise ValueError(f"{where} is {line.strip()!r}; expected HOST slots=N, HOST:N or HOST")
    if not hosts:
        raise ValueError(f"--hostfile {path!r} names no host; expected lines such as: worker1 slots=2")
    return _merged(hosts, f"--hostfile {path!r}")


def _merged(hosts: List[HostSlots], where: str) -> List[HostSlots]:
    seen: Dict[str, int] = {}
    for host in hosts:
        if host.name in seen:
            raise ValueError(f"{where} names host {host.name!r} twice; expected each host once with all its slots, "
                             f"e.g. {host.name}:{seen[host.name] + host.slots}")
        seen[host.name] = host.slots
    return hosts


def place_ranks(hosts: Sequence[HostSlots], num_proc: int) -> List[Tuple[str, Placement]]:
    """The host and placement of ranks ``0..num_proc-1``: the hosts' slots in order, the first
    ``num_proc`` of them. ValueError when the slots are fewer than ``num_proc``."""
    total = sum(h.slots for h in hosts)
    if total < num_proc:
        listed = ",".join(f"{h.name}:{h.slots}" for h in hosts)
        raise ValueError(f"the hosts {listed} have {total} slot(s) but -np is {num_proc}; expected at least -np "
                         "slots: add hosts or slots, or lower -np")
    names = [h.name for h in hosts for _ in range(h.slots)][:num_proc]
    return list(zip(names, assign_ranks(names)))


def assign_ranks(hosts: Sequence[str]) -> List[Placement]:
    """Placements of processes ``0..n-1`` running on ``hosts[i]``, ranks grouped host by host.

    Hosts are ordered by their first process, so process 0 is rank 0. ``cross_rank`` and
    ``cross_size`` follow Horovod: the index among, and the number of, ranks with the same
    ``local_rank``.
    """
    order: Dict[str, List[int]] = {}
    for process, host in enumerate(hosts):
        order.setdefault(host, []).append(process)
    rank_of: Dict[int, int] = {}
    local: Dict[int, Tuple[int, int]] = {}
    for processes in order.values():
        for local_rank, process in enumerate(processes):
            rank_of[process] = len(rank_of)
            local[process] = (local_rank, len(processes))
    placements = []
    for process in range(len(hosts)):
        local_rank, local_size = local[process]
        same_local = sorted(rank_of[p] for p in range(len(hosts)) if local[p][0] == local_rank)
        placements.append(Placement(
            rank=rank_of[process], local_rank=local_rank, local_size=local_size,
            cross_rank=same_local.index(rank_of[process]), cross_size=len(same_local),
        ))
    return placements


def _addresses(name: str) -> List[str]:
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)})
    except socket.gaierror:
        return []


def local_names() -> set:
    """The names this machine goes by without a lookup: localhost, 127.0.0.1 and its host name."""
    hostname = socket.gethostname().lower()
    return {"localhost", "127.0.0.1", hostname, hostname.split(".")[0]}


def is_this_machine(name: str) -> bool:
    """Whether ``name`` is this machine: one of its names, or an address it can listen on."""
    if name.lower() in local_names():
        return True
    for address in _addresses(name):
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, 0))  # only an address of this machine can be bound
            except OSError:
                continue
            return True
    return False


def ssh_argv(command: str, port: Optional[int], identity_file: Optional[str]) -> List[str]:
    """The SSH client's command line before the host: ``command`` (SPARK_HVD_SSH_COMMAND) in batch
    mode, with ``-p`` and ``-i`` when given, and no terminal (the ranks' output stays two streams)."""
    argv = shlex.split(command) + ["-o", "BatchMode=yes", "-T"]
    if port is not None:
        argv += ["-p", str(port)]
    if identity_file is not None:
        argv += ["-i", identity_file]
    return argv


def check_reachable(hosts: Sequence[str], ssh: Sequence[str], remote_command: Sequence[str],
                    timeout: float) -> Dict[str, str]:
    """Run ``remote_command`` on every host over SSH at once; each host's first output line.

    Raises :class:`UnreachableHostsError` naming every host that did not answer within
    ``timeout`` seconds or whose command failed, with the last line SSH or the command printed.
    """
    answers: Dict[str, str] = {}
    problems: Dict[str, str] = {}
    lock = threading.Lock()

    def check(host: str) -> None:
        argv = [*ssh, "-o", f"ConnectTimeout={min(CHECK_CONNECT_TIMEOUT_S, max(1, int(timeout)))}", host,
                shlex.join(remote_command)]
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            problem = f"no answer within {timeout:.0f} s"
        except OSError as exc:
            problem = f"{argv[0]} could not be started: {exc.strerror}"
        else:
            lines = [line for line in (done.stdout + "\n" + done.stderr).splitlines() if line.strip()]
            if done.returncode == 0 and done.stdout.strip():
                with lock:
                    answers[host] = done.stdout.strip().splitlines()[0]
                return
            problem = f"exit code {done.returncode}" + (f": {lines[-1].strip()}" if lines else "")
        with lock:
            problems[host] = problem

    threads = [threading.Thread(target=check, args=(host,), name=f"check-{host}", daemon=True) for host in hosts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 5)
    for host in hosts:
        if host not in answers and host not in problems:
            problems[host] = f"no answer within {timeout:.0f} s"
    if problems:
        listed = "; ".join(f"{host}: {problem}" for host, problem in problems.items())
        raise UnreachableHostsError(
            f"{len(problems)} of {len(hosts)} host(s) did not answer over SSH ({listed}); expected each host to accept "
            f"`{shlex.join(ssh)} HOST` without a password prompt and to have this Python environment at the same path "
            f"({shlex.join(remote_command[:1])}) with spark-hvd installed. Fix: set up key-based SSH to each host "
            "(ssh-copy-id HOST, and ssh HOST once to accept its host key), or set SPARK_HVD_SSH_COMMAND, --ssh-port or "
            "--ssh-identity-file")
    return answers


def address_towards(hosts: Sequence[str]) -> str:
    """This machine's address on the route to the first of ``hosts`` that resolves: the address the
    other hosts can reach it at (no packet is sent)."""
    for host in hosts:
        for address in _addresses(host):
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                try:
                    probe.connect((address, 9))
                except OSError:
                    continue
                return probe.getsockname()[0]
    raise ValueError(f"no route to any of the hosts {', '.join(hosts)}; expected host names this machine can resolve "
                     "and reach, or pass --network-interface to choose the address the ranks call back to")
