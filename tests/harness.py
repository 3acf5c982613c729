"""One harness for checks that run inside launched worlds: the runtime's and every binding's.

A check is a function ``check(hvd, rank, size)``: ``hvd`` is the framework module
(``spark_hvd.runtime``, ``spark_hvd.torch``, ``spark_hvd.tensorflow`` or ``spark_hvd.keras``). It raises AssertionError when the behaviour is
wrong and may return a value for the test to look at. Its expected values come from
``(rank, size)`` alone, so one check serves sizes 1, 2 and 3. A world is launched once per size
and runs a whole batch of checks in the same order on every rank, so process start-up is paid once
per batch. The first failure on a rank ends that rank's batch (its peers then fail fast instead of
waiting on collectives it will never join), and its traceback is reported under that check.
"""

from __future__ import annotations

import contextlib
import importlib
import subprocess
import time
import traceback
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

import numpy as np

__all__ = ["SIZES", "PRELOAD", "Check", "run_checks", "launch", "assert_passed", "is_alive", "wait_until", "rank_processes",
           "counting_lockstep", "adasum_reference"]

SIZES = (1, 2, 3)

Check = Callable[..., Any]

_FRAMEWORKS = {"runtime": "spark_hvd.runtime", "torch": "spark_hvd.torch", "tensorflow": "spark_hvd.tensorflow",
               "keras": "spark_hvd.keras"}


def _prepare(framework: str) -> Callable[[], None]:
    """Per-framework set-up in the rank; returns what to do before each check."""
    if framework in ("tensorflow", "keras"):
        import keras

        if keras.config.backend() == "tensorflow":
            import tensorflow as tf

            tf.config.threading.set_intra_op_parallelism_threads(1)
        return lambda: keras.utils.set_random_seed(1234)
    if framework != "torch":
        return lambda: None
    import torch

    torch.set_num_threads(1)
    return lambda: torch.manual_seed(1234)


def run_checks(checks: Sequence[Check], framework: str = "runtime") -> Dict[str, Dict[str, Any]]:
    """Runs inside each rank: initialize, run every check, and report each one's outcome as
    ``{"error": traceback or None, "value": what it returned, "seconds": how long it took}``."""
    before_each = _prepare(framework)
    hvd = importlib.import_module(_FRAMEWORKS[framework])
    hvd.init()
    outcomes: Dict[str, Dict[str, Any]] = {}
    try:
        for check in checks:
            before_each()
            start = time.perf_counter()
            try:
                value = check(hvd, hvd.rank(), hvd.size())
            except BaseException:
                outcomes[check.__name__] = {"error": traceback.format_exc(), "value": None,
                                            "seconds": time.perf_counter() - start}
                break
            outcomes[check.__name__] = {"error": None, "value": value, "seconds": time.perf_counter() - start}
    finally:
        hvd.shutdown()
    return outcomes


# What the ranks of each framework import before their first check: forked from a warm process
# that imported these once (spark_hvd.runner.run's preload), so a world of size 3 does not import
# TensorFlow three times over.
PRELOAD = {"runtime": (), "torch": ("torch", "torch._dynamo"), "tensorflow": ("tensorflow", "keras"),
           "keras": ("tensorflow", "keras")}


def launch(checks: Sequence[Check], np: int, framework: str = "runtime", timeout: float = 180,
           env: Optional[Dict[str, str]] = None, settings: Optional[Dict[str, object]] = None,
           preload: Optional[Sequence[str]] = None) -> List[Dict[str, Dict[str, Any]]]:
    """Launch a world of ``np`` ranks that runs ``checks``; return each rank's outcomes. The ranks
    are forked from a warm process that imported ``preload`` (default: the framework's
    :data:`PRELOAD`)."""
    if framework not in _FRAMEWORKS:
        raise ValueError(f"framework={framework!r} is not known; expected one of {sorted(_FRAMEWORKS)}")
    from spark_hvd.runner import run

    return run(run_checks, args=(list(checks), framework), np=np, timeout=timeout, env=env, settings=settings,
               preload=PRELOAD[framework] if preload is None else preload)


def assert_passed(results: List[Dict[str, Dict[str, Any]]], check: Check) -> List[Any]:
    """Fail with the rank's traceback unless ``check`` ran and passed on every rank; return the
    value it returned on each rank."""
    name = check.__name__
    for rank, outcomes in enumerate(results):
        if name not in outcomes:
            failed = [k for k, v in outcomes.items() if v["error"] is not None]
            raise AssertionError(f"rank {rank} did not run {name}: the earlier check {failed} failed")
        if outcomes[name]["error"] is not None:
            raise AssertionError(f"{name} failed on rank {rank}:\n{outcomes[name]['error']}")
    return [outcomes[name]["value"] for outcomes in results]


def is_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie waiting to be reaped counts as gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def wait_until(condition: Callable[[], Any], timeout: float, interval: float = 0.02) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` seconds pass; whether it held at the end."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return bool(condition())
        time.sleep(interval)
    return True


@contextlib.contextmanager
def rank_processes(size: int, command: Sequence[str], settings: Optional[Mapping[str, Any]] = None,
                   rank_options: Optional[Callable[[int], Mapping[str, Any]]] = None,
                   extra_env: Optional[Mapping[str, str]] = None, address: str = "127.0.0.1",
                   spawn: Optional[Callable[..., subprocess.Popen]] = None,
                   **popen: Any) -> Iterator[List[subprocess.Popen]]:
    """``size`` processes running ``command`` as the ranks of one job, with a rendezvous server on
    ``address``: yields their Popen objects (rank order). ``rank_options(rank)`` gives more arguments
    of ``rank_environment`` for one rank (its host, local rank, ...); ``spawn(rank, argv, env=...,
    **popen)`` starts a rank (default: ``subprocess.Popen`` here; the cluster tests start each on its
    host). On the way out every process still running is killed, every process is waited for, and
    the server is closed."""
    from spark_hvd.runner import rank_environment
    from spark_hvd.runtime.config import new_secret
    from spark_hvd.runtime.rendezvous import RendezvousServer

    secret = new_secret()
    server = RendezvousServer(address, secret)
    procs: List[subprocess.Popen] = []
    try:
        for rank in range(size):
            options = dict(rank_options(rank)) if rank_options is not None else {}
            env = rank_environment(rank=rank, size=size, rendezvous_addr=server.address, secret=secret,
                                   settings=dict(settings or {}), **options)
            env.update(extra_env or {})
            if spawn is None:
                procs.append(subprocess.Popen(list(command), env=env, **popen))
            else:
                procs.append(spawn(rank, list(command), env=env, **popen))
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        server.close()


@contextlib.contextmanager
def counting_lockstep() -> Iterator[List[bool]]:
    """Inside the block every call of ``spark_hvd.runtime.allreduce_lockstep`` appends to the
    yielded list whether it took the one-host fast path (True) or handed the request back (False)."""
    import spark_hvd.runtime as rt

    calls: List[bool] = []
    original = rt.allreduce_lockstep

    def counting(*args: Any, **kwargs: Any) -> Any:
        handle = original(*args, **kwargs)
        calls.append(handle is not None)
        return handle

    rt.allreduce_lockstep = counting
    try:
        yield calls
    finally:
        rt.allreduce_lockstep = original


def adasum_reference(vectors) -> np.ndarray:
    """Adasum of a power-of-two list of vectors, pairwise in rank order (Maleki et al., 2020)."""
    level = [np.asarray(v, dtype=np.float64) for v in vectors]
    while len(level) > 1:
        nxt = []
        for a, b in zip(level[0::2], level[1::2]):
            dot = float(a @ b)
            nxt.append((1.0 - dot / (2.0 * float(a @ a))) * a + (1.0 - dot / (2.0 * float(b @ b))) * b)
        level = nxt
    return level[0]
