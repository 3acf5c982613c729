"""A Spark standalone cluster on the harness's hosts: a master on the machine, one worker per host.

The master and every driver listen on the machine's address of the cluster network
(``10.213.0.1``); each worker runs on its host, with ``SPARK_LOCAL_IP`` set to the host's address,
so its executors and their Python workers (and the ranks they start) live on that host. Everything
comes from the pip package's ``spark-class`` and ``spark-submit``. :class:`SparkCluster` hands out
one SparkSession at a time, of a *kind*: ``"2x1"`` (one task slot on each host), ``"2x2"`` (two), or
a Spark Connect session on a Connect server started against the master. Asking for another kind
stops the current one first (a standalone application holds its executors' cores).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List, Mapping, Optional

from cluster_hosts import MACHINE_ADDRESS, HarnessError, Host, Hosts, death_hook

__all__ = ["SparkCluster", "SESSION_KINDS", "wait_for"]

MASTER_PORT = 7077
MASTER_UI_PORT = 18080
"""The master's web UI, whose ``/json/`` says what every worker runs."""
CONNECT_PORT = 15102
_START_TIMEOUT_S = 180.0
_STOP_GRACE_S = 20.0
_FAST_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
"""Short-lived JVMs on a busy two-core machine start sooner with the C1 compiler alone."""

_DRIVER_ENVIRON = ("SPARK_LOCAL_IP", "PYSPARK_PYTHON", "SPARK_CONNECT_MODE_ENABLED")
"""What the cluster's sessions set in this process's environment; restored when the cluster closes."""

SESSION_KINDS = {"2x1": 1, "2x2": 2}
"""Classic session kinds: task slots on each host."""


def wait_for(condition: Any, timeout: float, what: str, interval: float = 0.2) -> Any:
    """Poll ``condition()`` until it returns something true; HarnessError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise HarnessError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(interval)


def _spark_home() -> str:
    import pyspark

    return os.path.dirname(pyspark.__file__)


def _listening(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=1.0):
            return True
    except OSError:
        return False


class SparkCluster:
    """A master and one worker of ``cores`` cores on each of ``hosts``; use as a context manager."""

    def __init__(self, hosts: Hosts, cores: int = 2, worker_memory: str = "3g",
                 env: Optional[Mapping[str, str]] = None) -> None:
        self.hosts = hosts
        self._saved_environ = {name: os.environ.get(name) for name in _DRIVER_ENVIRON}
        self.cores = cores
        self.worker_memory = worker_memory
        self.extra_env = dict(env or {})
        self.master_url = f"spark://{MACHINE_ADDRESS}:{MASTER_PORT}"
        self.master: Optional[subprocess.Popen] = None
        self.workers: Dict[int, subprocess.Popen] = {}
        self.connect_server: Optional[subprocess.Popen] = None
        self.session: Any = None
        self.kind: Optional[str] = None
        assert hosts._dir is not None, "start the hosts first"
        self.dir = hosts._dir
        self._logs: List[Any] = []

    def __enter__(self) -> "SparkCluster":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- processes ---------------------------------------------------------------------------------
    def environment(self, address: str) -> Dict[str, str]:
        """The environment of a Spark process that listens on ``address``."""
        env = {**os.environ, **self.extra_env}
        for name in ("SPARK_HOME", "PYSPARK_GATEWAY_PORT", "PYSPARK_GATEWAY_SECRET", "SPARK_CONNECT_MODE_ENABLED",
                     "SPARK_LOCAL_REMOTE", "SPARK_REMOTE"):
            env.pop(name, None)
        env.update({
            "SPARK_LOCAL_IP": address, "SPARK_LOCAL_HOSTNAME": address, "PYSPARK_PYTHON": sys.executable,
            "SPARK_DAEMON_JAVA_OPTS": _FAST_JVM, "SPARK_DAEMON_MEMORY": "256m",
            "SPARK_LOG_DIR": self.dir, "SPARK_CONF_DIR": os.path.join(self.dir, "conf"),
            "PATH": os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", os.defpath)]),
        })
        return env

    def _log(self, name: str) -> Any:
        log = open(os.path.join(self.dir, f"{name}.log"), "ab")
        self._logs.append(log)
        return log

    def log_text(self, name: str) -> str:
        try:
            with open(os.path.join(self.dir, f"{name}.log"), "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def start(self) -> None:
        os.makedirs(os.path.join(self.dir, "conf"), exist_ok=True)
        with open(os.path.join(self.dir, "conf", "log4j2.properties"), "w") as f:
            f.write("rootLogger.level = warn\nrootLogger.appenderRef.stdout.ref = console\n"
                    "appender.console.type = Console\nappender.console.name = console\n"
                    "appender.console.target = SYSTEM_ERR\nappender.console.layout.type = PatternLayout\n"
                    "appender.console.layout.pattern = %d{HH:mm:ss.SSS} %p %c{1}: %m%n\n"
                    "logger.worker.name = org.apache.spark.deploy\nlogger.worker.level = info\n")
        spark_class = os.path.join(_spark_home(), "bin", "spark-class")
        log = self._log("master")
        self.master = subprocess.Popen(
            [spark_class, "org.apache.spark.deploy.master.Master", "--host", MACHINE_ADDRESS, "--port",
             str(MASTER_PORT), "--webui-port", str(MASTER_UI_PORT)], env=self.environment(MACHINE_ADDRESS), stdout=log, stderr=log,
            stdin=subprocess.DEVNULL, preexec_fn=death_hook())
        wait_for(lambda: self.master.poll() is not None or _listening(MACHINE_ADDRESS, MASTER_PORT),
                 _START_TIMEOUT_S, "the Spark master listening")
        if self.master.poll() is not None:
            raise HarnessError(f"the Spark master exited: {self.log_text('master')[-2000:]}")
        for host in self.hosts.hosts:
            self.start_worker(host)
        for host in self.hosts.hosts:
            self.wait_worker(host)

    def start_worker(self, host: Host) -> None:
        """Start (or start again) the worker of ``host``."""
        spark_class = os.path.join(_spark_home(), "bin", "spark-class")
        work_dir = os.path.join(self.dir, f"work-{host.name}")
        os.makedirs(work_dir, exist_ok=True)
        name = f"worker-{host.name}"
        with open(os.path.join(self.dir, f"{name}.log"), "wb"):
            pass  # a restarted worker's log starts empty, so its registration is seen afresh
        log = self._log(name)
        env = self.environment(host.address)
        env["SPARK_LOCAL_DIRS"] = os.path.join(work_dir, "local")
        self.workers[host.index] = host.popen(
            [spark_class, "org.apache.spark.deploy.worker.Worker", "--host", host.address, "--cores", str(self.cores),
             "--memory", self.worker_memory, "--work-dir", work_dir, "--webui-port", "0", self.master_url],
            env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL)

    def wait_worker(self, host: Host) -> None:
        name = f"worker-{host.name}"
        wait_for(lambda: "Successfully registered with master" in self.log_text(name)
                 or self.workers[host.index].poll() is not None, _START_TIMEOUT_S, f"the worker of {host.name} "
                 "registering with the master")
        if self.workers[host.index].poll() is not None:
            raise HarnessError(f"the worker of {host.name} exited: {self.log_text(name)[-2000:]}")

    def ensure_workers(self) -> None:
        """Start again the worker of every host whose worker has exited (a test killed it and did not
        bring it back), so that each session finds a worker on every host."""
        gone = [host for host in self.hosts.hosts if self.workers.get(host.index) is None
                or self.workers[host.index].poll() is not None]
        for host in gone:
            self.start_worker(host)
        for host in gone:
            self.wait_worker(host)

    # -- sessions ----------------------------------------------------------------------------------
    def session_conf(self, slots_per_host: int) -> Dict[str, str]:
        """Settings of a classic application with ``slots_per_host`` task slots on every host."""
        python = sys.executable
        return {
            "spark.master": self.master_url,
            "spark.driver.host": MACHINE_ADDRESS, "spark.driver.bindAddress": MACHINE_ADDRESS,
            "spark.executor.cores": str(slots_per_host),
            "spark.cores.max": str(slots_per_host * len(self.hosts.hosts)),
            "spark.executor.memory": "1g", "spark.driver.memory": "1g",
            "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false",
            "spark.sql.shuffle.partitions": "4",
            "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "1",
            "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "1s",
            "spark.pyspark.python": python, "spark.pyspark.driver.python": python,
            "spark.executorEnv.PYSPARK_PYTHON": python,
            "spark.driver.extraJavaOptions": _FAST_JVM, "spark.executor.extraJavaOptions": _FAST_JVM,
            "spark.sql.execution.arrow.pyspark.enabled": "true",
        }

    def use(self, kind: str) -> Any:
        """A session of ``kind`` (``"2x1"``, ``"2x2"`` or ``"connect"``); the current one when it is of that kind."""
        if kind != "connect" and kind not in SESSION_KINDS:
            raise ValueError(f"kind={kind!r} is not a session kind: expected one of {[*SESSION_KINDS, 'connect']}")
        self.ensure_workers()
        if self.session is not None and self.kind == kind and self._alive() and self._spread():
            return self.session
        self.stop_session()
        self.session = self._connect_session() if kind == "connect" else self._classic_session(SESSION_KINDS[kind])
        self.kind = kind
        return self.session

    def _alive(self) -> bool:
        """Whether the current session still runs (a program may have stopped it)."""
        if self.kind == "connect":
            return self.connect_server is not None and self.connect_server.poll() is None
        from pyspark import SparkContext

        return SparkContext._active_spark_context is not None

    def _spread(self) -> bool:
        """Whether the current session has one executor on every host: after a host's executor was
        lost, Spark may have started its replacement on another host that had a free core."""
        if self.kind == "connect":
            return True
        return sorted(self.executor_hosts(self.session)) == sorted(host.address for host in self.hosts.hosts)

    @staticmethod
    def executor_hosts(session: Any) -> List[str]:
        """The hosts of a classic session's executors (the driver left out)."""
        infos = session.sparkContext._jsc.sc().statusTracker().getExecutorInfos()
        return [info.host() for info in infos if info.host() != MACHINE_ADDRESS]

    def _classic_session(self, slots_per_host: int) -> Any:
        from pyspark.sql import SparkSession

        # Read by the driver JVM if this process starts one now.
        os.environ["SPARK_LOCAL_IP"] = MACHINE_ADDRESS
        os.environ["PYSPARK_PYTHON"] = sys.executable
        builder = SparkSession.builder.appName(f"spark-hvd-cluster-{slots_per_host}")
        for key, value in self.session_conf(slots_per_host).items():
            builder = builder.config(key, value)
        session = builder.getOrCreate()
        session.sparkContext.pythonExec = sys.executable
        session.sparkContext.setLogLevel("ERROR")
        self._wait_slots(session, slots_per_host * len(self.hosts.hosts))
        wanted = sorted(host.address for host in self.hosts.hosts)
        wait_for(lambda: sorted(self.executor_hosts(session)) == wanted, _START_TIMEOUT_S,
                 f"one executor on each of {wanted}")
        return session

    @staticmethod
    def _wait_slots(session: Any, slots: int) -> None:
        from spark_hvd.spark.launch.retry import wait_for_free_slots

        wait_for_free_slots(session, slots, _START_TIMEOUT_S)

    def _connect_session(self) -> Any:
        from pyspark.sql.connect.session import SparkSession as ConnectSession

        submit = os.path.join(_spark_home(), "bin", "spark-submit")
        conf = {**self.session_conf(SESSION_KINDS["2x1"]), "spark.connect.grpc.binding.address": MACHINE_ADDRESS,
                "spark.connect.grpc.binding.port": str(CONNECT_PORT)}
        argv = [submit, "--class", "org.apache.spark.sql.connect.service.SparkConnectServer", "--name",
                "spark-hvd-connect"]
        for key, value in conf.items():
            argv += ["--conf", f"{key}={value}"]
        env = self.environment(MACHINE_ADDRESS)
        env["SPARK_CONNECT_MODE"] = "0"  # what start-connect-server.sh sets: this JVM is the server
        env["SPARK_DAEMON_MEMORY"] = "1g"  # the launcher sizes the server's driver as a daemon
        log = self._log("connect-server")
        self.connect_server = subprocess.Popen(argv + ["spark-internal"], env=env, stdout=log, stderr=log,
                                               stdin=subprocess.DEVNULL, preexec_fn=death_hook())
        wait_for(lambda: self.connect_server.poll() is not None or _listening(MACHINE_ADDRESS, CONNECT_PORT),
                 _START_TIMEOUT_S, "the Spark Connect server listening")
        if self.connect_server.poll() is not None:
            raise HarnessError(f"the Spark Connect server exited: {self.log_text('connect-server')[-3000:]}")
        # pyspark's functions (F.col, ...) build Connect columns only while this says so.
        os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"
        session = ConnectSession.builder.remote(f"sc://{MACHINE_ADDRESS}:{CONNECT_PORT}").getOrCreate()
        self._wait_slots(session, len(self.hosts.hosts))
        return session

    def stop_session(self) -> None:
        session, self.session, self.kind = self.session, None, None
        if session is not None:
            try:
                session.stop()
            except Exception:  # a Connect client whose server is already gone
                pass
        server, self.connect_server = self.connect_server, None
        if server is not None:
            _stop(server)
            os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)
        if session is not None or server is not None:
            # The master places the next application's executors where cores are free: wait until the
            # stopped one's executors have gone from every worker, or its successor's could all land on one host.
            wait_for(lambda: self.cores_used() == 0, _START_TIMEOUT_S, "the stopped application's executors ending")

    def master_state(self) -> Dict[str, Any]:
        """The master's view of the cluster (its web UI's ``/json/``): workers, applications."""
        import json
        import urllib.request

        with urllib.request.urlopen(f"http://{MACHINE_ADDRESS}:{MASTER_UI_PORT}/json/", timeout=5.0) as reply:
            return json.loads(reply.read())

    def cores_used(self) -> int:
        """Cores that applications hold on the live workers."""
        try:
            state = self.master_state()
        except OSError:
            return -1
        return sum(worker.get("coresused", 0) for worker in state.get("workers", []) if worker.get("state") == "ALIVE")

    # -- ending --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the session, the workers and the master (the hosts are closed by their owner)."""
        self.stop_session()
        for process in self.workers.values():
            _stop(process)
        self.workers = {}
        if self.master is not None:
            _stop(self.master)
            self.master = None
        for log in self._logs:
            log.close()
        self._logs = []
        self._forget_driver_jvm()
        for name, value in self._saved_environ.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    @staticmethod
    def _forget_driver_jvm() -> None:
        """End the driver JVM this process started for the cluster's sessions: it was started with the
        cluster's address in its environment, which is gone with the hosts, so the next SparkSession of
        this process (another test module's local one) must start a JVM of its own."""
        from pyspark import SparkContext

        gateway = SparkContext._gateway
        if gateway is None:
            return
        process = getattr(gateway, "proc", None)
        try:
            gateway.shutdown()
        except Exception:  # a JVM that is already gone
            pass
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(timeout=_STOP_GRACE_S)
        SparkContext._gateway = None
        SparkContext._jvm = None


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=_STOP_GRACE_S)
