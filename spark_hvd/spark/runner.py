"""``run(fn, ...)``: call a function on every rank of a job made of one Spark barrier stage.

The driver checks the cluster before submitting anything (enough task slots, an executor Python
that can import spark-hvd), makes the job secret, serves a log collector, and submits
``num_proc`` barrier tasks. Each task places its rank, starts ``fn`` in a fresh interpreter with
the worker environment, and streams its output back (see ``_task``). Return values come back in
rank order through the stage's ``collect``; the first rank to fail is raised as
:class:`RankFailedError`.
"""

from __future__ import annotations

import base64
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, TextIO

import cloudpickle

from spark_hvd.runner.errors import RankFailedError
from spark_hvd.runtime import config

from ._log_stream import LogCollector
from ._task import FAILURE_MARKER, TaskSpec, run_task

__all__ = ["run", "RankFailedError"]

_SLOT_WAIT_S = 10.0
"""How long a cluster (not local) master may take to register enough executors for the job."""
_FAILURE_REPORT_WAIT_S = 5.0
_DRAIN_WAIT_S = 10.0
_PYTHON_PROBE_TIMEOUT_S = 60.0


# ----------------------------------------------------------------------------------------------
# Checks made on the driver before anything is submitted.


def _spark_context() -> Any:
    """The SparkContext of the active SparkSession; a ValueError saying how to make one."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    session = SparkSession.getActiveSession()
    if session is None and SparkContext._active_spark_context is None:
        raise ValueError(
            "spark_hvd.spark.run() needs an active SparkSession, but there is none; create one first, "
            "e.g. SparkSession.builder.master('local[2]').getOrCreate()"
        )
    if session is not None:
        try:
            return session.sparkContext
        except Exception as exc:  # Spark Connect sessions have no SparkContext
            raise ValueError(
                f"spark_hvd.spark.run() needs a classic SparkSession with a SparkContext, got {type(session).__name__} "
                f"({exc}); create the session with SparkSession.builder (not .remote())"
            ) from None
    return SparkContext._active_spark_context


def _total_slots(sc: Any) -> int:
    """Tasks the cluster can run at once for the default resource profile."""
    jsc = sc._jsc.sc()
    try:
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(profile))
    except Exception:  # Spark before 3.1 has no resource profiles
        return int(sc.defaultParallelism)


def check_slots(num_proc: int, slots: int, master: str) -> None:
    """Raise ValueError naming both numbers when a barrier stage of ``num_proc`` tasks cannot start."""
    if num_proc <= slots:
        return
    if master.startswith("local"):
        fix = f"lower num_proc or use a master with more threads, e.g. local[{num_proc}]"
    else:
        fix = "lower num_proc or add executors / raise spark.executor.cores (or lower spark.task.cpus)"
    raise ValueError(
        f"num_proc={num_proc} but the cluster has {slots} task slots; a barrier stage needs all of its "
        f"tasks running at once: {fix}"
    )


def _wait_for_slots(sc: Any, num_proc: int) -> None:
    master = str(sc.master)
    slots = _total_slots(sc)
    if slots < num_proc and not master.startswith("local"):
        # Executors of a freshly started cluster application register over a few seconds.
        deadline = time.monotonic() + _SLOT_WAIT_S
        while slots < num_proc and time.monotonic() < deadline:
            time.sleep(0.5)
            slots = _total_slots(sc)
    check_slots(num_proc, slots, master)


_checked_pythons: Dict[str, bool] = {}


def check_executor_python(python_exec: str, master: str, environ: Mapping[str, str]) -> None:
    """In local mode, fail clearly when the Python that runs Spark's tasks cannot import spark_hvd.

    Cluster executors live elsewhere; there a missing package shows up as the task's import
    error, which ``run()`` translates into the same advice.
    """
    if not master.startswith("local"):
        return
    resolved = shutil.which(python_exec, path=environ.get("PATH")) or python_exec
    if os.path.abspath(resolved) == os.path.abspath(sys.executable):
        return
    if resolved not in _checked_pythons:
        try:
            probe = subprocess.run([resolved, "-c", "import spark_hvd"], capture_output=True,
                                   timeout=_PYTHON_PROBE_TIMEOUT_S)
            _checked_pythons[resolved] = probe.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            _checked_pythons[resolved] = False
    if not _checked_pythons[resolved]:
        raise ValueError(_python_advice(f"Spark runs its Python tasks with {python_exec!r}, which cannot import "
                                         "spark_hvd"))


def _python_advice(what: str) -> str:
    return (
        f"{what}; set PYSPARK_PYTHON to a Python that has spark-hvd installed (for example "
        f"PYSPARK_PYTHON={sys.executable}, the driver's) before the SparkSession is created, or install "
        "spark-hvd on the executors"
    )


# ----------------------------------------------------------------------------------------------
# Turning a failed stage into the error of the rank that caused it.

_MARKER_RE = re.compile(re.escape(FAILURE_MARKER) + r" (\d+) failed: ([^:\n]+): ([^\n]*)")


def _original_exception(encoded: Optional[str]) -> Optional[BaseException]:
    if not encoded:
        return None
    try:
        # Sent by a task that proved knowledge of the job secret, like the results collect() returns.
        original = pickle.loads(base64.b64decode(encoded))
    except Exception:  # its class may not be importable on the driver; name and text remain
        return None
    return original if isinstance(original, BaseException) else None


def _rank_error(failure: Optional[Mapping[str, Any]], spark_error: BaseException) -> BaseException:
    """The error ``run()`` raises for a failed stage: the root-cause rank's, when one reported."""
    if failure is not None:
        rank = int(failure["rank"])
        exc_type = failure.get("type")
        summary = (f"rank {rank} raised {exc_type}: {failure.get('message', '')}" if exc_type
                   else str(failure.get("message", f"rank {rank} failed")))
        tail = str(failure.get("output_tail") or "")
        return RankFailedError(
            rank, summary, exc_type=exc_type, remote_traceback=failure.get("traceback") or None,
            output_tail=tail.splitlines(), original=_original_exception(failure.get("exception")),
        )
    text = str(spark_error)
    if "No module named 'spark_hvd'" in text:
        return ValueError(_python_advice("the executors' Python cannot import spark_hvd"))
    found = _MARKER_RE.search(text)
    if found:
        rank = int(found.group(1))
        return RankFailedError(rank, f"rank {rank} raised {found.group(2)}: {found.group(3)}",
                               exc_type=found.group(2))
    return RuntimeError(f"the barrier stage of spark_hvd.spark.run() failed: {text}")


def _root_cause(error: BaseException, failure: Optional[Mapping[str, Any]],
                finished: Mapping[int, float]) -> BaseException:
    """A rank whose function returned while the others still ran, when they then failed for want of
    it, is the root cause: named first, with their failure as the reaction."""
    if failure is None or not isinstance(error, RankFailedError) or not error.lost_a_peer():
        return error
    early = [(at, rank) for rank, at in finished.items() if at <= failure["received"] and rank != error.rank]
    if not early:
        return error
    _, rank = min(early)
    return RankFailedError(rank, f"rank {rank} returned while the other ranks were still running; then "
                                 f"{error.summary}", reaction=error)


class _JobGroup:
    """A Spark job group of its own for the stage, so an interrupted driver can cancel it."""

    _KEYS = ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel")

    def __init__(self, sc: Any, description: str) -> None:
        self._sc = sc
        self.group = f"spark-hvd-run-{uuid.uuid4().hex[:12]}"
        self._description = description
        self._saved: Dict[str, Optional[str]] = {}

    def __enter__(self) -> "_JobGroup":
        self._saved = {key: self._sc.getLocalProperty(key) for key in self._KEYS}
        self._sc.setJobGroup(self.group, self._description, interruptOnCancel=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        for key, value in self._saved.items():
            self._sc.setLocalProperty(key, value)


# ----------------------------------------------------------------------------------------------
# The public verb.


def _validate(fn: Any, args: Any, kwargs: Any, num_proc: Optional[int], default: int,
              start_timeout: Optional[float], env: Optional[Mapping[str, str]], verbose: int) -> int:
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple or list of positional arguments, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a mapping of keyword arguments, got {type(kwargs).__name__}")
    if num_proc is None:
        num_proc = default
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"num_proc={num_proc!r} is invalid: expected a positive int (the number of ranks)")
    if start_timeout is not None and not start_timeout > 0:
        raise ValueError(f"start_timeout={start_timeout!r} is invalid: expected seconds > 0, or None for the default")
    for key, value in (env or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"env[{key!r}]={value!r} is invalid: expected str names and str values; convert with str()")
    if not isinstance(verbose, int):
        raise ValueError(f"verbose={verbose!r} is invalid: expected an int (0 silences rank output)")
    return num_proc


def run(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    num_proc: Optional[int] = None,
    start_timeout: Optional[float] = None,
    env: Optional[Mapping[str, str]] = None,
    stdout: Optional[TextIO] = None,
    stderr: Optional[TextIO] = None,
    verbose: int = 1,
    use_gpu: Optional[bool] = None,
) -> List[Any]:
    """Call ``fn(*args, **kwargs)`` on ``num_proc`` ranks, one per Spark barrier task.

    Each rank runs in a fresh Python process with the worker environment (``SPARK_HVD_RANK``,
    ``SPARK_HVD_SIZE``, ... and ``env``), so ``spark_hvd.runtime.init()`` inside ``fn`` joins the
    job. Returns every rank's return value, in rank order.

    Args:
        num_proc: number of ranks; default ``sparkContext.defaultParallelism``. The cluster must
            have at least this many task slots, else ValueError before anything is submitted.
        start_timeout: seconds ranks may take to meet at the rendezvous (SPARK_HVD_START_TIMEOUT).
        env: extra environment variables for every rank.
        stdout, stderr: where the ranks' output lines go, as ``[rank]<stdout>:line``; default the
            driver's ``sys.stdout``/``sys.stderr``. ``verbose=0`` prints none.
        use_gpu: True gives each rank its Spark-assigned GPU (else GPU ``local_rank``) as
            CUDA_VISIBLE_DEVICES; False leaves CUDA_VISIBLE_DEVICES alone; None uses Spark's GPU
            assignment when tasks have one.

    Raises:
        RankFailedError: a rank's ``fn`` raised or its process died; names the rank, the error
            type, its message and the traceback's tail. The other ranks are stopped.
        ValueError: invalid values, no active SparkSession, too few task slots, or executors
            whose Python cannot import spark_hvd.
        TypeError: ``fn`` is not callable, or ``args``/``kwargs`` are not a sequence/mapping.
    """
    sc = _spark_context()
    num_proc = _validate(fn, args, kwargs, num_proc, int(sc.defaultParallelism), start_timeout, env, verbose)
    _wait_for_slots(sc, num_proc)
    check_executor_python(str(getattr(sc, "pythonExec", sys.executable)), str(sc.master),
                          config.environ_snapshot())
    try:
        payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as exc:
        raise ValueError(f"fn, args or kwargs could not be pickled with cloudpickle: {exc}; pass picklable "
                         "values, or create unpicklable objects (sessions, sockets, locks) inside fn") from None

    conf = sc.getConf()
    local = str(sc.master).startswith("local")
    advertised = conf.get("spark.driver.host", None) or ("127.0.0.1" if local else socket.gethostname())
    bind = conf.get("spark.driver.bindAddress", None) or advertised
    secret = config.new_secret()
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    collector = LogCollector(bind, advertised, secret, out, err, verbose)
    spec = TaskSpec(
        num_proc=num_proc, payload=payload, driver_sys_path=tuple(p for p in sys.path if isinstance(p, str)),
        secret=secret, collector_address=collector.address,
        settings={"start_timeout": start_timeout}, env=dict(env or {}), use_gpu=use_gpu, verbose=verbose,
    )

    def task(partition: Any) -> Any:
        return run_task(spec, partition)

    if verbose >= 2:
        err.write(f"spark-hvd: running {getattr(fn, '__name__', 'fn')} on {num_proc} barrier tasks\n")
    started = time.monotonic()
    try:
        with _JobGroup(sc, f"spark_hvd.spark.run: {num_proc} ranks") as group:
            try:
                rows = sc.parallelize(range(num_proc), num_proc).barrier().mapPartitions(task).collect()
            except KeyboardInterrupt:
                sc.cancelJobGroup(group.group)
                raise
            except Exception as exc:
                failure = collector.wait_failure(_FAILURE_REPORT_WAIT_S)
                raise _root_cause(_rank_error(failure, exc), failure, dict(collector.finished)) from None
        collector.wait_closed(sum(1 for row in rows if row[2]), _DRAIN_WAIT_S)
    finally:
        collector.close()
    if verbose >= 2:
        err.write(f"spark-hvd: {num_proc} ranks finished in {time.monotonic() - started:.1f} s\n")
    by_rank = {int(rank): blob for rank, blob, _ in rows}
    # Each blob is the rank process's own ("ok", value) outcome, unpickled only here.
    return [cloudpickle.loads(by_rank[rank])[1] for rank in range(num_proc)]
