"""The runtime's public functions: lifecycle, topology, and the collective grid on numpy arrays."""

from __future__ import annotations

import atexit
import os
import itertools
import logging
import pickle
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .config import RuntimeConfig
from .engine import Engine
from .handles import Entry, Handle
from .errors import NotInitializedError
from .negotiation import Meta
from .ops import Average, check_op, storage_dtype, wire_dtype
from .world import World, connect_world

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "is_homogeneous", "Handle", "poll", "synchronize",
    "allreduce", "allreduce_async", "grouped_allreduce", "grouped_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_async", "alltoall", "alltoall_async",
    "reducescatter", "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
    "barrier", "barrier_async", "join", "join_async", "broadcast_object", "allgather_object",
    "start_timeline", "stop_timeline", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set",
]

log = logging.getLogger("spark_hvd")


class ProcessSet:
    """A subset of ranks that runs collectives among itself (``process_set=`` of every collective)."""

    def __init__(self, ranks: Sequence[int]) -> None:
        ranks = sorted(int(r) for r in ranks)
        if len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"process set ranks {ranks} must be distinct and non-empty")
        self.ranks: Tuple[int, ...] = tuple(ranks)
        self.process_set_id: Optional[int] = None

    def size(self) -> int:
        return len(self.ranks)

    def rank(self) -> int:
        me = rank()
        if me not in self.ranks:
            raise ValueError(f"rank {me} is not a member of process set {self.ranks}")
        return self.ranks.index(me)

    def included(self) -> bool:
        return rank() in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={list(self.ranks)})"


global_process_set = ProcessSet([0])
global_process_set.process_set_id = 0


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.world: Optional[World] = None
        self.engine: Optional[Engine] = None
        self.counters: Dict[str, itertools.count] = {}
        self.atexit_registered = False
        self.process_sets: Dict[int, ProcessSet] = {}


_state = _State()


def _engine(what: str = "this operation") -> Engine:
    engine = _state.engine
    if engine is None:
        raise NotInitializedError(what)
    return engine


def init(config: Optional[RuntimeConfig] = None, **overrides: Any) -> None:
    """Join the job described by the worker contract (a world of one without a launcher).

    Calling it again while initialized does nothing.
    """
    with _state.lock:
        if _state.engine is not None:
            return
        cfg = config if config is not None else RuntimeConfig.from_env(**overrides)
        logging.getLogger("spark_hvd").setLevel(cfg.log_level.upper())
        if cfg.rank is None and cfg.size is None and cfg.rendezvous_addr is None:
            from .world import single_world
            world = single_world()
        else:
            world = connect_world(cfg)
        _state.world = world
        if cfg.bind_cpus:
            _bind_cpus(world.local_rank, world.local_size)
        _state.engine = Engine(world, cfg)
        _state.counters = {}
        global_process_set.ranks = tuple(range(world.size))
        _state.process_sets = {0: global_process_set}
        if not _state.atexit_registered:
            atexit.register(shutdown)
            _state.atexit_registered = True


def _bind_cpus(local_rank: int, local_size: int) -> None:
    """Give this rank a disjoint share of the usable CPUs; threads started later inherit it."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return
    share = len(cpus) // local_size
    if share == 0:
        log.warning("SPARK_HVD_BIND_CPUS: %d local ranks but %d usable CPUs; not binding", local_size, len(cpus))
        return
    os.sched_setaffinity(0, cpus[local_rank * share:(local_rank + 1) * share])


def shutdown() -> None:
    """Stop the engine and close connections; pending operations fail with CollectiveError."""
    with _state.lock:
        engine, world = _state.engine, _state.world
        _state.engine = None
        _state.world = None
    if engine is not None:
        engine.shutdown()
    if world is not None:
        world.close()


def is_initialized() -> bool:
    return _state.engine is not None


def _world(what: str) -> World:
    world = _state.world
    if world is None:
        raise NotInitializedError(what)
    return world


def rank() -> int:
    return _world("rank()").rank


def size() -> int:
    return _world("size()").size


def local_rank() -> int:
    return _world("local_rank()").local_rank


def local_size() -> int:
    return _world("local_size()").local_size


def cross_rank() -> int:
    return _world("cross_rank()").cross_rank


def cross_size() -> int:
    return _world("cross_size()").cross_size


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks (the same answer on every rank)."""
    return _world("is_homogeneous()").homogeneous


def poll(handle: Handle) -> bool:
    """True once the operation behind ``handle`` has finished (successfully or not)."""
    return handle.done()


def synchronize(handle: Handle, timeout: Optional[float] = None) -> Any:
    """Wait for ``handle`` and return its result (re-raising its error)."""
    return handle.wait(timeout)


# -- building requests -------------------------------------------------------------------------
def _name(kind: str, name: Optional[str]) -> str:
    if name is not None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name={name!r} must be a non-empty string")
        return name
    # Per-kind counters: ranks that call the same collectives in the same order agree on names.
    counter = _state.counters.setdefault(kind, itertools.count())
    return f"{kind}.noname.{next(counter)}"


def _ps_id(process_set: Optional[ProcessSet]) -> int:
    if process_set is None:
        return 0
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set!r} has not been registered; call add_process_set() on every rank first")
    if process_set.process_set_id not in _state.process_sets:
        raise ValueError(f"{process_set!r} was removed; register it again with add_process_set()")
    if not process_set.included():
        raise ValueError(f"rank {rank()} is not a member of {process_set!r}; only members may call its collectives")
    return process_set.process_set_id


def _prepare(array: Any, dtype: Optional[str]) -> Tuple[np.ndarray, str]:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"expected a numpy array, got {type(array).__name__}")
    wire = wire_dtype(array, dtype)
    if dtype is not None and array.dtype != storage_dtype(wire):
        array = array.view(storage_dtype(wire))  # e.g. bfloat16 given as int16 or ml_dtypes storage
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array, wire


def _check_out(out: np.ndarray, array: np.ndarray, what: str) -> np.ndarray:
    if out.shape != array.shape or out.dtype.itemsize != array.dtype.itemsize or not out.flags.c_contiguous:
        raise ValueError(
            f"{what}: out has shape {out.shape} and dtype {out.dtype}, expected a C-contiguous array of shape "
            f"{array.shape} and dtype {array.dtype}"
        )
    return out.view(array.dtype) if out.dtype != array.dtype else out


def _scales(prescale_factor: float, postscale_factor: float) -> Tuple[float, float]:
    return float(prescale_factor), float(postscale_factor)


def _submit(entries: List[Entry], will_wait: bool = False) -> None:
    _engine().submit(entries, will_wait)


def _handle(name: str, parts: int = 1, single: bool = True) -> Handle:
    return Handle(name, parts, single, _state.engine)


def _reduce_entries(kind: str, arrays: Sequence[np.ndarray], op: int, name: Optional[str],
                    prescale_factor: float, postscale_factor: float, outs: Optional[Sequence[Optional[np.ndarray]]],
                    dtype: Optional[str], process_set: Optional[ProcessSet], grouped: bool,
                    will_wait: bool = False) -> Handle:
    engine = _engine(kind)
    ps = _ps_id(process_set)
    base = _name(("grouped_" if grouped else "") + kind, name)
    handle = _handle(base, parts=len(arrays), single=not grouped)
    entries = []
    group = (base, len(arrays)) if grouped and len(arrays) > 1 else None
    pre, post = _scales(prescale_factor, postscale_factor)
    for i, raw in enumerate(arrays):
        array, wire = _prepare(raw, dtype)
        reduce_op = check_op(op, wire)
        if (pre != 1.0 or post != 1.0) and wire == "bool":
            raise ValueError("prescale_factor/postscale_factor are not defined for bool arrays")
        if kind == "reducescatter" and array.ndim == 0:
            raise ValueError("reducescatter needs an array with at least one dimension to split across ranks")
        out = None
        if kind == "allreduce":
            given = outs[i] if outs is not None else None
            if given is raw:
                if array is not raw and array.size and not np.may_share_memory(array, raw):
                    raise ValueError("in-place allreduce needs a C-contiguous array; pass np.ascontiguousarray(a)")
                out = array
            else:
                out = _check_out(given, array, kind) if given is not None else np.empty_like(array)
        entry_name = f"{base}.{i}" if grouped else base
        meta = Meta(kind, wire, tuple(array.shape), int(reduce_op), -1, pre, post, ps, group)
        entries.append(Entry(entry_name, meta, array, out, handle, i))
    if not entries:
        handle._finish()
        return handle
    engine.submit(entries, will_wait)
    return handle


def allreduce_async(array: np.ndarray, op: int = Average, name: Optional[str] = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0, out: Optional[np.ndarray] = None,
                    dtype: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> Handle:
    """Start an allreduce. Afterwards the result is the same on all ranks: op over every rank's
    ``array`` (scaled by prescale before and postscale after). ``out=array`` reduces in place."""
    return _reduce_entries("allreduce", [array], op, name, prescale_factor, postscale_factor, [out], dtype,
                           process_set, grouped=False)


def allreduce(array: np.ndarray, op: int = Average, name: Optional[str] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, out: Optional[np.ndarray] = None, dtype: Optional[str] = None,
              process_set: Optional[ProcessSet] = None) -> np.ndarray:
    """Blocking :func:`allreduce_async`."""
    return _reduce_entries("allreduce", [array], op, name, prescale_factor, postscale_factor, [out], dtype,
                           process_set, grouped=False, will_wait=True).wait()


def grouped_allreduce_async(arrays: Sequence[np.ndarray], op: int = Average, name: Optional[str] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            outs: Optional[Sequence[Optional[np.ndarray]]] = None, dtype: Optional[str] = None,
                            process_set: Optional[ProcessSet] = None) -> Handle:
    """Allreduce a list of arrays as one unit: they are negotiated and fused together."""
    return _reduce_entries("allreduce", list(arrays), op, name, prescale_factor, postscale_factor, outs, dtype,
                           process_set, grouped=True)


def grouped_allreduce(arrays: Sequence[np.ndarray], op: int = Average, name: Optional[str] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      outs: Optional[Sequence[Optional[np.ndarray]]] = None, dtype: Optional[str] = None,
                      process_set: Optional[ProcessSet] = None) -> List[np.ndarray]:
    return _reduce_entries("allreduce", list(arrays), op, name, prescale_factor, postscale_factor, outs, dtype,
                           process_set, grouped=True, will_wait=True).wait()


def reducescatter_async(array: np.ndarray, op: int = Average, name: Optional[str] = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0, dtype: Optional[str] = None,
                        process_set: Optional[ProcessSet] = None) -> Handle:
    """Start a reducescatter: rank r receives block r (numpy.array_split of dim 0) of the reduction."""
    return _reduce_entries("reducescatter", [array], op, name, prescale_factor, postscale_factor, None, dtype,
                           process_set, grouped=False)


def reducescatter(array: np.ndarray, op: int = Average, name: Optional[str] = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, dtype: Optional[str] = None,
                  process_set: Optional[ProcessSet] = None) -> np.ndarray:
    return _reduce_entries("reducescatter", [array], op, name, prescale_factor, postscale_factor, None, dtype,
                           process_set, grouped=False, will_wait=True).wait()


def grouped_reducescatter_async(arrays: Sequence[np.ndarray], op: int = Average, name: Optional[str] = None,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                dtype: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> Handle:
    return _reduce_entries("reducescatter", list(arrays), op, name, prescale_factor, postscale_factor, None,
                           dtype, process_set, grouped=True)


def grouped_reducescatter(arrays: Sequence[np.ndarray], op: int = Average, name: Optional[str] = None,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          dtype: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> List[np.ndarray]:
    return grouped_reducescatter_async(arrays, op, name, prescale_factor, postscale_factor, dtype,
                                       process_set).wait()


def _gather_entries(arrays: Sequence[np.ndarray], name: Optional[str], dtype: Optional[str],
                    process_set: Optional[ProcessSet], grouped: bool, will_wait: bool = False) -> Handle:
    _engine("allgather")
    ps = _ps_id(process_set)
    base = _name("grouped_allgather" if grouped else "allgather", name)
    handle = _handle(base, parts=len(arrays), single=not grouped)
    group = (base, len(arrays)) if grouped and len(arrays) > 1 else None
    entries = []
    for i, raw in enumerate(arrays):
        array, wire = _prepare(raw, dtype)
        meta = Meta("allgather", wire, tuple(array.shape), 0, -1, 1.0, 1.0, ps, group)
        entries.append(Entry(f"{base}.{i}" if grouped else base, meta, array, None, handle, i))
    if not entries:
        handle._finish()
        return handle
    _submit(entries, will_wait)
    return handle


def allgather_async(array: np.ndarray, name: Optional[str] = None, dtype: Optional[str] = None,
                    process_set: Optional[ProcessSet] = None) -> Handle:
    """Start an allgather: every rank receives all ranks' arrays concatenated along dim 0 in rank
    order (first dimensions may differ between ranks; the others must agree)."""
    return _gather_entries([array], name, dtype, process_set, grouped=False)


def allgather(array: np.ndarray, name: Optional[str] = None, dtype: Optional[str] = None,
              process_set: Optional[ProcessSet] = None) -> np.ndarray:
    return _gather_entries([array], name, dtype, process_set, grouped=False, will_wait=True).wait()


def grouped_allgather_async(arrays: Sequence[np.ndarray], name: Optional[str] = None, dtype: Optional[str] = None,
                            process_set: Optional[ProcessSet] = None) -> Handle:
    return _gather_entries(list(arrays), name, dtype, process_set, grouped=True)


def grouped_allgather(arrays: Sequence[np.ndarray], name: Optional[str] = None, dtype: Optional[str] = None,
                      process_set: Optional[ProcessSet] = None) -> List[np.ndarray]:
    return grouped_allgather_async(arrays, name, dtype, process_set).wait()


def broadcast_async(array: np.ndarray, root_rank: int, name: Optional[str] = None, out: Optional[np.ndarray] = None,
                    dtype: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> Handle:
    """Start a broadcast: afterwards the result equals ``root_rank``'s array on every rank.
    ``out=array`` overwrites the array in place."""
    return _broadcast(array, root_rank, name, out, dtype, process_set, False)


def _broadcast(array: np.ndarray, root_rank: int, name: Optional[str], out: Optional[np.ndarray],
               dtype: Optional[str], process_set: Optional[ProcessSet], will_wait: bool) -> Handle:
    _engine("broadcast")
    ps = _ps_id(process_set)
    members = _state.process_sets[ps].ranks
    if root_rank not in members:
        raise ValueError(f"root_rank={root_rank} is not a rank of the job (expected one of {list(members)})")
    array_c, wire = _prepare(array, dtype)
    base = _name("broadcast", name)
    if out is array:
        if array_c is not array and array_c.size and not np.may_share_memory(array_c, array):
            raise ValueError("in-place broadcast needs a C-contiguous array; pass np.ascontiguousarray(a)")
        target = array_c
    elif out is not None:
        target = _check_out(out, array_c, "broadcast")
    else:
        target = np.empty_like(array_c)
    handle = _handle(base)
    meta = Meta("broadcast", wire, tuple(array_c.shape), 0, int(root_rank), 1.0, 1.0, ps)
    _submit([Entry(base, meta, array_c, target, handle)], will_wait)
    return handle


def broadcast(array: np.ndarray, root_rank: int, name: Optional[str] = None, out: Optional[np.ndarray] = None,
              dtype: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> np.ndarray:
    return _broadcast(array, root_rank, name, out, dtype, process_set, True).wait()


def alltoall_async(array: np.ndarray, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
                   dtype: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> Handle:
    """Start an alltoall: block j of ``array`` (``splits[j]`` rows of dim 0) goes to rank j. The result
    is (received rows concatenated in rank order, the number of rows received from each rank)."""
    _engine("alltoall")
    ps = _ps_id(process_set)
    n = len(_state.process_sets[ps].ranks)
    array_c, wire = _prepare(array, dtype)
    if array_c.ndim == 0:
        raise ValueError("alltoall needs an array with at least one dimension")
    if splits is None:
        if array_c.shape[0] % n:
            raise ValueError(
                f"alltoall without splits needs dim 0 ({array_c.shape[0]}) divisible by the number of ranks ({n}); "
                "pass splits=[rows for rank 0, rows for rank 1, ...]"
            )
        split_list = [array_c.shape[0] // n] * n
    else:
        split_list = [int(s) for s in np.asarray(splits).reshape(-1)]
        if len(split_list) != n or any(s < 0 for s in split_list) or sum(split_list) != array_c.shape[0]:
            raise ValueError(
                f"alltoall splits={split_list} must give one non-negative row count per rank ({n}) adding up to "
                f"dim 0 of the array ({array_c.shape[0]})"
            )
    base = _name("alltoall", name)
    handle = _handle(base)
    meta = Meta("alltoall", wire, tuple(array_c.shape), 0, -1, 1.0, 1.0, ps, None, tuple(split_list))
    _submit([Entry(base, meta, array_c, None, handle)])
    return handle


def alltoall(array: np.ndarray, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
             dtype: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> Tuple[np.ndarray, np.ndarray]:
    return alltoall_async(array, splits, name, dtype, process_set).wait()


def barrier_async(process_set: Optional[ProcessSet] = None, name: Optional[str] = None) -> Handle:
    ps = _ps_id(process_set)
    base = _name("barrier", name)
    handle = _handle(base)
    _submit([Entry(base, Meta("barrier", "", (), 0, -1, 1.0, 1.0, ps), None, None, handle)])
    return handle


def barrier(process_set: Optional[ProcessSet] = None, timeout: Optional[float] = None) -> None:
    """Return once every rank of the process set has called barrier()."""
    ps = _ps_id(process_set)
    base = _name("barrier", None)
    handle = _handle(base)
    _submit([Entry(base, Meta("barrier", "", (), 0, -1, 1.0, 1.0, ps), None, None, handle)], will_wait=True)
    handle.wait(timeout)


def join_async() -> Handle:
    base = "join"
    handle = _handle(base)
    _submit([Entry(f"join.{rank()}", Meta("join", "", (), 0, -1, 1.0, 1.0, 0), None, None, handle)])
    return handle


def join(timeout: Optional[float] = None) -> int:
    """Declare that this rank has no more data. Until every rank has joined, the collectives of the
    others proceed, joined ranks contributing zeros (allreduce) or no rows (allgather). Returns the
    rank that joined last."""
    last = join_async().wait(timeout)
    # Ranks may have run different numbers of unnamed operations before joining; start the
    # counters afresh everywhere so the names of later unnamed operations agree again.
    _state.counters = {}
    return last


def _object_bytes(obj: Any) -> np.ndarray:
    try:
        import cloudpickle
        data = cloudpickle.dumps(obj)
    except ImportError:  # pragma: no cover - cloudpickle is a dependency
        data = pickle.dumps(obj)
    return np.frombuffer(data, dtype=np.uint8)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: Optional[ProcessSet] = None) -> Any:
    """Return root_rank's ``obj`` on every rank (pickled with cloudpickle)."""
    base = _name("broadcast_object", name)
    payload = _object_bytes(obj) if rank() == root_rank else np.empty(0, np.uint8)
    length = broadcast(np.array([payload.size], dtype=np.int64), root_rank, name=f"{base}.len",
                       process_set=process_set)
    buf = payload if rank() == root_rank else np.empty(int(length[0]), dtype=np.uint8)
    data = broadcast(buf, root_rank, name=f"{base}.data", process_set=process_set)
    return obj if rank() == root_rank else pickle.loads(data.tobytes())


def allgather_object(obj: Any, name: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> List[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    base = _name("allgather_object", name)
    payload = _object_bytes(obj)
    sizes = allgather(np.array([payload.size], dtype=np.int64), name=f"{base}.len", process_set=process_set)
    data = allgather(payload, name=f"{base}.data", process_set=process_set)
    out, start = [], 0
    for n in sizes.tolist():
        out.append(pickle.loads(data[start:start + n].tobytes()))
        start += n
    return out


def start_timeline(path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome-trace timeline to ``path`` (rank 0 writes; other ranks ignore it)."""
    _engine("start_timeline()").start_timeline(path, mark_cycles)


def stop_timeline() -> None:
    _engine("stop_timeline()").stop_timeline()


def add_process_set(ranks: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a process set; every rank of the job must call this with the same ranks."""
    ps = ranks if isinstance(ranks, ProcessSet) else ProcessSet(ranks)
    for r in ps.ranks:
        if not 0 <= r < size():
            raise ValueError(f"process set rank {r} is outside the job of size {size()}")
    base = _name("add_process_set", None)
    handle = _handle(base)
    meta = Meta("add_process_set", "", (), 0, -1, 1.0, 1.0, 0, None, ps.ranks)
    _submit([Entry(base, meta, None, None, handle)])
    ps.process_set_id = handle.wait()
    _state.process_sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Forget a process set on this rank; its id is not reused."""
    if process_set.process_set_id in (None, 0):
        return False
    return _state.process_sets.pop(process_set.process_set_id, None) is not None
