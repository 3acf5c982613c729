"""The main job on a cluster of two hosts, next to the same job on ``local[2]``: ``make cluster-demo``.

    python tests/cluster/demo.py [--rows 200000] [--epochs 3] [--rate 1gbit] [--no-local]

Forms the test cluster of ``tests/cluster/`` (two network-namespace hosts, links shaped to
``--rate``, a Spark standalone master and a two-core worker per host), runs
``examples/fraud_detection.py`` on it with one task slot per host (so its two ranks train on
different hosts and meet over TCP), then runs it again on ``local[2]`` (both ranks on one host,
over shared memory), on the same cores. It prints both runs' output and their training rows/s
(the median over the epochs after the first) with the ratio. Needs root, or an unprivileged user
namespace with its own network (docs/cluster.md).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parents[1] / "examples"
for path in (HERE, EXAMPLES):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

EPOCH_LINE = re.compile(r"epoch (\d+)/\d+: .*?([\d,]+) rows/s")


class _Tee(io.TextIOBase):
    """Writes to the terminal and keeps a copy."""

    def __init__(self, stream) -> None:
        self.stream, self.kept = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.stream.flush()
        return self.kept.write(text)


def training_rows_per_s(printed: str) -> Optional[float]:
    """The median rows/s of the epochs after the first (the first also warms up), from the progress lines."""
    rates = {int(m.group(1)): float(m.group(2).replace(",", "")) for m in EPOCH_LINE.finditer(printed)}
    later = [rate for epoch, rate in rates.items() if epoch > 1] or list(rates.values())
    return statistics.median(later) if later else None


def _run_example(argv: List[str]) -> tuple:
    """fraud_detection.main(argv) with its output shown and kept: (exit code, rows/s)."""
    import cloudpickle

    module = importlib.import_module("fraud_detection")
    cloudpickle.register_pickle_by_value(module)  # the executors' Python does not have examples/ on its path
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        code = module.main(argv)
    return code, training_rows_per_s(tee.kept.getvalue())


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rate", default="1gbit", help="link rate (tc's units), or none for unshaped links")
    parser.add_argument("--no-local", action="store_true", help="skip the local[2] run")
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error(f"--epochs {args.epochs}: expected at least 2 (the first epoch warms up)")

    from cluster_hosts import Hosts
    from cluster_spark import SparkCluster

    example = ["--rows", str(args.rows), "--epochs", str(args.epochs)]
    with tempfile.TemporaryDirectory(prefix="spark-hvd-cluster-demo-") as out:
        with Hosts(2) as hosts:
            hosts.shape(None if args.rate == "none" else args.rate)
            with SparkCluster(hosts, cores=2) as cluster:
                cluster.use("2x1")
                print(f"== fraud Pipeline on 2 hosts ({', '.join(h.name for h in hosts.hosts)}), one rank each, "
                      f"links {args.rate} ==", flush=True)
                code, on_cluster = _run_example(example + ["--out", os.path.join(out, "cluster")])
                cluster.stop_session()
        os.environ.pop("SPARK_LOCAL_IP", None)  # the cluster's driver address; local[2] binds to 127.0.0.1
        on_local = None
        if not args.no_local and code == 0:
            print("\n== the same on local[2] ==", flush=True)
            code, on_local = _run_example(example + ["--out", os.path.join(out, "local")])
    print("\n| run | training rows/s (median of epochs 2+) |\n|---|---|")
    print(f"| 2 hosts x 1 rank, {args.rate} | {on_cluster:,.0f} |" if on_cluster else "| 2 hosts | - |")
    if on_local:
        print(f"| local[2] | {on_local:,.0f} |")
        if on_cluster:
            print(f"cluster / local[2]: {on_cluster / on_local:.2f}x (target: at least 0.75x)")
    return code


if __name__ == "__main__":
    sys.exit(main())
