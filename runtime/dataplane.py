"""Data planes: how agreed collectives move their bytes, per process set.

The engine negotiates; a data plane executes. :class:`RingDataPlane` runs the built-in
algorithms over the transport (shared memory within a host, TCP between hosts), optionally
hierarchically for the whole job; the MPI backend has its own (:mod:`spark_hvd.runtime.mpi`).
Buffers are flat numpy arrays; results land in place.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from . import algorithms as alg
from .ops import ReduceOp, reduce_into
from .transport import Transport

__all__ = ["DataPlane", "RingDataPlane", "Hierarchy", "hierarchy_of"]

Check = Callable[[Sequence[int], float], None]


class DataPlane(Protocol):
    """Executes collectives among the members of each registered process set."""

    def size(self, ps: int) -> int: ...

    def rank(self, ps: int) -> int: ...

    def add_process_set(self, ps: int, ranks: Tuple[int, ...]) -> None: ...

    def allreduce(self, ps: int, flat: np.ndarray, op: ReduceOp, wire: str) -> None:
        """In place: ``flat`` becomes the reduction over the set of every member's ``flat``."""

    def reducescatter(self, ps: int, flat: np.ndarray, counts: Sequence[int], op: ReduceOp, wire: str) -> None:
        """In place: this member's block of ``flat`` (``counts`` elements per member) is reduced."""

    def allgather(self, ps: int, flat: np.ndarray, counts: Sequence[int]) -> None:
        """In place: every member's block of ``flat`` filled with what that member put there."""

    def broadcast(self, ps: int, flat: np.ndarray, root: int) -> None:
        """In place: ``flat`` equals that of member ``root`` (an index within the set)."""

    def alltoall(self, ps: int, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray,
                 recv_counts: Sequence[int]) -> None: ...


class Hierarchy:
    """The host-local and cross-host transports of one rank, for hierarchical allreduce."""

    def __init__(self, local: Transport, cross: Transport) -> None:
        self.local = local
        self.cross = cross


def hierarchy_of(transport: Transport, hosts: Sequence[str], check: Optional[Check]) -> Optional[Hierarchy]:
    """This rank's local and cross transports, or None when the job has one host or the hosts do
    not all run the same number of ranks (the cross-host rings would not line up)."""
    me = transport.rank
    by_host: Dict[str, List[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    groups = list(by_host.values())
    if len(groups) < 2 or len({len(g) for g in groups}) != 1:
        return None
    mine = by_host[hosts[me]]
    index = mine.index(me)
    cross_ranks = [g[index] for g in groups]
    return Hierarchy(_subset(transport, mine, check), _subset(transport, cross_ranks, check))


def _subset(transport: Transport, ranks: Sequence[int], check: Optional[Check]) -> Transport:
    me = transport.rank
    channels = {i: transport.channels[r] for i, r in enumerate(ranks) if r != me}
    return Transport(list(ranks).index(me), len(ranks), channels, check)


class RingDataPlane:
    """The built-in algorithms over this rank's transports (one per process set)."""

    def __init__(self, transport: Transport, chunk_bytes: int, hierarchy: Optional[Hierarchy] = None) -> None:
        self._world = transport
        self.transports: Dict[int, Transport] = {0: transport}
        self.chunk_bytes = chunk_bytes
        self.hierarchy = hierarchy

    def size(self, ps: int) -> int:
        return self.transports[ps].size

    def rank(self, ps: int) -> int:
        return self.transports[ps].rank

    def add_process_set(self, ps: int, ranks: Tuple[int, ...]) -> None:
        if self._world.rank in ranks:
            self.transports[ps] = _subset(self._world, ranks, self._world.check)

    @staticmethod
    def _reducer(op: ReduceOp, wire: str) -> Callable[[np.ndarray, np.ndarray], None]:
        return lambda acc, incoming: reduce_into(acc, incoming, op, wire)

    def allreduce(self, ps: int, flat: np.ndarray, op: ReduceOp, wire: str) -> None:
        if ps == 0 and self.hierarchy is not None:
            alg.hierarchical_allreduce(self.hierarchy.local, self.hierarchy.cross, flat, self._reducer(op, wire))
        else:
            alg.ring_allreduce(self.transports[ps], flat, self._reducer(op, wire))

    def reducescatter(self, ps: int, flat: np.ndarray, counts: Sequence[int], op: ReduceOp, wire: str) -> None:
        alg.ring_reducescatter(self.transports[ps], flat, counts, self._reducer(op, wire))

    def allgather(self, ps: int, flat: np.ndarray, counts: Sequence[int]) -> None:
        alg.ring_allgather(self.transports[ps], flat, counts)

    def broadcast(self, ps: int, flat: np.ndarray, root: int) -> None:
        alg.chain_broadcast(self.transports[ps], flat, root, self.chunk_bytes)

    def alltoall(self, ps: int, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray,
                 recv_counts: Sequence[int]) -> None:
        alg.pairwise_alltoall(self.transports[ps], send, send_counts, recv, recv_counts)
