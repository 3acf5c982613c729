"""``SparkHvdEnvironment``: Lightning's view of a spark-hvd world (ranks and sizes from the runtime)."""

from __future__ import annotations

from typing import Optional, Tuple

from lightning_fabric.plugins.environments import ClusterEnvironment

import spark_hvd.torch as hvd
from spark_hvd.runtime.config import read_setting

__all__ = ["SparkHvdEnvironment"]


def _rendezvous() -> Tuple[str, int]:
    """Host and port of the launcher's rendezvous, or this host and 0 for a world of one."""
    address: Optional[str] = read_setting("rendezvous_addr")
    if not address or ":" not in address:
        return read_setting("hostname"), 0
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port) if port.isdigit() else 0


class SparkHvdEnvironment(ClusterEnvironment):
    """The processes were started by ``spark-hvd-run`` or ``spark_hvd.spark.run``; the runtime knows the ranks.

    Asking for a rank or size joins the world (``spark_hvd.torch.init()``) when the process has
    not joined it yet. Lightning cannot move a process to another rank: ``set_global_rank`` and
    ``set_world_size`` accept only the values the launcher gave.
    """

    @property
    def creates_processes_externally(self) -> bool:
        """Always True: the launcher started every rank, Lightning starts none."""
        return True

    @property
    def main_address(self) -> str:
        """Host of the launcher's rendezvous (collectives do not go through it)."""
        return _rendezvous()[0]

    @property
    def main_port(self) -> int:
        """Port of the launcher's rendezvous, 0 in a world of one."""
        return _rendezvous()[1]

    @staticmethod
    def detect() -> bool:
        """Whether this process was started by a spark-hvd launcher."""
        return read_setting("rank") is not None or bool(read_setting("elastic"))

    @staticmethod
    def _joined() -> None:
        if not hvd.is_initialized():
            hvd.init()

    def world_size(self) -> int:
        """Number of processes in the job."""
        self._joined()
        return hvd.size()

    def set_world_size(self, size: int) -> None:
        """Accept the launcher's size; refuse any other."""
        if size != self.world_size():
            raise ValueError(
                f"world size {size} was requested, but the launcher started {self.world_size()} processes; "
                "the number of processes is chosen at launch (spark-hvd-run -np N, or num_proc in spark_hvd.spark.run)"
            )

    def global_rank(self) -> int:
        """Rank of this process in the job."""
        self._joined()
        return hvd.rank()

    def set_global_rank(self, rank: int) -> None:
        """Accept the launcher's rank; refuse any other."""
        if rank != self.global_rank():
            raise ValueError(
                f"global rank {rank} was requested for the process the launcher started as rank "
                f"{self.global_rank()}; ranks are assigned by the launcher and cannot be changed"
            )

    def local_rank(self) -> int:
        """Rank of this process among those on its host."""
        self._joined()
        return hvd.local_rank()

    def node_rank(self) -> int:
        """Index of this process's host among the job's hosts."""
        self._joined()
        return hvd.cross_rank()
