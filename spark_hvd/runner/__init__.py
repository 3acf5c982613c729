"""Launchers: the ``spark-hvd-run`` command (this machine, or hosts over SSH) and ``run(fn, ...)``."""

from .api import run
from .errors import RankFailedError
from .local import LocalJob
from .processes import OutputSink, RankExit, RankProcesses, print_prefixed, rank_environment

__all__ = [
    "run",
    "RankFailedError",
    "LocalJob",
    "RankProcesses",
    "RankExit",
    "OutputSink",
    "print_prefixed",
    "rank_environment",
]
