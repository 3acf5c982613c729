"""``run(fn, ...)``: call a function on every rank of a job made of one Spark barrier stage.

The driver checks the cluster before submitting anything (enough task slots, an executor Python
that can import spark-hvd), makes the job secret, opens an output channel (a socket on classic
sessions, the store on Spark Connect, whose client the executors may not reach), and submits
``num_proc`` barrier tasks as one ``mapInArrow(..., barrier=True)`` stage, which classic and
Connect sessions both run. Each task places its rank, starts ``fn`` in a fresh interpreter with
the worker environment, and streams its output back (see ``_task``). Return values come back in
rank order as the stage's rows, sealed with the job secret; the first rank to fail is raised as
:class:`RankFailedError`.
"""

from __future__ import annotations

import atexit
import base64
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, TextIO, Tuple

import cloudpickle

from spark_hvd.runner.api import check_arguments
from spark_hvd.runner.errors import RankFailedError
from spark_hvd.runner.payload import dumps_call
from spark_hvd.runner.warm import check_preload
from spark_hvd.runtime import config

from spark_hvd.spark.launch.log_stream import LogCollector
from spark_hvd.runtime.rendezvous import RendezvousServer
from spark_hvd.runtime.seal import unseal
from spark_hvd.spark.launch.store_log import STORE_CONTEXT, StoreLogCollector
from spark_hvd.spark.launch.task import FAILURE_MARKER, RESULT_SCHEMA, TaskSpec, result_name, run_task
from spark_hvd.spark.session import SessionInfo, active_session, session_info
from spark_hvd.spark.data.store import Store

__all__ = ["run", "RankFailedError", "check_controller", "check_nics", "TimestampedLines", "SlotsUnavailableError",
           "StageLostError", "check_slots", "wait_for_slots", "executor_python", "check_executor_python"]

_SLOT_WAIT_S = 10.0
"""How long a cluster (not local) master may take to register enough executors for the job."""
_FAILURE_REPORT_WAIT_S = 5.0
_CAUSE_REPORT_WAIT_S = 5.0
_DRAIN_WAIT_S = 10.0
_PYTHON_PROBE_TIMEOUT_S = 60.0


class SlotsUnavailableError(ValueError):
    """The cluster has fewer task slots than the barrier stage has tasks."""


class StageLostError(RuntimeError):
    """Spark failed the barrier stage without any rank reporting an error: an executor or a
    task was lost (killed, out of memory, its host gone). Running the stage again may succeed."""


# ----------------------------------------------------------------------------------------------
# Checks made on the driver before anything is submitted.


def check_slots(num_proc: int, slots: int, master: str) -> None:
    """Raise ValueError naming both numbers when a barrier stage of ``num_proc`` tasks cannot start."""
    if num_proc <= slots:
        return
    if master == "local" or master.startswith("local["):
        fix = f"lower num_proc or use a master with more threads, e.g. local[{num_proc}]"
    else:
        fix = "lower num_proc or add executors / raise spark.executor.cores (or lower spark.task.cpus)"
    raise SlotsUnavailableError(
        f"num_proc={num_proc} but the cluster has {slots} task slots; a barrier stage needs all of its "
        f"tasks running at once: {fix}"
    )


def wait_for_slots(session: Any, num_proc: int) -> SessionInfo:
    """Fail at once, naming both numbers, when the cluster cannot run ``num_proc`` tasks together.

    A cluster that does not tell its slots without a job (Spark Connect with dynamic allocation)
    is left to Spark's own barrier check, whose failure ``run()`` words the same way.
    """
    info = session_info(session)
    slots = info.slots
    in_process = info.master == "local" or info.master.startswith("local[")  # not local-cluster[...]
    if slots is not None and slots < num_proc and not in_process and not info.connect:
        # Executors of a freshly started cluster application register over a few seconds.
        deadline = time.monotonic() + _SLOT_WAIT_S
        while slots is not None and slots < num_proc and time.monotonic() < deadline:
            time.sleep(0.5)
            slots = session_info(session).slots
    if slots is not None:
        check_slots(num_proc, slots, info.master)
    return info


def executor_python(session: Any, info: SessionInfo) -> str:
    """The interpreter Spark starts for Python tasks, as far as this process can tell."""
    if not info.connect:
        return str(getattr(session.sparkContext, "pythonExec", None) or sys.executable)
    try:
        configured = session.conf.get("spark.pyspark.python", None)
    except Exception:  # servers may hide the setting; fall back to what the local server inherited
        configured = None
    return str(configured or config.environ_snapshot().get("PYSPARK_PYTHON") or "python3")


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

# What Spark says when a task's process or its executor went away rather than the code failing.
_LOST_RE = re.compile(r"ExecutorLostFailure|executor \S+ (?:exited|lost)|Executor (?:heartbeat timed out|lost)|"
                      r"Python worker exited unexpectedly|TaskKilled|killed|Worker lost|Container (?:killed|exited)|"
                      r"RPC client disassociated", re.IGNORECASE)
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
    if "BarrierJobSlotsNumberCheckFailed" in text or "SPARK-24819" in text:
        return SlotsUnavailableError("Spark refused the barrier stage: the cluster has fewer task slots than num_proc; a "
                          "barrier stage needs all of its tasks running at once: lower num_proc or add executors "
                          "(or raise spark.executor.cores, or lower spark.task.cpus)")
    if "No module named 'spark_hvd'" in text:
        return ValueError(_python_advice("the executors' Python cannot import spark_hvd"))
    found = _MARKER_RE.search(text)
    if found:
        rank = int(found.group(1))
        return RankFailedError(rank, f"rank {rank} raised {found.group(2)}: {found.group(3)}",
                               exc_type=found.group(2))
    if _LOST_RE.search(text):
        return StageLostError(f"the barrier stage of spark_hvd.spark.run() lost a task or an executor: {text}")
    return RuntimeError(f"the barrier stage of spark_hvd.spark.run() failed: {text}")


def _root_cause(error: BaseException, failure: Optional[Mapping[str, Any]],
                finished: Mapping[int, float]) -> BaseException:
    """A rank whose function returned while the others still ran, when they then failed for want of
    it, is the root cause: named first, with their failure as the reaction."""
    if failure is None or not isinstance(error, RankFailedError) or not error.lost_a_peer():
        return error
    named = _shut_down_peer(failure)
    if named is not None and named in finished:
        rank = named  # the peer it names returned: its report may have reached the driver second
    else:
        early = [(at, rank) for rank, at in finished.items() if at <= failure["received"] and rank != error.rank]
        if not early:
            return error
        _, rank = min(early)
    return RankFailedError(rank, f"rank {rank} returned while the other ranks were still running; then "
                                 f"{error.summary}", reaction=error)


def _first_cause(collector: Any, spark_error: BaseException, num_proc: int) -> Optional[Dict[str, Any]]:
    """The failure report that names the cause: the first to arrive, unless it is a rank that lost
    its peers, whose report can beat the cause's (a rank that raised, or whose process died) to the
    driver; that one is waited for a moment and preferred."""
    failure = collector.wait_failure(_FAILURE_REPORT_WAIT_S)
    if failure is None or not _lost_a_peer(failure, spark_error):
        return failure
    deadline = time.monotonic() + _CAUSE_REPORT_WAIT_S
    named = _shut_down_peer(failure)
    while True:
        causes = [f for f in list(collector.failures) if not _lost_a_peer(f, spark_error)]
        if causes:
            return min(causes, key=lambda f: f["received"])
        if named is not None and named in collector.finished:
            return failure  # the peer it lost returned: _root_cause names that rank
        if len(collector.failures) >= num_proc or time.monotonic() >= deadline:
            return failure
        time.sleep(0.1)
        collector.wait_failure(0.0)  # lets a store-based collector read new reports


_SHUT_DOWN_RE = re.compile(r"rank (\d+) has shut down")


def _shut_down_peer(failure: Mapping[str, Any]) -> Optional[int]:
    """The rank a failure says had shut down (returned) while it was needed, if it names one."""
    found = _SHUT_DOWN_RE.search(str(failure.get("message", "")))
    return int(found.group(1)) if found else None


def _lost_a_peer(failure: Mapping[str, Any], spark_error: BaseException) -> bool:
    error = _rank_error(failure, spark_error)
    return isinstance(error, RankFailedError) and error.lost_a_peer()


class _JobTag:
    """A job tag of its own for the stage (Spark Connect), so an interrupted client can cancel it."""

    def __init__(self, session: Any) -> None:
        self._session = session
        self.tag = f"spark-hvd-run-{uuid.uuid4().hex[:12]}"

    def __enter__(self) -> "_JobTag":
        self._session.addTag(self.tag)
        return self

    def cancel(self) -> None:
        self._session.interruptTag(self.tag)

    def __exit__(self, *exc: Any) -> None:
        self._session.removeTag(self.tag)


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

    def cancel(self) -> None:
        self._sc.cancelJobGroup(self.group)

    def __exit__(self, *exc: Any) -> None:
        for key, value in self._saved.items():
            self._sc.setLocalProperty(key, value)


class _QuietTaskFailures:
    """While the stage runs, a driver JVM in this process (a local master) logs nothing of the
    executor's and scheduler's task failures: a failing rank's Python traceback and some 40 lines of
    Java stack from each of them. The failure reaches the caller once, as the rank's own error.

    Afterwards the logging configuration is as it was: a logger that had no configuration of its own
    loses the one set here. (Setting it back to the level it inherited would not do: Spark's console
    filter lets through whatever a logger is explicitly configured for, and the scheduler's INFO lines
    would then follow every later job of the session.)"""

    _LOGGERS = ("org.apache.spark.executor.Executor", "org.apache.spark.scheduler.TaskSetManager",
                "org.apache.spark.scheduler.TaskSchedulerImpl")

    def __init__(self, session: Any) -> None:
        from pyspark import SparkContext

        context = SparkContext._active_spark_context
        self._jvm = getattr(context, "_jvm", None) if context is not None else None
        self._saved: Dict[str, Any] = {}  # name -> its own configured level, or None: it had no config

    def __enter__(self) -> "_QuietTaskFailures":
        if self._jvm is None:
            return self
        try:
            log4j = self._jvm.org.apache.logging.log4j
            configured = log4j.LogManager.getContext(False).getConfiguration().getLoggers()
            for name in self._LOGGERS:
                own = configured.containsKey(name)
                self._saved[name] = configured.get(name).getLevel() if own else None
                log4j.core.config.Configurator.setLevel(name, log4j.Level.OFF)
        except Exception:  # another logging backend: its messages stay as they are
            self._saved.clear()
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._saved:
            return
        log4j = self._jvm.org.apache.logging.log4j
        context = log4j.LogManager.getContext(False)
        configuration = context.getConfiguration()
        for name, level in self._saved.items():
            if level is None:
                configuration.removeLogger(name)
            else:
                log4j.core.config.Configurator.setLevel(name, level)
        context.updateLoggers()


def check_controller(use_mpi: Optional[bool], use_gloo: Optional[bool], extra_mpi_args: Optional[str]) -> None:
    """Horovod's controller arguments: on Spark the ranks always meet over spark-hvd's TCP ring."""
    for name, value in (("use_mpi", use_mpi), ("use_gloo", use_gloo)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} is not valid: expected True, False or None")
    if use_mpi or extra_mpi_args:
        given = "use_mpi=True" if use_mpi else f"extra_mpi_args={extra_mpi_args!r}"
        raise ValueError(f"{given} is not supported on Spark: the ranks of a barrier stage meet over spark-hvd's own "
                         "authenticated TCP ring and shared memory (what use_gloo=True chose in Horovod); fix: leave "
                         "use_mpi and extra_mpi_args unset, or run an MPI job with spark-hvd-run --mpi")


def check_nics(nics: Any) -> Optional[Tuple[str, ...]]:
    """``nics`` (a name, or a list or set of names) as a tuple, or None."""
    if nics is None:
        return None
    names = [nics] if isinstance(nics, str) else list(nics) if isinstance(nics, (list, tuple, set, frozenset)) else None
    if not names or not all(isinstance(n, str) and n.strip() for n in names):
        raise ValueError(f"nics={nics!r} is not valid: expected network interface names, e.g. nics=['eth0']")
    return tuple(sorted(n.strip() for n in names)) if isinstance(nics, (set, frozenset)) else tuple(n.strip()
                                                                                                    for n in names)


class TimestampedLines:
    """A text stream that starts every line written to it with the time it was written."""

    def __init__(self, target: TextIO) -> None:
        self._target = target
        self._at_line_start = True

    def write(self, text: str) -> int:
        parts = []
        for piece in text.splitlines(keepends=True):
            if self._at_line_start:
                parts.append(time.strftime("%a %b %d %H:%M:%S %Y") + ": ")
            parts.append(piece)
            self._at_line_start = piece.endswith("\n")
        self._target.write("".join(parts))
        return len(text)

    def flush(self) -> None:
        self._target.flush()

    def isatty(self) -> bool:
        return False


# ----------------------------------------------------------------------------------------------
# The public verb.


def _driver_addresses(session: Any, info: SessionInfo) -> Tuple[str, str]:
    """(address to listen on, address the executors dial) of a classic session's driver: Spark's
    own ``spark.driver.bindAddress`` and ``spark.driver.host``."""
    conf = session.sparkContext.getConf()
    advertised = conf.get("spark.driver.host", None) or ("127.0.0.1" if info.local else socket.gethostname())
    return conf.get("spark.driver.bindAddress", None) or advertised, advertised


def _driver_rendezvous(session: Any, info: SessionInfo, secret: str) -> Optional[RendezvousServer]:
    """The job's rendezvous server, served by a classic session's driver (which its executors reach:
    they talk to it for Spark itself); None on Spark Connect, whose client may be out of their reach,
    so that partition 0's task serves one instead."""
    if info.connect:
        return None
    bind, advertised = _driver_addresses(session, info)
    return RendezvousServer(bind, secret, advertised_host=advertised)


def _output_channel(session: Any, info: SessionInfo, store: Optional[Store], secret: str, out: TextIO,
                    err: TextIO, verbose: int) -> Tuple[Any, Optional[str], Optional[Store], Optional[str]]:
    """(collector, collector address, log store, log directory) for the job's output.

    Classic drivers serve a socket the tasks connect to. A Connect client may be out of the
    executors' reach, so its output travels through the store (a temporary one on a local master).
    """
    if not info.connect:
        bind, advertised = _driver_addresses(session, info)
        collector = LogCollector(bind, advertised, secret, out, err, verbose)
        return collector, collector.address, None, None
    if store is None and info.local:
        store = _local_output_store()
    if store is None:
        if verbose > 0:
            err.write("spark-hvd: rank output stays in the executors' logs: pass store= (storage the executors and "
                      "this client both reach) to see it here\n")
        return _NoOutput(), None, None, None
    directory = store.join("jobs", f"run-{uuid.uuid4().hex[:16]}")
    return StoreLogCollector(store, directory, secret, out, err, verbose), None, store, directory


_output_store: Optional[Store] = None


def _local_output_store() -> Store:
    global _output_store
    if _output_store is None:
        path = tempfile.mkdtemp(prefix="spark-hvd-output-")
        atexit.register(shutil.rmtree, path, True)
        _output_store = Store.create(path)
    return _output_store


class _NoOutput:
    """The collector of a job whose output cannot reach the client: failures come from the stage."""

    failures: List[Dict[str, Any]] = []
    finished: Dict[int, float] = {}

    def wait_failure(self, timeout: float) -> None:
        return None

    def wait_closed(self, connections: int, timeout: float) -> bool:
        return True

    def close(self) -> None:
        pass


def run(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    num_proc: Optional[int] = None,
    start_timeout: Optional[float] = None,
    use_mpi: Optional[bool] = None,
    use_gloo: Optional[bool] = None,
    extra_mpi_args: Optional[str] = None,
    env: Optional[Mapping[str, str]] = None,
    stdout: Optional[TextIO] = None,
    stderr: Optional[TextIO] = None,
    verbose: int = 1,
    nics: Optional[Sequence[str]] = None,
    prefix_output_with_timestamp: bool = False,
    executable: Optional[str] = None,
    *,
    use_gpu: Optional[bool] = None,
    store: Optional[Store] = None,
    spark: Any = None,
    preload: Sequence[str] = (),
) -> List[Any]:
    """Call ``fn(*args, **kwargs)`` on ``num_proc`` ranks, one per Spark barrier task.

    Each rank runs in a Python process of its own (a fresh interpreter, or a fork of a warm process
    with ``preload``) with the worker environment (``SPARK_HVD_RANK``, ``SPARK_HVD_SIZE``, ... and
    ``env``), so ``spark_hvd.runtime.init()`` inside ``fn`` joins the job. Returns every rank's
    return value, in rank order. Works on classic and Spark Connect sessions alike; the stage is a
    ``mapInArrow`` with ``barrier=True`` and results come back as its rows, sealed with the job
    secret.

    Args:
        num_proc: number of ranks; default the cluster's default parallelism. The cluster must
            have at least this many task slots, else ValueError before anything is submitted.
        start_timeout: seconds ranks may take to meet at the rendezvous (SPARK_HVD_START_TIMEOUT).
        env: extra environment variables for every rank.
        stdout, stderr: where the ranks' output lines go, as ``[rank]<stdout>:line``; default the
            driver's ``sys.stdout``/``sys.stderr``. ``verbose=0`` prints none.
        use_gpu: True gives each rank its Spark-assigned GPU (else GPU ``local_rank``) as
            CUDA_VISIBLE_DEVICES; False leaves CUDA_VISIBLE_DEVICES alone; None uses Spark's GPU
            assignment when tasks have one.
        store: on Spark Connect, where the ranks' output travels to this client (the executors
            need not reach it); default a temporary local store on a local master. Classic
            sessions stream output over an authenticated socket and ignore it.
        use_mpi, use_gloo, extra_mpi_args: Horovod's controller choice. The ranks of a Spark stage
            always meet over spark-hvd's own TCP ring (what use_gloo=True chose in Horovod);
            use_mpi=True or extra_mpi_args are refused with how to run MPI instead.
        nics: network interfaces the ranks listen on and advertise (the first of them that a
            host has), instead of the address Spark uses for the executor.
        prefix_output_with_timestamp: start every output line with the time it reached the driver.
        executable: the Python the rank processes run (default: the executor's own).
        preload: modules to import once per executor Python worker, in a warm process that the
            ranks of this and later jobs are forked from instead of starting a fresh interpreter
            (Linux; ``SPARK_HVD_WARM_START=0`` turns it off), e.g. ``("torch",)``. Each rank
            still gets its own process, environment and output.

    The positional order is Horovod's ``horovod.spark.run``; ``use_gpu``, ``store``, ``spark`` and
    ``preload`` are keywords of spark-hvd's.

    Raises:
        RankFailedError: a rank's ``fn`` raised or its process died; names the rank, the error
            type, its message and the traceback's tail. The other ranks are stopped.
        ValueError: invalid values, no active SparkSession, too few task slots, or executors
            whose Python cannot import spark_hvd.
        TypeError: ``fn`` is not callable, or ``args``/``kwargs`` are not a sequence/mapping.
    """
    check_controller(use_mpi, use_gloo, extra_mpi_args)
    interfaces = check_nics(nics)
    if executable is not None and (not isinstance(executable, str) or not executable):
        raise ValueError(f"executable={executable!r} is not valid: expected the path of a Python interpreter")
    preload = check_preload(preload)
    session = spark if spark is not None else active_session("spark_hvd.spark.run()")
    info = session_info(session)
    num_proc = check_arguments(fn, args, kwargs, count=info.default_parallelism if num_proc is None else num_proc,
                               count_name="num_proc", env=env, timeout=start_timeout, timeout_name="start_timeout")
    if not isinstance(verbose, int):
        raise ValueError(f"verbose={verbose!r} is invalid: expected an int (0 silences rank output)")
    if store is not None and not isinstance(store, Store):
        raise TypeError(f"store must be a spark_hvd.spark.Store, got {type(store).__name__}; use Store.create(path)")
    info = wait_for_slots(session, num_proc)
    if info.client_is_local:
        check_executor_python(executor_python(session, info), info.master, config.environ_snapshot())
    try:
        payload = dumps_call(fn, args, kwargs or {})
    except Exception as exc:
        raise ValueError(f"fn, args or kwargs could not be pickled with cloudpickle: {exc}; pass picklable "
                         "values, or create unpicklable objects (sessions, sockets, locks) inside fn") from None

    secret = config.new_secret()
    out: TextIO = stdout if stdout is not None else sys.stdout
    err: TextIO = stderr if stderr is not None else sys.stderr
    if prefix_output_with_timestamp:
        out, err = TimestampedLines(out), TimestampedLines(err)
    collector, address, log_store, log_dir = _output_channel(session, info, store, secret, out, err, verbose)
    try:
        rendezvous = _driver_rendezvous(session, info, secret)
    except BaseException:
        collector.close()
        raise
    spec = TaskSpec(
        num_proc=num_proc, payload=payload, driver_sys_path=tuple(p for p in sys.path if isinstance(p, str)),
        secret=secret, collector_address=address,
        settings={"start_timeout": start_timeout}, env=dict(env or {}), use_gpu=use_gpu, verbose=verbose,
        log_store=log_store, log_dir=log_dir, interfaces=interfaces, executable=executable,
        rendezvous_address=rendezvous.address if rendezvous is not None else None,
        preload=preload,
    )

    def task(batches: Any) -> Any:
        return run_task(spec, batches)

    if verbose >= 2:
        err.write(f"spark-hvd: running {getattr(fn, '__name__', 'fn')} on {num_proc} barrier tasks\n")
    started = time.monotonic()
    stage = session.range(0, num_proc, 1, num_proc).mapInArrow(task, RESULT_SCHEMA, barrier=True)
    cancel_scope = _JobTag(session) if info.connect else _JobGroup(session.sparkContext,
                                                                   f"spark_hvd.spark.run: {num_proc} ranks")
    try:
        with cancel_scope, _QuietTaskFailures(session):
            try:
                rows = stage.collect()
            except KeyboardInterrupt:
                cancel_scope.cancel()
                raise
            except Exception as exc:
                failure = _first_cause(collector, exc, num_proc)
                raise _root_cause(_rank_error(failure, exc), failure, dict(collector.finished)) from None
        collector.wait_closed(sum(1 for row in rows if row["streamed"]), _DRAIN_WAIT_S)
    finally:
        collector.close()
        if rendezvous is not None:
            rendezvous.close()
    if verbose >= 2:
        err.write(f"spark-hvd: {num_proc} ranks finished in {time.monotonic() - started:.1f} s\n")
    by_rank = {int(row["rank"]): bytes(row["result"]) for row in rows}
    # Each blob is the rank process's own ("ok", value) outcome, sealed by its task; unpickled
    # only once the seal proves it came from a holder of this job's secret.
    return [cloudpickle.loads(unseal(secret, STORE_CONTEXT, result_name(rank), by_rank[rank]))[1]
            for rank in range(num_proc)]
