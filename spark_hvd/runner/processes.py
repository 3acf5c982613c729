"""Rank processes: start them, stream their output with a rank prefix, stop them all when one fails.

Both launchers (the ``spark-hvd-run`` command and :func:`spark_hvd.runner.run`) manage their
ranks through :class:`RankProcesses`; the Spark integration reuses it for the process its task
starts. The public surface is small:

- :func:`rank_environment` builds the environment of one rank process;
- :meth:`RankProcesses.spawn` starts a rank; on Linux under a supervisor
  (:mod:`spark_hvd.runner.supervise`) that passes signals on and, however the rank or the launcher
  ends, leaves no process the rank started behind;
- :meth:`RankProcesses.wait` returns when every rank has exited, or as soon as one fails, after
  stopping the others; the failure comes back as a :class:`RankExit` (the root cause);
- :meth:`RankProcesses.terminate` stops what still runs (signal, grace period, SIGKILL);
- :func:`print_prefixed` is the default output sink: ``[1]<stdout>:line``.
"""

from __future__ import annotations

import collections
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from spark_hvd.runtime import config

from . import supervise
from .warm import WarmStartError

if TYPE_CHECKING:
    from .warm import WarmStarter

__all__ = [
    "OutputSink",
    "RankExit",
    "RankProcesses",
    "print_prefixed",
    "rank_environment",
    "LEAVER_WAIT_SECONDS",
    "TAIL_LINES",
    "TERMINATE_GRACE_SECONDS",
]

OutputSink = Callable[[int, str, str], None]
"""Receives each output line of a rank: ``(rank, "stdout" or "stderr", line without newline)``."""

TAIL_LINES = 30
"""Lines of output kept per rank, shown when that rank turns out to be the root cause of a failure."""

TERMINATE_GRACE_SECONDS = 3.0
"""Seconds a rank gets to exit after SIGTERM before it is killed; also what the processes a rank
leaves behind get, and a rank whose launcher died."""

# After the last process exits, its output pipes reach EOF at once unless a grandchild still
# holds them (possible only where ranks run unsupervised); do not let it hold up the launcher.
_PUMP_JOIN_SECONDS = 2.0

# How long a SIGKILLed rank (or its supervisor) may take to be reaped.
_KILL_WAIT_SECONDS = 5.0

LEAVER_WAIT_SECONDS = 1.0
"""After a rank fails, how long the others may go on before they are stopped, so that a rank that
left with code 0 and whose peers failed because of it is seen to exit: a leaver's peers learn of
its departure when it shuts down, and often fail before its interpreter has finished exiting."""

MAX_LINE_BYTES = 1 << 16
"""The longest piece of a rank's output handed on as one line (a rank that never ends a line must
not grow our memory without limit)."""


def rank_output_path(directory: Path, rank: str, stream: str) -> Path:
    """Where ``--output-filename`` keeps one stream of a rank: ``DIR/rank.<r>/stdout`` (or stderr)."""
    return directory / f"rank.{rank}" / stream

_print_lock = threading.Lock()


def print_prefixed(rank: int, stream: str, line: str) -> None:
    """Write one line of a rank's output to our stdout or stderr as ``[rank]<stream>:line``."""
    target = sys.stdout if stream == "stdout" else sys.stderr
    with _print_lock:
        target.write(f"[{rank}]<{stream}>:{line}\n")
        target.flush()


def rank_environment(
    *,
    rank: int,
    size: int,
    rendezvous_addr: str,
    secret: str,
    local_rank: Optional[int] = None,
    local_size: Optional[int] = None,
    cross_rank: int = 0,
    cross_size: int = 1,
    hostname: str = "127.0.0.1",
    host_key: Optional[str] = None,
    settings: Optional[Mapping[str, Any]] = None,
    base: Optional[Mapping[str, str]] = None,
    extra: Optional[Mapping[str, str]] = None,
) -> Dict[str, str]:
    """The complete environment of one rank process.

    Layers, later ones winning: ``base`` (default: this process's environment), the worker
    contract from :func:`spark_hvd.runtime.config.worker_environment` (local rank and size default
    to a single-host job), ``PYTHONUNBUFFERED=1`` so output streams line by line, then ``extra``.
    """
    env = dict(config.environ_snapshot() if base is None else base)
    env.update(
        config.worker_environment(
            rank=rank,
            size=size,
            local_rank=rank if local_rank is None else local_rank,
            local_size=size if local_size is None else local_size,
            cross_rank=cross_rank,
            cross_size=cross_size,
            rendezvous_addr=rendezvous_addr,
            secret=secret,
            hostname=hostname,
            host_key=host_key,
            settings=settings,
        )
    )
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def _ranks_were(ranks: Sequence[int]) -> str:
    """``rank 0 was`` or ``ranks 0, 1 and 3 were``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]} was"
    return "ranks " + ", ".join(str(r) for r in ranks[:-1]) + f" and {ranks[-1]} were"


@dataclass(frozen=True)
class RankExit:
    """How one rank ended: its exit code (negative: killed by that signal) and its last lines.

    A rank that exited with code 0 while others were still running, and was followed by a
    failure, is a root cause too: its peers lost it. Then ``running`` names the ranks that were
    still running when it left, and ``reaction`` is the first failure that followed.
    """

    rank: int
    returncode: int
    tail: Tuple[str, ...] = ()
    running: Tuple[int, ...] = ()
    """Ranks still running when this rank exited (set for a root cause that exited with code 0)."""
    reaction: Optional["RankExit"] = None
    """The first failure after this rank left early (set for a root cause that exited with code 0)."""

    def describe(self) -> str:
        """``rank 1 exited with code 17``, ``rank 1 was killed by signal SIGKILL``, or, for a
        rank that left early, ``rank 2 exited with code 0 while ranks 0 and 1 were still running``."""
        if self.returncode < 0:
            return f"rank {self.rank} was killed by signal {_signal_name(-self.returncode)}"
        text = f"rank {self.rank} exited with code {self.returncode}"
        if self.reaction is not None:
            if self.running:
                text += f" while {_ranks_were(self.running)} still running"
            else:
                text += f" before rank {self.reaction.rank} failed"
        return text

    @property
    def exit_status(self) -> int:
        """The status a launcher exits with for this failure: the rank's code, else the reaction's, else 1."""
        if self.returncode > 0:
            return self.returncode
        if self.reaction is not None:
            return self.reaction.exit_status
        return 1


class RankProcesses:
    """The processes of one job's ranks, their output pumps and their exit watchers.

    Output lines go to ``sink`` (default :func:`print_prefixed`) and, when ``output_dir`` is
    given, unprefixed to ``output_dir/rank.<r>/stdout`` and ``.../stderr``. ``log`` receives
    one line per lifecycle event (start, stop) for verbose launchers.
    """

    def __init__(
        self,
        *,
        sink: Optional[OutputSink] = print_prefixed,
        output_dir: Optional[os.PathLike] = None,
        tail_lines: int = TAIL_LINES,
        log: Optional[Callable[[str], None]] = None,
    ) -> None:
        self._sink = sink
        self._output_dir = Path(output_dir) if output_dir is not None else None
        self._tail_lines = tail_lines
        self._log = log
        self._lock = threading.Lock()
        self._procs: Dict[int, Any] = {}  # subprocess.Popen, or warm.WarmProcess for warm ranks
        self._exited: Dict[int, threading.Event] = {}
        self._returncodes: Dict[int, int] = {}
        self._stopped: Set[int] = set()
        self._tails: Dict[int, Deque[str]] = {}
        self._exits: "queue.Queue[Tuple[int, int]]" = queue.Queue()
        self._consumed: Set[int] = set()  # ranks whose exit wait() has already seen
        self._left_early: List[int] = []  # ranks that exited 0 on their own, in the order wait() saw them
        self._failure: Optional[RankExit] = None  # the first rank seen to fail on its own
        self._pumps: List[threading.Thread] = []
        self._supervised = supervise.available()
        self._warm: Set[int] = set()  # ranks forked from a warm process (no supervisor)
        self._control: Dict[int, IO[bytes]] = {}  # standard input of ranks on other hosts (see spawn)

    # -- starting -------------------------------------------------------------------------------

    def spawn(self, rank: int, argv: Sequence[str], env: Mapping[str, str], cwd: Optional[str] = None,
              starter: Optional["WarmStarter"] = None, control: Optional[bytes] = None) -> int:
        """Start ``argv`` as ``rank`` with exactly ``env``; return the pid of the process started.

        The rank runs in its own session, so signals reach its whole process group. On Linux it
        runs under a supervisor (whose pid is returned) that ends everything the rank started
        when the rank ends, and ends the rank and all of that when the thread that called
        ``spawn`` exits: call it from a thread that outlives the job, such as the main thread.

        With ``starter`` (a :class:`~spark_hvd.runner.warm.WarmStarter`), ``argv`` must be the
        worker's command line (``[python, "-m", "spark_hvd.runner.worker", DIR]``) and the rank is
        forked from that warm process instead, which plays the supervisor's part; when the warm
        process cannot fork it, the rank starts as a fresh interpreter (said on stderr).

        With ``control`` (a rank on another host: ``argv`` is the SSH command that runs
        :mod:`spark_hvd.runner.remote` there), ``control`` is written to the process's standard
        input, which stays open: signals for the rank travel on it as ``signal N`` lines, and
        closing it (or this process ending) stops the rank over there.
        """
        if rank in self._procs:
            raise ValueError(f"rank {rank} was already started; expected each rank to be spawned once")
        files = self._open_output_files(rank)
        try:
            proc: Any = None
            if starter is not None:
                try:
                    proc = starter.start(argv, env, cwd)
                    self._warm.add(rank)
                except WarmStartError as exc:
                    sys.stderr.write(f"spark-hvd: rank {rank} starts a fresh interpreter: {exc}\n")
            if proc is None:
                command = list(argv)
                if self._supervised:
                    command = supervise.command_line(command, os.getpid(), TERMINATE_GRACE_SECONDS)
                proc = subprocess.Popen(
                    command,
                    env=dict(env),
                    cwd=cwd,
                    stdin=subprocess.DEVNULL if control is None else subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
        except BaseException:
            for file in files.values():
                if file is not None:
                    file.close()
            raise
        if control is not None:
            self._control[rank] = proc.stdin
            self._write_control(rank, control)
        with self._lock:
            self._procs[rank] = proc
            self._exited[rank] = threading.Event()
            self._tails[rank] = collections.deque(maxlen=self._tail_lines)
        assert proc.stdout is not None and proc.stderr is not None
        for stream, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            pump = threading.Thread(
                target=self._pump, args=(rank, stream, pipe, files[stream]), name=f"rank{rank}-{stream}", daemon=True
            )
            pump.start()
            self._pumps.append(pump)
        threading.Thread(target=self._watch, args=(rank, proc), name=f"rank{rank}-exit", daemon=True).start()
        if self._log:
            self._log(f"started rank {rank} (pid {proc.pid}): {' '.join(argv)}")
        return proc.pid

    def _open_output_files(self, rank: int) -> Dict[str, Optional[IO[bytes]]]:
        if self._output_dir is None:
            return {"stdout": None, "stderr": None}
        paths = {name: rank_output_path(self._output_dir, str(rank), name) for name in ("stdout", "stderr")}
        paths["stdout"].parent.mkdir(parents=True, exist_ok=True)
        # Unbuffered, so the files are complete up to the last line even if we are killed.
        return {name: open(path, "wb", buffering=0) for name, path in paths.items()}

    def _pump(self, rank: int, stream: str, pipe: IO[bytes], file: Optional[IO[bytes]]) -> None:
        sink = self._sink
        try:
            # Bounded reads: a rank that never ends a line must not grow our memory without limit.
            for raw in iter(lambda: pipe.readline(MAX_LINE_BYTES), b""):
                if file is not None:
                    file.write(raw if raw.endswith(b"\n") else raw + b"\n")
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                self._tails[rank].append(f"[{rank}]<{stream}>:{line}")
                if sink is not None:
                    try:
                        sink(rank, stream, line)
                    except Exception:
                        # A broken sink must not stop the draining, or the rank blocks on a full pipe.
                        sink = None
        finally:
            pipe.close()
            if file is not None:
                file.close()

    def _watch(self, rank: int, proc: "subprocess.Popen[bytes]") -> None:
        code = proc.wait()
        with self._lock:
            self._returncodes[rank] = code
        self._exited[rank].set()
        self._exits.put((rank, code))

    # -- observing ------------------------------------------------------------------------------

    @property
    def ranks(self) -> List[int]:
        """Every rank started so far, in rank order."""
        return sorted(self._procs)

    @property
    def returncodes(self) -> Dict[int, int]:
        """Exit codes of the ranks that have exited so far (negative: killed by that signal)."""
        with self._lock:
            return dict(self._returncodes)

    @property
    def stopped(self) -> List[int]:
        """Ranks this object signalled to stop while they were still running."""
        with self._lock:
            return sorted(self._stopped)

    def running(self) -> List[int]:
        """Ranks that have not exited yet."""
        with self._lock:
            return sorted(r for r in self._procs if r not in self._returncodes)

    def pid(self, rank: int) -> int:
        """The pid of the process started for ``rank``: its supervisor where ranks are supervised."""
        return self._procs[rank].pid

    def tail(self, rank: int) -> List[str]:
        """The last lines of a rank's output, prefixed as they were printed."""
        return list(self._tails[rank])

    # -- waiting and stopping -------------------------------------------------------------------

    def wait(self, timeout: Optional[float] = None, grace: float = TERMINATE_GRACE_SECONDS) -> Optional[RankExit]:
        """Wait for every rank; once one fails, stop the others and return the root cause.

        The root cause is the first rank to exit with code 0 while others still ran, when a
        failure followed (its peers lost it; the failure comes back as its ``reaction``), else
        the first rank to fail. A rank that exits 0 within :data:`LEAVER_WAIT_SECONDS` after the
        failure still counts as having left first: the others run on for that long before they
        are stopped. Returns None when every rank exited on its own with code 0; ranks this
        object stopped are never the root cause. Raises TimeoutError, leaving the ranks running,
        when ``timeout`` seconds pass first; call again to go on waiting.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        leavers_until: Optional[float] = None
        pending = set(self._procs) - self._consumed
        while pending:
            now = time.monotonic()
            if self._failure is not None:
                leavers_until = leavers_until or now + LEAVER_WAIT_SECONDS
                if now >= leavers_until:
                    break
                wait_s = min(0.5, leavers_until - now)
            elif deadline is None:
                wait_s = 0.5
            else:
                wait_s = min(0.5, deadline - now)
                if wait_s <= 0:
                    raise TimeoutError(
                        f"ranks {sorted(pending)} were still running after {timeout} s"
                    )
            try:
                # Short slices keep the caller responsive to signals.
                rank, code = self._exits.get(timeout=wait_s)
            except queue.Empty:
                continue
            pending.discard(rank)
            self._consumed.add(rank)
            with self._lock:
                stopped_by_us = rank in self._stopped
            if stopped_by_us:
                continue
            if code == 0:
                self._left_early.append(rank)
            elif self._failure is None:
                self._failure = RankExit(rank, code)
                if self._log:
                    self._log(f"rank {rank} failed (code {code}); stopping the other ranks in "
                              f"{LEAVER_WAIT_SECONDS} s unless they end")
        if self._failure is None:
            self._join_pumps()
            return None
        self.terminate(grace=grace)
        self._join_pumps()
        return self._root_cause(self._failure)

    def _root_cause(self, failure: RankExit) -> RankExit:
        failure = RankExit(failure.rank, failure.returncode, tuple(self.tail(failure.rank)))
        if not self._left_early:
            return failure
        first = self._left_early[0]
        running = tuple(r for r in self.ranks if r != first)
        return RankExit(first, 0, tuple(self.tail(first)), running=running, reaction=failure)

    def next_exit(self, timeout: float) -> Optional[Tuple[int, int]]:
        """The next rank to exit and its exit code, stopping nobody (an elastic launcher decides
        itself what an exit means); None when none exits within ``timeout`` seconds."""
        try:
            rank, code = self._exits.get(timeout=timeout)
        except queue.Empty:
            return None
        self._consumed.add(rank)
        return rank, code

    def send_signal(self, signum: int, ranks: Optional[Sequence[int]] = None) -> List[int]:
        """Send ``signum`` to the process group of every running rank (or of those of ``ranks``
        still running); mark them as stopped by us.

        ``signum`` is SIGKILL or one of :data:`spark_hvd.runner.supervise.FORWARDED_SIGNALS`
        (SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2, SIGALRM).
        """
        if signum != signal.SIGKILL and signum not in supervise.FORWARDED_SIGNALS:
            names = ", ".join(_signal_name(s) for s in sorted(supervise.FORWARDED_SIGNALS))
            raise ValueError(f"signal {_signal_name(signum)} cannot be passed on to ranks; expected SIGKILL or one of "
                             f"{names}")
        with self._lock:
            running = [r for r in self._procs if r not in self._returncodes and (ranks is None or r in ranks)]
            self._stopped.update(running)
        for rank in running:
            self._signal(rank, signum)
        return running

    def terminate(self, signum: int = signal.SIGTERM, grace: float = TERMINATE_GRACE_SECONDS,
                  ranks: Optional[Sequence[int]] = None) -> List[int]:
        """Stop every running rank (or those of ``ranks``): ``signum``, up to ``grace`` seconds,
        then SIGKILL.

        Returns the ranks that were still running. Safe to call more than once.
        """
        running = self.send_signal(signum, ranks)
        if running and self._log:
            self._log(f"sent {signal.Signals(signum).name} to ranks {running}")
        deadline = time.monotonic() + grace
        for rank in running:
            self._exited[rank].wait(max(0.0, deadline - time.monotonic()))
        stubborn = [rank for rank in running if not self._exited[rank].is_set()]
        for rank in stubborn:
            self._signal(rank, signal.SIGKILL)
        if stubborn and self._log:
            self._log(f"killed ranks {stubborn} after a grace period of {grace} s")
        deadline = time.monotonic() + _KILL_WAIT_SECONDS
        for rank in stubborn:
            self._exited[rank].wait(max(0.0, deadline - time.monotonic()))
        if self._supervised:
            for rank in stubborn:
                if rank not in self._warm and not self._exited[rank].is_set():
                    # The supervisor did not act on KILL_NOW; its rank dies with it (parent-death signal).
                    self._procs[rank].kill()
                    self._exited[rank].wait(_KILL_WAIT_SECONDS)
        return running

    def _write_control(self, rank: int, data: bytes) -> bool:
        pipe = self._control[rank]
        try:
            pipe.write(data)
            pipe.flush()
        except (BrokenPipeError, ValueError, OSError):
            return False
        return True

    def _signal(self, rank: int, signum: int) -> None:
        proc = self._procs[rank]
        if rank in self._control and signum != signal.SIGKILL and \
                self._write_control(rank, f"signal {int(signum)}\n".encode()):
            return  # the rank's host passes it on; SIGKILL ends the connection, which stops the rank there
        if rank in self._warm:
            proc.send_signal(signum)  # to the rank's process group
            return
        if self._supervised:
            # The supervisor passes the signal on to the rank's process group. SIGKILL would end
            # the supervisor itself and strand what the rank started: ask it to kill instead.
            assert supervise.KILL_NOW is not None
            try:
                proc.send_signal(supervise.KILL_NOW if signum == signal.SIGKILL else signum)
            except ProcessLookupError:
                pass
            return
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass
        except PermissionError:
            # The rank left its process group for one we may not signal; reach at least the rank.
            try:
                proc.send_signal(signum)
            except ProcessLookupError:
                pass

    def _join_pumps(self) -> None:
        deadline = time.monotonic() + _PUMP_JOIN_SECONDS
        for pump in self._pumps:
            pump.join(max(0.0, deadline - time.monotonic()))

    def close(self, grace: float = TERMINATE_GRACE_SECONDS) -> None:
        """Stop what still runs and finish streaming output; nothing outlives this call."""
        self.terminate(grace=grace)
        for pipe in self._control.values():
            try:
                pipe.close()
            except OSError:
                pass
        self._join_pumps()

    def __enter__(self) -> "RankProcesses":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
