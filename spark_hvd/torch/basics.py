"""Lifecycle, topology, reduction constants, process sets and build probes of spark_hvd.torch."""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence, Union

import spark_hvd.runtime as _rt
from spark_hvd.runtime.build import (ccl_built, ddl_built, gloo_built, gloo_enabled, mpi_built, mpi_enabled,
                                     mpi_threads_supported, rocm_built)
from spark_hvd.runtime.errors import CollectiveError, NotInitializedError
from spark_hvd.runtime.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "is_homogeneous",
    "start_timeline",
    "stop_timeline",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "gloo_built",
    "gloo_enabled",
    "nccl_built",
    "nccl_problem",
    "ddl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
    "ReduceOp",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "HorovodInternalError",
    "NotInitializedError",
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
shutdown = _rt.shutdown
start_timeline = _rt.start_timeline
stop_timeline = _rt.stop_timeline


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

    ``comm`` may list every launched rank (accepted for Horovod compatibility); a strict subset
    is refused with an explanation. ``process_sets`` is a list of :class:`ProcessSet` objects (or
    rank lists) registered on every rank right after start-up, or ``"dynamic"``; process sets can
    always be added later with :func:`add_process_set`. Calling ``init()`` again while
    initialized does nothing; after :func:`shutdown` (or once the runtime has failed) it forms a
    fresh world, and process sets of the previous one must be registered again.
    """
    if process_sets is not None and not isinstance(process_sets, str):
        process_sets = list(process_sets)
    elif isinstance(process_sets, str) and process_sets != "dynamic":
        raise ValueError(f"process_sets={process_sets!r} is invalid: expected a list of ProcessSet or 'dynamic'")
    _rt.init()  # a no-op while initialized, a fresh world after shutdown() or a failure
    _check_comm(comm)
    for entry in process_sets if isinstance(process_sets, list) else ():
        _register(entry)


def _register(entry: Any) -> Any:
    if isinstance(entry, ProcessSet) and getattr(entry, "process_set_id", None) is not None:
        return entry
    return _rt.add_process_set(entry)


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks."""
    return bool(_rt.is_homogeneous())


def nccl_built() -> bool:
    """Whether CUDA tensors are reduced with NCCL: true only when libnccl loads and torch sees a GPU
    (otherwise CUDA tensors are staged through host memory; see :func:`nccl_problem`)."""
    return nccl_problem() is None


def nccl_problem() -> Optional[str]:
    """Why CUDA tensors cannot use NCCL here, or None when they can."""
    from spark_hvd.torch.device import device_problem

    return device_problem()


def cuda_built() -> bool:
    """Whether collectives run on CUDA devices without a host copy (NCCL usable, a GPU visible)."""
    return nccl_built()

