"""Launchers for jobs on this machine: the ``spark-hvd-run`` command and ``run(fn, ...)``."""

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
