"""A job on this machine: a rendezvous server on 127.0.0.1 and one process per rank."""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional, Sequence

from spark_hvd.runtime import config
from spark_hvd.runtime.rendezvous import RendezvousServer

from . import warm
from .processes import TERMINATE_GRACE_SECONDS, OutputSink, RankProcesses, print_prefixed, rank_environment

__all__ = ["LocalJob"]

LOCAL_HOST = "127.0.0.1"


class LocalJob:
    """``num_proc`` ranks of one command on this machine, sharing a fresh job secret.

    ``settings`` are runtime settings (RuntimeConfig field names) passed to every rank; ``env``
    holds extra environment variables that override everything else. Use as a context manager:
    leaving it stops every rank and the rendezvous server.
    """

    def __init__(
        self,
        num_proc: int,
        *,
        settings: Optional[Mapping[str, Any]] = None,
        env: Optional[Mapping[str, str]] = None,
        sink: Optional[OutputSink] = print_prefixed,
        output_dir: Optional[os.PathLike] = None,
        log: Optional[Callable[[str], None]] = None,
    ) -> None:
        if num_proc < 1:
            raise ValueError(f"num_proc={num_proc} is invalid: expected at least 1 process")
        self.num_proc = num_proc
        self.secret = config.new_secret()
        self.processes = RankProcesses(sink=sink, output_dir=output_dir, log=log)
        self._settings = dict(settings or {})
        self._env = dict(env or {})
        self._log = log
        self._server: Optional[RendezvousServer] = None

    def start(self, argv: Sequence[str], cwd: Optional[str] = None, preload: Sequence[str] = ()) -> RankProcesses:
        """Serve the rendezvous and start every rank running ``argv``. With ``preload`` (module
        names), ``argv`` is the worker's command line and the ranks are forked from a warm process
        that has imported those modules (:mod:`spark_hvd.runner.warm`), where one can start."""
        if self._server is not None:
            raise RuntimeError("this LocalJob was already started; create a new one per job")
        self._server = RendezvousServer(LOCAL_HOST, self.secret)
        if self._log:
            self._log(f"rendezvous server listening on {self._server.address}")
        base = config.environ_snapshot()
        starter = None
        for rank in range(self.num_proc):
            env = rank_environment(
                rank=rank,
                size=self.num_proc,
                rendezvous_addr=self._server.address,
                secret=self.secret,
                hostname=LOCAL_HOST,
                settings=self._settings,
                base=base,
                extra=self._env,
            )
            if rank == 0 and preload:
                starter = warm.starter_or_none(argv[0], preload, env, cwd)
            self.processes.spawn(rank, argv, env, cwd=cwd, starter=starter)
        return self.processes

    def close(self, grace: float = TERMINATE_GRACE_SECONDS) -> None:
        """Stop every rank still running, then the rendezvous server."""
        try:
            self.processes.close(grace)
        finally:
            if self._server is not None:
                self._server.close()

    def __enter__(self) -> "LocalJob":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
