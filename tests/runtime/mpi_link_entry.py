"""Two MPI ranks: rank 1 sends rank 0 a control frame far above MPI's eager size while rank 0 already
waits in a collective on another communicator that needs rank 1. The send must not wait for rank 0
to receive (it cannot until the collective is over); afterwards rank 0 receives the frame whole.

    mpiexec -n 2 python tests/runtime/mpi_link_entry.py
"""

import time

from mpi4py import MPI

from spark_hvd.runtime.mpi import MpiLink

FRAME = bytes(range(256)) * 8192  # 2 MiB


def main() -> None:
    control, data = MPI.COMM_WORLD.Dup(), MPI.COMM_WORLD.Dup()
    rank = control.Get_rank()
    link = MpiLink(control, 1 - rank)
    if rank == 1:
        time.sleep(0.3)  # rank 0 is inside the barrier by now
        link.send(FRAME)
        link.send(b"second")
    data.Barrier()  # the collective both ranks must reach
    if rank == 0:
        deadline = time.monotonic() + 30
        while len(link.frames) < 2 and time.monotonic() < deadline:
            link.pump()
        assert list(link.frames) == [FRAME, b"second"], [len(f) for f in link.frames]
    else:
        deadline = time.monotonic() + 30
        while link._sending and time.monotonic() < deadline:
            link.pump()  # the sends complete once rank 0 has received them
        assert not link._sending, "the sends never completed"
    data.Barrier()
    print(f"rank {rank}: ok", flush=True)


if __name__ == "__main__":
    main()
