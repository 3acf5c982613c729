"""The MPI backend: negotiation and data through mpi4py, for jobs started by mpiexec/mpirun.

The engine stays the same (negotiation, fusion, response cache, timeline, errors); what changes is
the world underneath. Control frames travel as MPI messages on a communicator of their own, and
collectives run as MPI collectives on numpy buffers (``Allreduce``, ``Reduce_scatter``,
``Allgatherv``, ``Bcast``, ``Alltoallv``). Reductions MPI has no type for (float16, bfloat16,
bool) run the built-in ring algorithms over MPI point-to-point messages instead. Every ``init()``
duplicates ``COMM_WORLD`` afresh, so a world formed after ``shutdown()`` shares nothing with the
last one.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .control import BYE
from .dataplane import RingDataPlane
from .ops import ReduceOp
from .transport import Op, Sink, Transport

__all__ = ["import_mpi", "mpi_world", "MpiLink", "MpiChannel", "MpiDataPlane"]

_CONTROL = 11
_DATA = 12
_GOODBYE_WAIT = 1.0
"""Seconds a closing control link waits for its peer's goodbye."""
_GOODBYE_POLL = 1e-4


_MPI: Any = None


def import_mpi() -> Any:
    """mpi4py's MPI module, or an ImportError that says how to install it."""
    global _MPI
    if _MPI is not None:
        return _MPI
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(
            f"the MPI backend needs mpi4py and an MPI library ({exc}); install them with "
            "`pip install \"spark-hvd[mpi]\"` (mpi4py and the mpich wheel), or leave SPARK_HVD_CONTROLLER unset "
            "to use the built-in rings"
        ) from None
    _MPI = MPI
    return MPI


class MpiLink:
    """A control link to one peer over an MPI communicator (polled: it has no descriptor)."""

    def __init__(self, comm: Any, peer: int) -> None:
        self.comm = comm
        self.peer = peer
        self.frames: Deque[bytes] = deque()
        self.closed = False
        self.error: Optional[str] = None
        self._status = import_mpi().Status()
        # Sends still in flight, with their frames kept alive until MPI is done with them.
        self._sending: Deque[Tuple[Any, bytes]] = deque()
        self._goodbye_received = False

    def pump(self) -> None:
        MPI = import_mpi()
        if self._sending:
            self._sending = deque(item for item in self._sending if not item[0].Test())
        while self.comm.Iprobe(source=self.peer, tag=_CONTROL, status=self._status):
            buf = bytearray(self._status.Get_count(MPI.BYTE))
            self.comm.Recv([buf, MPI.BYTE], source=self.peer, tag=_CONTROL)
            frame = bytes(buf)
            self._goodbye_received = self._goodbye_received or frame[:1] == BYE
            self.frames.append(frame)

    def fileno(self) -> Optional[int]:
        return None

    def send(self, frame: bytes) -> None:
        """Start sending ``frame``; it completes in the background (``pump`` finishes it). A
        large frame needs the peer to receive it first, and the peer may be inside a collective
        that waits for this rank: waiting for the send here would deadlock both. MPI delivers
        the frames of one link in the order they were sent."""
        request = self.comm.Isend([frame, import_mpi().BYTE], dest=self.peer, tag=_CONTROL)
        if not request.Test():
            self._sending.append((request, frame))

    def send_quietly(self, frame: bytes) -> None:
        import time

        request = self.comm.Isend([frame, import_mpi().BYTE], dest=self.peer, tag=_CONTROL)
        deadline = time.monotonic() + 1.0
        while not request.Test():
            if time.monotonic() > deadline:
                request.Cancel()
                return
            self.pump()

    def close(self) -> None:
        """Closed once the peer's goodbye is in (waiting for it at most :data:`_GOODBYE_WAIT`
        seconds): a message nobody receives would be left in MPI's queue of unexpected messages,
        which some transports (UCX) report when MPI finalizes."""
        import time

        deadline = time.monotonic() + _GOODBYE_WAIT
        while not self._goodbye_received and time.monotonic() < deadline:
            self.pump()
            time.sleep(_GOODBYE_POLL)
        self.closed = True


class _MpiOp(Op):
    def __init__(self, request: Any, peer: int, finish: Optional[Any] = None) -> None:
        self.request = request
        self.peer = peer
        self.finish = finish
        self.done = False

    def progress(self) -> bool:
        if self.done or not self.request.Test():
            return False
        self.done = True
        if self.finish is not None:
            self.finish()
        return True


class MpiChannel:
    """A point-to-point channel over MPI, for the ring algorithms MPI has no collective type for."""

    def __init__(self, comm: Any, peer: int, global_peer: int) -> None:
        self.comm = comm
        self._peer = peer  # rank in ``comm``
        self.peer = global_peer

    def isend(self, buf: memoryview) -> Op:
        op = _MpiOp(self.comm.Isend([buf, import_mpi().BYTE], dest=self._peer, tag=_DATA), self.peer)
        op.progress()
        return op

    def irecv(self, nbytes: int, sink: Sink) -> Op:
        target = getattr(sink, "target", None)
        if target is not None:
            view = target.cast("B") if target.format != "B" else target
            request = self.comm.Irecv([view[:nbytes], import_mpi().BYTE], source=self._peer, tag=_DATA)
            op = _MpiOp(request, self.peer)
        else:
            scratch = bytearray(nbytes)
            request = self.comm.Irecv([scratch, import_mpi().BYTE], source=self._peer, tag=_DATA)
            op = _MpiOp(request, self.peer, lambda: sink(0, memoryview(scratch)))
        op.progress()
        return op

    def close(self) -> None:
        pass


def _mpi_op(MPI: Any, op: ReduceOp) -> Any:
    return {ReduceOp.Sum: MPI.SUM, ReduceOp.Average: MPI.SUM, ReduceOp.Min: MPI.MIN, ReduceOp.Max: MPI.MAX,
            ReduceOp.Product: MPI.PROD}[op]


# Wire dtypes MPI reduces natively; the others take the rings over point-to-point messages.
_NATIVE = frozenset({"float32", "float64", "int8", "int16", "int32", "int64", "uint8"})


def _bytes(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)


class MpiDataPlane:
    """Collectives as MPI collectives, one communicator per process set."""

    def __init__(self, comm: Any, fallback: RingDataPlane) -> None:
        self.comms: Dict[int, Any] = {0: comm}
        self.fallback = fallback
        self._world = comm

    def size(self, ps: int) -> int:
        return self.comms[ps].Get_size()

    def rank(self, ps: int) -> int:
        return self.comms[ps].Get_rank()

    def add_process_set(self, ps: int, ranks: Tuple[int, ...]) -> None:
        self.fallback.add_process_set(ps, ranks)
        if self._world.Get_rank() in ranks:
            group = self._world.Get_group().Incl(list(ranks))
            self.comms[ps] = self._world.Create_group(group, tag=ps)
            group.Free()

    def allreduce(self, ps: int, flat: np.ndarray, op: ReduceOp, wire: str) -> None:
        if wire not in _NATIVE:
            self.fallback.allreduce(ps, flat, op, wire)
        elif flat.size:
            MPI = import_mpi()
            self.comms[ps].Allreduce(MPI.IN_PLACE, flat, op=_mpi_op(MPI, op))

    def reducescatter(self, ps: int, flat: np.ndarray, counts: Sequence[int], op: ReduceOp, wire: str) -> None:
        if wire not in _NATIVE:
            self.fallback.reducescatter(ps, flat, counts, op, wire)
            return
        MPI = import_mpi()
        comm = self.comms[ps]
        me = comm.Get_rank()
        lo = sum(counts[:me])
        mine = np.empty(counts[me], dtype=flat.dtype)
        comm.Reduce_scatter(flat, mine, recvcounts=list(counts), op=_mpi_op(MPI, op))
        flat[lo:lo + counts[me]] = mine

    def allgather(self, ps: int, flat: np.ndarray, counts: Sequence[int]) -> None:
        MPI = import_mpi()
        item = flat.dtype.itemsize
        sizes = [c * item for c in counts]
        displs = [sum(sizes[:i]) for i in range(len(sizes))]
        self.comms[ps].Allgatherv(MPI.IN_PLACE, [_bytes(flat), sizes, displs, MPI.BYTE])

    def broadcast(self, ps: int, flat: np.ndarray, root: int) -> None:
        if flat.size:
            self.comms[ps].Bcast([_bytes(flat), import_mpi().BYTE], root=root)

    def alltoall(self, ps: int, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray,
                 recv_counts: Sequence[int]) -> None:
        MPI = import_mpi()
        item = send.dtype.itemsize
        s_sizes = [c * item for c in send_counts]
        r_sizes = [c * item for c in recv_counts]
        s_displs = [sum(s_sizes[:i]) for i in range(len(s_sizes))]
        r_displs = [sum(r_sizes[:i]) for i in range(len(r_sizes))]
        sbuf = _bytes(send) if send.size else np.empty(0, np.uint8)
        rbuf = _bytes(recv) if recv.size else np.empty(0, np.uint8)
        self.comms[ps].Alltoallv([sbuf, s_sizes, s_displs, MPI.BYTE], [rbuf, r_sizes, r_displs, MPI.BYTE])

    def close(self) -> None:
        self.comms = {}  # kept alive, not freed: see _MpiWorldComms


class _MpiWorldComms:
    """The communicators one world duplicated, and what ending it takes.

    They are not freed: MPI may give a freed communicator's context to the next one duplicated,
    and a control message still in flight (a goodbye) would then arrive in the next world. A
    process keeps one set per ``init()``, a few contexts each.
    """

    def __init__(self, comms: List[Any], data: MpiDataPlane) -> None:
        self.comms = comms
        self.data = data

    def close(self) -> None:
        self.data.close()


def mpi_world(cfg: Any) -> Any:
    """This process's world from MPI_COMM_WORLD (started by mpiexec/mpirun)."""
    from .world import World

    MPI = import_mpi()
    base = MPI.COMM_WORLD
    data_comm, control_comm, p2p_comm = base.Dup(), base.Dup(), base.Dup()
    rank, size = data_comm.Get_rank(), data_comm.Get_size()
    local = data_comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    cross = data_comm.Split(color=local_rank, key=rank)
    cross_rank, cross_size = cross.Get_rank(), cross.Get_size()
    hosts = data_comm.allgather(cfg.host_key or MPI.Get_processor_name())
    local.Free()
    cross.Free()
    channels = {peer: MpiChannel(p2p_comm, peer, peer) for peer in range(size) if peer != rank}
    transport = Transport(rank, size, channels)
    data = MpiDataPlane(data_comm, RingDataPlane(transport, cfg.chunk_bytes))
    links: Dict[int, Any]
    if rank == 0:
        links = {peer: MpiLink(control_comm, peer) for peer in range(1, size)}
    else:
        links = {0: MpiLink(control_comm, 0)}
    per_host: Dict[str, int] = {}
    for host in hosts:
        per_host[host] = per_host.get(host, 0) + 1
    world = World(rank, size, local_rank, local_size, cross_rank, cross_size, transport, links,
                  homogeneous=len(set(per_host.values())) == 1, hosts=list(hosts), data=data)
    world.on_close = _MpiWorldComms([data_comm, control_comm, p2p_comm], data).close
    return world
