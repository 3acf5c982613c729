"""``run(fn, ...)``: call a function on ``np`` fresh local processes and collect every rank's result."""

from __future__ import annotations

import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence


from .errors import RankFailedError
from .local import LocalJob
from .payload import FUNCTION_FILE, dumps_call, read_sealed, result_file, write_sealed
from .processes import RankExit
from .warm import check_preload

__all__ = ["run", "check_arguments"]




def _log_to_stderr(message: str) -> None:
    print(f"spark_hvd.runner: {message}", file=sys.stderr, flush=True)


def check_arguments(fn: Any, args: Any, kwargs: Any, *, count: Any, count_name: str, env: Optional[Mapping[str, str]],
                    timeout: Optional[float], timeout_name: str) -> int:
    """The checks every launcher makes of what it was asked to run: ``fn`` callable, ``args`` a
    sequence, ``kwargs`` a mapping, ``count`` processes (named ``count_name`` in messages) at
    least 1, ``env`` of strings, ``timeout`` (named ``timeout_name``) positive or None; returns
    ``count``."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple or list of positional arguments, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a mapping of keyword arguments, got {type(kwargs).__name__}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"{count_name}={count!r} is invalid: expected an int of at least 1 (the number of ranks)")
    for key, value in (env or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"env[{key!r}]={value!r} is invalid: expected str names and str values; convert with str()")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0):
        raise ValueError(f"{timeout_name}={timeout!r} is invalid: expected seconds > 0, or None for the default")
    return count


def _write_function(workdir: Path, secret: str, fn: Callable[..., Any], args: Sequence[Any],
                    kwargs: Mapping[str, Any]) -> None:
    call = dumps_call(fn, args, kwargs)
    spec = {"sys_path": [p for p in sys.path if isinstance(p, str)], "call": call}
    write_sealed(workdir / FUNCTION_FILE, secret, pickle.dumps(spec))


def _read_outcome(workdir: Path, secret: str, rank: int) -> Optional[tuple]:
    path = workdir / result_file(rank)
    if not path.exists():
        return None
    return pickle.loads(read_sealed(path, secret))


def _rank_error(rank: int, details: Dict[str, Any], tail: Sequence[str]) -> RankFailedError:
    original = None
    if details.get("exception") is not None:
        try:
            original = pickle.loads(details["exception"])
        except Exception:
            # The class may not be importable here; the name, message and traceback still are.
            original = None
    return RankFailedError(
        rank,
        f"rank {rank} raised {details['type']}: {details['message']}",
        exc_type=details["type"],
        remote_traceback=details["traceback"],
        output_tail=tail,
        original=original,
    )


def _failure_error(failure: RankExit, workdir: Path, secret: str) -> RankFailedError:
    outcome = _read_outcome(workdir, secret, failure.rank)
    if failure.reaction is not None:
        reaction = _failure_error(failure.reaction, workdir, secret)
        if not reaction.lost_a_peer():
            # The failing rank raised an error of its own: the ranks that had finished did not cause it.
            return reaction
        how = "after fn returned" if outcome is not None and outcome[0] == "ok" else "without returning a result"
        return RankFailedError(failure.rank, f"{failure.describe()} ({how}); then {reaction.summary}",
                               output_tail=failure.tail, reaction=reaction)
    if outcome is not None and outcome[0] == "error":
        return _rank_error(failure.rank, outcome[1], failure.tail)
    return RankFailedError(failure.rank, failure.describe() + " before returning a result",
                           output_tail=failure.tail)


def run(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    np: int = 2,
    *,
    env: Optional[Mapping[str, str]] = None,
    start_timeout: Optional[float] = None,
    settings: Optional[Mapping[str, Any]] = None,
    verbose: bool = False,
    timeout: Optional[float] = None,
    preload: Sequence[str] = (),
) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``np`` new local processes; return the results in rank order.

    Each rank is a new process with the worker environment (``spark_hvd.runtime.init()``
    inside ``fn`` joins the job); ``fn`` and its arguments travel with cloudpickle, results come
    back the same way. Output lines are printed prefixed with the rank: ``[1]<stdout>:...``.

    ``env`` adds environment variables to every rank; ``settings`` passes runtime settings
    (RuntimeConfig field names such as ``fusion_threshold``); ``start_timeout`` bounds how long
    ``init()`` waits for all ranks; ``timeout`` bounds the whole call (TimeoutError after it).

    ``preload`` names modules to import once in a warm process that the ranks of this and later
    calls are forked from instead of starting a fresh interpreter (Linux; ``SPARK_HVD_WARM_START=0``
    turns it off), e.g. ``("torch",)``: repeated calls skip those imports. Each rank still gets its
    own process, environment, working directory and output.

    When a rank raises or dies, the other ranks are stopped and :class:`RankFailedError` is raised
    naming that rank, with its exception type, message and traceback. When a rank's ``fn``
    returned while others still ran and they then failed for want of it (a ``CollectiveError`` or
    ``RendezvousTimeout``), that rank is named instead, with their error as ``.reaction``. Nothing
    the ranks started outlives the call.
    """
    kwargs = {} if kwargs is None else kwargs
    check_arguments(fn, args, kwargs, count=np, count_name="np", env=env, timeout=timeout, timeout_name="timeout")
    preload = check_preload(preload)
    merged_settings = dict(settings or {})
    if start_timeout is not None:
        merged_settings["start_timeout"] = start_timeout
    log = _log_to_stderr if verbose else None
    with tempfile.TemporaryDirectory(prefix="spark-hvd-run-") as tmp:  # mode 0700: private to us
        workdir = Path(tmp)
        with LocalJob(np, settings=merged_settings, env=env, log=log) as job:
            _write_function(workdir, job.secret, fn, args, kwargs)
            processes = job.start([sys.executable, "-m", "spark_hvd.runner.worker", str(workdir)], preload=preload)
            try:
                failure = processes.wait(timeout)
            except TimeoutError:
                running = processes.running()
                raise TimeoutError(
                    f"run() did not finish within timeout={timeout} s; ranks {running} were still running "
                    "and have been stopped. Raise timeout= or look for a rank that waits on the others."
                ) from None
            if failure is not None:
                raise _failure_error(failure, workdir, job.secret)
            results = []
            for rank in range(np):
                outcome = _read_outcome(workdir, job.secret, rank)
                if outcome is None:
                    raise RankFailedError(rank, f"rank {rank} exited with code 0 without returning a result",
                                          output_tail=processes.tail(rank))
                results.append(outcome[1])
            return results
