"""The runtime's public functions: lifecycle, topology, and the collective grid on numpy arrays."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import pickle
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .config import RuntimeConfig
from .errors import NotInitializedError
from .handles import Handle
from .membership import join_next_world, read_updates
from .mpi import MpiDataPlane, mpi_world
from .ops import Average
from .rendezvous import RendezvousClient
from .session import Session
from .world import PeerLink, World, connect_world, single_world
from .kinds import ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, JOIN, REDUCESCATTER

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "is_homogeneous", "Handle", "poll", "synchronize",
    "allreduce", "allreduce_async", "allreduce_lockstep", "grouped_allreduce", "grouped_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_async", "alltoall", "alltoall_async",
    "reducescatter", "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
    "barrier", "barrier_async", "join", "join_async", "broadcast_object", "allgather_object",
    "start_timeline", "stop_timeline", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set", "host_updates", "mpi_enabled", "device_async", "peer_links", "PeerLink",
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
        self.session: Optional[Session] = None
        self.generation = 0  # init() calls so far in this process: keys and segments are per generation
        self.updates_seen = 0  # an elastic launcher's updates counter when this world formed
        self.updates_client: Optional[RendezvousClient] = None
        self.atexit_registered = False
        self.process_sets: Dict[int, ProcessSet] = {}


_state = _State()


def _session(what: str = "this operation") -> Session:
    session = _state.session
    if session is None:
        raise NotInitializedError(what)
    return session


def init(config: Optional[RuntimeConfig] = None, **overrides: Any) -> None:
    """Join the job described by the worker contract (a world of one without a launcher).

    Calling it again while initialized does nothing; after :func:`shutdown` it joins the job
    anew, as often as needed (every rank must do the same). A runtime that has failed (a lost
    peer, an abort, a stall past its deadline) can do nothing more, so init() then shuts it down
    and joins anew, as the other ranks, which failed too, will.
    """
    with _state.lock:
        stale = _state.session
        if stale is not None:
            if stale.engine.failure is None:
                return
            log.info("spark-hvd: initializing again after the runtime failed: %s", stale.engine.failure)
            shutdown()
        cfg = config if config is not None else RuntimeConfig.from_env(**overrides)
        logging.getLogger("spark_hvd").setLevel(cfg.log_level.upper())
        _state.generation += 1
        if cfg.controller == "mpi" or (cfg.controller == "auto" and cfg.rank is None and cfg.mpi_rank is not None):
            world = mpi_world(cfg)
        elif cfg.elastic and cfg.rank is None:
            cfg, generation = _join_elastic(cfg)
            world = connect_world(cfg, generation=generation)
        elif cfg.rank is None and cfg.size is None and cfg.rendezvous_addr is None:
            world = single_world()
        else:
            world = connect_world(cfg, generation=_state.generation)
        if cfg.bind_cpus:
            _bind_cpus(world.local_rank, world.local_size)
        try:
            session = Session(world, cfg)
        except BaseException:
            world.close()
            raise
        _state.session = session
        global_process_set.ranks = tuple(range(world.size))
        for stale_set in _state.process_sets.values():
            if stale_set is not global_process_set:
                stale_set.process_set_id = None  # ids belong to the world that registered them
        _state.process_sets = {0: global_process_set}
        if not _state.atexit_registered:
            atexit.register(shutdown)
            _state.atexit_registered = True


def _join_elastic(cfg: RuntimeConfig) -> Tuple[RuntimeConfig, int]:
    """An elastic worker's place in the world the launcher forms next; the launcher numbers the
    generations, so every member agrees on its keys."""
    cfg = cfg.require_worker()
    assignment = join_next_world(cfg, _state.generation)
    _state.updates_seen = assignment.updates
    placed = dataclasses.replace(cfg, rank=assignment.rank, size=assignment.size, local_rank=assignment.local_rank,
                                 local_size=assignment.local_size, cross_rank=assignment.cross_rank,
                                 cross_size=assignment.cross_size)
    return placed, assignment.generation


def host_updates() -> Tuple[bool, bool]:
    """Whether the elastic launcher has changed the available workers since this world formed, and
    whether it added any; the same answer on every rank (False, False outside elastic jobs)."""
    session = _session("host_updates()")
    cfg = session.config
    if not cfg.elastic:
        return False, False
    version, added = 0, False
    if session.rank == 0:
        if _state.updates_client is None:  # one connection for the world's life: commits are frequent
            _state.updates_client = RendezvousClient(cfg.rendezvous_addr, cfg.secret, cfg.start_timeout)
        version, added = read_updates(_state.updates_client, cfg.start_timeout)
    changed = version > _state.updates_seen
    flags = session.broadcast(np.array([int(changed), int(changed and added)], dtype=np.int64), 0,
                              name="elastic.host_updates", out=None, dtype=None, ps=0, will_wait=True).wait()
    return bool(flags[0]), bool(flags[1])


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
        session = _state.session
        _state.session = None
        client, _state.updates_client = _state.updates_client, None
    if client is not None:
        client.close()
    if session is not None:
        session.shutdown()


def mpi_enabled() -> bool:
    """Whether the running world negotiates and moves data through MPI."""
    session = _state.session
    return session is not None and isinstance(session.world.data, MpiDataPlane)


def is_initialized() -> bool:
    return _state.session is not None


def runtime_config() -> Optional[RuntimeConfig]:
    """The settings the running world was initialized with (None before init())."""
    session = _state.session
    return session.config if session is not None else None


def _world(what: str) -> World:
    return _session(what).world


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


def peer_links() -> List[PeerLink]:
    """How this rank's data reaches each other rank, in rank order: ``PeerLink(rank, transport,
    host, address, local_address)`` with transport ``"shm"`` (shared memory on one host), ``"tcp"``
    (with both ends' ``ip:port``) or ``"mpi"``."""
    return _world("peer_links()").links()


def poll(handle: Handle) -> bool:
    """True once the operation behind ``handle`` has finished (successfully or not)."""
    return handle.done()


def synchronize(handle: Handle, timeout: Optional[float] = None) -> Any:
    """Wait for ``handle`` and return its result (re-raising its error)."""
    return handle.wait(timeout)


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


def _reduce(kind: str, arrays: Sequence[np.ndarray], op: int, name: Optional[str], prescale_factor: float,
            postscale_factor: float, outs: Optional[Sequence[Optional[np.ndarray]]], dtype: Optional[str],
            process_set: Optional[ProcessSet], grouped: bool, will_wait: bool = False) -> Handle:
    session = _session(kind)
    return session.reduce(kind, arrays, op=op, name=name, prescale=prescale_factor, postscale=postscale_factor,
                          outs=outs, dtype=dtype, ps=_ps_id(process_set), grouped=grouped, will_wait=will_wait)


def allreduce_async(array: np.ndarray, op: int = Average, name: Optional[str] = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0, out: Optional[np.ndarray] = None,
                    dtype: Optional[str] = None, process_set: Optional[ProcessSet] = None, *,
                    will_wait: bool = False) -> Handle:
    """Start an allreduce. Afterwards the result is the same on all ranks: op over every rank's
    ``array`` (scaled by prescale before and postscale after). ``out=array`` reduces in place.

    ``will_wait=True``: the caller waits for the handle before anything else, as a blocking
    :func:`allreduce` does (the handle may be finished when it is returned)."""
    return _reduce(ALLREDUCE, [array], op, name, prescale_factor, postscale_factor, [out], dtype,
                   process_set, grouped=False, will_wait=will_wait)


def allreduce_lockstep(array: np.ndarray, op: int = Average, name: str = "lockstep",
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Optional[ProcessSet] = None) -> Optional[Handle]:
    """Reduce ``array`` in place the way :func:`allreduce_async` with ``out=array`` would, without
    negotiating it (through shared memory when every rank of the job is on this host, over direct TCP
    links between the ranks of a job across hosts): a finished handle, or None (nothing done) when it
    must go through :func:`allreduce_async` instead.

    For reductions that every rank issues in the same program order, e.g. the single gradient
    buffer of each training step. Issued out of order, the ranks fail with RankMismatchError
    instead of reducing unrelated data; every rank gets the same answer (None or a handle) for the
    same request. Bytes above SPARK_HVD_LOCKSTEP_BYTES (across hosts: bytes times the other ranks
    above SPARK_HVD_LOCKSTEP_LINK_BYTES), other dtypes than float16/32/64, process sets and Product
    always get None, and so does every request after a rank has joined.
    """
    session = _session(ALLREDUCE)
    if not session.lockstep_allreduce(array, op=op, name=name, prescale=prescale_factor,
                                      postscale=postscale_factor, ps=_ps_id(process_set)):
        return None
    return Handle.completed(name, array)


def allreduce(array: np.ndarray, op: int = Average, name: Optional[str] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, out: Optional[np.ndarray] = None, dtype: Optional[str] = None,
              process_set: Optional[ProcessSet] = None) -> np.ndarray:
    """Blocking :func:`allreduce_async`.

    Where every rank of the job shares one host (or the job has program-order links across hosts,
    see :func:`allreduce_lockstep`), a blocking allreduce of float16/32/64 with Sum, Average, Min
    or Max on the global process set is exchanged in program order without negotiation, as long
    as the ranks issue them in the same order; at a step where they do not, every rank negotiates
    its request, as Horovod does (across hosts every later one too)."""
    return _reduce(ALLREDUCE, [array], op, name, prescale_factor, postscale_factor, [out], dtype,
                   process_set, grouped=False, will_wait=True).wait()


def grouped_allreduce_async(arrays: Sequence[np.ndarray], op: int = Average, name: Optional[str] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            outs: Optional[Sequence[Optional[np.ndarray]]] = None, dtype: Optional[str] = None,
                            process_set: Optional[ProcessSet] = None) -> Handle:
    """Allreduce a list of arrays as one unit: they are negotiated and fused together."""
    return _reduce(ALLREDUCE, list(arrays), op, name, prescale_factor, postscale_factor, outs, dtype,
                   process_set, grouped=True)


def grouped_allreduce(arrays: Sequence[np.ndarray], op: int = Average, name: Optional[str] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      outs: Optional[Sequence[Optional[np.ndarray]]] = None, dtype: Optional[str] = None,
                      process_set: Optional[ProcessSet] = None) -> List[np.ndarray]:
    """Blocking :func:`grouped_allreduce_async`."""
    return _reduce(ALLREDUCE, list(arrays), op, name, prescale_factor, postscale_factor, outs, dtype,
                   process_set, grouped=True, will_wait=True).wait()


def reducescatter_async(array: np.ndarray, op: int = Average, name: Optional[str] = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0, dtype: Optional[str] = None,
                        process_set: Optional[ProcessSet] = None) -> Handle:
    """Start a reducescatter: rank r receives block r (numpy.array_split of dim 0) of the reduction."""
    return _reduce(REDUCESCATTER, [array], op, name, prescale_factor, postscale_factor, None, dtype,
                   process_set, grouped=False)


def reducescatter(array: np.ndarray, op: int = Average, name: Optional[str] = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, dtype: Optional[str] = None,
                  process_set: Optional[ProcessSet] = None) -> np.ndarray:
    """Blocking :func:`reducescatter_async`."""
    return _reduce(REDUCESCATTER, [array], op, name, prescale_factor, postscale_factor, None, dtype,
                   process_set, grouped=False, will_wait=True).wait()


def grouped_reducescatter_async(arrays: Sequence[np.ndarray], op: int = Average, name: Optional[str] = None,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                dtype: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> Handle:
    """Reducescatter a list of arrays as one unit."""
    return _reduce(REDUCESCATTER, list(arrays), op, name, prescale_factor, postscale_factor, None, dtype,
                   process_set, grouped=True)


def grouped_reducescatter(arrays: Sequence[np.ndarray], op: int = Average, name: Optional[str] = None,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          dtype: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> List[np.ndarray]:
    """Blocking :func:`grouped_reducescatter_async`."""
    return _reduce(REDUCESCATTER, list(arrays), op, name, prescale_factor, postscale_factor, None, dtype,
                   process_set, grouped=True, will_wait=True).wait()


def _allgather(arrays: Sequence[np.ndarray], name: Optional[str], dtype: Optional[str],
               process_set: Optional[ProcessSet], grouped: bool, will_wait: bool = False) -> Handle:
    session = _session(ALLGATHER)
    return session.allgather(arrays, name=name, dtype=dtype, ps=_ps_id(process_set), grouped=grouped,
                             will_wait=will_wait)


def allgather_async(array: np.ndarray, name: Optional[str] = None, dtype: Optional[str] = None,
                    process_set: Optional[ProcessSet] = None) -> Handle:
    """Start an allgather: every rank receives all ranks' arrays concatenated along dim 0 in rank
    order (first dimensions may differ between ranks; the others must agree)."""
    return _allgather([array], name, dtype, process_set, grouped=False)


def allgather(array: np.ndarray, name: Optional[str] = None, dtype: Optional[str] = None,
              process_set: Optional[ProcessSet] = None) -> np.ndarray:
    """Blocking :func:`allgather_async`."""
    return _allgather([array], name, dtype, process_set, grouped=False, will_wait=True).wait()


def grouped_allgather_async(arrays: Sequence[np.ndarray], name: Optional[str] = None, dtype: Optional[str] = None,
                            process_set: Optional[ProcessSet] = None) -> Handle:
    """Allgather a list of arrays as one unit."""
    return _allgather(list(arrays), name, dtype, process_set, grouped=True)


def grouped_allgather(arrays: Sequence[np.ndarray], name: Optional[str] = None, dtype: Optional[str] = None,
                      process_set: Optional[ProcessSet] = None) -> List[np.ndarray]:
    """Blocking :func:`grouped_allgather_async`."""
    return _allgather(list(arrays), name, dtype, process_set, grouped=True, will_wait=True).wait()


def broadcast_async(array: np.ndarray, root_rank: int, name: Optional[str] = None, out: Optional[np.ndarray] = None,
                    dtype: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> Handle:
    """Start a broadcast: afterwards the result equals ``root_rank``'s array on every rank.
    ``out=array`` overwrites the array in place."""
    session = _session(BROADCAST)
    return session.broadcast(array, root_rank, name=name, out=out, dtype=dtype, ps=_ps_id(process_set))


def broadcast(array: np.ndarray, root_rank: int, name: Optional[str] = None, out: Optional[np.ndarray] = None,
              dtype: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> np.ndarray:
    """Blocking :func:`broadcast_async`."""
    session = _session(BROADCAST)
    return session.broadcast(array, root_rank, name=name, out=out, dtype=dtype, ps=_ps_id(process_set),
                             will_wait=True).wait()


def alltoall_async(array: np.ndarray, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
                   dtype: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> Handle:
    """Start an alltoall: block j of ``array`` (``splits[j]`` rows of dim 0) goes to rank j. The result
    is (received rows concatenated in rank order, the number of rows received from each rank)."""
    session = _session(ALLTOALL)
    return session.alltoall(array, splits, name=name, dtype=dtype, ps=_ps_id(process_set))


def alltoall(array: np.ndarray, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
             dtype: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Blocking :func:`alltoall_async`."""
    session = _session(ALLTOALL)
    return session.alltoall(array, splits, name=name, dtype=dtype, ps=_ps_id(process_set), will_wait=True).wait()


def device_async(kind: str, tensors: Sequence[Any], outs: Sequence[Any], *, wire: str, name: Optional[str] = None,
                 op: int = Average, prescale_factor: float = 1.0, postscale_factor: float = 1.0, root_rank: int = -1,
                 splits: Optional[Sequence[int]] = None, process_set: Optional[ProcessSet] = None,
                 grouped: bool = False) -> Handle:
    """Start ``kind`` on device tensors of a framework that registered its device operations
    (spark_hvd.runtime.device); the data moves through NCCL on the device."""
    return _session(kind).device(kind, tensors, outs, wire=wire, name=name, ps=_ps_id(process_set),
                                 grouped=grouped, op=op, prescale=prescale_factor, postscale=postscale_factor,
                                 root_rank=root_rank, splits=splits)


def barrier_async(process_set: Optional[ProcessSet] = None, name: Optional[str] = None) -> Handle:
    """Start a barrier: its handle completes once every rank of the process set has started it."""
    return _session(BARRIER).barrier(ps=_ps_id(process_set), name=name)


def barrier(process_set: Optional[ProcessSet] = None, timeout: Optional[float] = None) -> None:
    """Return once every rank of the process set has called barrier()."""
    _session(BARRIER).barrier(ps=_ps_id(process_set), will_wait=True).wait(timeout)


def join_async() -> Handle:
    """Start a join (see :func:`join`)."""
    return _session(JOIN).join()


def join(timeout: Optional[float] = None) -> int:
    """Declare that this rank has no more data. Until every rank has joined, the allreduces and
    barriers of the others proceed, joined ranks contributing zeros; other collectives fail while a
    rank has joined. Returns the rank that joined last."""
    session = _session(JOIN)
    last = session.join().wait(timeout)
    # Ranks may have run different numbers of unnamed operations before joining; start the
    # counters afresh everywhere so the names of later unnamed operations agree again.
    session.reset_names()
    return last


def _object_bytes(obj: Any) -> np.ndarray:
    import cloudpickle

    return np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: Optional[ProcessSet] = None) -> Any:
    """Return root_rank's ``obj`` on every rank (pickled with cloudpickle)."""
    base = _session("broadcast_object").name("broadcast_object", name, _ps_id(process_set))
    payload = _object_bytes(obj) if rank() == root_rank else np.empty(0, np.uint8)
    length = broadcast(np.array([payload.size], dtype=np.int64), root_rank, name=f"{base}.len",
                       process_set=process_set)
    buf = payload if rank() == root_rank else np.empty(int(length[0]), dtype=np.uint8)
    data = broadcast(buf, root_rank, name=f"{base}.data", process_set=process_set)
    return obj if rank() == root_rank else pickle.loads(data.tobytes())


def allgather_object(obj: Any, name: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> List[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    base = _session("allgather_object").name("allgather_object", name, _ps_id(process_set))
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
    _session("start_timeline()").engine.start_timeline(path, mark_cycles)


def stop_timeline() -> None:
    """Stop writing the timeline and close its file."""
    _session("stop_timeline()").engine.stop_timeline()


def add_process_set(ranks: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a process set; every rank of the job must call this with the same ranks."""
    ps = ranks if isinstance(ranks, ProcessSet) else ProcessSet(ranks)
    ps.process_set_id = _session("add_process_set()").add_process_set(ps.ranks).wait()
    _state.process_sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Forget a process set on this rank; its id is not reused."""
    if process_set.process_set_id in (None, 0):
        return False
    return _state.process_sets.pop(process_set.process_set_id, None) is not None
