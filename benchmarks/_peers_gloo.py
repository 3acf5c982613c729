"""torch.distributed with gloo: one rank of the benchmark (``python _peers_gloo.py PLAN_JSON OUT_DIR``).

The launcher sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and GLOO_SOCKET_IFNAME for each rank.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any, Sequence

import torch
import torch.distributed as dist

from _peers_common import measure, pin_to_cpu, read_plan, write_rank_result

__all__ = ["main"]


class _Gloo:
    """In-place Sum all_reduce on float32 CPU tensors over gloo."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes // 4, dtype=torch.float32)

    def fill(self, buf: torch.Tensor, value: float) -> None:
        buf.fill_(value)

    def holds(self, buf: torch.Tensor, value: float) -> bool:
        return bool(torch.all(buf == value))

    def allreduce(self, buf: torch.Tensor) -> None:
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)

    def allreduce_many(self, bufs: Sequence[torch.Tensor]) -> None:
        works = [dist.all_reduce(b, op=dist.ReduceOp.SUM, async_op=True) for b in bufs]
        for work in works:
            work.wait()

    def barrier(self) -> None:
        dist.barrier()

    def max_scalar(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())


def main(argv: Sequence[str]) -> int:
    plan = read_plan(argv)
    # Before gloo starts its threads, so they inherit the placement.
    cpu = pin_to_cpu(int(os.environ.get("LOCAL_RANK", "0")), plan["pin"])
    # One core per rank, as for the other frameworks: no intra-op thread pool competing with peers.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=plan["world_timeout_s"]))
    try:
        result: Any = measure(_Gloo(), plan)
        result["version"] = torch.__version__
        result["cpu"] = cpu
        write_rank_result(argv[1], result["rank"], result)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
