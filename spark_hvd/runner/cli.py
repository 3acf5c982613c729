"""The ``spark-hvd-run`` command: ``-np`` ranks of a command here or on hosts over SSH, like horovodrun."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from spark_hvd.runtime import config

from .elastic import DEFAULT_ELASTIC_TIMEOUT, ElasticJob, ElasticOptions
from .follow import OutputFollower
from .hosts import (HostSlots, UnreachableHostsError, is_this_machine, local_names, parse_hosts, place_ranks,
                    read_hostfile, ssh_argv)
from .local import LocalJob
from .multihost import HostsJob
from .processes import TERMINATE_GRACE_SECONDS, RankExit, RankProcesses, rank_output_path

__all__ = ["main", "launch", "parse_options", "LaunchOptions", "UsageError", "check_hosts"]

PROG = "spark-hvd-run"
_MIB = 1024 * 1024


class UsageError(ValueError):
    """A command line that cannot be run; the message says what to change."""


@dataclass(frozen=True)
class LaunchOptions:
    """A validated command line."""

    num_proc: int
    """Number of ranks to start."""
    command: List[str]
    """The program and its arguments, run once per rank."""
    settings: Dict[str, Any]
    """Runtime settings passed to every rank (RuntimeConfig field names)."""
    output_dir: Optional[Path]
    """Where each rank's output is also written, as rank.<r>/stdout and rank.<r>/stderr."""
    env: Dict[str, str]
    """Environment variables set for every rank on top of ours and the worker contract."""
    verbose: bool
    """Log what is started and stopped."""
    elastic: Optional[ElasticOptions] = None
    """Set for elastic jobs."""
    mpiexec: Optional[str] = None
    """The mpiexec that starts the ranks (--mpi)."""
    hosts: Optional[List[HostSlots]] = None
    """The hosts of -H or --hostfile, in order (None: this machine)."""
    ssh: Optional[List[str]] = None
    """The SSH client's command line up to the host, when a host is not this machine."""
    address: Optional[str] = None
    """The address ranks call back to (--network-interface's), when a host is not this machine."""

    @property
    def remote(self) -> bool:
        """Whether some rank runs on another host."""
        return self.ssh is not None


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        allow_abbrev=False,
        description="Run COMMAND as -np ranks of one spark-hvd job on this machine, or on several hosts "
        "(-H, --hostfile) reached over SSH. Every host needs this Python environment at the same path and the "
        "working directory; on a Spark cluster, spark_hvd.spark.run() needs neither.",
        epilog="Each output line of rank r is printed as [r]<stdout>:... or [r]<stderr>:... . When run "
        "from a virtual environment, `python` in COMMAND is that environment's interpreter.",
    )
    parser.add_argument("-np", "--num-proc", dest="num_proc", type=int, metavar="N",
                        help="number of ranks to start (required)")
    parser.add_argument("-H", "--hosts", dest="hosts", metavar="HOST:SLOTS[,...]",
                        help="hosts and their slots, e.g. -H worker1:2,worker2:2; ranks fill them in order; hosts "
                             "other than this machine are reached over SSH (default: -np ranks on this machine)")
    parser.add_argument("-hostfile", "--hostfile", dest="hostfile", metavar="FILE",
                        help="a file of hosts, one per line as HOST slots=N (or HOST:N), instead of -H")
    parser.add_argument("-p", "--ssh-port", dest="ssh_port", type=int, metavar="PORT",
                        help="the SSH port of every host (default: SSH's own, usually 22)")
    parser.add_argument("-i", "--ssh-identity-file", dest="ssh_identity_file", metavar="FILE",
                        help="the SSH private key to log in with (default: SSH's own)")
    parser.add_argument("--timeline-filename", metavar="FILE",
                        help="write a Chrome-trace timeline of rank 0's collectives to FILE")
    parser.add_argument("--fusion-threshold-mb", type=float, metavar="MB",
                        help="tensor fusion buffer size in MiB (0 disables fusion)")
    parser.add_argument("--cycle-time-ms", type=float, metavar="MS",
                        help="milliseconds the coordinator may wait to fuse more requests")
    parser.add_argument("--autotune", action="store_true",
                        help="let rank 0 try fusion thresholds and cycle times during the first steps and keep the best")
    parser.add_argument("--autotune-log-file", metavar="FILE",
                        help="write each autotune sample and the final choice to FILE (CSV)")
    parser.add_argument("--autotune-warmup-samples", type=int, metavar="K",
                        help="autotune samples discarded before trials begin (default 3)")
    parser.add_argument("--autotune-steps-per-sample", type=int, metavar="K",
                        help="training steps measured under each autotune setting (default 10)")
    parser.add_argument("--autotune-bayes-opt-max-samples", type=int, metavar="K",
                        help="autotune trials at most before the best setting is kept (default 20)")
    parser.add_argument("--disable-cache", action="store_true",
                        help="remember no request signatures (as --cache-capacity 0)")
    parser.add_argument("--hierarchical-allreduce", action="store_true",
                        help="reduce within each host first, then across hosts (SPARK_HVD_HIERARCHICAL_ALLREDUCE)")
    parser.add_argument("--timeline-mark-cycles", action="store_true",
                        help="also mark each negotiation cycle in the timeline")
    parser.add_argument("--log-level", choices=("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"),
                        help="level of the ranks' spark_hvd loggers (TRACE is DEBUG, FATAL is ERROR)")
    parser.add_argument("--gloo", action="store_true",
                        help="Horovod's flag for its own TCP backend: spark-hvd's built-in backend, the default")
    parser.add_argument("--cache-capacity", type=int, metavar="K",
                        help="request signatures to cache (0 disables the cache)")
    parser.add_argument("--start-timeout", type=float, metavar="S",
                        help="seconds init() waits for every rank to arrive")
    parser.add_argument("--output-filename", metavar="DIR",
                        help="also write each rank's output to DIR/rank.<r>/stdout and DIR/rank.<r>/stderr")
    parser.add_argument("--bind-cpus", action="store_true",
                        help="pin each rank to its own share of this machine's CPUs (steadier latency)")
    parser.add_argument("--network-interface", "--network-interfaces", dest="network_interface",
                        metavar="NAME[,NAME]",
                        help="the network interface whose address the ranks listen on and give each other (the "
                             "first of the list this machine has), instead of 127.0.0.1 (SPARK_HVD_IFACE)")
    elastic = parser.add_argument_group(
        "elastic training", "any of these makes the job elastic: workers may be lost or added, and scripts written "
        "with hvd.elastic.run go on from their last commit")
    elastic.add_argument("--min-np", type=int, metavar="N", help="fewest workers a world may have (default: -np)")
    elastic.add_argument("--max-np", type=int, metavar="N", help="most workers a world may have (default: -np)")
    elastic.add_argument("--host-discovery-script", metavar="SCRIPT",
                         help="prints the available slots as HOST:SLOTS lines (this machine only); run every second")
    elastic.add_argument("--reset-limit", type=int, metavar="K", help="most new worlds after the first (default: no limit)")
    elastic.add_argument("--elastic-timeout", type=float, metavar="S",
                         help="seconds to wait for enough workers or for a new world (default 600)")
    parser.add_argument("--mpi", action="store_true",
                        help="start the ranks with the mpiexec of the mpich wheel (pip install \"spark-hvd[mpi]\"); "
                             "negotiation and data then go through MPI")
    parser.add_argument("--verbose", action="store_true", help="log what is started and stopped")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program to run, e.g. python train.py")
    return parser


def check_hosts(hosts: str, num_proc: int, hostfile: bool = False) -> List[HostSlots]:
    """The hosts of ``-H`` (or of the ``hostfile`` at path ``hosts``) in order, when their slots
    hold ``num_proc`` ranks; UsageError otherwise."""
    try:
        parsed = read_hostfile(hosts) if hostfile else parse_hosts(hosts)
        place_ranks(parsed, num_proc)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return parsed


def _hosts(args: argparse.Namespace) -> Optional[List[HostSlots]]:
    if args.hosts is not None and args.hostfile is not None:
        raise UsageError("-H and --hostfile both name hosts; expected one of them")
    if args.hostfile is not None:
        return check_hosts(args.hostfile, args.num_proc, hostfile=True)
    return None if args.hosts is None else check_hosts(args.hosts, args.num_proc)


def _ssh(args: argparse.Namespace, hosts: Optional[List[HostSlots]], environ: Dict[str, str]) -> Optional[List[str]]:
    """The SSH command line when a host that gets a rank is not this machine; None otherwise."""
    if hosts is None:
        return None
    used = {name for name, _ in place_ranks(hosts, args.num_proc)}
    if all(is_this_machine(name) for name in used):
        return None
    if args.ssh_port is not None and not 0 < args.ssh_port < 65536:
        raise UsageError(f"--ssh-port {args.ssh_port} is invalid: expected a port from 1 to 65535")
    identity = args.ssh_identity_file
    if identity is not None and not os.access(os.path.expanduser(identity), os.R_OK):
        raise UsageError(f"--ssh-identity-file {identity!r} cannot be read; expected the path of an SSH private key")
    command = config.read_setting("ssh_command", environ)
    argv = ssh_argv(command, args.ssh_port, None if identity is None else os.path.expanduser(identity))
    if shutil.which(argv[0]) is None:
        raise UsageError(f"the SSH client {argv[0]!r} (SPARK_HVD_SSH_COMMAND={command!r}) was not found; expected "
                         "an ssh on PATH (Debian/Ubuntu: apt-get install openssh-client)")
    return argv


def _check_writable_file(flag: str, filename: str) -> str:
    path = Path(filename).expanduser().resolve()
    if path.is_dir():
        raise UsageError(f"{flag} {filename!r} is a directory; expected a file path")
    if not path.parent.is_dir():
        raise UsageError(f"{flag} {filename!r}: directory {str(path.parent)!r} does not exist; create it first")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {filename!r} is not writable; choose a path you can write")
    return str(path)


def _prepare_output_dir(dirname: str) -> Path:
    path = Path(dirname).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise UsageError(f"--output-filename {dirname!r} exists and is not a directory; expected a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--output-filename {dirname!r} cannot be created: {exc.strerror}") from None
    if not os.access(path, os.W_OK):
        raise UsageError(f"--output-filename {dirname!r} is not writable; choose a directory you can write")
    return path


def _child_path(environ: Dict[str, str]) -> Dict[str, str]:
    # Like an activated virtual environment: `python` in COMMAND is the interpreter running us.
    if sys.prefix == sys.base_prefix:
        return {}
    bin_dir = os.path.dirname(sys.executable)
    return {"PATH": os.pathsep.join([bin_dir, environ.get("PATH", os.defpath)])}


def _check_command(command: List[str], env: Dict[str, str], environ: Dict[str, str]) -> None:
    if not command:
        raise UsageError(f"no command given; expected e.g. {PROG} -np 2 python train.py")
    path = env.get("PATH", environ.get("PATH", os.defpath))
    if shutil.which(command[0], path=path) is None:
        raise UsageError(
            f"command {command[0]!r} was not found or is not executable; expected a program on PATH or a "
            f"path to one, e.g. {PROG} -np 2 python train.py"
        )


def _check_interfaces(names: str) -> str:
    """``--network-interface`` names as SPARK_HVD_IFACE takes them, when this machine has one of them."""
    from spark_hvd.runtime.net import interface_address

    wanted = [name.strip() for name in names.split(",") if name.strip()]
    try:
        interface_address(wanted)
    except ValueError as exc:
        raise UsageError(f"--network-interface {names!r}: {exc}") from None
    return ",".join(wanted)


def _check_number(flag: str, value: Optional[float], ok: bool, expected: str) -> None:
    if value is not None and not ok:
        raise UsageError(f"{flag} {value} is invalid: expected {expected}")


def parse_options(argv: Sequence[str], environ: Optional[Dict[str, str]] = None) -> LaunchOptions:
    """Parse and validate a command line; UsageError (a ValueError) says what to fix."""
    environ = config.environ_snapshot() if environ is None else environ
    parser = _build_parser()
    args = parser.parse_args(list(argv))
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if args.num_proc is None:
        raise UsageError(f"-np is required; expected e.g. {PROG} -np 2 python train.py")
    if args.num_proc < 1:
        raise UsageError(f"-np {args.num_proc} is invalid: expected at least 1 process")
    hosts = _hosts(args)
    _check_number("--fusion-threshold-mb", args.fusion_threshold_mb,
                  args.fusion_threshold_mb is not None and args.fusion_threshold_mb >= 0, "MiB >= 0")
    _check_number("--cycle-time-ms", args.cycle_time_ms,
                  args.cycle_time_ms is not None and args.cycle_time_ms >= 0, "milliseconds >= 0")
    _check_number("--cache-capacity", args.cache_capacity,
                  args.cache_capacity is not None and args.cache_capacity >= 0, "a count >= 0")
    _check_number("--start-timeout", args.start_timeout,
                  args.start_timeout is not None and args.start_timeout > 0, "seconds > 0")
    _check_number("--autotune-warmup-samples", args.autotune_warmup_samples,
                  args.autotune_warmup_samples is not None and args.autotune_warmup_samples >= 0, "a count >= 0")
    _check_number("--autotune-steps-per-sample", args.autotune_steps_per_sample,
                  args.autotune_steps_per_sample is not None and args.autotune_steps_per_sample >= 1, "a count >= 1")
    _check_number("--autotune-bayes-opt-max-samples", args.autotune_bayes_opt_max_samples,
                  args.autotune_bayes_opt_max_samples is not None and args.autotune_bayes_opt_max_samples >= 1,
                  "a count >= 1")
    settings: Dict[str, Any] = {
        "autotune": True if args.autotune or args.autotune_log_file else None,
        "autotune_log": None if args.autotune_log_file is None
        else _check_writable_file("--autotune-log-file", args.autotune_log_file),
        "autotune_warmup_samples": args.autotune_warmup_samples,
        "autotune_steps_per_sample": args.autotune_steps_per_sample,
        "autotune_max_samples": args.autotune_bayes_opt_max_samples,
        "fusion_threshold": None if args.fusion_threshold_mb is None
        else int(args.fusion_threshold_mb * _MIB),
        "cycle_time_ms": args.cycle_time_ms,
        "cache_capacity": 0 if args.disable_cache else args.cache_capacity,
        "hierarchical_allreduce": True if args.hierarchical_allreduce else None,
        "timeline_mark_cycles": True if args.timeline_mark_cycles else None,
        "log_level": None if args.log_level is None else {"TRACE": "DEBUG", "FATAL": "ERROR"}.get(args.log_level,
                                                                                                args.log_level),
        "start_timeout": args.start_timeout,
        "bind_cpus": True if args.bind_cpus else None,
        "iface": None if args.network_interface is None else _check_interfaces(args.network_interface),
        "timeline": None if args.timeline_filename is None
        else _check_writable_file("--timeline-filename", args.timeline_filename),
    }
    elastic = _elastic_options(args)
    env = _child_path(environ)
    ssh = _ssh(args, hosts, environ)
    mpiexec = _mpiexec(args, env, environ) if args.mpi else None
    address = None
    if ssh is not None and settings["iface"] is not None:
        from spark_hvd.runtime.net import interface_address

        address = interface_address(settings["iface"].split(","))
    _check_command(command, env, environ)
    output_dir = None if args.output_filename is None else _prepare_output_dir(args.output_filename)
    return LaunchOptions(
        num_proc=args.num_proc,
        command=command,
        settings={k: v for k, v in settings.items() if v is not None},
        output_dir=output_dir,
        env=env,
        verbose=args.verbose,
        elastic=elastic,
        mpiexec=mpiexec,
        hosts=hosts,
        ssh=ssh,
        address=address,
    )


def _mpiexec(args: argparse.Namespace, env: Dict[str, str], environ: Dict[str, str]) -> str:
    if args.gloo:
        raise UsageError("--mpi and --gloo choose different backends; expected one of them")
    if _elastic_options(args) is not None:
        raise UsageError("--mpi cannot be combined with elastic options")
    path = env.get("PATH", environ.get("PATH", os.defpath))
    found = shutil.which("mpiexec", path=os.pathsep.join([os.path.dirname(sys.executable), path]))
    if found is None:
        raise UsageError("--mpi needs mpiexec; install the MPI extra (pip install \"spark-hvd[mpi]\": mpi4py and the "
                         "mpich wheel) or put an MPI installation's mpiexec on PATH")
    return found


def _elastic_options(args: argparse.Namespace) -> Optional[ElasticOptions]:
    given = [args.min_np, args.max_np, args.host_discovery_script, args.reset_limit, args.elastic_timeout]
    if all(value is None for value in given):
        return None
    if args.hosts is not None or args.hostfile is not None:
        raise UsageError("-H and --hostfile cannot be combined with elastic options; the slots come from --host-discovery-script "
                         "(or -np when there is none)")
    script = args.host_discovery_script
    if script is not None and shutil.which(shlex.split(script)[0]) is None and not os.access(
            shlex.split(script)[0], os.X_OK):
        raise UsageError(f"--host-discovery-script {script!r} is not an executable program; expected a script that "
                         "prints HOST:SLOTS lines, e.g. `echo localhost:4`")
    try:
        return ElasticOptions(
            num_proc=args.num_proc,
            min_np=args.min_np if args.min_np is not None else args.num_proc,
            max_np=args.max_np if args.max_np is not None else args.num_proc,
            discovery_script=script,
            reset_limit=args.reset_limit,
            elastic_timeout=args.elastic_timeout if args.elastic_timeout is not None else DEFAULT_ELASTIC_TIMEOUT,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise _Interrupted(signum)


def _fate_of_other(rank: int, code: Optional[int], stopped: bool) -> str:
    if code is None:
        return f"rank {rank} is still running"
    if code == 0:
        return f"rank {rank} had finished"
    if stopped and code in (-signal.SIGTERM, -signal.SIGKILL):
        return f"rank {rank} was stopped"
    return RankExit(rank, code).describe()


def _report_failure(failure: RankExit, processes: RankProcesses) -> None:
    """The root cause first with its last output, then the failure it caused if any, then the other ranks."""
    reported = [failure] if failure.reaction is None else [failure, failure.reaction]
    for position, ended in enumerate(reported):
        _say(("then " if position else "") + ended.describe())
        if ended.tail:
            _say(f"last {len(ended.tail)} lines of output of rank {ended.rank}:")
            for line in ended.tail:
                print(line, file=sys.stderr)
    codes = processes.returncodes
    stopped = set(processes.stopped)
    named = {ended.rank for ended in reported}
    others = [
        _fate_of_other(rank, codes.get(rank), rank in stopped) for rank in processes.ranks if rank not in named
    ]
    if others:
        _say(f"after rank {reported[-1].rank} failed: " + ", ".join(others))
    sys.stderr.flush()


def _forward_only(job: Any, signums: Sequence[int]) -> None:
    # Once stopping has begun, a further signal is passed on but must not abandon the cleanup.
    for signum in signums:
        signal.signal(signum, lambda n, f: job.processes.send_signal(n))


def _launch_elastic(options: LaunchOptions) -> int:
    assert options.elastic is not None
    log = _say if options.verbose else None
    job = ElasticJob(options.elastic, options.command, local_names=sorted(local_names()), settings=options.settings,
                     env=options.env, output_dir=options.output_dir, say=_say, log=log)
    in_main_thread = threading.current_thread() is threading.main_thread()
    forwarded = (signal.SIGINT, signal.SIGTERM) if in_main_thread else ()
    previous = {signum: signal.signal(signum, _raise_interrupted) for signum in forwarded}
    try:
        status = job.run()
    except _Interrupted as interrupt:
        name = signal.Signals(interrupt.signum).name
        _say(f"received {name}; forwarding it to all workers")
        job.processes.terminate(signum=interrupt.signum, grace=TERMINATE_GRACE_SECONDS)
        return 128 + interrupt.signum
    finally:
        try:
            job.close()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    if job.resets:
        _say(f"{len(job.resets)} reset(s): " + "; ".join(f"({i}) {r.describe()}" for i, r in enumerate(job.resets, 1)))
    return status


def _launch_mpi(options: LaunchOptions) -> int:
    assert options.mpiexec is not None
    env = dict(config.environ_snapshot())
    env.update(options.env)
    env["SPARK_HVD_CONTROLLER"] = "mpi"
    env["PYTHONUNBUFFERED"] = "1"
    for name, value in options.settings.items():
        env.update(config.setting_environment({name: value}))
    # Every rank's output goes to files of its own (the --output-filename directory, or a temporary
    # one), which are followed and printed line by line with rank labels; see follow.py for why
    # mpiexec's own labels are not used.
    directory = options.output_dir or Path(tempfile.mkdtemp(prefix="spark-hvd-mpi-output-"))
    follower = OutputFollower(directory, options.num_proc)
    follower.prepare()
    command = [options.mpiexec, "-n", str(options.num_proc),
               "-outfile-pattern", str(rank_output_path(directory, "%r", "stdout")),
               "-errfile-pattern", str(rank_output_path(directory, "%r", "stderr"))]
    scratch = Path(tempfile.mkdtemp(prefix="spark-hvd-mpi-"))
    try:
        command += _mpi_hosts(options, scratch)
    except UnreachableHostsError as exc:
        _say(f"error: {exc}")
        shutil.rmtree(scratch, ignore_errors=True)
        return 1
    command += options.command
    if options.verbose:
        _say("running " + " ".join(command))
    follower.start()
    try:
        return subprocess.call(command, env=env)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        follower.stop()
        if options.output_dir is None:
            shutil.rmtree(directory, ignore_errors=True)


def _mpi_hosts(options: LaunchOptions, scratch: Path) -> List[str]:
    """mpiexec's (MPICH Hydra's) arguments for -H or --hostfile: the host list, and for hosts other
    than this machine, the same SSH command and check as without --mpi, and the address their
    proxies call back to."""
    if options.hosts is None:
        return []
    arguments = ["-hosts", ",".join(f"{h.name}:{h.slots}" for h in options.hosts)]
    if not options.remote:
        return arguments
    assert options.ssh is not None
    job = _job(options)  # checks the hosts as a job without --mpi would, and starts nothing
    address = options.address or job.callback_address(job.check())
    # Hydra starts its proxies with one executable and its own arguments: a script that adds ours.
    launcher = scratch / "ssh"
    launcher.write_text("#!/bin/sh\nexec " + shlex.join(options.ssh) + ' "$@"\n')
    launcher.chmod(0o700)
    arguments += ["-launcher", "ssh", "-launcher-exec", str(launcher)]
    return arguments + ["-localhost", address]


def _job(options: LaunchOptions) -> Any:
    log = _say if options.verbose else None
    if options.remote:
        assert options.hosts is not None and options.ssh is not None
        check_timeout = options.settings.get("start_timeout", config.read_setting("start_timeout"))
        return HostsJob(options.hosts, options.num_proc, ssh=options.ssh, address=options.address,
                        check_timeout=check_timeout, settings=options.settings, env=options.env,
                        output_dir=options.output_dir, log=log)
    return LocalJob(options.num_proc, settings=options.settings, env=options.env, output_dir=options.output_dir,
                    log=log)


def launch(options: LaunchOptions) -> int:
    """Run a validated job to its end; return the exit status for the command line."""
    if options.elastic is not None:
        return _launch_elastic(options)
    if options.mpiexec is not None:
        return _launch_mpi(options)
    job = _job(options)
    # Signal handlers can only be installed from the main thread; elsewhere the caller owns signals.
    in_main_thread = threading.current_thread() is threading.main_thread()
    forwarded = (signal.SIGINT, signal.SIGTERM) if in_main_thread else ()
    previous = {signum: signal.signal(signum, _raise_interrupted) for signum in forwarded}
    try:
        processes = job.start(options.command)
        failure = processes.wait()
    except UnreachableHostsError as exc:
        _say(f"error: {exc}")
        return 1
    except _Interrupted as interrupt:
        _forward_only(job, forwarded)
        name = signal.Signals(interrupt.signum).name
        _say(f"received {name}; forwarding it to all ranks")
        job.processes.terminate(signum=interrupt.signum, grace=TERMINATE_GRACE_SECONDS)
        return 128 + interrupt.signum
    finally:
        _forward_only(job, forwarded)
        try:
            job.close()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    if failure is not None:
        _report_failure(failure, processes)
        return failure.exit_status
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``spark-hvd-run``; returns the process exit status."""
    try:
        options = parse_options(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return launch(options)


if __name__ == "__main__":
    sys.exit(main())
