"""A job across hosts: ranks on this machine start as local ranks do, ranks on other hosts over SSH.

Before anything starts, every other host is asked over SSH to answer (:func:`.hosts.check_reachable`),
all at once, and a host that does not is named with SSH's own message. The rendezvous server then
listens on this machine's address as the other hosts see it (the client address of their SSH
connection), or on the ``--network-interface`` address, never on every interface.

A remote rank is the SSH client process here, running :mod:`spark_hvd.runner.remote` there, which
starts the rank with the environment sent on the SSH channel: this launcher's environment (less
what belongs to one host or one login, :data:`NOT_FORWARDED`), the worker contract and the job's
settings. Its output comes back on SSH's two streams and is printed with its rank like a local
rank's; :class:`~.processes.RankProcesses` watches both kinds alike, so a failure anywhere stops
every rank, Ctrl-C reaches every rank as SIGINT, and when the launcher ends (even by SIGKILL, which
ends its SSH clients through their supervisors) the remote side sees its connection close and
stops its rank.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

from spark_hvd.runtime import config
from spark_hvd.runtime.rendezvous import RendezvousServer

from .hosts import HostSlots, address_towards, check_reachable, is_this_machine, place_ranks
from .local import LocalJob
from .processes import OutputSink, RankProcesses, print_prefixed, rank_environment

__all__ = ["HostsJob", "NOT_FORWARDED", "forwarded_environment"]

NOT_FORWARDED = frozenset({
    "HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "DISPLAY", "XAUTHORITY", "TERM_SESSION_ID", "TMUX", "TMUX_PANE",
    "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "SSH_AUTH_SOCK", "SSH_AGENT_PID", "XDG_RUNTIME_DIR",
    "XDG_SESSION_ID", "XDG_SESSION_TYPE", "DBUS_SESSION_BUS_ADDRESS", "MAIL",
})
"""Variables of the launcher's environment that describe this host or this login, not the job: a
remote rank keeps its own host's values of them."""

REMOTE_MODULE = "spark_hvd.runner.remote"


def forwarded_environment(environ: Mapping[str, str]) -> Dict[str, str]:
    """What of ``environ`` a rank on another host gets (shell functions and :data:`NOT_FORWARDED` left out)."""
    return {name: value for name, value in environ.items()
            if name not in NOT_FORWARDED and not name.startswith("BASH_FUNC_")}


class HostsJob(LocalJob):
    """``num_proc`` ranks of one command on ``hosts`` (filled in order), sharing a fresh job secret.

    ``ssh`` is the SSH client's command line up to the host (:func:`.hosts.ssh_argv`);
    ``address`` the address the ranks call back to (default: this machine's address as the first
    other host sees it); ``check_timeout`` bounds the reachability check. ``settings``, ``env``,
    ``sink``, ``output_dir`` and ``log`` are as for :class:`~.local.LocalJob`, and so is leaving
    it as a context manager (every rank stopped, here and, through their connections, there).
    """

    def __init__(self, hosts: Sequence[HostSlots], num_proc: int, *, ssh: Sequence[str],
                 address: Optional[str] = None, check_timeout: float = 30.0,
                 settings: Optional[Mapping[str, Any]] = None, env: Optional[Mapping[str, str]] = None,
                 sink: Optional[OutputSink] = print_prefixed, output_dir: Optional[os.PathLike] = None,
                 log: Optional[Callable[[str], None]] = None) -> None:
        super().__init__(num_proc, settings=settings, env=env, sink=sink, output_dir=output_dir, log=log)
        self.placed = place_ranks(hosts, num_proc)
        self.ssh = list(ssh)
        self._address = address
        self._check_timeout = check_timeout
        names = list(dict.fromkeys(name for name, _ in self.placed))
        local = {name: is_this_machine(name) for name in names}
        self.remote_hosts = [name for name in names if not local[name]]
        self._local = local

    def check(self) -> Dict[str, Dict[str, Any]]:
        """Ask every other host over SSH; what each answered (its address, ours as it sees it).
        Raises :class:`~.hosts.UnreachableHostsError` naming the hosts that did not answer."""
        answers = check_reachable(self.remote_hosts, self.ssh, [sys.executable, "-m", REMOTE_MODULE, "--check"],
                                  self._check_timeout)
        parsed: Dict[str, Dict[str, Any]] = {}
        for host, line in answers.items():
            try:
                parsed[host] = json.loads(line)
            except ValueError:
                parsed[host] = {}
        return parsed

    def start(self, argv: Sequence[str], cwd: Optional[str] = None, preload: Sequence[str] = ()) -> RankProcesses:
        """Check the hosts, serve the rendezvous, and start every rank running ``argv`` in ``cwd``
        (default: this directory, which must exist on every host). Ranks start as fresh processes
        (``preload`` is not supported)."""
        if preload:
            raise ValueError("a job across hosts starts fresh processes: expected no preload")
        if self._server is not None:
            raise RuntimeError("this HostsJob was already started; create a new one per job")
        answers = self.check()
        address = self._address or self.callback_address(answers)
        self._server = RendezvousServer(address, self.secret)
        if self._log:
            self._log(f"rendezvous server listening on {self._server.address}; hosts: " + ", ".join(
                f"{name} ({'this machine' if self._local[name] else answers[name].get('address') or name})"
                for name in dict.fromkeys(n for n, _ in self.placed)))
        environ = config.environ_snapshot()
        forwarded = forwarded_environment(environ)
        directory = os.path.abspath(cwd or os.getcwd())
        remote_command = shlex.join([sys.executable, "-m", REMOTE_MODULE])
        for name, placement in self.placed:
            local = self._local[name]
            hostname = address if local else (answers[name].get("address") or name)
            env = rank_environment(
                rank=placement.rank, size=self.num_proc, local_rank=placement.local_rank,
                local_size=placement.local_size, cross_rank=placement.cross_rank, cross_size=placement.cross_size,
                rendezvous_addr=self._server.address, secret=self.secret, hostname=hostname,
                settings=self._settings, base=environ if local else forwarded, extra=self._env)
            if local:
                self.processes.spawn(placement.rank, argv, env, cwd=directory)
                continue
            job = json.dumps({"argv": list(argv), "env": env, "cwd": directory}) + "\n"
            self.processes.spawn(placement.rank, [*self.ssh, name, remote_command], environ,
                                 control=job.encode())
        return self.processes

    def callback_address(self, answers: Dict[str, Dict[str, Any]]) -> str:
        """This machine's address as the first other host saw it in ``answers`` (of :meth:`check`),
        else the address of the route to the hosts."""
        for host in self.remote_hosts:
            seen = answers.get(host, {}).get("launcher")
            if seen:
                return str(seen)
        return address_towards(self.remote_hosts)
