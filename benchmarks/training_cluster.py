"""The fraud-sized model trained across two hosts of the test cluster, one rank on each.

    python benchmarks/training_cluster.py [--rate 1gbit] [--batch 1024] [--steps 2000] [--repeats 3]

The hosts are those of ``tests/cluster/`` (network namespaces on a bridge, each with its own
hostname; needs root), their links shaped to ``--rate`` (``tc ... tbf``; ``none`` leaves them as
they are). Both ranks run the 30-64-64-1 MLP with Adam and a logistic loss on in-memory batches
(one torch thread each, subnormals flushed), in the same processes, in alternating blocks of
``--steps`` steps:

- ``no communication``: the plain loop, nothing exchanged (the floor);
- ``spark-hvd``: the same loop with ``spark_hvd.torch.DistributedOptimizer`` (its gradient buffer
  takes the program-order links between hosts when the world has them);
- ``spark-hvd negotiated``: the same with ``SPARK_HVD_LOCKSTEP_LINK_BYTES=0`` (every reduction
  negotiated), in a second world started the same way.

Then the 4-byte Sum allreduce between the two processes, median microseconds: negotiated
(``allreduce``), program order (``allreduce_lockstep``), and the floor, a 4-byte exchange over one
plain TCP connection between the same two processes (each sends, then reads the other's bytes).
Rows give steps per second (the slower rank's) and the ratios to the floor of the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
CLUSTER = HERE.parent / "tests" / "cluster"
DEFAULT_JSON = HERE / "results" / "training_cluster.json"
FEATURES = 30
_PING_PORT = 29533
_WORLD_TIMEOUT_S = 600.0


# -- one rank ------------------------------------------------------------------------------------
def rank_main(plan: Dict[str, Any], out_dir: str) -> None:
    """One rank: the training blocks, then the 4-byte latencies; its result as rank<N>.json."""
    import numpy as np
    import torch

    import spark_hvd.runtime as rt
    import spark_hvd.torch as hvd

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    hvd.init()
    rank = hvd.rank()
    try:
        batch, steps = plan["batch"], plan["steps"]
        generator = torch.Generator().manual_seed(rank)
        x = torch.randn(batch, FEATURES, generator=generator)
        y = (torch.rand(batch, 1, generator=generator) < 0.5).float()
        loss_fn = torch.nn.BCEWithLogitsLoss()

        def model() -> Any:
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                       torch.nn.ReLU(), torch.nn.Linear(64, 1))

        plain_model, shared_model = model(), model()
        plain = torch.optim.Adam(plain_model.parameters(), lr=1e-3)
        shared = hvd.DistributedOptimizer(torch.optim.Adam(shared_model.parameters(), lr=1e-3),
                                          named_parameters=shared_model.named_parameters())

        def block(net: Any, optimizer: Any, count: int) -> float:
            hvd.allreduce(torch.zeros(1), name="block.start")  # both ranks start the block together
            started = time.perf_counter()
            for _ in range(count):
                optimizer.zero_grad()
                loss_fn(net(x), y).backward()
                optimizer.step()
            return count / (time.perf_counter() - started)

        block(plain_model, plain, plan["warmup"])
        block(shared_model, shared, plan["warmup"])
        rates: Dict[str, List[float]] = {"no communication": [], "spark-hvd": []}
        for _ in range(plan["repeats"]):
            rates["no communication"].append(block(plain_model, plain, steps))
            rates["spark-hvd"].append(block(shared_model, shared, steps))

        latencies: Dict[str, float] = {}
        four = np.ones(1, np.float32)
        latencies["negotiated"] = _median_us(lambda: rt.allreduce(four, op=rt.Sum, name="four"), plan["latency_iters"])
        if rt.allreduce_lockstep(four, op=rt.Sum, name="four.lockstep") is not None:  # the world has the path
            latencies["program order"] = _median_us(
                lambda: rt.allreduce_lockstep(four, op=rt.Sum, name="four.lockstep"), plan["latency_iters"])
        latencies["tcp floor"] = _tcp_floor_us(rank, plan)
        result = {"rank": rank, "rates": rates, "latency_us": latencies}
    finally:
        hvd.shutdown()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _median_us(op: Any, count: int) -> float:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        op()
        times.append(time.perf_counter() - started)
    return statistics.median(times[count // 10:]) * 1e6


def _tcp_floor_us(rank: int, plan: Dict[str, Any]) -> float:
    """A 4-byte exchange over one plain TCP connection between the two ranks, median microseconds."""
    import numpy as np

    sys.path.insert(0, str(HERE))
    from _peers_tcp import _connect, _TcpPair

    pair = _TcpPair(_connect(rank, plan["peer_address"], _PING_PORT), rank)
    buf = np.ones(1, np.float32)
    try:
        return _median_us(lambda: pair.allreduce(buf), plan["latency_iters"])
    finally:
        pair.sock.close()


# -- the driver ----------------------------------------------------------------------------------
def _cluster() -> Any:
    if str(CLUSTER) not in sys.path:
        sys.path.insert(0, str(CLUSTER))
    import cluster_hosts

    return cluster_hosts


def run_world(hosts: Any, plan: Dict[str, Any], settings: Dict[str, Any], work: Path) -> List[Dict[str, Any]]:
    """One spark-hvd world, rank r on host r; every rank's result."""
    from spark_hvd.runner.processes import rank_environment
    from spark_hvd.runtime.config import new_secret
    from spark_hvd.runtime.rendezvous import RendezvousServer

    sys.path.insert(0, str(HERE))
    from collectives import WorldFailed, _child_env, _stop, _tail

    work.mkdir(parents=True, exist_ok=True)
    (work / "plan.json").write_text(json.dumps(plan))
    secret = new_secret()
    server = RendezvousServer(_cluster().MACHINE_ADDRESS, secret)
    procs: List[subprocess.Popen] = []
    logs: List[Path] = []
    try:
        for rank, host in enumerate(hosts.hosts[:2]):
            env = rank_environment(rank=rank, size=2, local_rank=0, local_size=1, cross_rank=rank, cross_size=2,
                                   rendezvous_addr=f"{server.host}:{server.port}", secret=secret,
                                   hostname=host.address, host_key=host.name, base=_child_env({}), settings=settings)
            logs.append(work / f"output{rank}.txt")
            with open(logs[-1], "wb") as f:
                procs.append(host.popen([sys.executable, str(Path(__file__).resolve()), "--rank-main",
                                         str(work / "plan.json"), str(work)], env=env, stdout=f,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + _WORLD_TIMEOUT_S
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                time.sleep(2.0)
                raise WorldFailed("; ".join(f"rank {i} exited with code {procs[i].poll()}" for i in failed)
                                  + "".join(f"\n-- rank {i}:\n{_tail(log)}" for i, log in enumerate(logs)))
            time.sleep(0.05)
        if any(p.returncode for p in procs):
            raise WorldFailed("".join(f"\n-- rank {i}:\n{_tail(log)}" for i, log in enumerate(logs)))
    finally:
        _stop(procs)
        server.close()
    return [json.loads((work / f"rank{rank}.json").read_text()) for rank in range(2)]


def summarize(results: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per mode the slower rank's median steps per second; latencies, the larger rank's."""
    modes = results[0]["rates"].keys()
    rates = {m: min(statistics.median(r["rates"][m]) for r in results) for m in modes}
    latency = {k: max(r["latency_us"].get(k, float("nan")) for r in results) for k in results[0]["latency_us"]}
    return {"steps_per_s": rates, "latency_us": latency}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank-main", nargs=2, metavar=("PLAN", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--rate", default="1gbit", help="tc rate of every host link, or none (default 1gbit)")
    parser.add_argument("--batch", type=int, default=1024, help="rows per rank per step (default 1024)")
    parser.add_argument("--steps", type=int, default=2000, help="steps per timed block (default 2000)")
    parser.add_argument("--repeats", type=int, default=3, help="timed blocks per mode, alternating (default 3)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--quick", action="store_true", help="a few steps of everything (a smoke test)")
    args = parser.parse_args(argv)
    if args.rank_main:
        rank_main(json.loads(Path(args.rank_main[0]).read_text()), args.rank_main[1])
        return 0
    cluster = _cluster()
    steps, repeats = (50, 1) if args.quick else (args.steps, args.repeats)
    record: Dict[str, Any] = {"rate": args.rate, "batch": args.batch, "steps": steps, "repeats": repeats}
    with cluster.Hosts(2) as hosts, tempfile.TemporaryDirectory(prefix="spark-hvd-train-cluster-") as scratch:
        hosts.shape(None if args.rate == "none" else args.rate)
        plan = {"batch": args.batch, "steps": steps, "repeats": repeats, "warmup": max(10, steps // 10),
                "latency_iters": 100 if args.quick else 2000, "peer_address": hosts.hosts[0].address}
        links = summarize(run_world(hosts, plan, {}, Path(scratch) / "links"))
        negotiated = summarize(run_world(hosts, plan, {"lockstep_link_bytes": 0}, Path(scratch) / "negotiated"))
    floor = links["steps_per_s"]["no communication"]
    rows = [("no communication", floor), ("spark-hvd (program-order links)", links["steps_per_s"]["spark-hvd"]),
            ("no communication, second world", negotiated["steps_per_s"]["no communication"]),
            ("spark-hvd negotiated", negotiated["steps_per_s"]["spark-hvd"])]
    print(f"\nTwo hosts, one rank each, links {args.rate}; 30-64-64-1 MLP, batch {args.batch}, {steps} steps x "
          f"{repeats} per mode")
    print("| mode | steps/s (slower rank) | vs no communication of its world |\n|---|---|---|")
    for i, (name, rate) in enumerate(rows):
        own_floor = floor if i < 2 else negotiated["steps_per_s"]["no communication"]
        print(f"| {name} | {rate:,.0f} | {rate / own_floor:.2f}x |")
    tcp = links["latency_us"]["tcp floor"]
    print("\n| 4-byte allreduce | median us | vs the TCP exchange |\n|---|---|---|")
    for name, value in (("program order", links["latency_us"].get("program order")),
                        ("negotiated", links["latency_us"]["negotiated"]), ("tcp floor", tcp)):
        if value is not None:
            print(f"| {name} | {value:.1f} | {value / tcp:.2f}x |")
    record.update({"links": links, "negotiated": negotiated})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
