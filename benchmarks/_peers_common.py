"""The measurement loop every framework's ranks run: the same sweep, warm-up and timing rules for all.

A framework plugs in through a small adapter (:class:`Collectives`); :func:`measure` runs the size
sweep and the 200-gradient case on it and returns this rank's raw per-iteration times. The
launcher combines ranks by taking, for each iteration, the slowest rank's time, then the median.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from typing import Any, Dict, List, Optional, Protocol, Sequence

__all__ = ["Collectives", "NumpyBuffers", "measure", "iterations_for", "warmup_for", "write_rank_result", "read_plan", "pin_to_cpu", "MiB"]

KiB = 1024
MiB = 1024 * KiB


class Collectives(Protocol):
    """What the sweep needs from a framework, on buffers the adapter allocates itself."""

    rank: int
    size: int

    def buffer(self, nbytes: int) -> Any:
        """A float32 buffer of ``nbytes`` bytes, zero-filled."""

    def fill(self, buf: Any, value: float) -> None: ...

    def holds(self, buf: Any, value: float) -> bool:
        """True when every element of ``buf`` equals ``value``."""

    def allreduce(self, buf: Any) -> None:
        """Blocking in-place float32 Sum allreduce of ``buf``."""

    def allreduce_many(self, bufs: Sequence[Any]) -> None:
        """Submit an in-place Sum allreduce of every buffer asynchronously, then wait for all."""

    def barrier(self) -> None: ...

    def max_scalar(self, value: float) -> float:
        """The largest ``value`` over all ranks."""


class NumpyBuffers:
    """The buffer part of :class:`Collectives` on numpy float32 arrays, for the adapters whose
    framework reduces numpy arrays (spark-hvd, mpi4py, the raw TCP pair)."""

    def buffer(self, nbytes: int) -> Any:
        import numpy as np

        return np.zeros(nbytes // 4, dtype=np.float32)

    def fill(self, buf: Any, value: float) -> None:
        buf.fill(value)

    def holds(self, buf: Any, value: float) -> bool:
        import numpy as np

        return bool(np.all(buf == value))


def warmup_for(nbytes: int, quick: bool) -> int:
    """Untimed iterations before a size is measured: enough to settle buffers and connections."""
    if nbytes <= MiB:
        return 5 if quick else 10
    if nbytes <= 16 * MiB:
        return 2 if quick else 3
    return 1 if quick else 2


def iterations_for(estimate_s: float, budget_s: float, min_iters: int, max_iters: int) -> int:
    """Timed iterations that fit ``budget_s`` at ``estimate_s`` each, within [min_iters, max_iters]."""
    if estimate_s <= 0:
        return max_iters
    return max(min_iters, min(max_iters, int(budget_s / estimate_s)))


def _timed(op, buf: Any, count: int) -> List[float]:
    times = []
    clock = time.perf_counter
    for _ in range(count):
        start = clock()
        op(buf)
        times.append(clock() - start)
    return times


def _agreed_iterations(c: Collectives, warm_times: List[float], plan: Dict[str, Any]) -> int:
    # Every rank must run the same count, so the estimate is the slowest rank's.
    tail = sorted(warm_times[len(warm_times) // 2:]) or [0.0]
    estimate = c.max_scalar(tail[len(tail) // 2])
    return iterations_for(estimate, plan["budget_s"], plan["min_iters"], plan["max_iters"])


def _check(c: Collectives, nbytes: int) -> Any:
    buf = c.buffer(nbytes)
    # One checked call first: a benchmark of a wrong answer is worthless.
    c.fill(buf, float(c.rank + 1))
    c.allreduce(buf)
    expected = float(c.size * (c.size + 1) // 2)
    if not c.holds(buf, expected):
        raise RuntimeError(f"allreduce of {nbytes} bytes gave a wrong result on rank {c.rank}; expected {expected}")
    # Zeros keep repeated in-place sums finite (and free of denormals) for any iteration count.
    c.fill(buf, 0.0)
    return buf


def _time_size(c: Collectives, buf: Any, nbytes: int, plan: Dict[str, Any], first: bool) -> Dict[str, Any]:
    warm = _timed(c.allreduce, buf, warmup_for(nbytes, plan["quick"]) if first else 2)
    passes = plan["passes"]
    iters = _agreed_iterations(c, warm, {**plan, "budget_s": plan["budget_s"] / passes,
                                         "min_iters": -(-plan["min_iters"] // passes),
                                         "max_iters": -(-plan["max_iters"] // passes)})
    c.barrier()
    return {"iters": iters, "times_s": _timed(c.allreduce, buf, iters)}


def _sweep(c: Collectives, sizes: Sequence[int], plan: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """Every size, in ``passes`` rounds over the whole list, so a passing burst of load on a shared
    machine spreads over all sizes instead of spoiling one."""
    out: Dict[str, Dict[str, Any]] = {str(n): {"iters": 0, "pass_iters": [], "times_s": []} for n in sizes}
    for index in range(plan["passes"]):
        for nbytes in sizes:
            buf = _check(c, nbytes) if index == 0 else c.buffer(nbytes)
            timed = _time_size(c, buf, nbytes, plan, first=index == 0)
            del buf
            out[str(nbytes)]["iters"] += timed["iters"]
            out[str(nbytes)]["pass_iters"].append(timed["iters"])
            out[str(nbytes)]["times_s"] += timed["times_s"]
    return out


def _async_case(c: Collectives, plan: Dict[str, Any]) -> Dict[str, Any]:
    count, each = plan["async_count"], plan["async_bytes"]
    grads = [c.buffer(each) for _ in range(count)]
    for g in grads:
        c.fill(g, float(c.rank + 1))
    c.allreduce_many(grads)
    expected = float(c.size * (c.size + 1) // 2)
    if not all(c.holds(g, expected) for g in grads):
        raise RuntimeError(f"asynchronous allreduce of {count} buffers gave a wrong result on rank {c.rank}")
    for g in grads:
        c.fill(g, 0.0)
    warm = _timed(c.allreduce_many, grads, 3 if plan["quick"] else 5)
    rounds = _agreed_iterations(c, warm, {**plan, "budget_s": plan["async_budget_s"],
                                          "min_iters": plan["async_min_rounds"],
                                          "max_iters": plan["async_max_rounds"]})
    c.barrier()
    batched = _timed(c.allreduce_many, grads, rounds)
    single = _sweep(c, [count * each], plan)[str(count * each)]
    return {"count": count, "bytes_each": each, "rounds": rounds, "times_s": batched,
            "single_bytes": count * each, "single": single}


def _busy(seconds: float) -> None:
    """Keep this core busy for ``seconds`` in Python, as a training step's host code would."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _after_case(c: Collectives, plan: Dict[str, Any]) -> Dict[str, Any]:
    """A 4-byte allreduce back to back, then after ``after_ms`` of compute (a busy loop) and after
    as long idle (a sleep) before each: the latency a training step sees when its few small
    allreduces follow a stretch of other work, when the peers' threads may have gone to sleep."""
    pause = plan["after_ms"] / 1000.0
    iters = plan["after_iters"]
    buf = _check(c, 4)
    _timed(c.allreduce, buf, warmup_for(4, plan["quick"]))
    c.barrier()
    back_to_back = _timed(c.allreduce, buf, iters)
    out: Dict[str, Any] = {"after_ms": plan["after_ms"], "back_to_back": back_to_back}
    for label, wait in (("compute", _busy), ("idle", time.sleep)):
        c.barrier()
        times = []
        for _ in range(iters):
            wait(pause)
            start = time.perf_counter()
            c.allreduce(buf)
            times.append(time.perf_counter() - start)
        out[label] = times
    return out


def measure(c: Collectives, plan: Dict[str, Any]) -> Dict[str, Any]:
    """Run the size sweep and (if planned) the asynchronous and after-compute cases; this rank's raw times."""
    started = time.perf_counter()
    result: Dict[str, Any] = {"rank": c.rank, "size": c.size, "sizes": _sweep(c, plan["sizes"], plan)}
    if plan["async_count"]:
        result["async"] = _async_case(c, plan)
    if plan.get("after_ms"):
        result["after"] = _after_case(c, plan)
    result["wall_s"] = time.perf_counter() - started
    result["pid"] = os.getpid()
    result["python"] = platform.python_version()
    return result


def pin_to_cpu(local_rank: int, enabled: bool) -> Optional[int]:
    """With ``enabled``, bind this process (and threads it starts later) to one usable CPU, chosen by
    local rank; the CPU, or None. Every framework gets the same placement, so comparisons stay fair."""
    if not enabled or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[local_rank % len(cpus)]
    os.sched_setaffinity(0, {cpu})
    return cpu


def write_rank_result(out_dir: str, rank: int, result: Dict[str, Any]) -> None:
    """Write one rank's result where the launcher collects it (atomically: a reader never sees half)."""
    path = os.path.join(out_dir, f"rank{rank}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


def read_plan(argv: Sequence[str]) -> Dict[str, Any]:
    """The plan and output folder a peer script gets on its command line: PLAN_JSON OUT_DIR."""
    if len(argv) != 2:
        print(f"usage: {sys.argv[0]} PLAN_JSON OUT_DIR (started by benchmarks/collectives.py)", file=sys.stderr)
        raise SystemExit(2)
    with open(argv[0]) as f:
        return json.load(f)
