"""Elastic jobs on this machine: workers come and go, the launcher forms each new world.

The launcher starts workers (``SPARK_HVD_ELASTIC=1``, each with a worker id but no rank) and
serves the rendezvous. A worker's ``init()`` asks for its place in the next world
(:mod:`spark_hvd.runtime.membership`); the launcher answers once every running worker has asked,
keeping the survivors in their order (rank 0 stays a worker that has the state) and adding new
workers after them. When a worker dies, the survivors' collectives fail, ``hvd.elastic.run``
restores their last commit and they ask again; the launcher starts a replacement if the slots
allow. When the host-discovery script reports more slots, new workers start and the running ones
are told (``elastic/updates``) so that their next ``state.commit()`` makes room for them.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from spark_hvd.runtime import config
from spark_hvd.runtime.membership import UPDATES_KEY, Assignment, assign_key, encode_updates, join_key
from spark_hvd.runtime.rendezvous import RendezvousClient, RendezvousServer

from .processes import RankExit, RankProcesses, print_prefixed, OutputSink

__all__ = ["ElasticOptions", "ElasticJob", "Reset", "parse_discovery", "DEFAULT_ELASTIC_TIMEOUT"]

LOCAL_HOST = "127.0.0.1"
DEFAULT_ELASTIC_TIMEOUT = 600.0
_POLL_S = 0.05
_DISCOVERY_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ElasticOptions:
    """What an elastic job may do."""

    num_proc: int
    """Workers to start with (fewer when the discovery script offers fewer slots)."""
    min_np: int
    """Fewest workers a world may have; below it the launcher waits for slots."""
    max_np: int
    """Most workers a world may have."""
    discovery_script: Optional[str] = None
    """Prints ``host:slots`` lines (Horovod's format); this machine only. None: ``num_proc`` slots."""
    reset_limit: Optional[int] = None
    """Most times a new world may be formed after the first; None: no limit."""
    elastic_timeout: float = DEFAULT_ELASTIC_TIMEOUT
    """Seconds to wait for enough workers, or for every worker to join a new world."""
    discovery_interval: float = 1.0
    """Seconds between runs of the discovery script."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_np <= self.num_proc <= self.max_np:
            raise ValueError(f"--min-np {self.min_np}, -np {self.num_proc} and --max-np {self.max_np} are invalid: "
                             "expected 1 <= min-np <= np <= max-np")
        if self.reset_limit is not None and self.reset_limit < 0:
            raise ValueError(f"--reset-limit {self.reset_limit} is invalid: expected a count >= 0")
        if self.elastic_timeout <= 0:
            raise ValueError(f"--elastic-timeout {self.elastic_timeout} is invalid: expected seconds > 0")


@dataclass(frozen=True)
class Reset:
    """One new world after the first, and why it was formed."""

    generation: int
    causes: tuple
    size_before: int
    size_after: int

    def describe(self) -> str:
        why = "; ".join(self.causes) or "workers were added"
        return f"world {self.generation}: {why}; {self.size_before} -> {self.size_after} workers"


@dataclass
class _Worker:
    index: int
    state: str = "running"  # running, done, failed, removed
    rank: Optional[int] = None  # in the current world
    asked: int = 0  # the last join count answered


def parse_discovery(output: str, local_names: Sequence[str]) -> int:
    """Total slots of ``host:slots`` lines (a bare host is one slot); hosts must be this machine."""
    total = 0
    for line in output.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        host, sep, slots = line.rpartition(":")
        if not sep:
            host, slots = line, "1"
        if not slots.isdigit():
            raise ValueError(f"discovery line {line!r}: expected HOST:SLOTS with SLOTS a whole number")
        if host.lower() not in local_names:
            raise ValueError(f"discovery line {line!r} names host {host!r}, which is not this machine; spark-hvd-run "
                             "starts workers here only (remote hosts are reached through spark_hvd.spark.run_elastic)")
        total += int(slots)
    return total


class ElasticJob:
    """Runs an elastic job to its end; :meth:`run` returns the launcher's exit status."""

    def __init__(self, options: ElasticOptions, command: Sequence[str], *, local_names: Sequence[str],
                 settings: Optional[Mapping[str, object]] = None, env: Optional[Mapping[str, str]] = None,
                 sink: Optional[OutputSink] = print_prefixed, output_dir: Optional[os.PathLike] = None,
                 say: Callable[[str], None] = print, log: Optional[Callable[[str], None]] = None) -> None:
        self.options = options
        self.command = list(command)
        self.local_names = [n.lower() for n in local_names]
        self.settings = dict(settings or {})
        self.env = dict(env or {})
        self.secret = config.new_secret()
        self.processes = RankProcesses(sink=sink, output_dir=output_dir, log=log)
        self.resets: List[Reset] = []
        self._say = say
        self._log = log
        self._workers: Dict[int, _Worker] = {}
        self._generation = 0
        self._updates = 0
        self._causes: List[str] = []
        self._slots = options.num_proc
        self._waiting_since: Optional[float] = None
        self._server: Optional[RendezvousServer] = None
        self._client: Optional[RendezvousClient] = None

    # -- running ---------------------------------------------------------------------------------
    def run(self) -> int:
        self._server = RendezvousServer(LOCAL_HOST, self.secret)
        self._client = RendezvousClient(self._server.address, self.secret, 30.0)
        self._client.put(UPDATES_KEY, encode_updates(0, False))
        self._discover()
        for _ in range(min(self.options.num_proc, self._target())):
            self._spawn()
        next_discovery = time.monotonic() + self.options.discovery_interval
        while True:
            event = self.processes.next_exit(_POLL_S)
            if event is not None:
                self._exited(*event)
            now = time.monotonic()
            if self.options.discovery_script and now >= next_discovery:
                self._discover()
                next_discovery = now + self.options.discovery_interval
            status = self._settle(now)
            if status is not None:
                return status

    def close(self) -> None:
        try:
            self.processes.close()
        finally:
            if self._client is not None:
                self._client.close()
            if self._server is not None:
                self._server.close()

    def _settle(self, now: float) -> Optional[int]:
        """One round of decisions; the exit status once the job is over."""
        running = [w for w in self._workers.values() if w.state == "running"]
        if not running:
            failed = [w for w in self._workers.values() if w.state == "failed"]
            done = [w for w in self._workers.values() if w.state == "done"]
            if done and not self._causes:
                return 0
            self._say("no worker is left running" + (f" ({'; '.join(self._causes)})" if self._causes else ""))
            return 1 if failed or not done else 0
        if not any(w.state == "done" for w in self._workers.values()):
            self._grow(running)  # once a worker has finished, the job is ending: start nobody
        return self._form_world(now)

    def _target(self) -> int:
        return max(0, min(self.options.max_np, self._slots))

    def _grow(self, running: List[_Worker]) -> None:
        missing = self._target() - len(running)
        if missing <= 0:
            return
        in_world = any(w.rank is not None for w in running)
        for _ in range(missing):
            self._spawn()
        if in_world:
            # Running workers learn of the newcomers at their next commit and form a world with them.
            self._updates += 1
            assert self._client is not None
            self._client.put(UPDATES_KEY, encode_updates(self._updates, True))
            self._causes.append(f"{missing} worker(s) added")

    def _form_world(self, now: float) -> Optional[int]:
        assert self._server is not None and self._client is not None
        values = self._server.values()
        running = [w for w in self._workers.values() if w.state == "running"]
        asking = {w.index: int(values[join_key(self._worker_id(w))]) for w in running
                  if int(values.get(join_key(self._worker_id(w)), 0)) > w.asked}
        if not asking:
            self._waiting_since = None
            return None
        self._waiting_since = self._waiting_since or now
        if len(asking) < len(running) or len(running) < self.options.min_np:
            if now - self._waiting_since > self.options.elastic_timeout:
                absent = [self._worker_id(w) for w in running if w.index not in asking]
                self._say(f"no new world within --elastic-timeout {self.options.elastic_timeout:.0f} s: "
                          f"{len(running)} worker(s) running (at least {self.options.min_np} needed), "
                          f"{len(asking)} asking to join" + (f", not asking: {', '.join(absent)}" if absent else ""))
                return 1
            return None
        limit = self.options.reset_limit
        if self._generation >= 1 and limit is not None and len(self.resets) >= limit:
            self._say(f"--reset-limit {limit} reached: {'; '.join(self._causes) or 'workers changed'}; stopping")
            return 1
        before = sum(1 for w in self._workers.values() if w.rank is not None)
        # Survivors keep their order, so rank 0 holds the state everyone takes; newcomers follow.
        order = sorted(running, key=lambda w: (w.rank is None, w.rank if w.rank is not None else w.index))
        for w in self._workers.values():
            w.rank = None
        self._generation += 1
        size = len(order)
        for rank, w in enumerate(order):
            w.rank = rank
            w.asked = asking[w.index]
            placement = Assignment(generation=self._generation, rank=rank, size=size, local_rank=rank,
                                   local_size=size, cross_rank=0, cross_size=1, updates=self._updates)
            self._client.put(assign_key(self._worker_id(w), w.asked), placement.to_json())
        if self._generation > 1:
            reset = Reset(self._generation, tuple(self._causes), before, size)
            self.resets.append(reset)
            self._say(f"reset {len(self.resets)}: {reset.describe()}")
        self._causes = []
        self._waiting_since = None
        return None

    # -- workers ---------------------------------------------------------------------------------
    @staticmethod
    def _worker_id(worker: _Worker) -> str:
        return f"w{worker.index}"

    def _spawn(self) -> None:
        assert self._server is not None
        index = len(self._workers)
        worker = _Worker(index)
        env = dict(config.environ_snapshot())
        env.update(config.elastic_worker_environment(worker_id=self._worker_id(worker),
                                                     rendezvous_addr=self._server.address, secret=self.secret,
                                                     hostname=LOCAL_HOST, settings=self.settings))
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.env)
        self._workers[index] = worker
        self.processes.spawn(index, self.command, env)
        if self._log:
            self._log(f"started worker {index}")

    def _exited(self, index: int, code: int) -> None:
        worker = self._workers[index]
        if worker.state == "removed":
            return
        where = f"worker {index}" + (f" (rank {worker.rank})" if worker.rank is not None else "")
        if code == 0:
            worker.state = "done"
            return
        worker.state = "failed"
        how = RankExit(index, code).describe().replace(f"rank {index}", where, 1)
        self._causes.append(how)
        self._say(f"{how}; the others form a new world")

    def _discover(self) -> None:
        script = self.options.discovery_script
        if not script:
            return
        try:
            out = subprocess.run(shlex.split(script), capture_output=True, text=True, timeout=_DISCOVERY_TIMEOUT_S)
            if out.returncode != 0:
                raise ValueError(f"exited with code {out.returncode}: {out.stderr.strip()[-300:]}")
            slots = parse_discovery(out.stdout, self.local_names)
        except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
            self._say(f"host discovery script {script!r} failed ({exc}); keeping {self._slots} slot(s)")
            return
        if slots < self._slots:
            self._shrink(slots)
        self._slots = slots

    def _shrink(self, slots: int) -> None:
        running = sorted((w for w in self._workers.values() if w.state == "running"), key=lambda w: -w.index)
        excess = len(running) - max(0, min(slots, self.options.max_np))
        for worker in running[:max(0, excess)]:
            worker.state = "removed"
            self._causes.append(f"worker {worker.index} removed (discovery reports {slots} slot(s))")
            self.processes.terminate(ranks=[worker.index])

