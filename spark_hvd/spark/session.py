"""Spark sessions: a local one for laptops, tests and examples, and what spark-hvd needs to know
about any session (classic or Spark Connect) without asking for a SparkContext."""

from __future__ import annotations

import os
import re
import socket
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

__all__ = ["LOCAL_ENVIRONMENT", "local_spark_conf", "local_session", "SessionInfo", "session_info",
           "is_connect", "active_session", "task_max_failures", "SPARK_TASK_MAX_FAILURES"]

LOCAL_ENVIRONMENT: Dict[str, str] = {"SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}
"""Environment for a process that starts a local Spark JVM: loopback only, workers run this Python."""

_LOCAL_MASTER = re.compile(r"^local(?:\[(\*|\d+)(?:,\s*(\d+))?\])?$")
_LOCAL_CLUSTER = re.compile(r"^local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]$")
_LOOPBACK = ("localhost", "127.0.0.1", "::1", "[::1]")


def local_spark_conf(num_cores: int = 2, shuffle_partitions: int = 4) -> Dict[str, str]:
    """Spark settings for a local session: ``local[num_cores]``, no UI, loopback addresses, few
    shuffle partitions, and barrier stages that fail at once when slots are missing."""
    return {
        "spark.master": f"local[{num_cores}]",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.sql.shuffle.partitions": str(shuffle_partitions),
        # By default a barrier stage with too few slots re-checks 40 times, 15 s apart.
        "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "1",
        "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "1s",
        "spark.pyspark.python": sys.executable,
        "spark.pyspark.driver.python": sys.executable,
    }


def local_session(app_name: str = "spark-hvd", num_cores: int = 2, conf: Optional[Mapping[str, Any]] = None,
                  connect: bool = False) -> Any:
    """A local SparkSession whose Python workers run this interpreter, on loopback only.

    ``connect=True`` starts a local Spark Connect server in this process, on a free port of
    127.0.0.1, and returns a Connect session (as ``SparkSession.builder.remote("local[n]")`` does;
    needs ``pip install "pyspark[connect]"``), the kind of session Databricks' shared and serverless
    compute give. ``conf`` is applied on top
    of :func:`local_spark_conf`. Sets ``SPARK_LOCAL_IP`` and ``PYSPARK_PYTHON`` in this process's
    environment when unset (the Spark JVM reads them when it starts). A running classic session is
    reused as it is (Spark allows one SparkContext per process).
    """
    from pyspark.sql import SparkSession

    for name, value in LOCAL_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    settings = {**local_spark_conf(num_cores), **{k: str(v) for k, v in dict(conf or {}).items()}}
    if connect:
        return _local_connect_session(app_name, settings)

    from pyspark import SparkContext

    creating = SparkContext._active_spark_context is None
    builder = SparkSession.builder.appName(app_name)
    for key, value in settings.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    if creating:
        # pyspark's Python side takes the workers' interpreter from PYSPARK_PYTHON only, else
        # whatever 'python3' is on PATH, which need not have this environment's packages.
        session.sparkContext.pythonExec = session.sparkContext.getConf().get("spark.pyspark.python", sys.executable)
    return session


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _local_connect_session(app_name: str, settings: Dict[str, str]) -> Any:
    """A Connect client of a Connect server started in this process, on a free loopback port.

    ``remote("local[n]")`` would bind the server to every interface on the fixed port 15002, so
    two processes on one machine collide; here the server listens on 127.0.0.1 only, on a port
    of its own. Stopping the session stops the server, as with ``remote("local[n]")``.
    """
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    master = settings.pop("spark.master")
    start = getattr(ConnectSession, "_start_connect_server", None)
    if start is None:  # a pyspark without the helper: its own local server, on its fixed port
        builder = ConnectSession.builder.remote(master).appName(app_name)
        with warnings.catch_warnings():
            # The local server takes every setting at start; the client also tries to set the
            # static ones at run time and warns that it cannot, which is expected.
            warnings.filterwarnings("ignore", message=r"Failed to set spark\.", category=UserWarning)
            return builder.config(map=settings).getOrCreate()
    port = _free_loopback_port()
    options: Dict[str, Any] = {**settings, "spark.app.name": app_name,
                               "spark.connect.grpc.binding.address": "127.0.0.1",
                               "spark.connect.grpc.binding.port": str(port)}
    # pyspark's own flags for a server living in this process: Connect mode on, and stop()
    # ends the server with the session.
    os.environ["SPARK_LOCAL_REMOTE"] = "1"
    os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"
    start(master, options)  # the server's sessions take their defaults from these settings
    # "localhost" is the one host name the client sends its token to without TLS.
    return ConnectSession.builder.remote(f"sc://localhost:{port}").getOrCreate()


def is_connect(session: Any) -> bool:
    """Whether ``session`` is a Spark Connect session (no SparkContext, no JVM in this process)."""
    try:
        from pyspark.sql.connect.session import SparkSession as ConnectSession
    except ImportError:  # pyspark without the connect extra cannot make Connect sessions
        return False
    return isinstance(session, ConnectSession)


def active_session(what: str) -> Any:
    """The active SparkSession, classic or Connect; a ValueError saying how to make one."""
    from pyspark.sql import SparkSession

    # The active session is per thread; worker threads (CrossValidator's pool) see the default one.
    session = SparkSession.getActiveSession() or getattr(SparkSession, "_instantiatedSession", None)
    if session is None:
        try:
            from pyspark.sql.connect.session import SparkSession as ConnectSession

            session = ConnectSession.getActiveSession() or getattr(ConnectSession, "_default_session", None)
        except ImportError:
            session = None
    if session is None:
        raise ValueError(f"{what} needs an active SparkSession, but there is none; create one first, e.g. "
                         "SparkSession.builder.master('local[2]').getOrCreate() or spark_hvd.spark.local_session()")
    return session


@dataclass(frozen=True)
class SessionInfo:
    """What spark-hvd needs to know about a session, read the same way for classic and Connect."""

    connect: bool
    """A Spark Connect session: no SparkContext; executors may not reach this process."""
    master: str
    """``spark.master`` as the cluster reports it ('' when it does not say)."""
    slots: Optional[int]
    """Tasks the cluster can run at once, or None when it cannot be told without running a job."""
    default_parallelism: int
    """The default number of ranks when ``num_proc`` is not given."""
    client_is_local: bool
    """Whether the cluster's driver runs on this machine (always True for classic sessions)."""

    @property
    def local(self) -> bool:
        """A local master (``local[...]``) whose driver is on this machine."""
        return self.master.startswith("local") and self.client_is_local


def _conf(session: Any, key: str) -> Optional[str]:
    try:
        value = session.conf.get(key, None)
    except Exception:  # a key the server refuses to show counts as unset
        return None
    return None if value is None else str(value)


def slots_from_conf(master: str, get: Any) -> Optional[int]:
    """Task slots implied by the master URL and executor settings, or None when they do not say."""
    task_cpus = int(get("spark.task.cpus") or 1)
    found = _LOCAL_MASTER.match(master)
    if found:
        threads = found.group(1)
        if threads is None:
            return 1
        return (os.cpu_count() or 1) if threads == "*" else int(threads)
    found = _LOCAL_CLUSTER.match(master)
    if found:
        return int(found.group(1)) * (int(found.group(2)) // task_cpus)
    if (get("spark.dynamicAllocation.enabled") or "false").lower() == "true":
        return None
    instances, cores = get("spark.executor.instances"), get("spark.executor.cores")
    if instances and cores:
        return int(instances) * (int(cores) // task_cpus)
    return None


SPARK_TASK_MAX_FAILURES = 4
"""Spark's default ``spark.task.maxFailures`` on a cluster."""


def task_max_failures(session: Any) -> int:
    """How many times Spark lets one task fail before it fails the job: the ``F`` of a
    ``local[N,F]`` master (1 for ``local[N]``, which does not retry tasks), else
    ``spark.task.maxFailures`` (default 4)."""
    master = str(session.sparkContext.master) if not is_connect(session) else (_conf(session, "spark.master") or "")
    found = _LOCAL_MASTER.match(master)
    if found:
        return int(found.group(2) or 1)
    value = _conf(session, "spark.task.maxFailures")
    return int(value) if value else SPARK_TASK_MAX_FAILURES


def _client_is_local(session: Any) -> bool:
    try:
        host = session.client._builder.host  # the channel builder of the Connect client
    except AttributeError:
        return False
    return str(host) in _LOOPBACK


def session_info(session: Any) -> SessionInfo:
    """The :class:`SessionInfo` of ``session``."""
    if not is_connect(session):
        sc = session.sparkContext
        return SessionInfo(connect=False, master=str(sc.master), slots=_jvm_slots(sc),
                           default_parallelism=int(sc.defaultParallelism), client_is_local=True)
    master = _conf(session, "spark.master") or ""
    slots = slots_from_conf(master, lambda key: _conf(session, key))
    local = _client_is_local(session)
    if master.startswith("local[*]") and not local:
        slots = None  # the server's cores, not this machine's
    default = int(_conf(session, "spark.default.parallelism") or slots or 2)
    return SessionInfo(connect=True, master=master, slots=slots, default_parallelism=default, client_is_local=local)


def _jvm_slots(sc: Any) -> int:
    """Tasks a classic cluster can run at once for the default resource profile."""
    jsc = sc._jsc.sc()
    try:
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(profile))
    except Exception:  # Spark before 3.1 has no resource profiles
        return int(sc.defaultParallelism)
