"""Collective algorithms over the in-process transport, for sizes 1-4 and awkward lengths."""

import numpy as np
import pytest

from spark_hvd.runtime import algorithms as alg
from spark_hvd.runtime.inproc import run_threads
from spark_hvd.runtime.ops import ReduceOp, reduce_into

SIZES = [1, 2, 3, 4]
LENGTHS = [0, 1, 2, 5, 1000, 10007]


def _sum(acc, incoming):
    reduce_into(acc, incoming, ReduceOp.Sum, "float64")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("length", LENGTHS)
def test_ring_allreduce(size, length):
    """Every rank ends with the sum of all ranks' buffers."""
    def body(t):
        data = np.arange(length, dtype=np.float64) * (t.rank + 1)
        alg.ring_allreduce(t, data, _sum)
        return data
    want = np.arange(length) * sum(range(1, size + 1))
    assert all(np.array_equal(r, want) for r in run_threads(size, body))


@pytest.mark.parametrize("size", SIZES)
def test_reducescatter_leaves_each_rank_its_block(size):
    """Block r of the reduction ends on rank r, blocks of uneven sizes included."""
    counts = [r + 2 for r in range(size)]
    def body(t):
        data = np.ones(sum(counts)) * (t.rank + 1)
        alg.ring_reducescatter(t, data, counts, _sum)
        lo = sum(counts[:t.rank])
        return data[lo:lo + counts[t.rank]]
    for r, block in enumerate(run_threads(size, body)):
        assert block.tolist() == [sum(range(1, size + 1))] * counts[r]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("length", [0, 1, 33, 5000])
def test_chain_broadcast_from_every_root(size, length):
    """Root's buffer reaches everyone, chunked through the chain."""
    for root in range(size):
        def body(t):
            data = np.arange(length, dtype=np.int32) if t.rank == root else np.zeros(length, np.int32)
            alg.chain_broadcast(t, data, root, chunk_bytes=64)
            return data
        assert all(np.array_equal(r, np.arange(length)) for r in run_threads(size, body))


@pytest.mark.parametrize("size", SIZES)
def test_allgather_and_alltoall_uneven(size):
    """Allgather with different block sizes and alltoall with uneven splits (some empty)."""
    def gather(t):
        counts = [r + 1 for r in range(size)]
        out = np.zeros(sum(counts), np.int16)
        lo = sum(counts[:t.rank])
        out[lo:lo + counts[t.rank]] = t.rank
        alg.ring_allgather(t, out, counts)
        return out
    want = np.concatenate([np.full(r + 1, r) for r in range(size)])
    assert all(np.array_equal(r, want) for r in run_threads(size, gather))

    def exchange(t):
        send_counts = [(t.rank + j) % 3 for j in range(size)]
        send = np.concatenate([np.full(send_counts[j], 10 * t.rank + j) for j in range(size)]).astype(np.int64)
        recv_counts = [(j + t.rank) % 3 for j in range(size)]
        out = np.zeros(sum(recv_counts), np.int64)
        alg.pairwise_alltoall(t, send, send_counts, out, recv_counts)
        return out
    for r, out in enumerate(run_threads(size, exchange)):
        assert out.tolist() == [10 * j + r for j in range(size) for _ in range((j + r) % 3)]


def test_split_counts_matches_numpy():
    """Block sizes follow numpy.array_split, larger blocks first."""
    for total in range(0, 12):
        for parts in range(1, 5):
            assert alg.split_counts(total, parts) == [len(b) for b in np.array_split(np.arange(total), parts)]
