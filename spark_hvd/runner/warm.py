"""Warm rank starts: rank processes forked from a process that has imported the framework once.

A rank normally starts as a fresh interpreter (``python -m spark_hvd.runner.worker DIR``), and a
fresh interpreter pays for its imports again: ``import torch`` takes 1.2-1.5 s on a 2-core machine
and the first optimizer step adds ``torch._dynamo``, about 1 s more, in every rank of every job. A
:class:`WarmStarter` is a child process (the *warm process*) that imports the named modules once
and then forks one child per rank on request; the child becomes the rank as the fresh interpreter
would have, with:

- exactly the environment, working directory and ``sys.argv`` the fresh interpreter would have;
- stdin from ``/dev/null`` and stdout/stderr on pipes of the launcher's (passed over the control
  socket), written through line by line as with ``PYTHONUNBUFFERED=1``;
- a session of its own (signals reach its process group, as for a supervised rank), and SIGKILL
  when the warm process dies;
- Ctrl-C (SIGINT) as a fresh interpreter takes it: Python's handler, or ignored where the
  launcher ignores it (started in the background or under ``nohup``);
- the name ``hvd-rank<r>`` (:data:`RANK_PROCESS_NAME`) in ``ps`` and ``top``;
- Python's ``random`` and numpy's global generator reseeded, so forked ranks do not share draws.

The warm process talks to its launcher over an anonymous ``socketpair`` made at its start (no
listening socket: only the launcher holds the other end). It ends when the launcher closes the
pair, when the launcher thread that started it dies (parent-death signal) or when asked; a rank
still running then is killed with its process group. When a rank exits, what is left in its
process group gets SIGTERM and, after a grace period, SIGKILL.

The warm process is only as fresh as its imports: it is keyed by the interpreter, the modules, the
working directory and the environment less the variables of one job (``SPARK_HVD_*``,
``HOROVOD_*``, ``CUDA_VISIBLE_DEVICES``), so a rank never runs with imports made under settings
other than its own. Linux only (parent-death signal); elsewhere :func:`available` is False.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, IO, List, Mapping, Optional, Sequence, Tuple

__all__ = ["WarmStarter", "WarmProcess", "WarmStartError", "available", "environment_key", "starter_for",
           "starter_or_none", "check_preload", "close_starters", "serve", "JOB_VARIABLE_PREFIXES", "RANK_PROCESS_NAME"]

JOB_VARIABLE_PREFIXES = ("SPARK_HVD_", "HOROVOD_", "CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED")
"""Environment variables of one job or one rank: read when a rank runs, not when a module is
imported, so they do not decide which warm process may fork a rank."""

READY_TIMEOUT_S = 300.0
"""How long a warm process may take to import its modules (TensorFlow on a slow disk)."""

RANK_PROCESS_NAME = "hvd-rank"
"""Name (``/proc/PID/comm``, what ps and top show) of a rank forked from a warm process, followed by
its rank: its command line and ``/proc/PID/environ`` stay the warm process's."""

IDLE_EXIT_S = 600.0
"""A warm process with no rank running ends after this many seconds without a request."""

_REPLY_TIMEOUT_S = 30.0
_MESSAGE_LIMIT = 4 << 20
_GRACE_S = 3.0
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_WORKER_ARGV = ("-m", "spark_hvd.runner.worker")
# The warm process's command: imported, not run with ``-m``, which would execute this module a
# second time as ``__main__`` (the package imports it) and warn about it on every executor.
_BOOT = "import sys; from spark_hvd.runner.warm import serve; sys.exit(serve(sys.argv[1:]))"


class WarmStartError(RuntimeError):
    """The warm process could not start (a module failed to import) or stopped answering."""


def available() -> bool:
    """Whether ranks can be forked from a warm process here (Linux, with ``prctl``)."""
    return sys.platform.startswith("linux") and _prctl() is not None


def _prctl() -> Optional[Callable[..., int]]:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def environment_key(env: Mapping[str, str]) -> Dict[str, str]:
    """``env`` without the variables of one job (:data:`JOB_VARIABLE_PREFIXES`)."""
    return {k: v for k, v in env.items() if not k.startswith(JOB_VARIABLE_PREFIXES)}


def _send(sock: socket.socket, message: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def _receive(sock: socket.socket, max_fds: int = 0) -> Tuple[Optional[Dict[str, Any]], List[int]]:
    """One message (None at end of stream) and the descriptors that came with it."""
    if max_fds:
        data, fds, _flags, _addr = socket.recv_fds(sock, _MESSAGE_LIMIT, max_fds)
    else:
        data, fds = sock.recv(_MESSAGE_LIMIT), []
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), list(fds)


# ----------------------------------------------------------------------------------------------
# The launcher's side.


class WarmProcess:
    """A rank forked by a warm process: what :class:`~.processes.RankProcesses` uses of a Popen."""

    def __init__(self, pid: int, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: Optional[int] = None
        self._exited = threading.Event()

    def _set_exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"warm rank {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """Signal the rank's process group (the rank leads a session of its own)."""
        if self._exited.is_set():
            return
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmStarter:
    """A warm process: imports ``modules`` once, then forks a rank per :meth:`start`.

    ``env`` and ``cwd`` are those the ranks would start a fresh interpreter with (the warm process
    imports under :func:`environment_key` of ``env``). Raises :class:`WarmStartError` when it
    cannot start. Call from a thread that outlives the ranks: the warm process, and every rank it
    forked, ends when that thread does.
    """

    def __init__(self, python: str, modules: Sequence[str], env: Mapping[str, str], cwd: Optional[str] = None,
                 ready_timeout: float = READY_TIMEOUT_S) -> None:
        if not available():
            raise WarmStartError("warm rank starts need Linux (the parent-death signal)")
        self.python = python
        self.modules = tuple(modules)
        self.cwd = cwd
        self.key = environment_key(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._lock = threading.Lock()
        self._replies: Dict[int, Dict[str, Any]] = {}
        self._early_exits: Dict[int, int] = {}  # exits that overtook the reply to start()
        self._replied = threading.Condition(self._lock)
        self._ranks: Dict[int, WarmProcess] = {}
        self._next_id = 0
        self._closed = False
        try:
            self._proc = subprocess.Popen(
                [python, "-c", _BOOT, str(theirs.fileno()), *self.modules],
                env=dict(self.key), cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
            )
        finally:
            theirs.close()
        try:
            ready = self._await_ready(ready_timeout)
        except BaseException:
            self.close()
            raise
        self.pid = int(ready["pid"])
        threading.Thread(target=self._read, name="spark-hvd-warm-replies", daemon=True).start()

    def _await_ready(self, timeout: float) -> Dict[str, Any]:
        readable, _, _ = select.select([self._sock], [], [], timeout)
        if not readable:
            raise WarmStartError(f"the warm process did not import {', '.join(self.modules)} within {timeout:.0f} s")
        message, _ = _receive(self._sock)
        if message is None:
            code = self._proc.wait(timeout=_REPLY_TIMEOUT_S)
            raise WarmStartError(f"the warm process ({self.python}, spark_hvd.runner.warm) exited with code "
                                 f"{code} before it was ready")
        if "error" in message:
            raise WarmStartError(f"the warm process could not import {', '.join(self.modules)}: {message['error']}")
        return message

    @property
    def alive(self) -> bool:
        return not self._closed and self._proc.poll() is None

    def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: Optional[str] = None) -> WarmProcess:
        """Fork a rank running ``argv`` (``[python, "-m", "spark_hvd.runner.worker", DIR]``) with
        exactly ``env``; raises WarmStartError when the warm process does not answer."""
        if len(argv) != 4 or tuple(argv[1:3]) != _WORKER_ARGV:
            raise ValueError(f"argv={list(argv)!r} cannot start warm: expected [python, '-m', "
                             "'spark_hvd.runner.worker', DIR]")
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            with self._lock:
                if not self.alive:
                    raise WarmStartError("the warm process has ended")
                request_id = self._next_id
                self._next_id += 1
            _send(self._sock, {"op": "start", "id": request_id, "workdir": argv[3], "env": dict(env),
                               "cwd": cwd or self.cwd or os.getcwd()}, [out_w, err_w])
        except OSError as exc:
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
            raise WarmStartError(f"the warm process stopped answering: {exc}") from None
        except BaseException:
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
            raise
        os.close(out_w)
        os.close(err_w)
        stdout, stderr = os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb")
        deadline = time.monotonic() + _REPLY_TIMEOUT_S
        with self._replied:
            while request_id not in self._replies and self.alive and time.monotonic() < deadline:
                self._replied.wait(0.1)
            reply = self._replies.pop(request_id, None)
            if reply is not None and "pid" in reply:
                process = WarmProcess(int(reply["pid"]), stdout, stderr)
                if request_id in self._early_exits:
                    process._set_exit(self._early_exits.pop(request_id))
                else:
                    self._ranks[request_id] = process
                return process
        stdout.close()
        stderr.close()
        why = reply.get("error") if reply else "no answer within {:.0f} s".format(_REPLY_TIMEOUT_S)
        raise WarmStartError(f"the warm process could not fork a rank: {why}")

    def _read(self) -> None:
        while True:
            try:
                message, _ = _receive(self._sock)
            except OSError:
                message = None
            if message is None:
                break
            with self._replied:
                request_id = int(message["id"])
                if "exit" in message:
                    process = self._ranks.pop(request_id, None)
                    if process is not None:
                        process._set_exit(int(message["exit"]))
                    else:
                        self._early_exits[request_id] = int(message["exit"])
                else:
                    self._replies[request_id] = message
                self._replied.notify_all()
        # The warm process is gone, and its ranks with it (parent-death signal).
        with self._replied:
            self._closed = True
            for process in self._ranks.values():
                process._set_exit(-int(signal.SIGKILL))
            self._ranks.clear()
            self._replied.notify_all()

    def close(self, timeout: float = 10.0) -> None:
        """End the warm process; ranks it forked that still run are killed with their groups."""
        with self._lock:
            self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


_starters: Dict[str, WarmStarter] = {}
_starters_lock = threading.Lock()
_MAX_STARTERS = 2


def starter_for(python: str, modules: Sequence[str], env: Mapping[str, str],
                cwd: Optional[str] = None) -> WarmStarter:
    """This process's warm process for ranks of ``python`` that import ``modules`` under ``env``,
    started on first use and kept for later jobs; the least recently used of more than two ends."""
    cwd = cwd or os.getcwd()
    key = hashlib.sha256(json.dumps([python, list(modules), cwd, sorted(environment_key(env).items())])
                         .encode()).hexdigest()
    with _starters_lock:
        starter = _starters.pop(key, None)
        if starter is not None and not starter.alive:
            starter.close()
            starter = None
        if starter is None:
            starter = WarmStarter(python, modules, env, cwd)
        _starters[key] = starter  # the most recently used last
        while len(_starters) > _MAX_STARTERS:
            oldest = next(iter(_starters))
            _starters.pop(oldest).close()
        return starter


def check_preload(preload: Any) -> Tuple[str, ...]:
    """``preload`` as a tuple of module names; ValueError for anything else (a lone string included)."""
    if isinstance(preload, (str, bytes)) or not isinstance(preload, (tuple, list)) or \
            not all(isinstance(m, str) and m for m in preload):
        raise ValueError(f"preload={preload!r} is not valid: expected a sequence of module names, e.g. ('torch',)")
    return tuple(preload)


def starter_or_none(python: str, preload: Sequence[str], env: Mapping[str, str],
                    cwd: Optional[str] = None) -> Optional[WarmStarter]:
    """:func:`starter_for` the ranks of a job that preloads ``preload``, or None where they start
    fresh interpreters: nothing to preload, ``SPARK_HVD_WARM_START=0`` in ``env``, not Linux, or
    the warm process failed to start (said on stderr)."""
    from spark_hvd.runtime import config

    if not preload or not available() or not config.read_setting("warm_start", env):
        return None
    try:
        return starter_for(python, preload, env, cwd)
    except WarmStartError as exc:
        sys.stderr.write(f"spark-hvd: ranks start fresh interpreters: {exc}\n")
        return None


def close_starters() -> None:
    """End every warm process this process started."""
    with _starters_lock:
        while _starters:
            _starters.popitem()[1].close()


# ----------------------------------------------------------------------------------------------
# The warm process.


class _Zygote:
    def __init__(self, sock: socket.socket, idle_exit_s: float = IDLE_EXIT_S) -> None:
        self.sock = sock
        self.idle_exit_s = idle_exit_s
        self.ranks: Dict[int, int] = {}  # pid -> request id
        self.reaped: List[Tuple[float, int]] = []  # (SIGKILL due, process group) of ranks that exited
        self.wake: Tuple[int, ...] = ()

    def serve(self) -> None:
        wake_r, wake_w = os.pipe()
        self.wake = (wake_r, wake_w)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: self._end(0))
        try:
            idle_since = time.monotonic()
            while True:
                now = time.monotonic()
                if self.ranks:
                    idle_since = now
                elif now - idle_since >= self.idle_exit_s:
                    break
                timeout = idle_since + self.idle_exit_s - now
                if self.reaped:
                    timeout = min(timeout, max(0.0, self.reaped[0][0] - now))
                readable, _, _ = select.select([self.sock, wake_r], [], [], timeout)
                if wake_r in readable:
                    os.read(wake_r, 4096)
                self._reap()
                self._kill_leftovers()
                if self.sock in readable:
                    message, fds = _receive(self.sock, max_fds=2)
                    if message is None:
                        break
                    idle_since = time.monotonic()
                    self._start(message, fds)
        finally:
            self._end(None)

    def _start(self, message: Dict[str, Any], fds: List[int]) -> None:
        request_id = int(message["id"])
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            _send(self.sock, {"id": request_id, "error": f"expected 2 descriptors, got {len(fds)}"})
            return
        try:
            pid = os.fork()
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            _send(self.sock, {"id": request_id, "error": f"fork failed: {exc}"})
            return
        if pid == 0:
            _become_rank(self.sock, self.wake, message, fds)  # never returns
        for fd in fds:
            os.close(fd)
        self.ranks[pid] = request_id
        _send(self.sock, {"id": request_id, "pid": pid})

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            request_id = self.ranks.pop(pid, None)
            if request_id is None:
                continue
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            self._signal_group(pid, signal.SIGTERM)
            self.reaped.append((time.monotonic() + _GRACE_S, pid))
            try:
                _send(self.sock, {"id": request_id, "exit": code})
            except OSError:
                pass

    def _kill_leftovers(self) -> None:
        now = time.monotonic()
        while self.reaped and self.reaped[0][0] <= now:
            _, group = self.reaped.pop(0)
            self._signal_group(group, signal.SIGKILL)

    @staticmethod
    def _signal_group(group: int, signum: int) -> None:
        try:
            os.killpg(group, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def _end(self, code: Optional[int]) -> None:
        for pid in list(self.ranks):
            self._signal_group(pid, signal.SIGKILL)
        for _, group in self.reaped:
            self._signal_group(group, signal.SIGKILL)
        os._exit(0 if code is None else code)


def _become_rank(control: socket.socket, wake: Sequence[int], message: Dict[str, Any], fds: List[int]) -> None:
    """In the forked child: turn into ``python -m spark_hvd.runner.worker DIR``, then exit."""
    code = 1
    try:
        control.close()
        signal.set_wakeup_fd(-1)
        for fd in wake:
            os.close(fd)
        for signum in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)
        # Ctrl-C as a fresh interpreter takes it: Python's handler, unless the launcher ignored
        # SIGINT (started in the background or under nohup), which this process inherited.
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()
        prctl = _prctl()
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (null, *fds):
            os.close(fd)
        os.chdir(message["cwd"])
        os.environ.clear()
        os.environ.update(message["env"])
        if prctl is not None:  # what ps and top show, as the command line is the warm process's
            prctl(_PR_SET_NAME, f"{RANK_PROCESS_NAME}{os.environ.get('SPARK_HVD_RANK', '')}".encode()[:15], 0, 0, 0)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True,
                                      errors="backslashreplace")
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr  # type: ignore[misc]
        _reseed()
        from spark_hvd.runner import worker

        sys.argv = [worker.__file__, message["workdir"]]
        try:
            code = worker.main([message["workdir"]])
        except KeyboardInterrupt:
            code = 130
        worker._exit_now(code)
    except BaseException:
        try:
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(code or 1)
    os._exit(code)


def _reseed() -> None:
    """Forked ranks would otherwise all draw the warm process's numbers."""
    import random

    random.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def _serve(argv: List[str]) -> int:
    sock = socket.socket(fileno=int(argv[0]))
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() == 1:  # the launcher is already gone
            return 0
    try:
        for name in argv[1:]:
            __import__(name)
        # Forking is safe only from a process whose one Python thread is this one.
        extra = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        if extra:
            raise RuntimeError(f"importing {', '.join(argv[1:])} started threads ({', '.join(extra)}); ranks "
                               "cannot be forked from this process")
    except BaseException as exc:
        _send(sock, {"error": f"{type(exc).__name__}: {exc}"})
        return 1
    _send(sock, {"ready": True, "pid": os.getpid()})
    _Zygote(sock).serve()
    return 0


def serve(argv: List[str]) -> int:
    """The warm process's main: ``argv`` is the control socket's descriptor, then the modules."""
    if not argv or not argv[0].isdigit():
        print("usage: python -m spark_hvd.runner.warm FD [MODULE ...] (started by spark_hvd.runner.warm.WarmStarter)",
              file=sys.stderr)
        return 2
    return _serve(argv)


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:]))
