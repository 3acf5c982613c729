"""Hierarchical allreduce on CPU ranks: four ranks on two simulated hosts of this machine (shared
memory within a "host", TCP between them) reduce within the host, across hosts, then gather."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from harness import rank_processes

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


DEVICE_JOB = textwrap.dedent(
    """
    import json, os
    import numpy as np
    import fake_nccl
    import spark_hvd.runtime as rt
    from spark_hvd.runtime import device

    rt.init()
    rank, size = rt.rank(), rt.size()
    lib = fake_nccl.FakeNccl(os.environ["FAKE_NCCL_DIR"])
    device.register_device_ops("cuda", fake_nccl.NumpyDeviceOps())
    device._nccl, device._nccl_problem = lib, None
    checks = 0
    for dtype in ("float32", "float64", "int64"):
        for length in (1, 3, 1001, 100_003):
            mine = (np.arange(length) % 5 + rank).astype(dtype)
            out = np.empty_like(mine)
            rt.device_async("allreduce", [mine], [out], wire=dtype, op=rt.Sum, name=f"d.{dtype}.{length}").wait()
            want = sum((np.arange(length) % 5 + r).astype(np.float64) for r in range(size))
            assert np.array_equal(out.astype(np.float64), want), (dtype, length)
            checks += 1
    parts = [np.full(7, rank + i, np.float32) for i in range(5)]
    handles = [rt.device_async("allreduce", [p], [p], wire="float32", op=rt.Average, name=f"f{i}",
                               prescale_factor=3.0, postscale_factor=0.5) for i, p in enumerate(parts)]
    for i, handle in enumerate(handles):
        assert handle.wait().tolist() == [sum(r + i for r in range(size)) / size * 1.5] * 7
    comms = sorted(entry[2:] for entry in lib.log if entry[0] == "init")
    print(json.dumps({"checks": checks, "comms": comms}), flush=True)
    rt.shutdown()
    """
)


def _two_hosts(tmp_path, job: str, env_extra=None):
    """Run ``job`` as ranks 0-1 on "hostA" and 2-3 on "hostB", hierarchical allreduce on; return
    each rank's last output line as JSON."""
    script = tmp_path / "job.py"
    script.write_text(job)

    def host(rank):
        return dict(local_rank=rank % 2, local_size=2, cross_rank=rank // 2, cross_size=2,
                    host_key="hostA" if rank < 2 else "hostB")

    with rank_processes(4, [sys.executable, str(script)], {"hierarchical_allreduce": True}, rank_options=host,
                        extra_env=env_extra, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as procs:
        outputs = [proc.communicate(timeout=180) for proc in procs]
    reports = []
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank}: {err[-3000:]}"
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def test_hierarchical_allreduce_on_two_simulated_hosts(tmp_path):
    """Ranks 0-1 on "host A" and 2-3 on "host B": each rank's local ring is its host's two ranks
    over shared memory, its cross ring the same local rank on the other host over TCP, and
    allreduce results (several dtypes and lengths, fused requests) are exact."""
    for rank, report in enumerate(_two_hosts(tmp_path, JOB)):
        assert report["hierarchical"] is True
        assert report["local"] == [rank % 2, 2] and report["cross"] == [rank // 2, 2]
        assert report["channels"] == ["ShmChannel", "TcpChannel", "TcpChannel"]
        assert report["checks"] == 20


def test_hierarchical_allreduce_of_device_tensors(tmp_path):
    """The same two hosts with device tensors (the stand-in NCCL of fake_nccl.py): allreduce is an
    NCCL reduce-scatter within the host, the host ring across hosts, an NCCL allgather within the
    host; the only communicator made is the host's (2 ranks), and results are exact, fused and
    scaled ones included."""
    folder = tmp_path / "nccl"
    folder.mkdir()
    env = {"FAKE_NCCL_DIR": str(folder), "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent)] + sys.path)}
    for rank, report in enumerate(_two_hosts(tmp_path, DEVICE_JOB, env)):
        assert report["checks"] == 12
        assert report["comms"] == [[2, rank % 2]], report  # the host's communicator, nothing world-wide
