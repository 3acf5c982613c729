"""A lost peer surfaces as CollectiveError on every other rank in bounded time; strangers are
rejected without disturbing a running job."""

import json
import sys
import textwrap

import pytest

from harness import rank_processes
from spark_hvd.runtime.config import new_secret

VICTIM = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    import numpy as np
    import spark_hvd.runtime as rt

    out_dir, victim, payload = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rt.init()
    rank = rt.rank()
    data = np.ones(payload, np.float32)
    rt.allreduce(data, name="warmup")
    if rank == victim:
        def die():
            time.sleep(1.0)
            with open(os.path.join(out_dir, "killed"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=die, daemon=True).start()
    errors = []
    step = 0
    try:
        while True:
            rt.allreduce(data, out=data, op=rt.Sum, name=f"step.{step % 4}")
            data.fill(1.0)
            step += 1
    except rt.CollectiveError as exc:
        errors.append((time.time(), str(exc), exc.lost_rank))
    # Later operations fail at once as well.
    started = time.time()
    try:
        rt.barrier()
    except rt.CollectiveError as exc:
        errors.append((time.time() - started, str(exc), exc.lost_rank))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"errors": errors, "steps": step}, f)
    """
)


def _run_job(tmp_path, size, victim, payload, settings=None):
    script = tmp_path / "victim.py"
    script.write_text(VICTIM)
    with rank_processes(size, [sys.executable, str(script), str(tmp_path), str(victim), str(payload)],
                        settings) as procs:
        for proc in procs:
            proc.wait(timeout=60)
    killed_at = float((tmp_path / "killed").read_text())
    reports = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(size) if r != victim}
    return killed_at, reports, [p.returncode for p in procs]


@pytest.mark.parametrize("payload", [1, 2_000_000], ids=["small", "8MiB-in-flight"])
def test_killed_peer_fails_survivors_quickly(tmp_path, payload):
    """SIGKILL of rank 1 in a 3-rank job: ranks 0 and 2 raise CollectiveError naming rank 1 well
    under the default peer timeout, later operations fail at once, and every process exits."""
    killed_at, reports, codes = _run_job(tmp_path, 3, victim=1, payload=payload)
    assert codes[0] == 0 and codes[2] == 0 and codes[1] != 0
    for rank, report in reports.items():
        (failed_at, message, lost), (later_seconds, later_message, _) = report["errors"]
        print(f"rank {rank}: lost peer surfaced after {failed_at - killed_at:.3f} s: {message}")
        assert failed_at - killed_at < 10.0
        assert "rank 1" in message, message
        assert lost == 1
        assert later_seconds < 5.0 and later_message  # failed at once, not after a timeout


def _stranger_job():
    import socket

    import numpy as np

    import spark_hvd.runtime as rt
    from spark_hvd.runtime.errors import AuthenticationError
    from spark_hvd.runtime.rendezvous import RendezvousClient
    from spark_hvd.runtime.config import read_setting

    rt.init()
    outcomes = []
    total = 0.0
    for step in range(50):
        if rt.rank() == 0 and step == 10:
            addr = read_setting("rendezvous_addr")
            host, port = addr.rsplit(":", 1)
            # 1. A client with the wrong secret is refused.
            try:
                RendezvousClient(addr, new_secret(), timeout=2.0)
                outcomes.append("wrong secret accepted")
            except AuthenticationError:
                outcomes.append("wrong secret refused")
            # 2. Garbage instead of a handshake: the server hangs up without reading a request.
            raw = socket.create_connection((host, int(port)), timeout=5)
            raw.recv(32)  # the server's challenge
            raw.sendall(b"\x80\x05not a pickle, not a proof" * 4)
            try:
                closed = raw.recv(100) == b""
            except ConnectionResetError:
                closed = True
            outcomes.append("garbage closed" if closed else "garbage answered")
            raw.close()
        total += float(rt.allreduce(np.array([1.0]), op=rt.Sum, name="work")[0])
    rt.shutdown()
    return outcomes, total


def test_unauthenticated_connections_are_rejected_during_a_job(launch):
    """During a running job, a wrong-secret client and a garbage sender are turned away by the
    rendezvous server and the job's collectives still complete with correct results."""
    results = launch(_stranger_job, np=2)
    assert results[0][0] == ["wrong secret refused", "garbage closed"]
    assert [r[1] for r in results] == [100.0, 100.0]
