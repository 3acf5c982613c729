"""The body of one barrier task of ``spark_hvd.spark.run``: place the rank, start its process, report.

Every task learns the hosts of all tasks through the job's rendezvous server. On a classic
session the driver serves it (its address travels in the :class:`TaskSpec`); each task puts its
host there and reads everyone's. On Spark Connect the driver may be out of the executors' reach,
so partition 0's task serves it and leaves its address in the store that carries the job's output;
partition 0 then holds the server until every other task has said its rank is done with it. Only
a Connect job without a store meets through ``BarrierTaskContext.allGather`` and a closing
``barrier()``, each of which Spark answers no sooner than a second after it is called. Ranks are
numbered host by host (partition 0 is always rank 0), so ranks that share a host are neighbours in
the ring. The rank's ``fn`` then runs in a process of its own, managed by
:class:`spark_hvd.runner.RankProcesses`: a fresh interpreter (``python -m spark_hvd.runner.worker``)
or, for a job that preloads modules, a fork of this Python worker's warm process
(:mod:`spark_hvd.runner.warm`). Its output is streamed to the driver line by line (over a socket,
or through the store for a Spark Connect client); a failed rank fails the task, which makes Spark
abort the whole stage and kill the other tasks (and, with them, their rank processes). The task's
one result row carries its rank's outcome, sealed with the job secret.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import posixpath
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

from spark_hvd.runner.errors import RankFailedError
from spark_hvd.runner.payload import FUNCTION_FILE, read_sealed, result_file, write_sealed
from spark_hvd.runner import warm
from spark_hvd.runner.hosts import Placement, assign_ranks
from spark_hvd.runner.processes import RankExit, RankProcesses, print_prefixed, rank_environment

from spark_hvd.spark.launch.log_stream import LogSender
from spark_hvd.runtime.errors import RendezvousTimeout
from spark_hvd.runtime.rendezvous import RendezvousClient, RendezvousServer
from spark_hvd.runtime.seal import seal, unseal
from spark_hvd.spark.launch.store_log import STORE_CONTEXT, StoreLogSender

__all__ = ["TaskSpec", "failure_summary", "run_task", "rank_address", "name_hosts",
           "RESULT_SCHEMA", "result_name", "remove_stale_workdirs", "WORKDIR_PREFIX", "TASK_GPUS_VARIABLE", "task_gpus"]

RESULT_SCHEMA = "rank long, result binary, streamed boolean"
"""The rows a barrier task returns: its rank, its sealed outcome, whether its output was streamed."""

FAILURE_MARKER = "spark-hvd rank"
"""Start of the message of the exception a failed task raises; the driver looks for it."""

WORKDIR_PREFIX = "spark-hvd-rank"
"""Start of the name of a rank's working directory: ``spark-hvd-rank<rank>-<owner pid>-<random>``."""

_OUTPUT_TAIL_LINES = 100
_SENDER_CONNECT_TIMEOUT_S = 10.0
_EXIT_GRACE_S = 30.0
_TASK_HOST_KEY = "task/host/"
"""Rendezvous key prefix under which each task of a job puts its host (``task/host/<partition>``)."""
_TASK_DONE_KEY = "task/done/"
"""Rendezvous key prefix under which a task says its rank no longer needs the server."""
_RENDEZVOUS_FILE = "rendezvous"
"""Where, in a Connect job's output directory of the store, partition 0 leaves the server's address."""
_PUBLISH_POLL_S = 0.05
_DONE_WAIT_SLICE_S = 60.0
_PEER_LOSS_GRACE_S = 5.0
"""How long a task whose rank only lost a peer waits before failing the stage, so that the report of
the rank that caused it (raised, or died) reaches the driver before Spark kills that rank's task."""


@dataclass(frozen=True)
class TaskSpec:
    """Everything a task needs, as plain values: it travels to the executors in the closure."""

    num_proc: int
    """Number of ranks (barrier tasks) of the job."""
    payload: bytes
    """cloudpickle of ``(fn, args, kwargs)``; only the rank process unpickles it."""
    driver_sys_path: Tuple[str, ...]
    """The driver's sys.path, appended to the task's for the rank process."""
    secret: str
    """The job secret (hex), made on the driver."""
    collector_address: Optional[str]
    """host:port of the driver's log collector, or None when output goes through the store."""
    settings: Mapping[str, Any]
    """Runtime settings passed to every rank through ``worker_environment``."""
    env: Mapping[str, str]
    """The caller's extra environment variables for every rank."""
    use_gpu: Optional[bool]
    """True: set CUDA_VISIBLE_DEVICES (Spark's GPU, else local_rank); None: only from Spark's GPU."""
    verbose: int
    """0 drops rank output (failures still reach the driver); 1 and up streams it to the driver."""
    log_store: Any = None
    """The store whose ``log_dir`` carries output to a client the executors cannot reach."""
    log_dir: Optional[str] = None
    """Directory in ``log_store`` for this job's output chunks."""
    interfaces: Optional[Tuple[str, ...]] = None
    """Network interfaces to listen on and advertise (the first one a host has); None: the address
    Spark uses for the executor."""
    executable: Optional[str] = None
    """The Python of the rank processes; None: the executor's own."""
    preload: Tuple[str, ...] = ()
    """Modules a warm process imports once per executor Python worker, to fork the rank from
    (:mod:`spark_hvd.runner.warm`); empty: the rank starts a fresh interpreter."""
    rendezvous_address: Optional[str] = None
    """host:port of the rendezvous server the driver serves for the job; None when the driver may be
    out of the executors' reach (partition 0 serves one then)."""


def result_name(rank: int) -> str:
    """The name a rank's outcome is sealed under in its result row."""
    return f"result.{rank}"


def _host_of(address: str) -> str:
    host = address.rpartition(":")[0] if ":" in address else address
    return host.strip("[]") or "127.0.0.1"


def failure_summary(rank: int, details: Mapping[str, Any]) -> str:
    """The message of the exception a failed task raises (and the driver parses as a fallback)."""
    text = f"{FAILURE_MARKER} {rank} failed: {details.get('type') or 'Died'}: {details.get('message', '')}"
    trace = details.get("traceback") or ""
    if trace:
        text += "\n" + trace.rstrip()
    return text


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def remove_stale_workdirs(parent: Optional[str] = None) -> List[str]:
    """Remove rank working directories in ``parent`` (default the temp directory) whose owning
    task process is dead: an executor killed mid-task never ran its ``finally``. Returns the
    paths removed. Directories of live tasks, and names not of this form, are left alone."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(WORKDIR_PREFIX):
            continue
        fields = name[len(WORKDIR_PREFIX):].split("-")
        if len(fields) < 3 or not fields[0].isdigit() or not fields[1].isdigit():
            continue
        path = os.path.join(parent, name)
        if _pid_alive(int(fields[1])) or not os.path.isdir(path) or os.stat(path).st_uid != os.getuid():
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _write_call(workdir: str, spec: TaskSpec) -> None:
    """Leave the pickled call where ``spark_hvd.runner.worker`` reads it, sealed with the secret."""
    # The task's sys.path holds what Spark shipped here (--py-files, ...); the driver's adds the
    # modules that functions pickled by reference come from, which on a local master are here too.
    paths = [p for p in sys.path if isinstance(p, str)]
    paths += [p for p in spec.driver_sys_path if p not in paths]
    call = {"sys_path": paths, "call": spec.payload}
    write_sealed(os.path.join(workdir, FUNCTION_FILE), spec.secret, pickle.dumps(call))


TASK_GPUS_VARIABLE = "SPARK_HVD_TASK_GPUS"
"""The rank's environment variable holding the GPU addresses Spark assigned to its task, comma
separated (read by :func:`spark_hvd.spark.task.get_available_devices`)."""


def task_gpus(context: Any) -> List[str]:
    """The addresses of the GPUs Spark assigned to this task (empty without GPU scheduling)."""
    try:
        resource = context.resources().get("gpu")
    except Exception:  # resources() is missing on very old Spark versions
        resource = None
    return [str(address) for address in resource.addresses] if resource is not None else []


def _gpu_devices(context: Any, use_gpu: Optional[bool], local_rank: int) -> Optional[str]:
    if use_gpu is False:
        return None
    addresses = task_gpus(context)
    if addresses:
        return ",".join(addresses)
    return str(local_rank) if use_gpu else None


def _outcome(rank: int, sealed: Optional[bytes], failure: Optional[RankExit],
             tail: str) -> Tuple[bool, bytes, Dict[str, Any]]:
    """(ok, sealed result, failure details) from the rank's result file and how its process ended."""
    if sealed is not None and failure is None:
        return True, sealed, {}  # the value stays pickled until it reaches the driver
    status, details = "missing", {}
    if sealed is not None:
        try:
            status, details = pickle.loads(sealed)
        except Exception:  # e.g. an "ok" value whose class does not import in this task
            status = "unreadable"
    if status == "ok":
        return True, sealed or b"", {}  # fn returned; only the interpreter's exit went wrong
    if status == "error":
        exc = details.get("exception")
        return False, b"", {
            "type": details.get("type", "Exception"), "message": details.get("message", ""),
            "traceback": details.get("traceback", ""), "output_tail": tail,
            "exception": base64.b64encode(exc).decode() if exc else None,
        }
    how = failure.describe() if failure is not None else f"rank {rank} exited with code 0"
    return False, b"", {
        "type": None, "message": f"{how} before returning a result", "traceback": "", "output_tail": tail,
    }


def _run_rank(spec: TaskSpec, placement: Placement, env: Dict[str, str],
              sender: Any) -> Tuple[bool, bytes, Dict[str, Any]]:
    """Run the rank's process to the end: (ok, sealed result bytes, failure details)."""
    rank = placement.rank

    def sink(rank: int, stream: str, line: str) -> None:
        if spec.verbose > 0 and not sender.line(stream, line):
            # Undeliverable to the driver: keep it in this executor's log instead.
            print_prefixed(rank, stream, line)

    remove_stale_workdirs()
    # mode 0700: private to us; the pid in the name lets a later task on this host find it
    # stale if this process is killed before its finally runs.
    workdir = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{rank}-{os.getpid()}-")
    processes = RankProcesses(sink=sink, tail_lines=_OUTPUT_TAIL_LINES)
    try:
        _write_call(workdir, spec)
        argv = [spec.executable or sys.executable, "-m", "spark_hvd.runner.worker", workdir]
        processes.spawn(rank, argv, env, starter=warm.starter_or_none(argv[0], spec.preload, env))
        result_path = os.path.join(workdir, result_file(rank))
        returned_at: Optional[float] = None
        while True:
            # fn runs as long as it needs; what ends a hung rank is Spark killing this task when
            # the stage aborts, and the rank process dies with this one.
            try:
                failure = processes.wait(timeout=1.0)
                break
            except TimeoutError:
                pass
            if returned_at is None and os.path.exists(result_path):
                returned_at = time.monotonic()
            if returned_at is not None and time.monotonic() - returned_at > _EXIT_GRACE_S:
                failure = None  # fn returned but the interpreter does not exit: keep the result
                break
        processes.close()
        sealed = read_sealed(result_path, spec.secret) if os.path.exists(result_path) else None
        return _outcome(rank, sealed, failure, "\n".join(processes.tail(rank)))
    finally:
        processes.close()
        shutil.rmtree(workdir, ignore_errors=True)


class _NoChannel:
    """The sender of a job whose client gave no way to reach it: output stays in the executor log."""

    connected = False
    problem = "the client offered no output channel (on Spark Connect, pass store= to stream output)"

    def line(self, stream: str, text: str) -> bool:
        return False

    def failure(self, details: Dict[str, Any]) -> bool:
        return False

    def finished(self) -> bool:
        return False

    def close(self) -> None:
        pass


def _sender(spec: TaskSpec, rank: int) -> Any:
    if spec.log_store is not None and spec.log_dir is not None:
        return StoreLogSender(spec.log_store, spec.log_dir, spec.secret, rank)
    if spec.collector_address is None:
        return _NoChannel()
    return LogSender(spec.collector_address, spec.secret, rank, _SENDER_CONNECT_TIMEOUT_S)


def _task_cpus(context: Any) -> int:
    """The CPUs Spark gave this task (``spark.task.cpus``): the rank's math threads
    (:func:`spark_hvd.spark.estimator.training.rank_threads`)."""
    try:
        return max(1, int(context.cpus()))
    except Exception:  # a Spark without TaskContext.cpus(): one, Spark's default
        return 1


_NAMED_RANKS = re.compile(r"\branks? (\d+(?:, \d+)*)")


def name_hosts(message: str, hosts: Mapping[int, str], rank: int) -> str:
    """``message`` of rank ``rank``, which lost a peer, with the host of every other rank it names
    added (a rank's own runtime knows the addresses of the ranks that reached it, not of those that
    never did); ``hosts`` maps ranks to the hosts Spark ran them on."""
    named = []
    for found in _NAMED_RANKS.finditer(message):
        for text in found.group(1).split(", "):
            other = int(text)
            if other != rank and other in hosts and other not in named and hosts[other] not in message:
                named.append(other)
    if not named:
        return message
    where = ", ".join(f"rank {other} on host {hosts[other]}" for other in named[:10])
    return f"{message} [{where}]"


def rank_address(spec: TaskSpec, executor_address: str) -> str:
    """The address this task's rank listens on and advertises: that of the first interface named by
    ``nics=`` or SPARK_HVD_IFACE (HOROVOD_GLOO_IFACE; the job's ``env``, else this executor's) that
    this host has, else the one Spark uses for the executor. Never a wildcard address."""
    from spark_hvd.runtime import config
    from spark_hvd.runtime.net import advertised_address

    names = ",".join(spec.interfaces) if spec.interfaces else \
        config.read_setting("iface", {**config.environ_snapshot(), **spec.env})
    return advertised_address(_host_of(executor_address), names)


def _start_timeout(spec: TaskSpec) -> float:
    from spark_hvd.runtime import config

    return float(spec.settings.get("start_timeout") or
                 config.read_setting("start_timeout", {**config.environ_snapshot(), **spec.env}))


def _exchange_hosts(spec: TaskSpec, address: str, partition: int, host: str) -> List[str]:
    """Every task's host, in partition order, through the rendezvous server at ``address``."""
    client = RendezvousClient(address, spec.secret, _SENDER_CONNECT_TIMEOUT_S)
    try:
        client.put(f"{_TASK_HOST_KEY}{partition}", host)
        return client.get([f"{_TASK_HOST_KEY}{p}" for p in range(spec.num_proc)], timeout=_start_timeout(spec),
                          what="barrier tasks")
    finally:
        client.close()


def _publish_rendezvous(spec: TaskSpec, address: str) -> None:
    """Partition 0: leave the address of the server it serves where the other tasks look for it."""
    name = _RENDEZVOUS_FILE
    spec.log_store.write(posixpath.join(spec.log_dir, name),
                         seal(spec.secret, STORE_CONTEXT, name, json.dumps({"address": address}).encode()))


def _published_rendezvous(spec: TaskSpec) -> str:
    """The address partition 0 published in the store, waiting for it up to the start timeout."""
    path = posixpath.join(spec.log_dir, _RENDEZVOUS_FILE)
    timeout = _start_timeout(spec)
    deadline = time.monotonic() + timeout
    while not spec.log_store.exists(path):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"partition 0 did not publish the job's rendezvous address at {path} within "
                               f"{timeout:.0f} s; check that every barrier task started, or raise "
                               "SPARK_HVD_START_TIMEOUT")
        time.sleep(_PUBLISH_POLL_S)
    sealed = spec.log_store.read(path)
    return str(json.loads(unseal(spec.secret, STORE_CONTEXT, _RENDEZVOUS_FILE, sealed))["address"])


def _meet(spec: TaskSpec, context: Any, partition: int,
          host: str) -> Tuple[List[str], str, Optional[RendezvousServer], bool]:
    """(every task's host in partition order, the rendezvous address, the server this task serves
    or None, whether the tasks met through Spark's allGather and must end with its barrier)."""
    if spec.rendezvous_address is not None:
        # One stage attempt per server: Spark never retries a failed barrier ResultStage (it
        # aborts the job), so no keys of an earlier attempt can be there.
        return _exchange_hosts(spec, spec.rendezvous_address, partition, host), spec.rendezvous_address, None, False
    server = RendezvousServer(host, spec.secret) if partition == 0 else None
    try:
        if spec.log_store is not None and spec.log_dir is not None:
            if server is not None:
                _publish_rendezvous(spec, server.address)
            address = server.address if server is not None else _published_rendezvous(spec)
            return _exchange_hosts(spec, address, partition, host), address, server, False
        mine = {"host": host, "rendezvous": server.address if server else None}
        everyone = [json.loads(m) for m in context.allGather(json.dumps(mine))]
        return [m["host"] for m in everyone], everyone[0]["rendezvous"], server, True
    except BaseException:
        if server is not None:
            server.close()
        raise


def _part(spec: TaskSpec, address: str, partition: int, server: Any) -> None:
    """After this task's rank finished: partition 0, which serves the rendezvous, waits until every
    other task says its rank is done with it; the others say so."""
    client = RendezvousClient(address, spec.secret, _SENDER_CONNECT_TIMEOUT_S)
    try:
        if server is None:
            client.put(f"{_TASK_DONE_KEY}{partition}", "1")
            return
        keys = [f"{_TASK_DONE_KEY}{p}" for p in range(1, spec.num_proc)]
        while True:  # as long as the other ranks run; a failed one makes Spark kill this task
            try:
                client.get(keys, timeout=_DONE_WAIT_SLICE_S, what="other tasks")
                return
            except RendezvousTimeout:
                continue
    finally:
        client.close()


def run_task(spec: TaskSpec, batches: Iterable[Any]) -> Iterator[Any]:
    """mapInArrow function of the barrier stage: yields one row ``(rank, sealed outcome, streamed)``."""
    import pyarrow as pa
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    partition = context.partitionId()
    host = rank_address(spec, context.getTaskInfos()[partition].address)
    server: Optional[RendezvousServer] = None
    sender: Any = None
    try:
        hosts, rendezvous_addr, server, met_by_spark = _meet(spec, context, partition, host)
        placements = assign_ranks(hosts)
        placement = placements[partition]
        rank = placement.rank

        for _ in batches:  # the input rows only shape the stage: one partition per rank
            pass
        sender = _sender(spec, rank)
        if not sender.connected:
            sys.stderr.write(f"spark-hvd: rank {rank} output stays in this executor's log: {sender.problem}\n")
        extra = dict(spec.env)
        gpus = _gpu_devices(context, spec.use_gpu, placement.local_rank)
        if gpus is not None:
            extra.setdefault("CUDA_VISIBLE_DEVICES", gpus)
        extra[TASK_GPUS_VARIABLE] = ",".join(task_gpus(context))
        env = rank_environment(
            rank=rank, size=spec.num_proc, local_rank=placement.local_rank, local_size=placement.local_size,
            cross_rank=placement.cross_rank, cross_size=placement.cross_size, rendezvous_addr=rendezvous_addr,
            secret=spec.secret, hostname=host, settings={"task_cpus": _task_cpus(context), **(spec.settings or {})},
            extra=extra,
        )
        ok, outcome, details = _run_rank(spec, placement, env, sender)
        if not ok:
            lost_a_peer = RankFailedError(rank, "", exc_type=details.get("type")).lost_a_peer()
            if lost_a_peer:
                by_rank = {p.rank: h for p, h in zip(placements, hosts)}
                details = dict(details, message=name_hosts(str(details.get("message", "")), by_rank, rank))
            sender.failure(details)
            if lost_a_peer:
                time.sleep(_PEER_LOSS_GRACE_S)
            raise RuntimeError(failure_summary(rank, details))
        sender.finished()
        streamed = sender.connected
        sender.close()
        # Partition 0 serves the rendezvous until every rank is done with it.
        if met_by_spark:
            context.barrier()
        elif spec.rendezvous_address is None:
            _part(spec, rendezvous_addr, partition, server)
        sealed = seal(spec.secret, STORE_CONTEXT, result_name(rank), outcome)
        yield pa.RecordBatch.from_pydict({"rank": [rank], "result": [sealed], "streamed": [streamed]},
                                         schema=pa.schema([("rank", pa.int64()), ("result", pa.binary()),
                                                           ("streamed", pa.bool_())]))
    finally:
        if sender is not None:
            sender.close()
        if server is not None:
            server.close()
