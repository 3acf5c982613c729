"""The messages ranks exchange to agree on their requests: metadata, announcements, responses."""

from __future__ import annotations

import math
import pickle
from typing import NamedTuple, Optional, Tuple, Union

from .ops import storage_dtype

__all__ = ["Meta", "Announce", "RequestBatch", "Response", "ResponseBatch", "dump_requests",
           "load_requests", "dump_responses", "load_responses"]



class Meta(NamedTuple):
    """What a rank says about one request; equal metas on all ranks mean the request agrees.

    Build it with keywords: ``Meta(kind="allreduce", dtype="float32", shape=(4,))``.
    """

    kind: str
    """One of :data:`~spark_hvd.runtime.kinds.REQUEST_KINDS`."""
    dtype: str
    """Wire dtype name (``""`` for requests without data)."""
    shape: Tuple[int, ...]
    op: int = 0
    """ReduceOp of reductions."""
    root: int = -1
    """Root rank of a broadcast."""
    prescale: float = 1.0
    postscale: float = 1.0
    ps: int = 0
    """Process set id."""
    group: Optional[Tuple[str, int]] = None
    """(group name, number of members) of grouped requests, which are answered together."""
    splits: Optional[Tuple[int, ...]] = None
    """Rows sent to each rank by an alltoall."""
    ranks: Optional[Tuple[int, ...]] = None
    """Members of the process set an add_process_set request registers."""
    device: str = "cpu"
    """Where the data lives: ``"cpu"`` (numpy arrays) or ``"cuda"`` (device tensors, moved by NCCL)."""

    def count(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    def nbytes(self) -> int:
        return math.prod(self.shape) * storage_dtype(self.dtype).itemsize if self.dtype else 0


class Announce(NamedTuple):
    """A worker tells the coordinator about one request: by signature id once it has learned one."""

    name: str
    sig: Union[int, Meta]
    payload: Optional[bytes] = None
    """A small allreduce's prescaled input, so the coordinator can answer it without a data phase."""


class RequestBatch(NamedTuple):
    """What a worker sends the coordinator in one message."""

    seq: int
    """The last response batch this worker had processed when it wrote these announcements."""
    items: Tuple[Announce, ...]


class Response(NamedTuple):
    """One agreed step, identical on every rank.

    ``kind`` is a request kind, ``"allreduce_eager"`` (results computed by the coordinator),
    or ``"error"``. ``sids`` holds one signature id per name; allgather and alltoall, whose ranks
    contribute different shapes, carry one id per member rank in ``rank_sids`` instead.
    """

    kind: str
    names: Tuple[str, ...]
    ps: int
    sids: Tuple[int, ...] = ()
    rank_sids: Tuple[Tuple[int, ...], ...] = ()
    error: str = ""
    """Why the request failed (kind ``"error"``), naming each rank's value."""
    results: Tuple[bytes, ...] = ()
    """The reduced bytes of each name (kind ``"allreduce_eager"``)."""
    value: int = -1
    """The last rank to join (kind ``"join"``) or the new process set id (``"add_process_set"``)."""


class ResponseBatch(NamedTuple):
    """What the coordinator sends every worker after each decision."""

    seq: int
    responses: Tuple[Response, ...]
    teach: Tuple[Tuple[int, Meta], ...] = ()
    """Ids workers keep and may announce by (the response cache)."""
    resolve: Tuple[Tuple[int, Meta], ...] = ()
    """Ids used by these responses that workers do not hold: valid for this batch only."""
    evicted: Tuple[int, ...] = ()
    """Ids workers must forget and no longer announce."""


# On the wire, batches travel as plain tuples: pickling a named tuple costs several times more
# (a Python-level call per instance), and every step of training sends these.
def dump_requests(batch: RequestBatch) -> bytes:
    return pickle.dumps((batch.seq, [tuple(item) for item in batch.items]), protocol=5)


def load_requests(data: bytes) -> RequestBatch:
    seq, items = pickle.loads(data)
    return RequestBatch(seq, tuple(map(Announce._make, items)))


def dump_responses(batch: ResponseBatch) -> bytes:
    return pickle.dumps((batch.seq, [tuple(r) for r in batch.responses], batch.teach, batch.resolve, batch.evicted),
                        protocol=5)


def load_responses(data: bytes) -> ResponseBatch:
    seq, responses, teach, resolve, evicted = pickle.loads(data)
    return ResponseBatch(seq, tuple(map(Response._make, responses)), teach, resolve, evicted)
