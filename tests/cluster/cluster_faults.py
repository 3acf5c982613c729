"""Faults for the cluster tests: training callbacks that pause a rank where a fault is wanted, and
the driver-side threads that cut a host's links, bring them back, or kill a host's processes.

A :class:`PauseAt` callback on one rank writes its host's name into a marker file at the chosen
point of training (once: the file stays) and waits there until the test has done its harm and
says so; the fault thread then knows which host runs that rank. :class:`CutWhenRankStarts`
needs no callback: it watches the hosts for the rank's process and cuts that host's links the
moment the process exists, before the rank has reached ``init()``.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Callable, List, Optional

from cluster_hosts import Host, Hosts

__all__ = ["PauseAt", "FaultThread", "paused_host", "release", "CutWhenRankStarts", "rank_pid"]

PAUSE_WAIT_S = 120.0
"""How long a paused rank waits for the test (it goes on afterwards either way)."""


class PauseAt:
    """Pauses rank ``rank`` once: after batch ``step`` of epoch ``epoch``, or with ``at_end`` when
    training has ended (before the rank returns its result)."""

    def __init__(self, directory: str, rank: int = 1, epoch: int = 0, step: int = 0, at_end: bool = False) -> None:
        self.directory = str(directory)
        self.rank, self.at, self.at_end = rank, (epoch, step), at_end
        self.epoch = 0

    def on_epoch_begin(self, epoch, state) -> None:
        self.epoch = epoch

    def on_batch_end(self, step, logs, state) -> None:
        if not self.at_end and state.rank == self.rank and (self.epoch, step) == self.at:
            self._pause()

    def on_train_end(self, state) -> None:
        if self.at_end and state.rank == self.rank:
            self._pause()

    def _pause(self) -> None:
        marker = os.path.join(self.directory, "paused")
        if os.path.exists(marker):
            return  # paused in an earlier attempt: this one trains on
        with open(marker + ".tmp", "w") as f:
            f.write(socket.gethostname())
        os.rename(marker + ".tmp", marker)
        go = os.path.join(self.directory, "go")
        deadline = time.monotonic() + PAUSE_WAIT_S
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.05)


def paused_host(directory: str, hosts: Hosts, timeout: float = PAUSE_WAIT_S) -> Host:
    """The host whose rank paused, once one has."""
    marker = os.path.join(str(directory), "paused")
    deadline = time.monotonic() + timeout
    while not os.path.exists(marker):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no rank paused within {timeout:.0f} s")
        time.sleep(0.05)
    with open(marker) as f:
        name = f.read().strip()
    return next(host for host in hosts.hosts if host.name == name)


def release(directory: str) -> None:
    """Let the paused rank go on."""
    open(os.path.join(str(directory), "go"), "w").close()


def rank_pid(host: Host, rank: int) -> Optional[int]:
    """The pid of the rank process of ``rank`` on ``host``, if it runs there."""
    for pid, found in host.rank_processes().items():
        if found == rank:
            return pid
    return None


class FaultThread(threading.Thread):
    """Runs ``harm`` beside the fit; :meth:`finish` joins it and raises what it raised."""

    def __init__(self, harm: Callable[[], None]) -> None:
        super().__init__(daemon=True)
        self._harm = harm
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            self._harm()
        except BaseException as exc:  # reported by finish() in the test's thread
            self.error = exc

    def finish(self, timeout: float = 180.0) -> None:
        self.join(timeout)
        assert not self.is_alive(), "the fault thread did not finish"
        if self.error is not None:
            raise self.error


class CutWhenRankStarts:
    """Cuts the links of the host where rank ``rank``'s process appears, at once, for ``seconds``."""

    def __init__(self, hosts: Hosts, rank: int, seconds: float, timeout: float = 180.0) -> None:
        self.hosts, self.rank, self.seconds, self.timeout = hosts, rank, seconds, timeout
        self.cut: List[str] = []

    def __call__(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            for host in self.hosts.hosts:
                if rank_pid(host, self.rank) is not None:
                    host.cut()
                    self.cut.append(host.name)
                    try:
                        time.sleep(self.seconds)
                    finally:
                        host.restore()
                    return
            time.sleep(0.02)
        raise TimeoutError(f"rank {self.rank}'s process did not appear on any host within {self.timeout:.0f} s")
