"""The error a launcher raises on its caller when one rank of the job failed."""

from __future__ import annotations

import functools
from typing import Any, List, Optional, Sequence, Tuple

from spark_hvd.runtime.errors import CollectiveError, RendezvousTimeout, SparkHvdError

__all__ = ["RankFailedError"]

# What a rank raises when a peer it needs has gone: such a failure is a reaction, not a cause.
_PEER_LOSS = (CollectiveError, RendezvousTimeout)


class RankFailedError(SparkHvdError, RuntimeError):
    """A rank raised an exception or exited abnormally; the other ranks were stopped.

    ``rank`` is the root cause; ``exc_type`` the qualified name of the exception it raised (None
    when it died without raising, e.g. killed by a signal); ``remote_traceback`` the formatted
    traceback from that rank; ``output_tail`` its last lines of output; ``original`` the
    exception object itself when it could be sent back, else None.

    When the root cause is a rank that ended early with exit code 0 (its peers lost it), that
    rank is ``rank`` and ``reaction`` is the error of the first rank that failed after it.
    """

    def __init__(
        self,
        rank: int,
        summary: str,
        *,
        exc_type: Optional[str] = None,
        remote_traceback: Optional[str] = None,
        output_tail: Sequence[str] = (),
        original: Optional[BaseException] = None,
        reaction: Optional["RankFailedError"] = None,
    ) -> None:
        self.rank = rank
        self.summary = summary
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.output_tail = tuple(output_tail)
        self.original = original
        self.reaction = reaction
        parts = [summary, *self.details()]
        if reaction is not None:
            parts.extend(reaction.details())
        super().__init__("\n\n".join(parts))

    def __reduce__(self) -> Tuple[Any, ...]:
        # The message is made from the fields: rebuild from them, so the error can be pickled
        # (to cross a process or a queue) and copied.
        return (functools.partial(type(self), exc_type=self.exc_type, remote_traceback=self.remote_traceback,
                                  output_tail=self.output_tail, original=self.original, reaction=self.reaction),
                (self.rank, self.summary))

    def details(self) -> List[str]:
        """What is known of this rank beyond the summary: its traceback, else its last lines."""
        if self.remote_traceback:
            return [f"Traceback from rank {self.rank}:\n{self.remote_traceback.rstrip()}"]
        if self.output_tail:
            return [f"Last {len(self.output_tail)} lines of output of rank {self.rank}:\n" + "\n".join(self.output_tail)]
        return []

    def lost_a_peer(self) -> bool:
        """Whether the rank failed the way ranks fail when a peer has left: a collective or the
        rendezvous gave up."""
        if self.original is not None:
            return isinstance(self.original, _PEER_LOSS)
        return self.exc_type in {f"{kind.__module__}.{kind.__qualname__}" for kind in _PEER_LOSS}
