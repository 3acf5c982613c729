"""The worlds of `benchmarks/collectives.py --cluster` run on the hosts and agree on every sum:
spark-hvd's flat ring of four ranks and the raw TCP floor of one pair (numbers are not asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("framework, per_host", [("tcp", 1), ("spark-hvd", 2)])
def test_a_cluster_benchmark_world_runs_on_the_hosts(hosts, tmp_path, framework, per_host):
    """Every rank checks its first allreduce of each size before timing it; a wrong sum fails the world."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    import collectives
    from collectives_cluster import run_world_on_hosts

    plan = collectives.build_plan(collectives.build_parser().parse_args(["--cluster", "--quick", "--sizes", "4", "64K"]))
    plan.update(async_count=0, after_ms=0.0, world_timeout_s=120.0)
    ranks = run_world_on_hosts(hosts, framework, per_host, False, plan, tmp_path)
    assert [r["rank"] for r in ranks] == list(range(2 * per_host))
    combined = collectives.combine(ranks, 2 * per_host)
    assert combined["status"] == "ok" and set(combined["sizes"]) == {"4", "65536"}
    assert all(size["median_s"] > 0 for size in combined["sizes"].values())


def test_the_training_benchmark_world_trains_on_both_hosts_over_the_links(hosts, tmp_path):
    """`benchmarks/training_cluster.py`'s world: both ranks train both loops and time the 4-byte
    allreduce three ways, the program-order one included (the links between the hosts)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    import training_cluster

    plan = {"batch": 64, "steps": 20, "repeats": 1, "warmup": 5, "latency_iters": 20,
            "peer_address": hosts.hosts[0].address}
    summary = training_cluster.summarize(training_cluster.run_world(hosts, plan, {}, tmp_path))
    assert set(summary["steps_per_s"]) == {"no communication", "spark-hvd"}
    assert all(rate > 0 for rate in summary["steps_per_s"].values())
    assert set(summary["latency_us"]) == {"negotiated", "program order", "tcp floor"}
