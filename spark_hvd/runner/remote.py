"""The rank's side of ``spark-hvd-run`` on another host, started there over SSH.

``python -m spark_hvd.runner.remote --check`` prints one JSON line (spark-hvd's version and the
two addresses of the SSH connection: this host's and the launcher's as seen from here) and exits:
the launcher's check that the host answers and has the environment.

``python -m spark_hvd.runner.remote`` reads one JSON line from standard input, ``{"argv": [...],
"env": {...}, "cwd": "..."}``, and runs ``argv`` as the rank with exactly that environment in
that directory, under the rank supervisor (:mod:`spark_hvd.runner.supervise`) so that nothing the
rank starts outlives it. The rank's output goes to this process's output, which SSH carries back
to the launcher. The environment holds the job secret, so it travels on the SSH channel, never on
a command line that other users of the host could read. Standard input stays open as the control
channel for the rest of the job:

- a line ``signal N`` passes signal ``N`` on to the rank (the launcher's Ctrl-C reaches the rank
  as SIGINT, as it does locally);
- end of input (the launcher closed it, the launcher died, or the connection broke) stops the
  rank: SIGTERM, then SIGKILL after a grace period.

This process exits as the rank did: its exit code, or 128 + the signal that killed it (SSH turns
a remote signal into its own error code, so the signal is reported as a code).

Only the standard library is imported: this process starts once per remote rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from typing import Any, Dict, List, Optional

__all__ = ["main", "STOP_GRACE_SECONDS"]

STOP_GRACE_SECONDS = 3.0
"""Seconds a rank gets after SIGTERM, when the launcher is gone, before it is killed."""


def _check() -> int:
    from importlib import metadata

    connection = os.environ.get("SSH_CONNECTION", "").split()
    try:
        version: Optional[str] = metadata.version("spark-hvd")
    except metadata.PackageNotFoundError:  # run from a source tree
        version = None
    answer = {"version": version, "python": sys.executable,
              "launcher": connection[0] if len(connection) == 4 else None,
              "address": connection[2] if len(connection) == 4 else None}
    print(json.dumps(answer), flush=True)
    return 0


def _read_job() -> Dict[str, Any]:
    line = sys.stdin.buffer.readline()
    if not line:
        raise SystemExit("spark-hvd remote: no job description on standard input (expected one JSON line from "
                         "spark-hvd-run)")
    job = json.loads(line)
    if not isinstance(job.get("argv"), list) or not isinstance(job.get("env"), dict):
        raise SystemExit("spark-hvd remote: the job description lacks argv or env")
    return job


def _command(argv: List[str]) -> List[str]:
    from spark_hvd.runner import supervise

    if not supervise.available():
        return argv
    return supervise.command_line(argv, os.getpid(), STOP_GRACE_SECONDS)


class _Rank:
    def __init__(self, proc: "subprocess.Popen[bytes]") -> None:
        self.proc = proc

    def signal(self, signum: int) -> None:
        try:
            self.proc.send_signal(signum)  # the supervisor passes it on to the rank's process group
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        """The launcher is gone: SIGTERM, a grace period, then SIGKILL."""
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # the supervisor's death takes the rank with it (parent-death signal)


def _control(rank: _Rank) -> None:
    for raw in sys.stdin.buffer:
        words = raw.decode(errors="replace").split()
        if len(words) == 2 and words[0] == "signal" and words[1].isdigit():
            rank.signal(int(words[1]))
    if rank.proc.poll() is None:
        rank.stop()


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--check"]:
        return _check()
    if args:
        print(f"spark-hvd remote: unexpected arguments {args!r}; expected none or --check", file=sys.stderr)
        return 2
    job = _read_job()
    cwd = job.get("cwd")
    if cwd is not None and not os.path.isdir(cwd):
        host = os.uname().nodename
        print(f"spark-hvd: directory {cwd!r} does not exist on host {host}; expected the same working directory on "
              "every host (run from a directory every host has, e.g. on a shared filesystem)", file=sys.stderr)
        return 2
    try:
        proc = subprocess.Popen(_command([str(a) for a in job["argv"]]), env={str(k): str(v) for k, v in
                                                                              job["env"].items()},
                                cwd=cwd, stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        print(f"spark-hvd: cannot start {job['argv'][0]!r} on host {os.uname().nodename}: {exc.strerror}",
              file=sys.stderr)
        return 127
    rank = _Rank(proc)
    threading.Thread(target=_control, args=(rank,), name="control", daemon=True).start()
    signal.signal(signal.SIGHUP, lambda n, f: rank.signal(signal.SIGTERM))
    code = proc.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: the control thread is blocked reading standard input, which the interpreter's
    # shutdown would wait on.
    os._exit(status)
