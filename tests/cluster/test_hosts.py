"""run() across hosts of a Spark standalone cluster: ranks on two hosts meet over TCP on the
executors' addresses (or the interface named with nics=, SPARK_HVD_IFACE or HOROVOD_GLOO_IFACE),
ranks of one host over shared memory, and collectives are right both ways; spark-hvd-run takes
--network-interface. The first tests run one rank per host, the last ones two per host."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from spark_hvd.spark import run

pytestmark = pytest.mark.timeout(600)

SIZES = (1, 1000, 262_147)
"""Elements of the allreduce checks: one, a few KiB, and 1 MiB that no rank count divides."""


def describe_rank(hierarchical: bool = False):
    """On each rank: where it is, how it reaches every other rank, and allreduce results."""
    import dataclasses
    import os
    import socket

    import spark_hvd.runtime as hvd

    hvd.init()
    try:
        sums = []
        for n in SIZES:
            mine = np.arange(n, dtype=np.float64) + hvd.rank()
            sums.append(bool(np.array_equal(hvd.allreduce(mine, op=hvd.Sum, name=f"sum.{n}"),
                                            hvd.size() * np.arange(n, dtype=np.float64)
                                            + sum(range(hvd.size())))))
        return {"rank": hvd.rank(), "hostname": socket.gethostname(), "local_rank": hvd.local_rank(),
                "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
                "advertised": os.environ["SPARK_HVD_HOSTNAME"], "sums": sums,
                "links": [dataclasses.asdict(link) for link in hvd.peer_links()]}
    finally:
        hvd.shutdown()


def host_of(ranks, rank):
    return ranks[rank]["hostname"]


def test_ranks_on_two_hosts_meet_over_tcp_on_the_executors_addresses(spark_2x1, hosts):
    """Two ranks, one per host: different hostnames, local_size 1, cross_size 2, each advertises
    its host's cluster address, reaches the other over TCP from and to those addresses, and the
    allreduces are exact."""
    ranks = run(describe_rank, num_proc=2)
    by_name = {host.name: host for host in hosts.hosts}
    assert sorted(r["hostname"] for r in ranks) == sorted(by_name)
    for r in ranks:
        host = by_name[r["hostname"]]
        assert (r["local_rank"], r["local_size"], r["cross_size"]) == (0, 1, 2)
        assert r["advertised"] == host.address
        assert r["sums"] == [True] * len(SIZES)
        (link,) = r["links"]
        peer = by_name[host_of(ranks, link["rank"])]
        assert (link["transport"], link["host"]) == ("tcp", peer.name)
        assert link["address"].split(":")[0] == peer.address
        assert link["local_address"].split(":")[0] == host.address
    assert sorted(r["cross_rank"] for r in ranks) == [0, 1]


@pytest.mark.parametrize("how", [{"nics": ["data0"]}, {"nics": ["no-such-nic", "data0"]},
                                 {"env": {"SPARK_HVD_IFACE": "data0"}}, {"env": {"HOROVOD_GLOO_IFACE": "data0"}}],
                         ids=["nics", "nics-first-found", "SPARK_HVD_IFACE", "HOROVOD_GLOO_IFACE"])
def test_the_ranks_use_the_interface_they_are_told(spark_2x1, hosts, how):
    """Named the second interface (data0), every rank listens on and advertises its data0 address and
    the TCP link runs between the data0 addresses, not the executors' ones."""
    ranks = run(describe_rank, num_proc=2, **how)
    data = {host.name: host.data_address for host in hosts.hosts}
    for r in ranks:
        assert r["advertised"] == data[r["hostname"]]
        (link,) = r["links"]
        assert link["transport"] == "tcp"
        assert link["address"].split(":")[0] == data[host_of(ranks, link["rank"])]
        assert link["local_address"].split(":")[0] == data[r["hostname"]]
        assert r["sums"] == [True] * len(SIZES)


def test_an_interface_no_host_has_is_named_with_what_the_host_has(spark_2x1):
    """nics naming an interface the executors' hosts lack fails at once, naming it and the interfaces there."""
    with pytest.raises(Exception, match=r"network interface\(s\) \['eth9'\] not found .* on host shvd-h\d; this "
                                        r"host has: data0 \(10\.213\.0\.1\d\d\), eth0 \(10\.213\.0\.1\d\)"):
        run(describe_rank, num_proc=2, nics=["eth9"])


RUNNER_SCRIPT = """
import spark_hvd.runtime as hvd
hvd.init()
print("links", [(link.transport, link.address, link.local_address) for link in hvd.peer_links()])
hvd.shutdown()
"""


def test_spark_hvd_run_listens_on_the_network_interface_it_is_given(hosts):
    """spark-hvd-run --network-interface data0 on one host: the two local ranks (sockets, not shared
    memory) connect between that host's data0 address; an interface the host lacks is a usage error
    naming what it has."""
    host = hosts.hosts[0]
    command = [sys.executable, "-m", "spark_hvd.runner.cli", "-np", "2", "--network-interface", "data0"]
    done = subprocess.run(host.command(["env", "SPARK_HVD_SHM=0", *command, sys.executable, "-c", RUNNER_SCRIPT]),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "links" in line]
    assert len(lines) == 2
    for line in lines:
        assert "'tcp'" in line and line.count(f"'{host.data_address}:") == 2, line
    refused = subprocess.run(host.command([*command[:-2], "--network-interface", "eth9", sys.executable, "-c", "1"]),
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0
    assert "--network-interface 'eth9'" in refused.stderr and f"data0 ({host.data_address})" in refused.stderr


def test_two_ranks_per_host_share_memory_inside_a_host_and_tcp_across(spark_2x2, hosts):
    """Four ranks, two per host, hierarchical allreduce on: the ranks of one host are neighbours
    (local_size 2, cross_size 2), reach each other through shared memory and the other host's
    ranks over TCP between the hosts' addresses, and every allreduce is exact."""
    ranks = run(describe_rank, num_proc=4, env={"SPARK_HVD_HIERARCHICAL_ALLREDUCE": "1"})
    by_name = {host.name: host for host in hosts.hosts}
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert host_of(ranks, 0) == host_of(ranks, 1) != host_of(ranks, 2) == host_of(ranks, 3)
    for r in ranks:
        assert (r["local_size"], r["cross_size"]) == (2, 2)
        assert r["local_rank"] == r["rank"] % 2 and r["cross_rank"] == r["rank"] // 2
        assert r["sums"] == [True] * len(SIZES)
        transports = {}
        for link in r["links"]:
            same_host = host_of(ranks, link["rank"]) == r["hostname"]
            transports[link["rank"]] = link["transport"]
            if not same_host:
                assert link["address"].split(":")[0] == by_name[host_of(ranks, link["rank"])].address
        expected = {p: "shm" if host_of(ranks, p) == r["hostname"] else "tcp" for p in range(4) if p != r["rank"]}
        assert transports == expected


def end_on_large_allreduces(count: int, elements: int):
    """On each rank: ``count`` allreduces of ``elements`` float32 as the last collectives before
    shutdown (nothing after them holds a faster rank back); whether each sum was exact."""
    import spark_hvd.runtime as hvd

    hvd.init()
    try:
        exact = []
        for _ in range(count):
            total = hvd.allreduce(np.full(elements, hvd.rank() + 1, dtype=np.float32), op=hvd.Sum, name="last")
            exact.append(bool(np.all(total == sum(range(1, hvd.size() + 1)))))
        return exact
    finally:
        hvd.shutdown()


def test_a_rank_that_finished_first_and_shut_down_does_not_fail_the_ranks_still_receiving(spark_2x2):
    """Flat ring of four ranks on two hosts over 1 Gbit/s links: a rank whose last allreduce ends
    early (its last chunk came over shared memory) shuts down while its host-link neighbour is still
    receiving that rank's last chunk over TCP. Its goodbye, on another connection, arrives first;
    the neighbour still completes the allreduce with the data in flight."""
    results = run(end_on_large_allreduces, args=(25, 4 << 20), num_proc=4,
                  env={"SPARK_HVD_HIERARCHICAL_ALLREDUCE": "0"})
    assert results == [[True] * 25] * 4
