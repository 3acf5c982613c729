"""The program each rank of :func:`spark_hvd.runner.run` executes: ``python -m spark_hvd.runner.worker DIR``.

It reads the sealed function from ``DIR/fn``, calls it, and writes the sealed outcome to
``DIR/result.<rank>``: ``("ok", value)`` or ``("error", details)``. The exit code is 0 after a
return and 1 after an exception.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from spark_hvd.runtime.config import read_setting

from .payload import FUNCTION_FILE, read_sealed, result_file, write_sealed

__all__ = ["main"]


def _error_details(exc: BaseException) -> Dict[str, Any]:
    import cloudpickle

    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    try:
        pickled: Optional[bytes] = cloudpickle.dumps(exc)
    except Exception:
        pickled = None
    # Start the traceback at the user's code: the frames of this module say nothing about the error.
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return {
        "type": name,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(kind, exc, tb or exc.__traceback__)),
        "exception": pickled,
    }


def _call(workdir: Path, secret: str) -> Tuple[str, Any]:
    spec = pickle.loads(read_sealed(workdir / FUNCTION_FILE, secret))
    # Functions pickled by reference must import here as they did in the caller.
    sys_path: List[str] = spec["sys_path"]
    sys.path.extend(p for p in sys_path if p not in sys.path)
    fn, args, kwargs = pickle.loads(spec["call"])
    return "ok", fn(*args, **kwargs)


def main(argv: Optional[List[str]] = None) -> int:
    import cloudpickle

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m spark_hvd.runner.worker DIR (started by spark_hvd.runner.run)", file=sys.stderr)
        return 2
    workdir = Path(argv[0])
    rank, secret = read_setting("rank"), read_setting("secret")
    if rank is None or secret is None:
        print("SPARK_HVD_RANK and SPARK_HVD_SECRET expected, but not set: start this through "
              "spark_hvd.runner.run()", file=sys.stderr)
        return 2
    try:
        outcome: Tuple[str, Any] = _call(workdir, secret)
        data = cloudpickle.dumps(outcome)
    except (Exception, SystemExit) as exc:
        outcome = ("error", _error_details(exc))
        data = cloudpickle.dumps(outcome)
    except KeyboardInterrupt:
        # Ctrl-C reaches every process of the terminal's group: one line per rank says it, the
        # caller (interrupted too) has the traceback that matters.
        print(f"spark-hvd: rank {rank} interrupted (KeyboardInterrupt)", file=sys.stderr)
        return 130
    write_sealed(workdir / result_file(rank), secret, data)
    return 0 if outcome[0] == "ok" else 1


def _exit_now(code: int) -> None:
    """Leave without the interpreter's teardown, which takes most of a second once torch is loaded.

    The runtime is shut down first (peers hear a clean goodbye) and output is flushed; the result
    file is already written.
    """
    runtime = sys.modules.get("spark_hvd.runtime")
    if runtime is not None:
        try:
            runtime.shutdown()
        except Exception:  # the outcome is recorded; a failing goodbye must not change the exit code
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    try:
        _exit_now(main())
    except KeyboardInterrupt:  # a second Ctrl-C while leaving
        os._exit(130)
