"""Lifecycle, topology, reduction constants, process sets and build probes of spark_hvd.tensorflow."""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional, Sequence, Union

import tensorflow as tf

import spark_hvd.runtime as _rt
from spark_hvd.runtime.build import (ccl_built, ddl_built, gloo_built, gloo_enabled, mpi_built, mpi_enabled,
                                     mpi_threads_supported, rocm_built)
from spark_hvd.runtime.errors import CollectiveError, NotInitializedError
from spark_hvd.runtime.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "is_homogeneous", "start_timeline", "stop_timeline",
    "rank_op", "size_op", "local_rank_op", "local_size_op", "process_set_included_op",
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
    "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "HorovodInternalError", "NotInitializedError", "on_new_world",
]

HorovodInternalError = CollectiveError

ProcessSet = _rt.ProcessSet
global_process_set = _rt.global_process_set
add_process_set = _rt.add_process_set
remove_process_set = _rt.remove_process_set

rank = _rt.rank
size = _rt.size
local_rank = _rt.local_rank
local_size = _rt.local_size
cross_rank = _rt.cross_rank
cross_size = _rt.cross_size
is_initialized = _rt.is_initialized
start_timeline = _rt.start_timeline
stop_timeline = _rt.stop_timeline

# Graph-mode operations number their executions per name; a new world starts the numbers afresh.
_new_world_hooks: List[Callable[[], None]] = []


def on_new_world(hook: Callable[[], None]) -> None:
    """Call ``hook`` whenever this process leaves a world or joins a new one (init, shutdown, join)."""
    _new_world_hooks.append(hook)


def _reset() -> None:
    for hook in _new_world_hooks:
        hook()


def _check_comm(comm: Any) -> None:
    if comm is None:
        return
    if isinstance(comm, (list, tuple, range)):
        world = _rt.size()
        if sorted(comm) == list(range(world)):
            return
        raise ValueError(
            f"init(comm={list(comm)!r}) asks for a sub-world of the {world} launched ranks, which spark-hvd "
            "does not form; launch only the processes you need (spark-hvd-run -np N), or keep all ranks "
            "and use process sets: init(process_sets=[ProcessSet(ranks)])"
        )
    raise ValueError(
        f"init(comm={type(comm).__name__}) is not supported: spark-hvd forms its world from the launcher's "
        "environment, not from an MPI communicator. Call init() without comm."
    )


def init(comm: Optional[Sequence[int]] = None,
         process_sets: Optional[Union[str, Iterable[Any]]] = None) -> None:
    """Join the job started by the launcher (or form a one-process world without one).

    Afterwards :func:`is_initialized` is True and every collective may be called. ``comm`` may list
    every launched rank (accepted for Horovod compatibility); a strict subset is refused.
    ``process_sets`` is a list of :class:`ProcessSet` objects (or rank lists) registered on every
    rank right after start-up, or ``"dynamic"``. Calling it again while initialized does nothing;
    after :func:`shutdown` (or once the runtime has failed) it forms a fresh world.
    """
    if process_sets is not None and not isinstance(process_sets, str):
        process_sets = list(process_sets)
    elif isinstance(process_sets, str) and process_sets != "dynamic":
        raise ValueError(f"process_sets={process_sets!r} is invalid: expected a list of ProcessSet or 'dynamic'")
    if not _rt.is_initialized():
        _reset()
    _rt.init()
    _check_comm(comm)
    for entry in process_sets if isinstance(process_sets, list) else ():
        if not (isinstance(entry, ProcessSet) and entry.process_set_id is not None):
            _rt.add_process_set(entry)


def shutdown() -> None:
    """Leave the job: afterwards collectives raise until :func:`init` is called again."""
    _reset()
    _rt.shutdown()


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks."""
    return bool(_rt.is_homogeneous())


# --- topology as tensors: constants, so graphs built with them see the values at build time ------


def _int_op(value: int, name: Optional[str]) -> tf.Tensor:
    return tf.constant(value, dtype=tf.int32, name=name)


def rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's rank as an int32 scalar tensor."""
    return _int_op(rank(), name)


def local_rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's rank on its host as an int32 scalar tensor."""
    return _int_op(local_rank(), name)


def size_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks of process set ``process_set_id`` (0: all ranks) as an int32 scalar tensor."""
    return _int_op(len(_process_set_ranks(process_set_id)), name)


def local_size_op(name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks on this host as an int32 scalar tensor."""
    return _int_op(local_size(), name)


def process_set_included_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """1 if this rank belongs to process set ``process_set_id``, else 0, as an int32 scalar tensor."""
    return _int_op(int(rank() in _process_set_ranks(process_set_id)), name)


def _process_set_ranks(process_set_id: int) -> Sequence[int]:
    if process_set_id == 0:
        return range(size())
    known = _rt.api._state.process_sets.get(process_set_id)
    if known is not None:
        return known.ranks
    raise ValueError(f"process_set_id={process_set_id} is not a registered process set; call add_process_set() first")


# --- build probes of TensorFlow tensors (the rest are the runtime's: spark_hvd.runtime.build) ---------


def nccl_built() -> bool:
    """Always False: TensorFlow tensors travel through host memory."""
    return False


def cuda_built() -> bool:
    """Always False: collectives on GPU tensors run on copies in host memory."""
    return False

