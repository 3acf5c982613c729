"""Allreduce side by side: spark-hvd, torch.distributed (gloo) and mpi4py (mpich) on this machine.

    python benchmarks/collectives.py [--np 2 3] [--sizes 4 64K 1M] [--quick] [--json PATH]

For each world size, each available framework's world is launched once and runs the same sweep:
an in-place float32 Sum allreduce per size (warm-up, then timed iterations bounded by a time
budget), then 200 buffers of 16 KiB submitted asynchronously and waited for, next to one
allreduce of their combined size, then a 4-byte allreduce back to back and after 10 ms of compute
or of idling before each (``--after-ms``). Per iteration the slowest rank's time counts; the table shows
the median, algorithm bandwidth (bytes / time) and bus bandwidth (algbw x 2(n-1)/n, what a ring
moves per link), the ratios of spark-hvd to each peer, and the targets the project set itself.
Raw numbers, versions and machine facts go to a JSON file.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    # The peer modules live next to this file; spark-hvd's ranks import them by this path too.
    sys.path.insert(0, str(HERE))

from _peers_common import KiB, MiB  # noqa: E402

__all__ = ["main", "parse_size", "summarize_times", "FRAMEWORKS"]

FRAMEWORKS = ("spark-hvd", "spark-hvd-mpi", "gloo", "mpi")
PEERS = ("gloo", "mpi")
DEFAULT_JSON = HERE / "results" / "collectives.json"
FULL_SIZES = [4 ** k for k in range(1, 15)]  # 4 B, 16 B, ..., 64 MiB, 256 MiB
QUICK_SIZES = [4, 64 * KiB, MiB, 16 * MiB]
ASYNC_COUNT = 200
ASYNC_BYTES = 16 * KiB
AFTER_MS = 10.0
CLUSTER_SIZES = [4, 1 * KiB, 16 * KiB, 64 * KiB, MiB, 4 * MiB, 16 * MiB, 32 * MiB]
CLUSTER_RATES = ("1gbit", "10gbit", "none")
DEFAULT_CLUSTER_JSON = HERE / "results" / "collectives_cluster.json"


# -- arguments ---------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """Bytes from ``4``, ``64K``, ``64KiB``, ``1M``, ``256MiB`` (binary units); a multiple of 4."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(?:i?[bB])?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"size {text!r} is not understood: expected e.g. 4, 64K, 1M or 256MiB")
    value = int(match.group(1)) * {"": 1, "k": KiB, "m": MiB, "g": 1024 * MiB}[match.group(2).lower()]
    if value < 4 or value % 4:
        raise argparse.ArgumentTypeError(
            f"size {text!r} = {value} bytes is invalid: expected a positive multiple of 4 (float32 elements)")
    return value


def size_label(nbytes: int) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:g} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{nbytes} B"


def _setting(text: str) -> Tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--hvd-setting {text!r}: expected KEY=VALUE, e.g. cycle_time_ms=1")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Allreduce latency and bandwidth of spark-hvd next to gloo and MPI on this machine.")
    parser.add_argument("--np", type=int, nargs="+", metavar="N",
                        help="world sizes to run (default: 2 3; with --quick: 2)")
    parser.add_argument("--sizes", type=parse_size, nargs="+", metavar="SIZE",
                        help="message sizes in bytes, K/M suffixes allowed (default: powers of 4 from 4 B to 256 MiB)")
    parser.add_argument("--quick", action="store_true",
                        help="np=2, sizes 4 B, 64 KiB, 1 MiB, 16 MiB and fewer iterations (under a minute)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, metavar="PATH",
                        help=f"where to write the raw results (default: {DEFAULT_JSON.relative_to(HERE.parent)})")
    parser.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS),
                        help="frameworks to run (default: all that are installed)")
    parser.add_argument("--no-async", action="store_true", help="skip the 200 x 16 KiB asynchronous case")
    parser.add_argument("--after-ms", type=float, default=AFTER_MS, metavar="MS",
                        help=f"time a 4-byte allreduce after MS milliseconds of compute and of idling before each "
                             f"(default {AFTER_MS:g}; 0 skips the case)")
    parser.add_argument("--hvd-setting", type=_setting, action="append", default=[], metavar="KEY=VALUE",
                        help="a spark-hvd runtime setting for its world, e.g. fusion_threshold=0 (repeatable)")
    parser.add_argument("--pin", action="store_true",
                        help="bind each rank of every framework to one CPU (local rank modulo the usable CPUs)")
    parser.add_argument("--cluster", action="store_true",
                        help="between two hosts of the test cluster (tests/cluster/: network namespaces, needs "
                             "root or a user namespace with its own network), links shaped to each of --rates, "
                             "spark-hvd flat and hierarchical next to gloo (see collectives_cluster.py)")
    parser.add_argument("--rates", nargs="+", default=list(CLUSTER_RATES), metavar="RATE",
                        help="link rates of --cluster, as tc writes them (1gbit, 10gbit), or none for unshaped")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="limit for one framework's world (default: 120 with --quick, else 600)")
    return parser


def build_plan(args: argparse.Namespace) -> Dict[str, Any]:
    quick = bool(args.quick)
    default_sizes = QUICK_SIZES if quick else CLUSTER_SIZES if getattr(args, "cluster", False) else FULL_SIZES
    sizes = sorted(set(args.sizes or default_sizes))
    timeout = args.timeout or (120.0 if quick else 600.0)
    if timeout <= 0:
        raise ValueError(f"--timeout={timeout} is invalid: expected seconds > 0")
    if args.after_ms < 0:
        raise ValueError(f"--after-ms={args.after_ms} is invalid: expected milliseconds >= 0 (0 skips the case)")
    plan = {
        "quick": quick,
        "sizes": sizes,
        # Seconds of timed iterations per size, and the bounds on their number.
        "budget_s": 0.1 if quick else 0.5,
        "min_iters": 3 if quick else 5,
        "max_iters": 300 if quick else 2000,
        # Rounds over the whole size list; each gets 1/passes of the budget.
        "passes": 1 if quick else 3,
        "async_count": 0 if args.no_async else ASYNC_COUNT,
        "async_bytes": ASYNC_BYTES,
        "async_budget_s": 0.5 if quick else 2.0,
        "async_min_rounds": 3 if quick else 5,
        "async_max_rounds": 10 if quick else 50,
        "after_ms": args.after_ms,
        "after_iters": 30 if quick else 100,
        "world_timeout_s": timeout,
        "pin": bool(args.pin),
    }
    return plan


# -- launching worlds --------------------------------------------------------------------------
class WorldFailed(RuntimeError):
    """A framework's world did not produce results; the message says why."""


def _child_env(extra: Dict[str, str]) -> Dict[str, str]:
    env = dict(os.environ)
    # One compute thread per rank for every framework: ranks share the cores with each other.
    env.update({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    env["PYTHONPATH"] = os.pathsep.join([str(HERE)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """Terminate the worlds we started (each in its own session), then kill what is left."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + 3.0
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait(5.0)


def _run_processes(commands: List[Tuple[List[str], Dict[str, str]]], out_dir: Path, size: int,
                   timeout: float) -> List[Dict[str, Any]]:
    """Start the commands, wait for all (stopping the rest when one fails), read every rank's result."""
    procs: List[subprocess.Popen] = []
    logs: List[Path] = []
    try:
        for i, (cmd, env) in enumerate(commands):
            log = out_dir / f"output{i}.txt"
            logs.append(log)
            with open(log, "wb") as f:
                procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, code = failed[0]
                what = " ".join(Path(part).name for part in commands[i][0][:1] + commands[i][0][-3:-2])
                raise WorldFailed(f"process {i} ({what}) exited with code {code}; its last output:\n" + _tail(logs[i]))
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                raise WorldFailed(f"did not finish within {timeout:.0f} s (raise --timeout)\n" + _tail(logs[0]))
            time.sleep(0.05)
    finally:
        _stop(procs)
    results = []
    for rank in range(size):
        path = out_dir / f"rank{rank}.json"
        if not path.exists():
            raise WorldFailed(f"rank {rank} finished without writing {path.name}:\n" + _tail(logs[0]))
        results.append(json.loads(path.read_text()))
    return results


def run_sparkhvd(np_: int, plan: Dict[str, Any], settings: Dict[str, str]) -> List[Dict[str, Any]]:
    from spark_hvd.runner import run
    from spark_hvd.runner.errors import RankFailedError

    from _peers_sparkhvd import run_rank

    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    try:
        return run(run_rank, args=(plan,), np=np_, env=env, settings=settings or None,
                   timeout=plan["world_timeout_s"])
    except (RankFailedError, TimeoutError) as exc:
        raise WorldFailed(str(exc)) from None


def run_gloo(np_: int, plan: Dict[str, Any], work: Path) -> List[Dict[str, Any]]:
    plan_path = work / "plan.json"
    port = str(_free_port())
    commands = []
    for rank in range(np_):
        env = _child_env({"RANK": str(rank), "WORLD_SIZE": str(np_), "LOCAL_RANK": str(rank),
                          "LOCAL_WORLD_SIZE": str(np_), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                          "GLOO_SOCKET_IFNAME": "lo"})
        commands.append(([sys.executable, str(HERE / "_peers_gloo.py"), str(plan_path), str(work)], env))
    return _run_processes(commands, work, np_, plan["world_timeout_s"])


def mpiexec_path() -> Optional[Path]:
    """The mpiexec of the MPI wheel installed next to this interpreter (not a system MPI)."""
    candidate = Path(sys.executable).parent / "mpiexec"
    return candidate if candidate.exists() and os.access(candidate, os.X_OK) else None


def run_mpi(np_: int, plan: Dict[str, Any], work: Path) -> List[Dict[str, Any]]:
    mpiexec = mpiexec_path()
    assert mpiexec is not None
    cmd = [str(mpiexec), "-n", str(np_), sys.executable, str(HERE / "_peers_mpi.py"), str(work / "plan.json"),
           str(work)]
    return _run_processes([(cmd, _child_env({}))], work, np_, plan["world_timeout_s"])


def run_sparkhvd_mpi(np_: int, plan: Dict[str, Any], work: Path) -> List[Dict[str, Any]]:
    """spark-hvd on its MPI backend: the same rank function, started by the mpich wheel's mpiexec."""
    mpiexec = mpiexec_path()
    assert mpiexec is not None
    cmd = [str(mpiexec), "-n", str(np_), sys.executable, str(HERE / "_peers_sparkhvd.py"), str(work / "plan.json"),
           str(work)]
    return _run_processes([(cmd, _child_env({"SPARK_HVD_CONTROLLER": "mpi"}))], work, np_, plan["world_timeout_s"])


def availability(name: str) -> Optional[str]:
    """None when the framework can run here, else a note saying what is missing and how to add it."""
    if name == "spark-hvd":
        if importlib.util.find_spec("spark_hvd") is None:
            return "spark_hvd is not installed (pip install -e .)"
        return None
    if name == "spark-hvd-mpi" and importlib.util.find_spec("spark_hvd") is None:
        return "spark_hvd is not installed (pip install -e .)"
    if name == "gloo":
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed (pip install torch==2.13.0)"
        return None
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install -e '.[mpi]', which brings the mpich wheel)"
    if mpiexec_path() is None:
        return f"no mpiexec next to {sys.executable} (pip install mpich)"
    return None


def run_world(name: str, np_: int, plan: Dict[str, Any], settings: Dict[str, str]) -> List[Dict[str, Any]]:
    if name == "spark-hvd":
        return run_sparkhvd(np_, plan, settings)
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        work = Path(tmp)
        (work / "plan.json").write_text(json.dumps(plan))
        runner = {"gloo": run_gloo, "mpi": run_mpi, "spark-hvd-mpi": run_sparkhvd_mpi}[name]
        return runner(np_, plan, work)


# -- combining ranks ---------------------------------------------------------------------------
def summarize_times(per_rank: Sequence[Sequence[float]], passes: Sequence[int] = ()) -> Dict[str, Any]:
    """Per iteration the slowest rank's time; then median, min and 90th percentile of those, and the
    median of each pass (``passes`` gives their iteration counts) to show how steady the run was."""
    counts = {len(t) for t in per_rank}
    if len(counts) != 1:
        raise ValueError(f"ranks timed different numbers of iterations: {sorted(counts)}; expected one count")
    slowest = [max(column) for column in zip(*per_rank)]
    ordered = sorted(slowest)
    bounds = [0]
    for count in passes:
        bounds.append(bounds[-1] + count)
    pass_medians = [statistics.median(slowest[a:b]) * 1e6 for a, b in zip(bounds, bounds[1:]) if b > a]
    return {
        "iters": len(slowest),
        "median_s": statistics.median(slowest),
        "min_s": ordered[0],
        "p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "pass_medians_us": [round(m, 2) for m in pass_medians],
        "times_us": [round(t * 1e6, 2) for t in slowest],
    }


def bandwidths(nbytes: int, seconds: float, size: int) -> Tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes per second)."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * 2 * (size - 1) / size


def combine(rank_results: List[Dict[str, Any]], size: int) -> Dict[str, Any]:
    sizes = {}
    for key in rank_results[0]["sizes"]:
        nbytes = int(key)
        summary = summarize_times([r["sizes"][key]["times_s"] for r in rank_results],
                                  rank_results[0]["sizes"][key].get("pass_iters", ()))
        summary["algbw_GBps"], summary["busbw_GBps"] = bandwidths(nbytes, summary["median_s"], size)
        sizes[key] = summary
    combined: Dict[str, Any] = {"status": "ok", "version": rank_results[0].get("version"),
                                "wall_s": max(r["wall_s"] for r in rank_results),
                                "cpus": [r.get("cpu") for r in rank_results], "sizes": sizes}
    if "async" in rank_results[0]:
        first = rank_results[0]["async"]
        batched = summarize_times([r["async"]["times_s"] for r in rank_results])
        single = summarize_times([r["async"]["single"]["times_s"] for r in rank_results],
                                 first["single"].get("pass_iters", ()))
        combined["async"] = {
            "count": first["count"], "bytes_each": first["bytes_each"], "batched": batched,
            "single_bytes": first["single_bytes"], "single": single,
            "ratio": batched["median_s"] / single["median_s"],
        }
    if "after" in rank_results[0]:
        after = {"after_ms": rank_results[0]["after"]["after_ms"]}
        for case in ("back_to_back", "compute", "idle"):
            after[case] = summarize_times([r["after"][case] for r in rank_results])
        after["compute_over_back_to_back"] = after["compute"]["median_s"] / after["back_to_back"]["median_s"]
        combined["after"] = after
    return combined


# -- reporting ---------------------------------------------------------------------------------
def _fmt(value: Optional[float], digits: int = 2) -> str:
    if value is None:
        return "-"
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 100:
        return f"{value:.1f}"
    return f"{value:.{digits}f}"


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def _size_row(nbytes: int, fws: Dict[str, Dict[str, Any]], names: Sequence[str]) -> Dict[str, Optional[float]]:
    row: Dict[str, Optional[float]] = {}
    for name in names:
        entry = fws.get(name, {}).get("sizes", {}).get(str(nbytes))
        row[f"{name}.us"] = entry["median_s"] * 1e6 if entry else None
        row[f"{name}.algbw"] = entry["algbw_GBps"] if entry else None
        row[f"{name}.busbw"] = entry["busbw_GBps"] if entry else None
    for peer in PEERS:
        row[f"busbw/{peer}"] = _ratio(row.get("spark-hvd.busbw"), row.get(f"{peer}.busbw"))
        row[f"lat/{peer}"] = _ratio(row.get("spark-hvd.us"), row.get(f"{peer}.us"))
    # The MPI backend against raw mpi4py: what the engine costs on top of the same MPI.
    row["mpi-backend busbw/mpi"] = _ratio(row.get("spark-hvd-mpi.busbw"), row.get("mpi.busbw"))
    row["mpi-backend lat/mpi"] = _ratio(row.get("spark-hvd-mpi.us"), row.get("mpi.us"))
    return row


def print_table(np_: int, fws: Dict[str, Dict[str, Any]], sizes: Sequence[int], out: Callable[[str], None]) -> None:
    names = [n for n in FRAMEWORKS if fws.get(n, {}).get("status") == "ok"]
    out(f"\n== np={np_}: float32 in-place Sum allreduce, median of the slowest rank per iteration ==")
    for name in FRAMEWORKS:
        status = fws.get(name, {})
        if status.get("status") != "ok":
            out(f"  {name}: {status.get('status', 'not run')}: {status.get('note', '')}".rstrip())
    if not names:
        out("  (no framework produced results)")
        return
    header = ["size"]
    for name in names:
        header += [f"{name} us", "algbw", "busbw"]
    header += ["busbw/gloo", "busbw/mpi", "lat/gloo", "lat/mpi", "mpi-backend lat/mpi", "mpi-backend busbw/mpi"]
    rows = []
    for nbytes in sizes:
        row = _size_row(nbytes, fws, names)
        cells = [size_label(nbytes)]
        for name in names:
            cells += [_fmt(row[f"{name}.us"], 1), _fmt(row[f"{name}.algbw"]), _fmt(row[f"{name}.busbw"])]
        cells += [_fmt(row["busbw/gloo"]), _fmt(row["busbw/mpi"]), _fmt(row["lat/gloo"], 3),
                  _fmt(row["lat/mpi"], 3), _fmt(row["mpi-backend lat/mpi"], 3), _fmt(row["mpi-backend busbw/mpi"])]
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    out("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for cells in rows:
        out("  ".join(c.rjust(w) for c, w in zip(cells, widths)))
    out("(us: median microseconds; algbw = bytes/time, busbw = algbw x 2(n-1)/n, in GB/s; "
        "ratios are spark-hvd (built-in rings) over the peer, and spark-hvd-mpi (its MPI backend) over raw "
        "mpi4py: busbw higher is better, lat lower is better)")
    async_rows = [(n, fws[n]["async"]) for n in names if "async" in fws[n]]
    if async_rows:
        first = async_rows[0][1]
        label = f"{first['count']} x {size_label(first['bytes_each'])} async"
        single = f"one {size_label(first['single_bytes'])}"
        out(f"\n  {'framework':>10}  {label + ' ms':>24}  {single + ' ms':>18}  {'ratio':>6}  {'spark-hvd/this':>14}")
        hvd_async = fws.get("spark-hvd", {}).get("async", {}).get("batched", {}).get("median_s")
        for name, a in async_rows:
            vs = _ratio(hvd_async, a["batched"]["median_s"])
            out(f"  {name:>10}  {_fmt(a['batched']['median_s'] * 1e3):>24}  {_fmt(a['single']['median_s'] * 1e3):>18}"
                f"  {_fmt(a['ratio']):>6}  {_fmt(vs, 3):>14}")
        out("  (ratio: the asynchronous batch over one allreduce of the same total size; lower is better)")
    after_rows = [(n, fws[n]["after"]) for n in names if "after" in fws[n]]
    if after_rows:
        ms = after_rows[0][1]["after_ms"]
        out(f"\n  4-byte allreduce latency, median us of the slowest rank: back to back, and after {ms:g} ms of "
            "compute (busy loop) or idle (sleep) before each")
        out(f"  {'framework':>13}  {'back to back':>12}  {'after compute':>13}  {'after idle':>10}  "
            f"{'compute/b2b':>11}  {'compute: spark-hvd/this':>23}")
        hvd_after = fws.get("spark-hvd", {}).get("after", {}).get("compute", {}).get("median_s")
        for name, a in after_rows:
            out(f"  {name:>13}  {_fmt(a['back_to_back']['median_s'] * 1e6, 1):>12}  "
                f"{_fmt(a['compute']['median_s'] * 1e6, 1):>13}  {_fmt(a['idle']['median_s'] * 1e6, 1):>10}  "
                f"{_fmt(a['compute_over_back_to_back']):>11}  "
                f"{_fmt(_ratio(hvd_after, a['compute']['median_s']), 3):>23}")


def evaluate_targets(results: Dict[str, Dict[str, Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """The issue's targets at np=2, each PASS or MISS with the measured ratio (or n/a and why)."""
    fws = results.get("2", {})
    hvd = fws.get("spark-hvd", {})
    targets: List[Dict[str, Any]] = []

    def peer_note(peer: str) -> Optional[str]:
        if hvd.get("status") != "ok":
            return f"spark-hvd did not run at np=2 ({hvd.get('note', 'not run')})"
        if fws.get(peer, {}).get("status") != "ok":
            return f"{peer} did not run at np=2 ({fws.get(peer, {}).get('note', 'not run')})"
        return None

    def busbw_target(peer: str, floor: int, want: float) -> Dict[str, Any]:
        text = f"busbw >= {want:g}x {peer} from {size_label(floor)} up (np=2)"
        note = peer_note(peer)
        if note:
            return {"target": text, "result": "n/a", "note": note}
        ratios = []
        for key, mine in hvd["sizes"].items():
            theirs = fws[peer]["sizes"].get(key)
            if int(key) >= floor and theirs:
                ratios.append((mine["busbw_GBps"] / theirs["busbw_GBps"], int(key)))
        if not ratios:
            return {"target": text, "result": "n/a", "note": f"no size of at least {size_label(floor)} was run"}
        worst, at = min(ratios)
        return {"target": text, "result": "PASS" if worst >= want else "MISS", "ratio": worst,
                "note": f"lowest ratio {worst:.2f} at {size_label(at)}; "
                        + ", ".join(f"{size_label(n)} {r:.2f}" for r, n in sorted(ratios, key=lambda x: x[1]))}

    targets.append(busbw_target("gloo", 64 * KiB, 1.5))
    targets.append(busbw_target("mpi", 16 * MiB, 1.0))
    text = "4-byte latency <= 0.25x gloo's (np=2)"
    note = peer_note("gloo")
    if note is None and "4" in hvd["sizes"] and "4" in fws["gloo"]["sizes"]:
        ratio = hvd["sizes"]["4"]["median_s"] / fws["gloo"]["sizes"]["4"]["median_s"]
        targets.append({"target": text, "result": "PASS" if ratio <= 0.25 else "MISS", "ratio": ratio,
                        "note": f"{hvd['sizes']['4']['median_s'] * 1e6:.1f} us vs "
                                f"{fws['gloo']['sizes']['4']['median_s'] * 1e6:.1f} us"})
    else:
        targets.append({"target": text, "result": "n/a", "note": note or "4 B was not in the sweep"})
    ours, raw = fws.get("spark-hvd-mpi", {}), fws.get("mpi", {})
    for text, low, high, key, want, better in (
            ("MPI backend latency <= 3x raw mpi4py from 4 B to 64 KiB (np=2)", 4, 64 * KiB, "median_s", 3.0, "le"),
            ("MPI backend busbw >= 0.9x raw mpi4py from 1 MiB up (np=2)", MiB, 1 << 40, "busbw_GBps", 0.9, "ge")):
        if ours.get("status") != "ok" or raw.get("status") != "ok":
            targets.append({"target": text, "result": "n/a", "note": "spark-hvd-mpi or mpi did not run at np=2"})
            continue
        ratios = [(ours["sizes"][k][key] / raw["sizes"][k][key], int(k)) for k in ours["sizes"]
                  if k in raw["sizes"] and low <= int(k) <= high]
        if not ratios:
            targets.append({"target": text, "result": "n/a", "note": "no size in that range was run"})
            continue
        worst, at = max(ratios) if better == "le" else min(ratios)
        ok = worst <= want if better == "le" else worst >= want
        targets.append({"target": text, "result": "PASS" if ok else "MISS", "ratio": worst,
                        "note": f"worst {worst:.2f} at {size_label(at)}; "
                                + ", ".join(f"{size_label(n)} {r:.2f}" for r, n in sorted(ratios, key=lambda x: x[1]))})
    text = "4-byte allreduce after compute <= 0.25x gloo's and <= 2x spark-hvd's back to back (np=2)"
    note = peer_note("gloo")
    if note is None and "after" in hvd and "after" in fws["gloo"]:
        ours_after = hvd["after"]
        vs_gloo = ours_after["compute"]["median_s"] / fws["gloo"]["after"]["compute"]["median_s"]
        vs_self = ours_after["compute_over_back_to_back"]
        targets.append({"target": text, "result": "PASS" if vs_gloo <= 0.25 and vs_self <= 2.0 else "MISS",
                        "ratio": vs_gloo,
                        "note": f"{ours_after['compute']['median_s'] * 1e6:.1f} us vs gloo "
                                f"{fws['gloo']['after']['compute']['median_s'] * 1e6:.1f} us; "
                                f"{vs_self:.2f}x our back to back "
                                f"({ours_after['back_to_back']['median_s'] * 1e6:.1f} us)"})
    else:
        targets.append({"target": text, "result": "n/a", "note": note or "the after-compute case was not run"})
    text = "200 x 16 KiB async <= 2x one 3.2 MB allreduce (spark-hvd, np=2)"
    if hvd.get("status") == "ok" and "async" in hvd:
        a = hvd["async"]
        targets.append({"target": text, "result": "PASS" if a["ratio"] <= 2.0 else "MISS", "ratio": a["ratio"],
                        "note": f"{a['batched']['median_s'] * 1e3:.2f} ms vs {a['single']['median_s'] * 1e3:.2f} ms"})
    else:
        targets.append({"target": text, "result": "n/a",
                        "note": "spark-hvd's asynchronous case did not run at np=2"})
    return targets


def print_targets(targets: List[Dict[str, Any]], out: Callable[[str], None]) -> None:
    out("\n== targets ==")
    for t in targets:
        ratio = f" (ratio {t['ratio']:.3f})" if "ratio" in t else ""
        out(f"  {t['result']:<4}  {t['target']}{ratio}: {t['note']}")


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> Dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "executable": sys.executable,
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "versions": {d: _version(d) for d in ("spark-hvd", "numpy", "torch", "mpi4py", "mpich")},
    }


def _load() -> float:
    """The 1-minute load average: other work on a shared machine shows up here (and in the numbers)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    plan = build_plan(args)
    nps = args.np or ([2] if args.quick else [2, 3])
    bad = [n for n in nps if n < 2]
    if bad:
        raise SystemExit(f"--np {bad} is invalid: expected world sizes of at least 2")
    settings = dict(args.hvd_setting)
    out = lambda line: print(line, flush=True)  # noqa: E731
    info = machine_info()
    started = time.time()
    if args.cluster:
        return _main_cluster(args, plan, info, started, out)
    out(f"collectives benchmark: np={nps}, {len(plan['sizes'])} sizes "
        f"({size_label(plan['sizes'][0])} .. {size_label(plan['sizes'][-1])}), "
        f"{'quick' if plan['quick'] else 'full'} plan, {info['cpus_usable']} usable cores, "
        f"{'ranks pinned to CPUs' if plan['pin'] else 'ranks not pinned'}, "
        f"load average {info['loadavg_start'][0] if info['loadavg_start'] else '?'}")
    notes = {name: availability(name) for name in FRAMEWORKS}
    results: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for np_ in nps:
        fws: Dict[str, Dict[str, Any]] = {}
        for name in FRAMEWORKS:
            if name not in args.frameworks:
                fws[name] = {"status": "skipped", "note": "not selected with --frameworks"}
                continue
            if notes[name]:
                fws[name] = {"status": "skipped", "note": notes[name]}
                out(f"np={np_} {name}: skipped, {notes[name]}")
                continue
            t0 = time.monotonic()
            load = _load()
            try:
                fws[name] = combine(run_world(name, np_, plan, settings), np_)
                fws[name]["load_before"], fws[name]["load_after"] = load, _load()
                out(f"np={np_} {name}: done in {time.monotonic() - t0:.1f} s "
                    f"(1-minute load average {load:.2f} before, {fws[name]['load_after']:.2f} after)")
            except WorldFailed as exc:
                fws[name] = {"status": "failed", "note": str(exc).splitlines()[0], "detail": str(exc)}
                out(f"np={np_} {name}: FAILED after {time.monotonic() - t0:.1f} s: {exc}")
        results[str(np_)] = fws
    for np_ in nps:
        print_table(np_, results[str(np_)], plan["sizes"], out)
    targets = evaluate_targets(results)
    print_targets(targets, out)
    info["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    document = {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": [sys.executable] + sys.argv,
        "wall_s": time.time() - started,
        "machine": info,
        "plan": plan,
        "results": results,
        "targets": targets,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(document, indent=1))
    out(f"\nwrote {args.json} ({document['wall_s']:.0f} s in all)")
    return 0


def _main_cluster(args: argparse.Namespace, plan: Dict[str, Any], info: Dict[str, Any], started: float,
                  out: Callable[[str], None]) -> int:
    from collectives_cluster import run_cluster

    plan["async_count"], plan["after_ms"] = 0, 0.0  # the size sweep only: the links are what is measured
    out(f"collectives benchmark, cluster mode: 2 hosts, rates {args.rates}, {len(plan['sizes'])} sizes "
        f"({size_label(plan['sizes'][0])} .. {size_label(plan['sizes'][-1])}), {info['cpus_usable']} usable cores")
    measured = run_cluster(args, plan, out)
    document = {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": [sys.executable] + sys.argv, "wall_s": time.time() - started, "machine": info, "plan": plan,
        **measured,
    }
    path = DEFAULT_CLUSTER_JSON if args.json == DEFAULT_JSON else args.json
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1))
    out(f"\nwrote {path} ({document['wall_s']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
