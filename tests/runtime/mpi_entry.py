"""Run the runtime checks in a world started by mpiexec; each rank writes its outcomes as JSON.

    spark-hvd-run --mpi -np N python tests/runtime/mpi_entry.py OUTDIR
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import harness  # noqa: E402
import runtime_checks  # noqa: E402

import spark_hvd.runtime as rt  # noqa: E402


def main() -> None:
    outcomes = harness.run_checks(runtime_checks.ALL, "runtime")
    rt.init()  # a second world in the same processes, to record what the first one ran on
    report = {"outcomes": outcomes, "mpi": rt.mpi_enabled(), "rank": rt.rank(), "size": rt.size()}
    rt.shutdown()
    with open(os.path.join(sys.argv[1], f"rank{report['rank']}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
