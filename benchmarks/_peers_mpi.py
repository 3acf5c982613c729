"""mpi4py with the mpich wheel: one rank of the benchmark (``mpiexec -n N python _peers_mpi.py PLAN OUT``)."""

from __future__ import annotations

import sys
from typing import Any, Sequence

import numpy as np
from mpi4py import MPI

from _peers_common import NumpyBuffers, measure, pin_to_cpu, read_plan, write_rank_result

__all__ = ["main"]


class _Mpi(NumpyBuffers):
    """In-place Allreduce (MPI.IN_PLACE, MPI.SUM) on numpy float32 buffers."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()

    def allreduce(self, buf: np.ndarray) -> None:
        self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    def allreduce_many(self, bufs: Sequence[np.ndarray]) -> None:
        requests = [self.comm.Iallreduce(MPI.IN_PLACE, b, op=MPI.SUM) for b in bufs]
        MPI.Request.Waitall(requests)

    def barrier(self) -> None:
        self.comm.Barrier()

    def max_scalar(self, value: float) -> float:
        return float(self.comm.allreduce(value, op=MPI.MAX))


def main(argv: Sequence[str]) -> int:
    plan = read_plan(argv)
    comm = MPI.COMM_WORLD
    # All ranks run on this host, so the world rank is the local rank.
    cpu = pin_to_cpu(comm.Get_rank(), plan["pin"])
    result: Any = measure(_Mpi(comm), plan)
    result["cpu"] = cpu
    result["version"] = f"mpi4py {__import__('mpi4py').__version__}; " + MPI.Get_library_version().splitlines()[0].strip()
    write_rank_result(argv[1], result["rank"], result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
