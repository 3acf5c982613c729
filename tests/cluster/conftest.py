"""Fixtures of the cluster tests: one cluster of two hosts for the tests of this folder (a package, so
the cluster ends, and restores this process's environment, before the other folders' tests run).

The hosts are network namespaces on a bridge (see cluster_hosts.py), each link shaped to 1 Gbit/s;
a Spark standalone master runs on the machine and a two-core worker on each host (cluster_spark.py).
Tests ask for a session of a kind (``spark_2x1``: one task slot per host, ``spark_2x2``: two,
``spark_connect``); modules are ordered so that each kind is started once. After every test, no rank
process may be left on any host and every host's /dev/shm must be empty.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Iterator

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from cluster_hosts import Hosts  # noqa: E402
from cluster_spark import SparkCluster  # noqa: E402

"""What the command line of a rank process contains."""
PEER_TIMEOUT_S = 4.0
"""SPARK_HVD_PEER_TIMEOUT of every process of the cluster: a cut link breaks connections in use after
about this long (the default, 10 s, would make each network-fault test wait out 15 s cuts)."""
LEFTOVER_DEVICES_WAIT_S = 10.0
"""How long a closed cluster's network devices may take to vanish."""
LEFTOVER_WAIT_S = 60.0
"""How long a finished test's rank processes may take to exit (a task Spark killed ends its rank)."""


@pytest.fixture(scope="package")
def hosts() -> Iterator[Hosts]:
    with Hosts(2) as made:
        made.shape("1gbit")
        yield made
    # The kernel removes a namespace's devices after its last process, asynchronously (a namespace
    # that held many TCP connections takes a moment longer).
    deadline = time.monotonic() + LEFTOVER_DEVICES_WAIT_S
    while made.leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert made.leftovers() == {}, f"the cluster left network devices behind: {made.leftovers()}"


@pytest.fixture(scope="package")
def cluster(hosts) -> Iterator[SparkCluster]:
    with SparkCluster(hosts, cores=2, env={"SPARK_HVD_PEER_TIMEOUT": str(PEER_TIMEOUT_S)}) as made:
        yield made


@pytest.fixture
def spark_2x1(cluster):
    """A classic session with one task slot on each of the two hosts."""
    return cluster.use("2x1")


@pytest.fixture
def spark_2x2(cluster):
    """A classic session with two task slots on each of the two hosts."""
    return cluster.use("2x2")


@pytest.fixture
def spark_connect(cluster):
    """A Spark Connect session of a Connect server that runs against the cluster's master."""
    return cluster.use("connect")


def rank_processes(hosts: Hosts) -> dict:
    """Rank processes still running, by host name."""
    found = {host.name: sorted(host.rank_processes()) for host in hosts.hosts}
    return {name: pids for name, pids in found.items() if pids}


@pytest.fixture(autouse=True)
def nothing_left_on_the_hosts(request) -> Iterator[None]:
    """After each test: every host up and linked, no rank process running, every /dev/shm empty."""
    yield
    if "hosts" not in request.fixturenames:
        return
    made: Hosts = request.getfixturevalue("hosts")
    for host in made.hosts:
        host.restore()  # a failed fault test may have left a link down
    from cluster_spark import wait_for
    from cluster_hosts import HarnessError

    try:
        wait_for(lambda: not rank_processes(made), LEFTOVER_WAIT_S, "the rank processes ending")
    except HarnessError:
        pass
    assert rank_processes(made) == {}, "rank processes were left running on the hosts"
    assert {host.name: host.shm_entries() for host in made.hosts} == {host.name: [] for host in made.hosts}
