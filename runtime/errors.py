"""The error taxonomy of spark-hvd, built on the standard exceptions."""

from __future__ import annotations

from typing import Optional

__all__ = [
    "SparkHvdError",
    "CollectiveError",
    "RankMismatchError",
    "RendezvousTimeout",
    "PeerUnreachableError",
    "AuthenticationError",
    "TamperedError",
    "NotInitializedError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
]


class SparkHvdError(Exception):
    """Base class of every error raised by spark-hvd itself."""


class CollectiveError(SparkHvdError, RuntimeError):
    """A collective could not complete: a peer was lost, the job aborted, or it stalled too long.

    ``lost_rank`` names the rank whose loss caused it, when one did.
    """

    def __init__(self, message: str, lost_rank: Optional[int] = None) -> None:
        super().__init__(message)
        self.lost_rank = lost_rank


# Horovod scripts catch this name around elastic training loops.
HorovodInternalError = CollectiveError


class RankMismatchError(CollectiveError):
    """Ranks submitted the same named operation with different shapes, dtypes, ops or roots, or an
    operation that cannot run while a rank has joined.

    The operation fails on every rank taking part; the runtime stays usable afterwards. Like
    Horovod's errors for these cases it is a ``HorovodInternalError`` (a RuntimeError).
    """


class RendezvousTimeout(SparkHvdError, TimeoutError):
    """Not every rank arrived at the rendezvous (or connected) within the start timeout."""


class PeerUnreachableError(RendezvousTimeout):
    """A peer or the rendezvous server could not be reached over the network: connections were
    refused, there was no route to its host, or they were reset or timed out until the start timeout
    ran out, or an established one broke during start-up.

    The host or the network path is at fault, not the job's code, so launchers retry it like a lost
    host. ``host`` is the address that could not be reached, when known.
    """

    def __init__(self, message: str, host: Optional[str] = None) -> None:
        super().__init__(message)
        self.host = host

    def __reduce__(self):  # keeps ``host`` when the error travels to the driver pickled
        return (type(self), (str(self), self.host))


class AuthenticationError(SparkHvdError, PermissionError):
    """A connection did not prove knowledge of the job secret."""


class TamperedError(SparkHvdError, PermissionError):
    """Bytes read back (a payload file, a stored output chunk) are not sealed with the job's secret."""


class NotInitializedError(SparkHvdError, ValueError):
    """An operation was called before ``init()`` or after ``shutdown()``."""

    def __init__(self, what: str = "this operation") -> None:
        super().__init__(
            f"spark-hvd has not been initialized; call init() before {what} "
            "(and do not call it after shutdown())."
        )
        self.what = what

    def __reduce__(self):  # rebuilt from ``what``, not from the message made of it
        return (type(self), (self.what,))


class HostsUpdatedInterrupt(SparkHvdError):
    """Raised by an elastic state's ``commit()`` on every rank at once when the launcher has slots
    for more workers: ``hvd.elastic.run`` then forms a new world with them.

    ``skip_sync`` is True when no worker was added (the state need not be sent again).
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the hosts of the elastic job changed; the world is formed again")
        self.skip_sync = skip_sync

    def __reduce__(self):
        return (type(self), (self.skip_sync,))
