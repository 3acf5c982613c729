"""Rank supervisor: runs one rank's command and, however it ends, ends everything the rank started.

On Linux, :class:`~spark_hvd.runner.processes.RankProcesses` starts each rank through this
module, in an isolated interpreter that imports nothing else (see :func:`command_line`), as in::

    python -I -S supervise.py LAUNCHER_PID GRACE_SECONDS -- COMMAND [ARG ...]

The supervisor makes itself a child subreaper, so a process orphaned anywhere below it (a
daemon that double-forked, the children of a rank that died) is re-parented to it instead of to
init, and it asks the kernel for :data:`PARENT_DIED` when the launcher thread that started it
dies, SIGKILL included. It starts the rank in a session of its own, set to be SIGKILLed should
the supervisor itself die, then waits for signals:

- a signal in :data:`FORWARDED_SIGNALS` goes on to the rank's process group;
- :data:`PARENT_DIED`, or finding the launcher gone, stops the rank: SIGTERM to its process
  group, up to GRACE_SECONDS, then SIGKILL;
- :data:`KILL_NOW`, the launcher's last step of stopping a rank, SIGKILLs it at once.

Once the rank has exited, every process left below the supervisor gets SIGTERM, and SIGKILL when
GRACE_SECONDS have passed, round after round until none is left (a process that dies hands its
own children to the supervisor). The supervisor then exits as the rank did, with its exit code or
by raising the signal that killed it on itself, so a launcher reports the rank's own fate.

Only the standard library is imported, and no more of it than needed: this process is started
once per rank and its start-up is on the path to the rank's first line of output.
"""

from __future__ import annotations

import os
import sys
import time

try:
    # The C module: `signal` adds enum, which would double this process's start-up time.
    import _signal as _sig
except ImportError:  # interpreters without CPython's module layout
    import signal as _sig  # type: ignore[no-redef]

# typing is not imported at run time (start-up cost, see above); type checkers read this block.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Optional

    _Prctl = Optional[Callable[..., int]]

__all__ = ["FORWARDED_SIGNALS", "KILL_NOW", "PARENT_DIED", "available", "command_line", "main"]

_RTMIN = getattr(_sig, "SIGRTMIN", None)

PARENT_DIED = None if _RTMIN is None else int(_RTMIN) + 1
"""Delivered to the supervisor when the launcher thread that started it dies (Linux)."""

KILL_NOW = None if _RTMIN is None else int(_RTMIN) + 2
"""Sent by a launcher: SIGKILL the rank and everything below it now."""

FORWARDED_SIGNALS = frozenset(
    int(_sig.__dict__[name]) for name in
    ("SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGALRM") if name in _sig.__dict__
)
"""Signals a launcher may send to a supervised rank; the supervisor passes them to its process group."""

# Signals that cannot be caught, or that the kernel raises on a fault of our own, stay unblocked.
_UNBLOCKABLE = frozenset(
    int(_sig.__dict__[name]) for name in
    ("SIGKILL", "SIGSTOP", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGSYS", "SIGABRT")
    if name in _sig.__dict__
)

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36

# Between signals, how often the launcher's presence is checked (a backstop for PARENT_DIED).
_POLL_SECONDS = 1.0
# How long processes that were SIGKILLed may take to go; a process stuck in the kernel is left.
_KILL_WAIT_SECONDS = 10.0
_EXEC_FAILED = 127
_EXIT_CODE_1 = 1 << 8  # the wait status of a process that exited with code 1

_USAGE = "usage: supervise.py LAUNCHER_PID GRACE_SECONDS -- COMMAND [ARG ...] (started by spark_hvd.runner)"


def available() -> bool:
    """Whether ranks can be supervised here: Linux (subreapers, parent-death signals) and this file on disk."""
    return (sys.platform.startswith("linux") and KILL_NOW is not None and bool(sys.executable)
            and os.path.isfile(__file__))


# Imported rather than run as a script, so its compiled form is cached; appended to sys.path,
# so nothing in this directory can stand in for a standard module.
_BOOTSTRAP = "import sys; sys.path.append(sys.argv[1]); import supervise; sys.exit(supervise.main(sys.argv[2:]))"


def command_line(command: list[str], launcher_pid: int, grace: float) -> list[str]:
    """The argv that runs ``command`` under a supervisor for the launcher process ``launcher_pid``.

    ``-I -S``: the supervisor needs neither the user's environment nor site-packages, and
    skipping them keeps its start-up short; the rank still gets the environment unchanged.
    """
    return [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, os.path.dirname(os.path.abspath(__file__)),
            str(launcher_pid), repr(float(grace)), "--", *command]


def _parse(argv: list[str]) -> tuple[int, float, list[str]]:
    if len(argv) < 4 or argv[2] != "--":
        raise ValueError(f"expected LAUNCHER_PID GRACE_SECONDS -- COMMAND, got {argv!r}")
    try:
        launcher_pid, grace = int(argv[0]), float(argv[1])
    except ValueError:
        raise ValueError(f"LAUNCHER_PID {argv[0]!r} and GRACE_SECONDS {argv[1]!r} must be numbers") from None
    if launcher_pid < 1 or not grace >= 0:
        raise ValueError(f"expected LAUNCHER_PID >= 1 and GRACE_SECONDS >= 0, got {launcher_pid} and {grace}")
    return launcher_pid, grace, argv[3:]


def _load_prctl() -> _Prctl:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (ImportError, OSError, AttributeError):
        return None


def _start_rank(command: list[str], prctl: _Prctl) -> int:
    supervisor = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    # The child: whatever happens here must end in exec or _exit, never back in the supervisor's loop.
    try:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(_sig.SIGKILL), 0, 0, 0)
        if os.getppid() != supervisor:
            os._exit(_EXEC_FAILED)  # the supervisor died before the death signal was armed
        os.setsid()
        # As a fresh process would have them: Python ignores these two, and ignoring survives exec.
        for name in ("SIGPIPE", "SIGXFSZ"):
            if name in _sig.__dict__:
                _sig.signal(_sig.__dict__[name], _sig.SIG_DFL)
        _sig.pthread_sigmask(_sig.SIG_SETMASK, ())
        os.execvp(command[0], command)
    except OSError as exc:
        _say(f"cannot run {command[0]!r}: {exc.strerror or exc}")
    finally:
        os._exit(_EXEC_FAILED)


def _say(message: str) -> None:
    """One line on stderr, which is the rank's: the launcher shows it among the rank's output."""
    try:
        os.write(2, f"spark-hvd: {message}\n".encode("utf-8", "replace"))
    except OSError:
        pass


def _children() -> list[int]:
    """Pids of this process's children (after ``_reap``, none of them a zombie we could reap)."""
    pid = os.getpid()
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except OSError:  # kernels built without CONFIG_PROC_CHILDREN
        pass
    found = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(name))
    return found


def _send(pid: int, signum: int, group: bool = False) -> None:
    try:
        if group:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


class _Supervision:
    """The state of one supervised rank: its pid, its wait status once it ended, how far stopping got."""

    def __init__(self, rank_pid: int, launcher_pid: int, grace: float, watched: set[int]) -> None:
        self.rank_pid = rank_pid
        self.launcher_pid = launcher_pid
        self.grace = grace
        self.watched = watched
        self.rank_status: int | None = None
        self.kill_at: float | None = None  # set when the rank is asked to stop: SIGKILL follows then
        self.killing = False

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                if self.rank_status is None:
                    # Someone else reaped the rank; waiting on would never end.
                    _say("the rank's exit status was lost; reporting exit code 1")
                    self.rank_status = _EXIT_CODE_1
                return
            if pid == 0:
                return
            if pid == self.rank_pid:
                self.rank_status = status

    def _stop(self) -> None:
        if self.kill_at is None:
            self.kill_at = time.monotonic() + self.grace
            _send(self.rank_pid, int(_sig.SIGTERM), group=True)

    def _kill(self) -> None:
        self.killing = True
        _send(self.rank_pid, int(_sig.SIGKILL), group=True)

    def _next_signal(self, timeout: float) -> int | None:
        info = _sig.sigtimedwait(self.watched, max(0.0, timeout))
        return None if info is None else info.si_signo

    def wait_for_rank(self) -> None:
        """Pass signals on to the rank until it has exited; stop it if the launcher goes."""
        give_up_at: float | None = None
        while True:
            self._reap()
            if self.rank_status is not None:
                return
            now = time.monotonic()
            if self.kill_at is None and os.getppid() != self.launcher_pid:
                self._stop()  # the launcher is gone, whatever became of its death signal
            if not self.killing and self.kill_at is not None and now >= self.kill_at:
                self._kill()
            if self.killing:
                give_up_at = give_up_at or now + _KILL_WAIT_SECONDS
                if now >= give_up_at:
                    return
            timeout = _POLL_SECONDS
            if self.kill_at is not None and not self.killing:
                timeout = min(timeout, self.kill_at - now)
            signum = self._next_signal(timeout)
            if signum == PARENT_DIED:
                self._stop()
            elif signum == KILL_NOW:
                self._kill()
            elif signum in FORWARDED_SIGNALS:
                _send(self.rank_pid, signum, group=True)

    def clear_descendants(self) -> None:
        """End every process left below us: SIGTERM, SIGKILL after the grace period, until none is left."""
        term_until = time.monotonic() + (0.0 if self.killing else self.grace)
        give_up_at = term_until + _KILL_WAIT_SECONDS
        # Members of the rank's group whose parents still live are reached through the group.
        _send(self.rank_pid, int(_sig.SIGKILL if self.killing else _sig.SIGTERM), group=True)
        asked: set[int] = set()
        while True:
            self._reap()
            children = _children()
            now = time.monotonic()
            if not children or now >= give_up_at:
                return
            if self.killing or now >= term_until:
                self.killing = True
                _send(self.rank_pid, int(_sig.SIGKILL), group=True)
                for pid in children:
                    _send(pid, int(_sig.SIGKILL))
                timeout = give_up_at - now
            else:
                for pid in children:
                    if pid not in asked:
                        _send(pid, int(_sig.SIGTERM))
                        asked.add(pid)
                timeout = term_until - now
            # A child's death (SIGCHLD) is also when its own children become ours: look again then.
            if self._next_signal(min(_POLL_SECONDS, timeout)) == KILL_NOW:
                self.killing = True


def _exit_as(status: int | None) -> None:
    """Leave with the rank's wait status: its exit code, or death by the same signal."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    if status is None:
        os._exit(1)  # the rank never ended: it was SIGKILLed and is stuck in the kernel
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if os.WCOREDUMP(status):
            import resource

            # The rank dumped its core already; a second, of the supervisor, would only mislead.
            resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
        try:
            _sig.signal(signum, _sig.SIG_DFL)
        except (OSError, ValueError):
            pass  # SIGKILL has no handler to reset
        os.kill(os.getpid(), signum)
        _sig.pthread_sigmask(_sig.SIG_UNBLOCK, {signum})
        os._exit(128 + signum)  # reached only for a signal whose default action is not to terminate
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def main(argv: list[str] | None = None) -> int:
    """Supervise one rank; exits as the rank did. Returns 2 only for a malformed command line."""
    try:
        launcher_pid, grace, command = _parse(sys.argv[1:] if argv is None else list(argv))
    except ValueError as exc:
        print(f"{_USAGE}\nerror: {exc}", file=sys.stderr)
        return 2
    # Every signal that could end or stop us is taken through sigtimedwait (ones we do not act on
    # are dropped): a supervisor that died would strand what the rank started. Blocked before
    # the death signal is armed, so that one cannot kill us either.
    watched = set(_sig.valid_signals()) - _UNBLOCKABLE
    _sig.pthread_sigmask(_sig.SIG_BLOCK, watched)
    # An ignored SIGCHLD, inherited across exec from a launcher that ignores it, would have the
    # kernel reap our children unseen, the rank's exit status with them.
    _sig.signal(_sig.SIGCHLD, _sig.SIG_DFL)
    prctl = _load_prctl()
    if prctl is not None and PARENT_DIED is not None:
        prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        prctl(_PR_SET_PDEATHSIG, PARENT_DIED, 0, 0, 0)
    if os.getppid() != launcher_pid:
        return 1  # the launcher died before the death signal was armed: start nothing
    supervision = _Supervision(_start_rank(command, prctl), launcher_pid, grace, watched)
    supervision.wait_for_rank()
    supervision.clear_descendants()
    _exit_as(supervision.rank_status)
    return 1


if __name__ == "__main__":
    sys.exit(main())
