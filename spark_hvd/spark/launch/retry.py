"""Running a barrier stage again after it lost a task, a rank process or an executor.

:func:`run_with_retries` is the loop the estimators put around their training stage: it tells a
lost process or executor (worth another attempt) from an error in the user's code (which the next
attempt would repeat, so it is raised at once), waits for the cluster to have the task slots
again, reports the retry in one line, and launches the stage anew through a callable of the
caller's, which resumes from whatever the last attempt checkpointed.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Tuple, TypeVar

from spark_hvd.runner.errors import RankFailedError

from spark_hvd.spark.launch.barrier import SlotsUnavailableError, StageLostError
from spark_hvd.spark.session import session_info

__all__ = ["is_recoverable", "describe_failure", "wait_for_free_slots", "slots_when_free", "run_with_retries", "SLOT_WAIT_S"]

T = TypeVar("T")

SLOT_WAIT_S = 300.0
"""Default seconds a retry waits for the cluster to have enough task slots again."""
_POLL_S = 1.0


def is_recoverable(error: BaseException) -> bool:
    """Whether a failed stage may succeed when run again: a rank process died without raising
    (killed, out of memory), a rank lost its peers (whose process or executor went away), or
    Spark lost a task or an executor. An exception raised by the user's code is not."""
    if isinstance(error, StageLostError):
        return True
    if isinstance(error, RankFailedError):
        if error.reaction is not None:
            return False  # a rank returned early and its peers then failed: the code's logic
        return error.exc_type in (None, "Died") or error.lost_a_peer()
    return False


def describe_failure(error: BaseException) -> str:
    """A one-line cause for a retry report."""
    if isinstance(error, RankFailedError):
        text = error.summary
    else:
        text = str(error)
    text = " ".join(text.split())
    return text if len(text) <= 200 else text[:197] + "..."


_RETRY_ADVICE = ("to run the barrier stage again", "add executors, or restart the fit when the cluster has recovered "
                 "(a fit with the same run_id resumes from its last checkpoint)")


def slots_when_free(session: Any, num_proc: int, timeout_s: float,
                    advice: Tuple[str, str] = _RETRY_ADVICE) -> Optional[int]:
    """Wait until the cluster has at least ``num_proc`` task slots; returns how many it has, or
    None for a cluster that does not tell its slots (Spark Connect with dynamic allocation), which
    is not waited for.

    Raises TimeoutError naming both numbers after ``timeout_s``; ``advice`` is (what the slots
    are for, the fix), as the message says them.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        slots = session_info(session).slots
        if slots is None or slots >= num_proc:
            return slots
        if time.monotonic() >= deadline:
            purpose, fix = advice
            raise TimeoutError(
                f"waited {timeout_s:.0f} s for {num_proc} free task slots {purpose}, but the cluster has {slots}: "
                f"expected lost executors to be replaced; fix: {fix}")
        time.sleep(_POLL_S)


def wait_for_free_slots(session: Any, num_proc: int, timeout_s: float) -> int:
    """:func:`slots_when_free` for a retry: the slots, ``num_proc`` where the cluster does not tell."""
    slots = slots_when_free(session, num_proc, timeout_s)
    return slots if slots is not None else num_proc


def run_with_retries(launch: Callable[[int], T], *, session: Any, num_proc: int, max_retries: int,
                     report: Callable[[str], None], resume_point: Optional[Callable[[], str]] = None,
                     slot_timeout_s: float = SLOT_WAIT_S) -> T:
    """``launch(attempt)`` (attempt 1, 2, ...) until it returns, retrying recoverable failures.

    After a failure that :func:`is_recoverable` accepts, and while fewer than ``max_retries``
    retries were made, it waits for ``num_proc`` free slots of ``session`` (``slot_timeout_s``;
    not at all with ``session=None``), calls
    ``report`` with one line (the attempt, the cause and ``resume_point()``, where the next
    attempt starts), and launches again. Any other failure, or one past ``max_retries``, is
    raised as it is (the last with a note of the attempts made). A stage Spark refuses for want
    of slots while retrying is submitted again once they are back, without counting a retry.
    """
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(f"max_retries={max_retries!r} is not valid: expected an integer >= 0 (0 disables retries)")
    attempt = 1
    refused_until: Optional[float] = None
    while True:
        try:
            return launch(attempt)
        except SlotsUnavailableError:
            if attempt == 1:
                raise
            # A lost executor can still count among the slots for a moment after it is gone.
            if refused_until is None:
                refused_until = time.monotonic() + slot_timeout_s
            if time.monotonic() >= refused_until or session is None:
                raise
            wait_for_free_slots(session, num_proc, max(1.0, refused_until - time.monotonic()))
            time.sleep(_POLL_S)
            continue
        except Exception as error:
            if not is_recoverable(error):
                raise
            if attempt > max_retries:
                error.add_note(f"spark-hvd: gave up after {attempt} attempts (max_retries={max_retries}); raise "
                               "max_retries to retry more often")
                raise
            cause = describe_failure(error)
        if session is not None:
            wait_for_free_slots(session, num_proc, slot_timeout_s)
        attempt += 1
        where = resume_point() if resume_point is not None else "the start"
        report(f"spark-hvd: retry {attempt - 1}/{max_retries} (attempt {attempt}) after the barrier stage failed: "
               f"{cause}; resuming from {where}")
