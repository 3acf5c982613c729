"""The error a launcher raises on its caller when one rank of the job failed."""

from __future__ import annotations

from typing import Optional, Sequence

from spark_hvd.runtime.errors import SparkHvdError

__all__ = ["RankFailedError"]


class RankFailedError(SparkHvdError, RuntimeError):
    """A rank raised an exception or exited abnormally; the other ranks were stopped.

    ``rank`` is the root cause; ``exc_type`` the qualified name of the exception it raised (None
    when it died without raising, e.g. killed by a signal); ``remote_traceback`` the formatted
    traceback from that rank; ``output_tail`` its last lines of output; ``original`` the
    exception object itself when it could be sent back, else None.
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
    ) -> None:
        parts = [summary]
        if remote_traceback:
            parts.append(f"Traceback from rank {rank}:\n{remote_traceback.rstrip()}")
        elif output_tail:
            parts.append(f"Last {len(output_tail)} lines of output of rank {rank}:\n" + "\n".join(output_tail))
        super().__init__("\n\n".join(parts))
        self.rank = rank
        self.summary = summary
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.output_tail = tuple(output_tail)
        self.original = original
