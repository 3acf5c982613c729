"""Every ``SPARK_HVD_*`` setting, declared once: the worker contract and the tuning knobs.

Precedence is explicit argument > environment > default. Horovod's variable names are read as
aliases, so job configurations written for Horovod keep working. This is the only module of the
project that reads ``os.environ``.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from .ordering import ORDERINGS

__all__ = [
    "Setting",
    "SETTINGS",
    "RuntimeConfig",
    "worker_environment",
    "elastic_worker_environment",
    "setting_environment",
    "new_secret",
    "read_setting",
    "environ_snapshot",
]


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean such as 1/0 or true/false, got {text!r}")


def _parse_controller(text: str) -> str:
    value = text.strip().lower()
    value = {"gloo": "ring", "": "auto"}.get(value, value)
    if value not in ("auto", "mpi", "ring"):
        raise ValueError(f"expected mpi, ring (gloo) or auto, got {text!r}")
    return value


_parse_controller.__name__ = "controller"


def _parse_ordering(text: str) -> str:
    value = text.strip().lower() or "auto"
    if value not in ORDERINGS:
        raise ValueError(f"expected one of {', '.join(ORDERINGS)}, got {text!r}")
    return value


_parse_ordering.__name__ = "ordering"


@dataclass(frozen=True)
class Setting:
    """One configuration variable of the runtime."""

    field: str
    """Attribute name on :class:`RuntimeConfig`."""
    env: str
    """The ``SPARK_HVD_*`` environment variable."""
    type: Callable[[str], Any]
    """Parser from the environment's text."""
    default: Any
    """Value used when neither an argument nor the environment gives one."""
    doc: str
    """One line saying what the setting does."""
    aliases: Tuple[str, ...] = ()
    """Other environment variables (Horovod's names) read when ``env`` is unset."""


MiB = 1024 * 1024

SETTINGS: Tuple[Setting, ...] = (
    # The worker contract, written by exactly one launcher function: worker_environment().
    Setting("rank", "SPARK_HVD_RANK", int, None, "Global rank of this process.", ("HOROVOD_RANK",)),
    Setting("size", "SPARK_HVD_SIZE", int, None, "Number of processes in the job.", ("HOROVOD_SIZE",)),
    Setting("local_rank", "SPARK_HVD_LOCAL_RANK", int, None, "Rank among the processes on this host.",
            ("HOROVOD_LOCAL_RANK",)),
    Setting("local_size", "SPARK_HVD_LOCAL_SIZE", int, None, "Number of processes on this host.",
            ("HOROVOD_LOCAL_SIZE",)),
    Setting("cross_rank", "SPARK_HVD_CROSS_RANK", int, None, "Index of this host among the job's hosts.",
            ("HOROVOD_CROSS_RANK",)),
    Setting("cross_size", "SPARK_HVD_CROSS_SIZE", int, None, "Number of hosts in the job.",
            ("HOROVOD_CROSS_SIZE",)),
    Setting("rendezvous_addr", "SPARK_HVD_RENDEZVOUS_ADDR", str, None,
            "host:port of the rendezvous server where ranks publish their addresses."),
    Setting("secret", "SPARK_HVD_SECRET", str, None,
            "Hex job secret; every connection proves knowledge of it before any payload is read."),
    Setting("hostname", "SPARK_HVD_HOSTNAME", str, "127.0.0.1",
            "Address this rank listens on and advertises to its peers.", ("HOROVOD_HOSTNAME",)),
    Setting("host_key", "SPARK_HVD_HOST_KEY", str, None,
            "Identifies the physical host; ranks with equal keys use shared memory (default: hostname)."),
    Setting("iface", "SPARK_HVD_IFACE", str, None,
            "Network interface(s), comma-separated, whose IPv4 address the rank listens on and advertises (the "
            "first one its host has) instead of SPARK_HVD_HOSTNAME.", ("HOROVOD_GLOO_IFACE",)),
    Setting("controller", "SPARK_HVD_CONTROLLER", _parse_controller, "auto",
            "Backend of negotiation and data: mpi (through mpi4py), ring (the built-in rings), or auto (mpi "
            "when started by mpiexec/mpirun, else ring).", ("HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS")),
    Setting("mpi_rank", "PMI_RANK", int, None,
            "Rank given by an MPI launcher (read, never written): with controller auto, init() then uses MPI.",
            ("OMPI_COMM_WORLD_RANK", "PMIX_RANK")),
    Setting("elastic", "SPARK_HVD_ELASTIC", _parse_bool, False,
            "This process is a worker of an elastic job: init() asks the launcher for its place in each world.",
            ("HOROVOD_ELASTIC",)),
    Setting("worker_id", "SPARK_HVD_WORKER_ID", str, None,
            "Identity of an elastic worker, stable across the worlds it takes part in."),
    # Tuning.
    Setting("fusion_threshold", "SPARK_HVD_FUSION_THRESHOLD", int, 64 * MiB,
            "Bytes up to which ready allreduce requests are packed into one fusion buffer (0 disables).",
            ("HOROVOD_FUSION_THRESHOLD",)),
    Setting("cycle_time_ms", "SPARK_HVD_CYCLE_TIME", float, 0.0,
            "Milliseconds the coordinator may hold ready requests back to fuse more; 0 answers at once.",
            ("HOROVOD_CYCLE_TIME",)),
    Setting("autotune", "SPARK_HVD_AUTOTUNE", _parse_bool, False,
            "Rank 0 tries fusion thresholds and cycle times during the first steps, then keeps the best.",
            ("HOROVOD_AUTOTUNE",)),
    Setting("autotune_log", "SPARK_HVD_AUTOTUNE_LOG", str, None,
            "CSV file where rank 0 writes each autotune sample (setting, steps, seconds, bytes/s) and the choice.",
            ("HOROVOD_AUTOTUNE_LOG",)),
    Setting("autotune_warmup_samples", "SPARK_HVD_AUTOTUNE_WARMUP_SAMPLES", int, 3,
            "Autotune samples run under the starting settings and discarded before trials begin.",
            ("HOROVOD_AUTOTUNE_WARMUP_SAMPLES",)),
    Setting("autotune_steps_per_sample", "SPARK_HVD_AUTOTUNE_STEPS_PER_SAMPLE", int, 10,
            "Training steps (a tensor name reduced again) measured under each autotune setting.",
            ("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",)),
    Setting("autotune_max_samples", "SPARK_HVD_AUTOTUNE_MAX_SAMPLES", int, 20,
            "Autotune trials at most (after the warm-up) before the best setting is kept.",
            ("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",)),
    Setting("hierarchical_allreduce", "SPARK_HVD_HIERARCHICAL_ALLREDUCE", _parse_bool, False,
            "Allreduce within each host first, then across hosts among one rank per host (several hosts).",
            ("HOROVOD_HIERARCHICAL_ALLREDUCE",)),
    Setting("eager_threshold", "SPARK_HVD_EAGER_THRESHOLD", int, 32768,
            "Allreduces up to this many bytes travel inside the negotiation messages (0 disables)."),
    Setting("lockstep_bytes", "SPARK_HVD_LOCKSTEP_BYTES", int, 1 << 20,
            "Gradient buffers and blocking allreduces up to this many bytes, of a world whose ranks share one "
            "host, are reduced through shared-memory mailboxes in program order, without negotiation (0 disables)."),
    Setting("lockstep_link_bytes", "SPARK_HVD_LOCKSTEP_LINK_BYTES", int, 1 << 20,
            "Gradient buffers and blocking allreduces of a world across hosts (of at most 16 ranks) whose size "
            "times the other ranks is "
            "at most this many bytes are sent straight to every rank over TCP links of their own and reduced "
            "in program order, without negotiation (0 disables; SPARK_HVD_LOCKSTEP_BYTES=0 too)."),
    Setting("cache_capacity", "SPARK_HVD_CACHE_CAPACITY", int, 1024,
            "Request signatures remembered so steady-state negotiation sends ids, not metadata (0 disables).",
            ("HOROVOD_CACHE_CAPACITY",)),
    Setting("timeline", "SPARK_HVD_TIMELINE", str, None,
            "Path of a Chrome-trace timeline written by rank 0 from start-up; DYNAMIC writes none until "
            "start_timeline() is called.", ("HOROVOD_TIMELINE",)),
    Setting("timeline_mark_cycles", "SPARK_HVD_TIMELINE_MARK_CYCLES", _parse_bool, False,
            "Also mark each negotiation cycle in the timeline.", ("HOROVOD_TIMELINE_MARK_CYCLES",)),
    Setting("stall_check_seconds", "SPARK_HVD_STALL_CHECK_TIME_SECONDS", float, 60.0,
            "Seconds a request may wait for other ranks before a warning names it (0 disables).",
            ("HOROVOD_STALL_CHECK_TIME_SECONDS",)),
    Setting("stall_shutdown_seconds", "SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS", float, 0.0,
            "Seconds after which a stalled request fails every rank with CollectiveError (0 never).",
            ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",)),
    Setting("start_timeout", "SPARK_HVD_START_TIMEOUT", float, 60.0,
            "Seconds init() waits for every rank to arrive at the rendezvous and connect.",
            ("HOROVOD_START_TIMEOUT",)),
    Setting("elastic_timeout", "SPARK_HVD_ELASTIC_TIMEOUT", float, 600.0,
            "Seconds an elastic worker waits in init() for the launcher to form the next world.",
            ("HOROVOD_ELASTIC_TIMEOUT",)),
    Setting("peer_timeout", "SPARK_HVD_PEER_TIMEOUT", float, 10.0,
            "Seconds within which a silent or vanished peer is declared lost."),
    Setting("shm", "SPARK_HVD_SHM", _parse_bool, True,
            "Move data between ranks of one host through shared memory instead of sockets."),
    Setting("shm_ordering", "SPARK_HVD_SHM_ORDERING", _parse_ordering, "auto",
            "How shared-memory counters are published in order: auto (plain stores on x86-64, whose stores keep "
            "program order; release/acquire atomics of libatomic on other CPUs, which may reorder plain stores) or "
            "atomics (libatomic everywhere). Without libatomic on another CPU, ranks of one host use sockets."),
    Setting("bind_cpus", "SPARK_HVD_BIND_CPUS", _parse_bool, False,
            "Pin each rank to its own share of the host's CPUs at init() (when there are enough)."),
    Setting("warm_start", "SPARK_HVD_WARM_START", _parse_bool, True,
            "Fork the ranks of estimator fits on Spark from one process per executor Python worker that has "
            "imported the framework once, instead of a fresh interpreter per rank (Linux)."),
    Setting("task_cpus", "SPARK_HVD_TASK_CPUS", int, None,
            "CPUs the rank's Spark task was given (spark.task.cpus): the threads of its math libraries."),
    Setting("profile_steps", "SPARK_HVD_PROFILE_STEPS", _parse_bool, False,
            "Estimator ranks time each phase of their training steps and add it to every epoch's history."),
    Setting("chunk_bytes", "SPARK_HVD_CHUNK_BYTES", int, 512 * 1024,
            "Pipelining unit for large buffers: bytes per shared-memory slot or socket chunk."),
    Setting("nccl_library", "SPARK_HVD_NCCL_LIBRARY", str, None,
            "Path of the libnccl.so.2 to use for CUDA tensors (default: the nvidia-nccl-cu12 wheel's, torch's, "
            "or the system's)."),
    Setting("ssh_command", "SPARK_HVD_SSH_COMMAND", str, "ssh",
            "The command spark-hvd-run reaches other hosts with, e.g. 'ssh -F ~/.ssh/cluster_config' (batch mode and "
            "-p/-i from its flags are added)."),
    Setting("log_level", "SPARK_HVD_LOG_LEVEL", str, "WARNING",
            "Logging level of the spark_hvd loggers (DEBUG, INFO, WARNING, ERROR).", ("HOROVOD_LOG_LEVEL",)),
)

_BY_FIELD: Dict[str, Setting] = {s.field: s for s in SETTINGS}


def environ_snapshot() -> Dict[str, str]:
    """A copy of the process environment, for launchers that pass it on to children."""
    return dict(os.environ)


def read_setting(field: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The value of one setting from the environment (or its default), parsed."""
    setting = _BY_FIELD[field]
    env = os.environ if environ is None else environ
    for name in (setting.env,) + setting.aliases:
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        try:
            return setting.type(raw)
        except ValueError as exc:
            raise ValueError(
                f"environment variable {name}={raw!r} is not a valid {setting.type.__name__}: {exc}. "
                f"{name}: {setting.doc}"
            ) from None
    return setting.default


def _default(name: str) -> Any:
    return _BY_FIELD[name].default


@dataclass(frozen=True)
class RuntimeConfig:
    """Resolved configuration of one worker process (defaults and meanings: :data:`SETTINGS`)."""

    rank: Optional[int] = _default("rank")
    size: Optional[int] = _default("size")
    local_rank: Optional[int] = _default("local_rank")
    local_size: Optional[int] = _default("local_size")
    cross_rank: Optional[int] = _default("cross_rank")
    cross_size: Optional[int] = _default("cross_size")
    rendezvous_addr: Optional[str] = _default("rendezvous_addr")
    secret: Optional[str] = _default("secret")
    hostname: str = _default("hostname")
    host_key: Optional[str] = _default("host_key")
    iface: Optional[str] = _default("iface")
    controller: str = _default("controller")
    mpi_rank: Optional[int] = _default("mpi_rank")
    elastic: bool = _default("elastic")
    worker_id: Optional[str] = _default("worker_id")
    fusion_threshold: int = _default("fusion_threshold")
    cycle_time_ms: float = _default("cycle_time_ms")
    autotune: bool = _default("autotune")
    autotune_log: Optional[str] = _default("autotune_log")
    autotune_warmup_samples: int = _default("autotune_warmup_samples")
    autotune_steps_per_sample: int = _default("autotune_steps_per_sample")
    autotune_max_samples: int = _default("autotune_max_samples")
    hierarchical_allreduce: bool = _default("hierarchical_allreduce")
    eager_threshold: int = _default("eager_threshold")
    lockstep_bytes: int = _default("lockstep_bytes")
    lockstep_link_bytes: int = _default("lockstep_link_bytes")
    cache_capacity: int = _default("cache_capacity")
    timeline: Optional[str] = _default("timeline")
    timeline_mark_cycles: bool = _default("timeline_mark_cycles")
    stall_check_seconds: float = _default("stall_check_seconds")
    stall_shutdown_seconds: float = _default("stall_shutdown_seconds")
    start_timeout: float = _default("start_timeout")
    elastic_timeout: float = _default("elastic_timeout")
    peer_timeout: float = _default("peer_timeout")
    shm: bool = _default("shm")
    shm_ordering: str = _default("shm_ordering")
    bind_cpus: bool = _default("bind_cpus")
    warm_start: bool = _default("warm_start")
    task_cpus: Optional[int] = _default("task_cpus")
    profile_steps: bool = _default("profile_steps")
    chunk_bytes: int = _default("chunk_bytes")
    nccl_library: Optional[str] = _default("nccl_library")
    ssh_command: str = _default("ssh_command")
    log_level: str = _default("log_level")

    def __post_init__(self) -> None:
        checks = (
            ("fusion_threshold", self.fusion_threshold >= 0, "a byte count >= 0"),
            ("cycle_time_ms", self.cycle_time_ms >= 0, "milliseconds >= 0"),
            ("autotune_warmup_samples", self.autotune_warmup_samples >= 0, "a count >= 0"),
            ("autotune_steps_per_sample", self.autotune_steps_per_sample >= 1, "a count >= 1"),
            ("autotune_max_samples", self.autotune_max_samples >= 1, "a count >= 1"),
            ("cache_capacity", self.cache_capacity >= 0, "a count >= 0"),
            ("eager_threshold", self.eager_threshold >= 0, "a byte count >= 0"),
            ("lockstep_bytes", self.lockstep_bytes >= 0, "a byte count >= 0"),
            ("lockstep_link_bytes", self.lockstep_link_bytes >= 0, "a byte count >= 0"),
            ("stall_check_seconds", self.stall_check_seconds >= 0, "seconds >= 0"),
            ("stall_shutdown_seconds", self.stall_shutdown_seconds >= 0, "seconds >= 0"),
            ("start_timeout", self.start_timeout > 0, "seconds > 0"),
            ("elastic_timeout", self.elastic_timeout > 0, "seconds > 0"),
            ("peer_timeout", self.peer_timeout > 0, "seconds > 0"),
            ("chunk_bytes", self.chunk_bytes >= 4096 and self.chunk_bytes % 64 == 0,
             "a multiple of 64 of at least 4096"),
            ("task_cpus", self.task_cpus is None or self.task_cpus >= 1, "a count >= 1"),
        )
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is invalid: expected {expected}. "
                    f"Fix the argument or {_BY_FIELD[name].env}."
                )
        if self.size is not None and self.size < 1:
            raise ValueError(f"size={self.size} is invalid: expected at least 1 process")
        if self.rank is not None and self.size is not None and not 0 <= self.rank < self.size:
            raise ValueError(f"rank={self.rank} is outside the job of size={self.size}: expected 0 <= rank < size")

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, **overrides: Any) -> "RuntimeConfig":
        """Resolve every setting: ``overrides`` (not None) > environment > default."""
        unknown = set(overrides) - set(_BY_FIELD)
        if unknown:
            raise TypeError(f"unknown runtime settings {sorted(unknown)}; known: {sorted(_BY_FIELD)}")
        values = {}
        for setting in SETTINGS:
            given = overrides.get(setting.field)
            values[setting.field] = given if given is not None else read_setting(setting.field, environ)
        return cls(**values)

    def require_worker(self) -> "RuntimeConfig":
        """Check that the worker contract is complete; name each missing variable."""
        needed = ("worker_id", "rendezvous_addr", "secret") if self.elastic and self.rank is None else \
            ("rank", "size", "rendezvous_addr", "secret")
        missing = [_BY_FIELD[f].env for f in needed if getattr(self, f) is None]
        if missing:
            raise ValueError(
                "environment variable(s) " + ", ".join(missing) + " expected, but not set. "
                "Start the script with `spark-hvd-run -np N python script.py`, through "
                "spark_hvd.spark.run(), or call init() without a launcher for a single process."
            )
        filled = {}
        if self.local_rank is None:
            filled["local_rank"] = self.rank
        if self.local_size is None:
            filled["local_size"] = self.size
        if self.cross_rank is None:
            filled["cross_rank"] = 0
        if self.cross_size is None:
            filled["cross_size"] = 1
        return dataclasses.replace(self, **filled) if filled else self


def new_secret() -> str:
    """A fresh random job secret, as hex."""
    return secrets.token_hex(32)


def worker_environment(
    *,
    rank: int,
    size: int,
    local_rank: int,
    local_size: int,
    cross_rank: int,
    cross_size: int,
    rendezvous_addr: str,
    secret: str,
    hostname: str = "127.0.0.1",
    host_key: Optional[str] = None,
    settings: Optional[Mapping[str, Any]] = None,
) -> Dict[str, str]:
    """The environment variables that make a process a worker: the only writer of the contract.

    ``settings`` maps RuntimeConfig field names (fusion_threshold, timeline, ...) to values that
    are passed on to the worker. Horovod's HOROVOD_RANK etc. are written too, so Horovod-era
    scripts that read them keep working.
    """
    env = {
        "SPARK_HVD_RANK": str(rank),
        "SPARK_HVD_SIZE": str(size),
        "SPARK_HVD_LOCAL_RANK": str(local_rank),
        "SPARK_HVD_LOCAL_SIZE": str(local_size),
        "SPARK_HVD_CROSS_RANK": str(cross_rank),
        "SPARK_HVD_CROSS_SIZE": str(cross_size),
        "SPARK_HVD_RENDEZVOUS_ADDR": rendezvous_addr,
        "SPARK_HVD_SECRET": secret,
        "SPARK_HVD_HOSTNAME": hostname,
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(size),
        "HOROVOD_LOCAL_RANK": str(local_rank),
        "HOROVOD_LOCAL_SIZE": str(local_size),
        "HOROVOD_CROSS_RANK": str(cross_rank),
        "HOROVOD_CROSS_SIZE": str(cross_size),
    }
    if host_key is not None:
        env["SPARK_HVD_HOST_KEY"] = host_key
    env.update(setting_environment(settings))
    return env


def setting_environment(settings: Optional[Mapping[str, Any]]) -> Dict[str, str]:
    """The environment variables that pass runtime settings (RuntimeConfig field names) to a worker."""
    env = {}
    for field, value in (settings or {}).items():
        if field not in _BY_FIELD:
            raise TypeError(f"unknown runtime setting {field!r}; known: {sorted(_BY_FIELD)}")
        if value is None:
            continue
        if isinstance(value, bool):
            value = int(value)
        env[_BY_FIELD[field].env] = str(value)
    return env


def elastic_worker_environment(
    *,
    worker_id: str,
    rendezvous_addr: str,
    secret: str,
    hostname: str = "127.0.0.1",
    host_key: Optional[str] = None,
    settings: Optional[Mapping[str, Any]] = None,
) -> Dict[str, str]:
    """The environment of an elastic worker: its identity instead of a rank, which the launcher
    assigns anew for every world the worker joins (see :func:`worker_environment`)."""
    env = {
        "SPARK_HVD_ELASTIC": "1",
        "SPARK_HVD_WORKER_ID": worker_id,
        "SPARK_HVD_RENDEZVOUS_ADDR": rendezvous_addr,
        "SPARK_HVD_SECRET": secret,
        "SPARK_HVD_HOSTNAME": hostname,
        "HOROVOD_ELASTIC": "1",
    }
    if host_key is not None:
        env["SPARK_HVD_HOST_KEY"] = host_key
    env.update(setting_environment(settings))
    return env
