"""``run_elastic(fn, ...)``: elastic training on Spark, one barrier stage per world.

A function written with ``hvd.elastic.run`` keeps training when executors come and go. Each world
is a barrier stage of the size the cluster offers (between ``min_num_proc`` and
``max_num_proc``). Rank 0 persists every ``state.commit()`` to the store, sealed with the job's
secret; when a stage fails because a rank process or an executor was lost, the driver waits for
at least ``min_num_proc`` slots and starts a new stage, whose first ``state.sync()`` hands the
last commit to every rank. While a stage runs, the driver watches the cluster's slots: when more
are free (and ``max_num_proc`` allows), it asks the ranks to end the world at their next commit
and starts a larger one.

An exception raised by a rank's code also starts a new world from the last commit, as Horovod's
``run_elastic`` does: it counts as a failure of that rank's task, and the run fails with that
exception once one rank's task has failed as often as Spark allows a task to fail
(``spark.task.maxFailures``; the ``F`` of a ``local[N,F]`` master, 1 for ``local[N]``, so
there a code error fails at once). Errors no new world can fix fail the run at once: those
raised on the driver before any rank runs (bad arguments, a function that cannot be pickled),
a rank's ImportError, SyntaxError or pickling error, and a rank that returned while its peers
still trained.
"""

from __future__ import annotations

import pickle
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, TextIO, Tuple

from spark_hvd.runner.errors import RankFailedError
from spark_hvd.runtime import config
from spark_hvd.runtime.elastic import StageHooks, WorldResizeRequested

from spark_hvd.runtime.seal import seal, unseal
from spark_hvd.spark.launch.store_log import STORE_CONTEXT
from spark_hvd.spark.launch.retry import describe_failure, is_recoverable, slots_when_free
from spark_hvd.spark.launch.barrier import run
from spark_hvd.spark.session import active_session, session_info, task_max_failures
from spark_hvd.spark.data.store import Store

__all__ = ["run_elastic", "restartable", "ELASTIC_TIMEOUT_S"]

ELASTIC_TIMEOUT_S = 600.0
"""Default seconds run_elastic waits for ``min_num_proc`` free task slots before a new world."""
_WATCH_INTERVAL_S = 1.0
_RESIZE_CHECK_INTERVAL_S = 1.0
_STATE_NAME = "elastic.state"


@dataclass(frozen=True)
class _ElasticStage:
    """What the ranks of one stage need, as plain values (travels in the closure)."""

    store: Store
    state_path: str
    """Where rank 0 persists each commit, sealed with ``secret``."""
    resize_path: str
    """The driver writes this file to ask the ranks to end the world at their next commit."""
    secret: str


class _StoreHooks(StageHooks):
    """Rank side: commits persisted to the store, a resize requested through it."""

    def __init__(self, stage: _ElasticStage) -> None:
        self.stage = stage
        self._checked_at = 0.0

    def load(self, state: Any) -> None:
        from spark_hvd.runtime import api

        stage = self.stage
        if api.rank() != 0 or not stage.store.exists(stage.state_path):
            return
        # Sealed with this job's secret by an earlier stage's rank 0, so safe to unpickle.
        snapshot = pickle.loads(unseal(stage.secret, STORE_CONTEXT, _STATE_NAME, stage.store.read(stage.state_path)))
        state.load_snapshot(snapshot)

    def committed(self, state: Any) -> None:
        from spark_hvd.runtime import api

        if api.rank() == 0:
            data = pickle.dumps(state.snapshot(), protocol=pickle.HIGHEST_PROTOCOL)
            self.stage.store.write(self.stage.state_path, seal(self.stage.secret, STORE_CONTEXT, _STATE_NAME, data))

    def resize_requested(self) -> bool:
        from spark_hvd.runtime import api

        wanted = False
        if api.rank() == 0:
            now = time.monotonic()
            if now - self._checked_at >= _RESIZE_CHECK_INTERVAL_S:
                self._checked_at = now
                wanted = self.stage.store.exists(self.stage.resize_path)
        if api.size() == 1:
            return wanted
        return bool(api.broadcast_object(wanted, root_rank=0, name="spark_hvd.elastic.resize"))


def _elastic_rank(stage: _ElasticStage, fn: Callable[..., Any], args: Sequence[Any],
                  kwargs: Mapping[str, Any]) -> Tuple[str, Any]:
    """The function each rank of a stage runs: ``fn`` with the store hooks installed."""
    from spark_hvd.runtime import elastic

    elastic.use_stage_hooks(_StoreHooks(stage))
    try:
        return "done", fn(*args, **kwargs)
    except WorldResizeRequested:
        return "resize", None
    finally:
        elastic.use_stage_hooks(None)


class _SlotWatcher:
    """Driver side: asks the running world to end once the cluster offers more slots."""

    def __init__(self, session: Any, size: int, max_num_proc: Optional[int], store: Store, path: str) -> None:
        self._session, self._size, self._max = session, size, max_num_proc
        self._store, self._path = store, path
        self._stop = threading.Event()
        self.requested_size: Optional[int] = None
        self._thread = threading.Thread(target=self._watch, name="spark-hvd-slot-watcher", daemon=True)

    def __enter__(self) -> "_SlotWatcher":
        if self._max is None or self._max > self._size:
            self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(_WATCH_INTERVAL_S):
            try:
                slots = session_info(self._session).slots
            except Exception:  # the session is going away; the stage's own outcome decides
                return
            if slots is not None and slots > self._size:
                self.requested_size = slots if self._max is None else min(slots, self._max)
                self._store.write(self._path, str(self.requested_size).encode())
                return

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * _WATCH_INTERVAL_S + 5.0)


_NOT_FIXED_BY_A_NEW_WORLD = (ImportError, SyntaxError, pickle.PicklingError, pickle.UnpicklingError)


def restartable(error: BaseException) -> bool:
    """Whether a failed world's error is one a new world may not repeat: a rank's code raised
    (not an import, syntax or pickling error), as opposed to a lost process (always restarted)
    or a driver-side error (never)."""
    if not isinstance(error, RankFailedError) or error.reaction is not None or error.exc_type is None:
        return False
    if error.original is not None:
        return not isinstance(error.original, _NOT_FIXED_BY_A_NEW_WORLD)
    name = error.exc_type.rsplit(".", 1)[-1]
    return name not in {kind.__name__ for kind in _NOT_FIXED_BY_A_NEW_WORLD} | {"ModuleNotFoundError"}


def _check_sizes(num_proc: int, min_num_proc: Optional[int], max_num_proc: Optional[int],
                 reset_limit: Optional[int], elastic_timeout: Optional[float]) -> Tuple[int, Optional[int]]:
    for name, value in (("min_num_proc", min_num_proc), ("max_num_proc", max_num_proc)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} is invalid: expected a positive int (a number of ranks) or None")
    low = num_proc if min_num_proc is None else min_num_proc
    if low > num_proc:
        raise ValueError(f"min_num_proc={low} is larger than num_proc={num_proc}: expected min_num_proc <= num_proc "
                         "<= max_num_proc; lower min_num_proc or raise num_proc")
    if max_num_proc is not None and max_num_proc < num_proc:
        raise ValueError(f"max_num_proc={max_num_proc} is smaller than num_proc={num_proc}: expected min_num_proc <= "
                         "num_proc <= max_num_proc; raise max_num_proc or lower num_proc")
    if reset_limit is not None and (isinstance(reset_limit, bool) or not isinstance(reset_limit, int)
                                    or reset_limit < 0):
        raise ValueError(f"reset_limit={reset_limit!r} is invalid: expected an int >= 0 (new worlds allowed) or None")
    if elastic_timeout is not None and not elastic_timeout > 0:
        raise ValueError(f"elastic_timeout={elastic_timeout!r} is invalid: expected seconds > 0, or None for "
                         f"the default {ELASTIC_TIMEOUT_S:.0f}")
    return low, max_num_proc


def _wait_for_world(session: Any, low: int, high: Optional[int], timeout_s: float, last: int) -> int:
    """The size of the next world: the free slots, at least ``low`` (waited for), at most ``high``;
    the ``last`` size when the cluster does not tell its slots."""
    slots = slots_when_free(session, low, timeout_s, advice=(
        f"(min_num_proc={low}) for run_elastic's next world", "add executors, lower min_num_proc, or raise "
        "elastic_timeout"))
    if slots is None:
        return last
    return slots if high is None else min(slots, high)


_default_store: Optional[Store] = None


def _store_for(store: Optional[Store], local: bool) -> Store:
    global _default_store
    if store is not None:
        if not isinstance(store, Store):
            raise TypeError(f"store must be a spark_hvd.spark.Store, got {type(store).__name__}; use "
                            "Store.create(path)")
        return store
    if not local:
        raise ValueError("store=None is not valid for run_elastic on a cluster: expected storage every executor "
                         "and the driver reach, where commits outlive a lost executor; pass e.g. "
                         "store=Store.create('hdfs:///user/me/spark-hvd')")
    if _default_store is None:
        import atexit
        import shutil
        import tempfile

        path = tempfile.mkdtemp(prefix="spark-hvd-elastic-")
        atexit.register(shutil.rmtree, path, True)
        _default_store = Store.create(path)
    return _default_store


def run_elastic(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    num_proc: Optional[int] = None,
    min_num_proc: Optional[int] = None,
    max_num_proc: Optional[int] = None,
    start_timeout: Optional[float] = None,
    elastic_timeout: Optional[float] = None,
    reset_limit: Optional[int] = None,
    env: Optional[Mapping[str, str]] = None,
    stdout: Optional[TextIO] = None,
    stderr: Optional[TextIO] = None,
    verbose: int = 1,
    nics: Optional[Sequence[str]] = None,
    prefix_output_with_timestamp: bool = False,
    min_np: Optional[int] = None,
    max_np: Optional[int] = None,
    *,
    use_gpu: Optional[bool] = None,
    store: Optional[Store] = None,
    spark: Any = None,
) -> List[Any]:
    """Run ``fn(*args, **kwargs)``, an elastic training function, on worlds of changing size.

    ``fn`` initializes spark-hvd and calls a function decorated with ``hvd.elastic.run`` on a
    state object (``TorchState``, ``ObjectState``, Keras's and TensorFlow's states). Every
    ``state.commit()`` on rank 0 is persisted to ``store``. When a stage loses a rank process
    or an executor, a new stage of the size now free (at least ``min_num_proc``, waited for up to
    ``elastic_timeout`` seconds; at most ``max_num_proc``) starts, and its ranks resume from the
    last commit. When more slots become free while a stage runs, the ranks end the world at their
    next commit and a larger one starts. Returns the return values of the last world's ranks, in
    rank order.

    Args:
        num_proc: ranks of the first world; default the cluster's default parallelism.
        min_num_proc: fewest ranks to train with (default ``num_proc``).
        max_num_proc: most ranks (default: as many as the cluster has slots).
        elastic_timeout: seconds to wait for ``min_num_proc`` slots before a new world (default 600).
        reset_limit: how many new worlds may be started after the first (default unlimited); one
            more raises the last world's error, or RuntimeError when that world was ended to grow.
        store: where commits are kept; default a temporary one on a local master.
        start_timeout, env, stdout, stderr, verbose, nics, prefix_output_with_timestamp, use_gpu, spark:
            as for :func:`run`. The positional order is Horovod's ``horovod.spark.run_elastic``,
            whose deprecated ``min_np`` and ``max_np`` mean ``min_num_proc`` and ``max_num_proc``.

    A rank's exception starts a new world too, counted against that rank's task: once it has
    failed ``spark.task.maxFailures`` times (the ``F`` of ``local[N,F]``; 1 for ``local[N]``)
    the run fails with it. Import, syntax and pickling errors, and errors on the driver, fail at
    once.

    Raises:
        RankFailedError: a rank's code raised, more often than Spark lets a task fail, or an
            error no new world fixes.
        RuntimeError: more than ``reset_limit`` new worlds were needed to grow.
        TimeoutError: fewer than ``min_num_proc`` slots for ``elastic_timeout`` seconds.
    """
    session = spark if spark is not None else active_session("spark_hvd.spark.run_elastic()")
    info = session_info(session)
    if num_proc is None:
        num_proc = info.default_parallelism
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"num_proc={num_proc!r} is invalid: expected a positive int (the ranks of the first world)")
    for old_name, value, name, current in (("min_np", min_np, "min_num_proc", min_num_proc),
                                           ("max_np", max_np, "max_num_proc", max_num_proc)):
        if value is not None and current is not None and value != current:
            raise ValueError(f"{old_name}={value!r} and {name}={current!r} disagree: {old_name} is Horovod's older "
                             f"name for {name}; pass only {name}")
    min_num_proc = min_num_proc if min_num_proc is not None else min_np
    max_num_proc = max_num_proc if max_num_proc is not None else max_np
    low, high = _check_sizes(num_proc, min_num_proc, max_num_proc, reset_limit, elastic_timeout)
    store = _store_for(store, info.local)
    timeout_s = float(elastic_timeout or ELASTIC_TIMEOUT_S)
    err = stderr if stderr is not None else sys.stderr
    job = store.join("elastic", f"job-{uuid.uuid4().hex[:16]}")
    secret = config.new_secret()
    size = num_proc
    resets = 0
    max_failures = task_max_failures(session)
    failures: Dict[int, int] = {}
    try:
        while True:
            stage = _ElasticStage(store=store, state_path=f"{job}/state", resize_path=f"{job}/resize-{resets}",
                                  secret=secret)
            cause, failed = "", None
            with _SlotWatcher(session, size, high, store, stage.resize_path) as watcher:
                try:
                    outcomes = run(_elastic_rank, args=(stage, fn, tuple(args), dict(kwargs or {})), num_proc=size,
                                   start_timeout=start_timeout, env=env, stdout=stdout, stderr=stderr,
                                   verbose=verbose, nics=nics, prefix_output_with_timestamp=prefix_output_with_timestamp,
                                   use_gpu=use_gpu, store=store, spark=session)
                except Exception as error:
                    failed = error
                    if is_recoverable(error):
                        cause = f"the world of {size} lost a rank ({describe_failure(error)})"
                    elif restartable(error):
                        assert isinstance(error, RankFailedError)
                        count = failures[error.rank] = failures.get(error.rank, 0) + 1
                        if count >= max_failures:
                            error.add_note(f"spark-hvd: run_elastic: the task of rank {error.rank} failed {count} "
                                           f"time(s), Spark's limit for a task (spark.task.maxFailures="
                                           f"{max_failures}); fix: correct the error, or allow more task failures "
                                           "(spark.task.maxFailures, or a local[N,F] master)")
                            raise
                        cause = (f"{describe_failure(error)} (failure {count} of the {max_failures} Spark allows "
                                 f"rank {error.rank}'s task)")
                    else:
                        raise
                else:
                    if all(kind == "done" for kind, _ in outcomes):
                        return [value for _, value in outcomes]
                    cause = f"{watcher.requested_size or 'more'} task slots are free"
            resets += 1
            if reset_limit is not None and resets > reset_limit:
                message = (f"run_elastic needed new world number {resets} but reset_limit={reset_limit}; "
                           f"last cause: {cause}; fix: raise reset_limit (or pass None for no limit)")
                if failed is None:
                    raise RuntimeError(message)
                failed.add_note(f"spark-hvd: {message}")
                raise failed
            size = _wait_for_world(session, low, high, timeout_s, size)
            if verbose > 0:
                err.write(f"spark-hvd: run_elastic: {cause}; starting world {resets + 1} with {size} ranks from the "
                          "last commit\n")
                err.flush()
    finally:
        store.delete(job)
