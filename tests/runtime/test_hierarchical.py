"""Hierarchical allreduce on CPU ranks: four ranks on two simulated hosts of this machine (shared
memory within a "host", TCP between them) reduce within the host, across hosts, then gather."""

import json
import subprocess
import sys
import textwrap

from spark_hvd.runner import rank_environment
from spark_hvd.runtime.config import new_secret
from spark_hvd.runtime.rendezvous import RendezvousServer

JOB = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import spark_hvd.runtime as rt
    from spark_hvd.runtime import api

    rt.init()
    rank, size = rt.rank(), rt.size()
    data = api._state.session.engine.data
    hierarchy = data.hierarchy
    report = {
        "hierarchical": hierarchy is not None,
        "local": None if hierarchy is None else [hierarchy.local.rank, hierarchy.local.size],
        "cross": None if hierarchy is None else [hierarchy.cross.rank, hierarchy.cross.size],
        "channels": sorted(type(c).__name__ for c in api._state.session.world.transport.channels.values()),
        "checks": 0,
    }
    for dtype in ("float32", "float64", "int64", "float16"):
        for length in (0, 1, 3, 1001, 300_007):
            mine = (np.arange(length) % 5 + rank).astype(dtype)
            got = rt.allreduce(mine, op=rt.Sum)
            want = sum((np.arange(length) % 5 + r).astype(np.float64) for r in range(size))
            assert np.array_equal(got.astype(np.float64), want), (dtype, length)
            report["checks"] += 1
    fused = [rt.allreduce_async(np.full(7, rank + i, np.float32), op=rt.Average, name=f"f{i}") for i in range(5)]
    for i, handle in enumerate(fused):
        assert rt.synchronize(handle).tolist() == [sum(r + i for r in range(size)) / size] * 7
    print(json.dumps(report), flush=True)
    rt.shutdown()
    """
)


def test_hierarchical_allreduce_on_two_simulated_hosts(tmp_path):
    """Ranks 0-1 on "host A" and 2-3 on "host B": each rank's local ring is its host's two ranks
    over shared memory, its cross ring the same local rank on the other host over TCP, and
    allreduce results (several dtypes and lengths, fused requests) are exact."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    secret = new_secret()
    server = RendezvousServer("127.0.0.1", secret)
    procs = []
    try:
        for rank in range(4):
            host = "hostA" if rank < 2 else "hostB"
            env = rank_environment(rank=rank, size=4, local_rank=rank % 2, local_size=2, cross_rank=rank // 2,
                                   cross_size=2, rendezvous_addr=server.address, secret=secret, host_key=host,
                                   settings={"hierarchical_allreduce": True})
            procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        outputs = [proc.communicate(timeout=180) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        server.close()
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank}: {err[-3000:]}"
        report = json.loads(out.strip().splitlines()[-1])
        assert report["hierarchical"] is True
        assert report["local"] == [rank % 2, 2] and report["cross"] == [rank // 2, 2]
        assert report["channels"] == ["ShmChannel", "TcpChannel", "TcpChannel"]
        assert report["checks"] == 20
