"""The cluster mode of benchmarks/collectives.py: allreduce between two hosts of the test cluster.

    python benchmarks/collectives.py --cluster [--rates 1gbit 10gbit none] [--quick]

The hosts are those of ``tests/cluster/`` (network namespaces on a bridge, each with its own
hostname and /dev/shm; needs root, or an unprivileged user namespace with its own network). For
each link rate (``tc ... tbf`` on both ends of every host's link; ``none`` leaves them unshaped) the
same sweep runs in three layouts, spark-hvd and gloo in the same hosts, one after the other:

- ``2x1``: one rank per host (every byte crosses the link);
- ``2x2 flat``: two ranks per host in one ring (spark-hvd's ring across hosts; gloo's own);
- ``2x2 hierarchical``: spark-hvd with SPARK_HVD_HIERARCHICAL_ALLREDUCE (shared memory inside a
  host, a ring across hosts).

With one rank per host, a third column is the floor of the machine and link: two Python processes
that exchange the buffer over one TCP connection and add (``_peers_tcp.py``), what any two-rank
allreduce must at least do.

Line rate is the tbf rate: a ring allreduce of N bytes between two hosts moves N bytes each way
over each link (bus bandwidth = algbw x 2(n-1)/n per rank link; with one rank per host that is
N bytes per direction), so "of line" is bytes over time against the link's bytes per second.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
CLUSTER = HERE.parent / "tests" / "cluster"

__all__ = ["run_cluster", "run_world_on_hosts", "LAYOUTS", "line_rate_share"]

LAYOUTS = (("2x1", 1, False), ("2x2 flat", 2, False), ("2x2 hierarchical", 2, True))
"""(name, ranks per host, hierarchical) of each layout."""
_WORLD_TIMEOUT_S = 600.0


def _harness() -> Any:
    if str(CLUSTER) not in sys.path:
        sys.path.insert(0, str(CLUSTER))
    import cluster_hosts

    return cluster_hosts


def line_rate_share(nbytes: int, seconds: float, rate_bits: Optional[int], ranks_per_host: int,
                    hierarchical: bool = False) -> Optional[float]:
    """The share of a host link's rate that an allreduce of ``nbytes`` between two hosts used (None
    for an unshaped link). A ring of n ranks moves 2(n-1)/n x nbytes over each of its edges, and a
    host's link carries one edge each way (nbytes with one rank per host, 1.5 x nbytes flat 2x2);
    the hierarchical allreduce's cross-host step moves nbytes / local_size in each of local_size
    two-rank rings, nbytes in all."""
    if not rate_bits:
        return None
    size = 2 * ranks_per_host
    carried = nbytes if hierarchical else nbytes * 2 * (size - 1) / size
    return carried / seconds / (rate_bits / 8)


def run_world_on_hosts(hosts: Any, framework: str, per_host: int, hierarchical: bool, plan: Dict[str, Any],
           work: Path) -> List[Dict[str, Any]]:
    """Start one world of ``framework`` on the hosts (ranks in host order), wait, read every rank's result."""
    from collectives import WorldFailed, _child_env, _stop, _tail

    size = per_host * len(hosts.hosts)
    (work / "plan.json").write_text(json.dumps(plan))
    procs: List[subprocess.Popen] = []
    logs: List[Path] = []
    server = None
    try:
        if framework == "spark-hvd":
            from spark_hvd.runner.processes import rank_environment
            from spark_hvd.runtime.config import new_secret
            from spark_hvd.runtime.rendezvous import RendezvousServer

            secret = new_secret()
            server = RendezvousServer(_harness().MACHINE_ADDRESS, secret)
            rendezvous = f"{server.host}:{server.port}"
        for rank in range(size):
            host = hosts.hosts[rank // per_host]
            local = rank % per_host
            if framework == "spark-hvd":
                env = rank_environment(
                    rank=rank, size=size, local_rank=local, local_size=per_host, cross_rank=rank // per_host,
                    cross_size=len(hosts.hosts), rendezvous_addr=rendezvous, secret=secret, hostname=host.address,
                    host_key=host.name, base=_child_env({}),
                    settings={"hierarchical_allreduce": hierarchical})
                script = "_peers_sparkhvd.py"
            else:
                env = _child_env({"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(local),
                                  "LOCAL_WORLD_SIZE": str(per_host), "MASTER_ADDR": hosts.hosts[0].address,
                                  "MASTER_PORT": "29511" if framework == "gloo" else "29512",
                                  "GLOO_SOCKET_IFNAME": "eth0"})
                script = "_peers_gloo.py" if framework == "gloo" else "_peers_tcp.py"
            log = work / f"output{rank}.txt"
            logs.append(log)
            with open(log, "wb") as f:
                procs.append(host.popen([sys.executable, str(HERE / script), str(work / "plan.json"), str(work)],
                                        env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True))
        deadline = time.monotonic() + plan["world_timeout_s"]
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # The rank that failed first is not always the lowest, and a rank's traceback comes after its
                # shutdown: let them all end (bounded) and report each.
                grace = time.monotonic() + 30.0
                while any(p.poll() is None for p in procs) and time.monotonic() < grace:
                    time.sleep(0.1)
                failed = [(i, p.poll()) for i, p in enumerate(procs) if p.poll() not in (None, 0)]
                raise WorldFailed("; ".join(f"rank {i} of {framework} exited with code {code}" for i, code in failed)
                                  + "".join(f"\n-- rank {i}:\n{_tail(log)}" for i, log in enumerate(logs)))
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                raise WorldFailed(f"{framework} did not finish within {plan['world_timeout_s']:.0f} s\n{_tail(logs[0])}")
            time.sleep(0.05)
    finally:
        _stop(procs)
        if server is not None:
            server.close()
    return [json.loads((work / f"rank{rank}.json").read_text()) for rank in range(size)]


def _row_cells(nbytes: int, fws: Dict[str, Dict[str, Any]], rate_bits: Optional[int], per_host: int,
               hierarchical: bool) -> List[str]:
    from collectives import _fmt, size_label

    cells = [size_label(nbytes)]
    times = {}
    for name in ("spark-hvd", "gloo"):
        entry = fws.get(name, {}).get("sizes", {}).get(str(nbytes))
        times[name] = entry["median_s"] if entry else None
        cells.append(_fmt(entry["median_s"] * 1e6, 1) if entry else "-")
        cells.append(_fmt(entry["busbw_GBps"]) if entry else "-")
    hvd, gloo = times["spark-hvd"], times["gloo"]
    cells.append(_fmt(hvd / gloo, 3) if hvd and gloo else "-")
    share = line_rate_share(nbytes, hvd, rate_bits, per_host, hierarchical) if hvd else None
    cells.append(f"{share * 100:.1f}%" if share is not None else "-")
    floor = fws.get("tcp", {}).get("sizes", {}).get(str(nbytes))
    cells.append(_fmt(floor["median_s"] * 1e6, 1) if floor else "-")
    floor_share = line_rate_share(nbytes, floor["median_s"], rate_bits, per_host) if floor else None
    cells.append(f"{floor_share * 100:.1f}%" if floor_share is not None else "-")
    return cells


def run_cluster(args: Any, plan: Dict[str, Any], out: Callable[[str], None]) -> Dict[str, Any]:
    """Every rate x layout: spark-hvd and gloo side by side; the tables, targets, and raw results."""
    from collectives import WorldFailed, combine

    harness = _harness()
    rates: Sequence[Optional[str]] = [None if r == "none" else r for r in args.rates]
    results: Dict[str, Dict[str, Dict[str, Any]]] = {}
    with harness.Hosts(2) as hosts:
        for rate in rates:
            hosts.shape(rate)
            for layout, per_host, hierarchical in LAYOUTS:
                key = f"{rate or 'unshaped'} {layout}"
                fws: Dict[str, Dict[str, Any]] = {}
                for framework in ("spark-hvd", "gloo", "tcp"):
                    if framework == "gloo" and hierarchical:
                        continue  # gloo has no hierarchical allreduce of its own
                    if framework == "tcp" and per_host != 1:
                        continue  # the floor is one pair of processes, one per host
                    t0 = time.monotonic()
                    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
                        try:
                            fws[framework] = combine(run_world_on_hosts(hosts, framework, per_host, hierarchical, plan,
                                                            Path(tmp)), per_host * 2)
                            out(f"{key} {framework}: done in {time.monotonic() - t0:.1f} s")
                        except WorldFailed as exc:
                            fws[framework] = {"status": "failed", "note": str(exc).splitlines()[0],
                                              "detail": str(exc)}
                            out(f"{key} {framework}: FAILED: {exc}")
                results[key] = fws
        hosts.shape(None)
    for key, fws in results.items():
        rate = key.split(" ", 1)[0]
        bits = None if rate == "unshaped" else harness.rate_bits(rate)
        per_host = 1 if "2x1" in key else 2
        if "hierarchical" in key:
            fws = dict(fws, gloo=results.get(key.replace("hierarchical", "flat"), {}).get("gloo", {}))
        out(f"\n== cluster, 2 hosts, {key}: float32 Sum allreduce, median of the slowest rank ==")
        header = ["size", "spark-hvd us", "busbw", "gloo us", "busbw", "time/gloo", "of line rate",
                  "raw TCP us", "of line rate"]
        rows = [_row_cells(int(n), fws, bits, per_host, "hierarchical" in key) for n in plan["sizes"]]
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
        out("  ".join(h.rjust(w) for h, w in zip(header, widths)))
        for cells in rows:
            out("  ".join(c.rjust(w) for c, w in zip(cells, widths)))
    targets = evaluate_cluster_targets(results, harness.rate_bits)
    out("\ntargets (cluster):")
    for t in targets:
        out(f"  {t['status']:4}  {t['name']}: {t['measured']}")
    return {"results": results, "targets": targets}


def evaluate_cluster_targets(results: Dict[str, Dict[str, Dict[str, Any]]],
                             rate_bits: Callable[[str], int]) -> List[Dict[str, Any]]:
    """From 1 MiB up over shaped links: at least gloo's bandwidth and 95% of line rate; 4 B to 64 KiB at
    most 0.6x gloo's latency; hierarchical 2x2 at least as fast as the flat ring from 1 MiB up."""
    targets: List[Dict[str, Any]] = []

    def sizes(fws: Dict[str, Any], name: str) -> Dict[str, Any]:
        return fws.get(name, {}).get("sizes", {})

    for key, fws in results.items():
        rate = key.split(" ", 1)[0]
        hvd, gloo = sizes(fws, "spark-hvd"), sizes(fws, "gloo")
        if not hvd:
            continue
        big = [n for n in hvd if int(n) >= 1 << 20]
        small = [n for n in hvd if int(n) <= 64 << 10]
        if gloo and "hierarchical" not in key:
            worst = min((gloo[n]["median_s"] / hvd[n]["median_s"], n) for n in big if n in gloo) if big else None
            if worst:
                targets.append({"name": f"{key}: bandwidth from 1 MiB >= gloo's", "status":
                                "PASS" if worst[0] >= 1.0 else "MISS",
                                "measured": f"worst {worst[0]:.2f}x gloo's at {int(worst[1]) >> 20} MiB"})
            worst = max((hvd[n]["median_s"] / gloo[n]["median_s"], n) for n in small if n in gloo) if small else None
            if worst:
                targets.append({"name": f"{key}: latency 4 B-64 KiB <= 0.6x gloo's", "status":
                                "PASS" if worst[0] <= 0.6 else "MISS",
                                "measured": f"worst {worst[0]:.2f}x at {int(worst[1])} B"})
        if rate != "unshaped" and big:
            per_host = 1 if "2x1" in key else 2
            shares = [(line_rate_share(int(n), hvd[n]["median_s"], rate_bits(rate), per_host, "hierarchical" in key), n)
                      for n in big]
            worst_share = min(shares)
            targets.append({"name": f"{key}: >= 95% of line rate from 1 MiB", "status":
                            "PASS" if worst_share[0] >= 0.95 else "MISS",
                            "measured": f"worst {worst_share[0] * 100:.1f}% at {int(worst_share[1]) >> 20} MiB"})
        if "hierarchical" in key:
            flat = sizes(results.get(key.replace("hierarchical", "flat"), {}), "spark-hvd")
            pairs = [(flat[n]["median_s"] / hvd[n]["median_s"], n) for n in big if n in flat]
            if pairs:
                worst = min(pairs)
                targets.append({"name": f"{key}: at least as fast as the flat ring from 1 MiB", "status":
                                "PASS" if worst[0] >= 1.0 else "MISS",
                                "measured": f"worst {worst[0]:.2f}x the flat ring's speed at "
                                            f"{int(worst[1]) >> 20} MiB"})
    return targets


def _main_guard() -> None:  # pragma: no cover - the module runs through collectives.py
    raise SystemExit("run benchmarks/collectives.py --cluster")


if __name__ == "__main__":
    _main_guard()
