"""spark-hvd's side of the benchmark: the function each rank runs under ``spark_hvd.runner.run``, or,
on its MPI backend, this script under mpiexec (``python _peers_sparkhvd.py PLAN OUT``)."""

from __future__ import annotations

from typing import Any, Dict, Sequence

import numpy as np

from _peers_common import NumpyBuffers, measure, pin_to_cpu, read_plan, write_rank_result

__all__ = ["run_rank", "main"]


class _SparkHvd(NumpyBuffers):
    """In-place Sum allreduce on numpy float32 buffers, through the spark-hvd engine."""

    def __init__(self, hvd: Any) -> None:
        self.hvd = hvd
        self.rank = hvd.rank()
        self.size = hvd.size()

    def allreduce(self, buf: np.ndarray) -> None:
        # A stable name per size, as a training loop's gradients have.
        self.hvd.allreduce(buf, op=self.hvd.Sum, out=buf, name=f"bench.{buf.nbytes}")

    def allreduce_many(self, bufs: Sequence[np.ndarray]) -> None:
        hvd = self.hvd
        handles = [hvd.allreduce_async(b, op=hvd.Sum, out=b, name=f"grad.{i}") for i, b in enumerate(bufs)]
        for handle in handles:
            hvd.synchronize(handle)

    def barrier(self) -> None:
        self.hvd.barrier()

    def max_scalar(self, value: float) -> float:
        return float(self.hvd.allreduce(np.array([value], dtype=np.float64), op=self.hvd.Max, name="bench.max")[0])


def run_rank(plan: Dict[str, Any]) -> Dict[str, Any]:
    import spark_hvd
    import spark_hvd.runtime as hvd
    from spark_hvd.runtime.config import read_setting

    # Before init(), so the engine thread inherits the placement.
    cpu = pin_to_cpu(read_setting("local_rank") or 0, plan["pin"])
    hvd.init()
    try:
        try:
            result = measure(_SparkHvd(hvd), plan)
        except BaseException:
            # Said before shutdown(), which waits for the other ranks: the cause is seen even if that wait is cut short.
            import sys
            import traceback

            traceback.print_exc(file=sys.stderr)
            sys.stderr.flush()
            raise
        result["rank"] = hvd.rank()
        result["cpu"] = cpu
        result["version"] = getattr(spark_hvd, "__version__", "unknown")
        return result
    finally:
        hvd.shutdown()


def main() -> None:
    import sys

    plan = read_plan(sys.argv[1:])
    result = run_rank(plan)
    write_rank_result(sys.argv[2], result["rank"], result)


if __name__ == "__main__":
    main()
