"""The collective kinds: one name for each, and one table of what each kind is.

The session names a request's kind from here, negotiation compares and answers requests by the
table's columns, the engine executes each response kind with the executor's method of that kind,
and the framework bindings name kinds by these constants, so a kind is spelled once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

__all__ = ["ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER", "BARRIER", "JOIN",
           "ADD_PROCESS_SET", "ALLREDUCE_EAGER", "ERROR", "KindInfo", "KINDS", "REQUEST_KINDS", "DEVICE_KINDS"]

ALLREDUCE = "allreduce"
ALLGATHER = "allgather"
BROADCAST = "broadcast"
ALLTOALL = "alltoall"
REDUCESCATTER = "reducescatter"
BARRIER = "barrier"
JOIN = "join"
ADD_PROCESS_SET = "add_process_set"
ALLREDUCE_EAGER = "allreduce_eager"
"""Response only: allreduces whose results the coordinator computed from the announced payloads."""
ERROR = "error"
"""Response only: a request the ranks disagree on, failed on every rank with the listing."""


@dataclass(frozen=True)
class KindInfo:
    """What one request kind is."""

    name: str
    compared: Tuple[str, ...]
    """The request's fields every rank must give alike (``shape`` may be ``trailing``: all but the
    first dimension; ``splits_len``: the number of splits)."""
    reduces: bool = False
    """Takes a reduction op and pre/postscale factors."""
    per_rank: bool = False
    """Ranks contribute different shapes: the response carries every rank's signature."""
    fuses: bool = False
    """Ready requests of this kind are packed into one fused response."""
    with_joined: bool = True
    """Runs while some ranks have joined (they contribute zeros or nothing)."""
    on_device: bool = False
    """Also runs on device tensors (NCCL)."""
    grouped: bool = False
    """Has a grouped form (several tensors, answered together)."""


KINDS: Dict[str, KindInfo] = {info.name: info for info in (
    KindInfo(ALLREDUCE, ("device", "dtype", "shape", "op", "prescale", "postscale", "group"), reduces=True,
             fuses=True, on_device=True, grouped=True),
    KindInfo(REDUCESCATTER, ("device", "dtype", "shape", "op", "prescale", "postscale", "group"), reduces=True,
             with_joined=False, on_device=True, grouped=True),
    KindInfo(BROADCAST, ("device", "dtype", "shape", "root"), with_joined=False, on_device=True),
    KindInfo(ALLGATHER, ("device", "dtype", "trailing", "group"), per_rank=True, with_joined=False, on_device=True,
             grouped=True),
    KindInfo(ALLTOALL, ("device", "dtype", "trailing", "splits_len"), per_rank=True, with_joined=False,
             on_device=True),
    KindInfo(BARRIER, ()),
    KindInfo(JOIN, ()),
    KindInfo(ADD_PROCESS_SET, ("ranks",)),
)}
"""Every request kind by name."""

REQUEST_KINDS: Tuple[str, ...] = tuple(KINDS)
"""The kinds a caller can request, in the table's order."""

DEVICE_KINDS: Tuple[str, ...] = tuple(name for name, info in KINDS.items() if info.on_device)
"""The kinds that run on device tensors."""
