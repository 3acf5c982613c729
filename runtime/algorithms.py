"""Collective algorithms as plain functions over a :class:`~.transport.Transport`.

All buffers are flat, contiguous numpy arrays. Rings are pipelined: the transport moves large
segments in chunks, and reductions happen chunk by chunk as data arrives, so a segment is never
held twice. Every function leaves the same result on every rank of the transport.
"""

from __future__ import annotations

from typing import Callable, List, Sequence

import numpy as np

from .transport import CopySink, ReduceSink, Transport

__all__ = [
    "split_counts",
    "offsets",
    "ring_allreduce",
    "ring_reducescatter",
    "ring_allgather",
    "chain_broadcast",
    "pairwise_alltoall",
    "hierarchical_allreduce",
]

Reducer = Callable[[np.ndarray, np.ndarray], None]


def split_counts(total: int, parts: int) -> List[int]:
    """Sizes of ``parts`` near-equal blocks of ``total`` items, larger ones first (numpy.array_split)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def offsets(counts: Sequence[int]) -> List[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def _bytes(array: np.ndarray) -> memoryview:
    return memoryview(array.reshape(-1).view(np.uint8)) if array.size else memoryview(b"")


def ring_reducescatter(t: Transport, flat: np.ndarray, counts: Sequence[int], reduce: Reducer) -> None:
    """Reduce ``flat`` across ranks so that block ``rank`` (of ``counts`` elements) holds the result.

    Other blocks are left with partial sums.
    """
    n, r = t.size, t.rank
    if n == 1:
        return
    starts = offsets(counts)
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        send_idx = (r - step - 1) % n
        recv_idx = (r - step - 2) % n
        send = flat[starts[send_idx]:starts[send_idx + 1]]
        recv = flat[starts[recv_idx]:starts[recv_idx + 1]]
        t.sendrecv(right, _bytes(send), left, recv.nbytes, ReduceSink(recv, reduce))


def ring_allgather(t: Transport, flat: np.ndarray, counts: Sequence[int]) -> None:
    """Block ``rank`` of ``flat`` holds this rank's data; afterwards every block is filled everywhere."""
    n, r = t.size, t.rank
    if n == 1:
        return
    starts = offsets(counts)
    raw = flat.view(np.uint8) if flat.size else flat
    item = flat.dtype.itemsize
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        send_idx = (r - step) % n
        recv_idx = (r - step - 1) % n
        send = raw[starts[send_idx] * item:starts[send_idx + 1] * item]
        recv = raw[starts[recv_idx] * item:starts[recv_idx + 1] * item]
        t.sendrecv(right, memoryview(send), left, recv.nbytes, CopySink(memoryview(recv)))


def ring_allreduce(t: Transport, flat: np.ndarray, reduce: Reducer) -> None:
    """In place: afterwards ``flat`` holds the reduction of every rank's ``flat``."""
    if t.size == 1 or flat.size == 0:
        return
    counts = split_counts(flat.size, t.size)
    ring_reducescatter(t, flat, counts, reduce)
    ring_allgather(t, flat, counts)


def chain_broadcast(t: Transport, flat: np.ndarray, root: int, chunk_bytes: int) -> None:
    """In place: afterwards every rank's ``flat`` equals root's. Chunks flow down a pipelined chain."""
    n, r = t.size, t.rank
    if n == 1 or flat.size == 0:
        return
    raw = memoryview(flat.reshape(-1).view(np.uint8))
    position = (r - root) % n
    successor = (r + 1) % n if position < n - 1 else None
    predecessor = (r - 1) % n if position > 0 else None
    total = len(raw)
    # Every rank cuts the buffer the same way: a send and its receive always have equal sizes.
    bounds = list(range(0, total, chunk_bytes)) + [total]
    pieces = [raw[bounds[k]:bounds[k + 1]] for k in range(len(bounds) - 1)]
    previous = None
    for piece in pieces:
        ops = []
        if predecessor is None:
            ops.append(t.isend(successor, piece))  # type: ignore[arg-type]
        else:
            ops.append(t.irecv(predecessor, len(piece), CopySink(piece)))
            if previous is not None and successor is not None:
                ops.append(t.isend(successor, previous))
        t.wait(ops)
        previous = piece
    if predecessor is not None and successor is not None:
        t.send(successor, previous)  # type: ignore[arg-type]


def pairwise_alltoall(t: Transport, send: np.ndarray, send_counts: Sequence[int],
                      out: np.ndarray, recv_counts: Sequence[int]) -> None:
    """Rank r's block j of ``send`` lands in rank j's block r of ``out`` (counts in elements)."""
    n, r = t.size, t.rank
    item = send.dtype.itemsize
    s_off = [o * item for o in offsets(send_counts)]
    r_off = [o * item for o in offsets(recv_counts)]
    sraw = send.reshape(-1).view(np.uint8) if send.size else np.empty(0, np.uint8)
    rraw = out.reshape(-1).view(np.uint8) if out.size else np.empty(0, np.uint8)
    rraw[r_off[r]:r_off[r + 1]] = sraw[s_off[r]:s_off[r + 1]]
    for step in range(1, n):
        dst, src = (r + step) % n, (r - step) % n
        block = rraw[r_off[src]:r_off[src + 1]]
        t.sendrecv(dst, memoryview(sraw[s_off[dst]:s_off[dst + 1]]), src, block.nbytes, CopySink(memoryview(block)))


def hierarchical_allreduce(local: Transport, cross: Transport, flat: np.ndarray, reduce: Reducer) -> None:
    """In place, for ranks grouped by host: reduce-scatter within the host, allreduce each block
    across hosts among the ranks that hold it, allgather within the host. Only ``1/local.size`` of
    the buffer crosses between hosts from each rank."""
    if flat.size == 0:
        return
    counts = split_counts(flat.size, local.size)
    ring_reducescatter(local, flat, counts, reduce)
    lo = sum(counts[:local.rank])
    ring_allreduce(cross, flat[lo:lo + counts[local.rank]], reduce)
    ring_allgather(local, flat, counts)
