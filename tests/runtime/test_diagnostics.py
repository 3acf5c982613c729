"""Timeline, stall inspector and mismatch errors, observed from real processes."""

import json

import numpy as np

import spark_hvd.runtime as rt


def _mismatches():
    rt.init()
    rank = rt.rank()
    messages = {}
    cases = {
        "shape": lambda: rt.allreduce(np.zeros(3 + rank, np.float32), name="bad.shape"),
        "dtype": lambda: rt.allreduce(np.zeros(3, np.float32 if rank == 0 else np.float64), name="bad.dtype"),
        "op": lambda: rt.allreduce(np.zeros(3), op=rt.Sum if rank == 0 else rt.Max, name="bad.op"),
        "root": lambda: rt.broadcast(np.zeros(2), root_rank=rank, name="bad.root"),
        "kind": lambda: (rt.allreduce(np.zeros(2), name="bad.kind") if rank == 0
                         else rt.allgather(np.zeros(2), name="bad.kind")),
        "trailing": lambda: rt.allgather(np.zeros((2, 2 + rank)), name="bad.trailing"),
    }
    for label, call in cases.items():
        try:
            call()
        except rt.RankMismatchError as exc:
            messages[label] = str(exc)
        else:
            raise AssertionError(f"{label}: no RankMismatchError")
        # The runtime stays usable after each failure.
        assert rt.allreduce(np.ones(2), op=rt.Sum).tolist() == [rt.size()] * 2
    rt.shutdown()
    return messages


def test_mismatch_fails_every_rank_with_a_listing(launch):
    """Disagreeing shape/dtype/op/root/kind fail on every rank with each rank's value listed,
    and the next operation works."""
    results = launch(_mismatches, np=2)
    for messages in results:
        assert "rank 0: (3,)" in messages["shape"] and "rank 1: (4,)" in messages["shape"]
        assert "rank 0: float32" in messages["dtype"] and "rank 1: float64" in messages["dtype"]
        assert "rank 0: Sum" in messages["op"] and "rank 1: Max" in messages["op"]
        assert "root ranks differ" in messages["root"]
        assert "rank 0: allreduce" in messages["kind"] and "rank 1: allgather" in messages["kind"]
        assert "shapes after the first dimension" in messages["trailing"]
    assert results[0] == results[1]


def _timeline_job(second_path):
    rt.init()
    for step in range(3):
        handles = [rt.allreduce_async(np.full(5000, step, np.float32), name=f"grad.{i}") for i in range(4)]
        rt.allreduce_async(np.ones(3), name="small").wait()  # answered inside the negotiation messages
        rt.allreduce(np.ones(2), name="in.order")  # blocking: exchanged in program order, not negotiated
        for h in handles:
            rt.synchronize(h)
    rt.allgather(np.zeros((2, 2)), name="gathered")
    rt.start_timeline(second_path)  # switch files at run time
    rt.allreduce(np.ones(8), name="after.switch")
    rt.stop_timeline()
    rt.allreduce(np.ones(8), name="not.recorded")
    rt.shutdown()
    return rt.__name__


def test_timeline_is_chrome_trace_with_phases(launch, tmp_path):
    """Rank 0 writes valid JSON trace events with per-tensor phases; start/stop at run time work."""
    first, second = tmp_path / "timeline.json", tmp_path / "second.json"
    launch(_timeline_job, np=2, args=(str(second),), settings={"timeline": str(first)})
    events = json.loads(first.read_text())
    names = {e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    assert {"grad.0", "grad.3", "gathered", "small"} <= names
    small_pid = next(e["pid"] for e in events if e.get("ph") == "M" and e.get("args", {}).get("name") == "small")
    assert any(e.get("args", {}).get("eager") for e in events if e.get("pid") == small_pid and e.get("ph") == "X")
    in_order = next(e["pid"] for e in events if e.get("ph") == "M" and e.get("args", {}).get("name") == "in.order")
    spans = [e for e in events if e.get("pid") == in_order and e.get("ph") == "X"]
    assert len(spans) == 3 and all(e["name"] == "REDUCE" and e["args"]["program_order"] for e in spans), spans
    phases = {e["name"] for e in events if e.get("ph") == "X"}
    assert {"NEGOTIATE", "QUEUE", "MEMCPY_IN_FUSION_BUFFER", "REDUCE", "MEMCPY_OUT_FUSION_BUFFER"} <= phases
    assert all(e["dur"] >= 0 and "ts" in e for e in events if e.get("ph") == "X")
    later = json.loads(second.read_text())
    later_names = {e["args"]["name"] for e in later if e.get("ph") == "M" and e["name"] == "process_name"}
    assert later_names == {"after.switch"}


def _stall_job():
    import time
    rt.init()
    if rt.rank() == 1:
        time.sleep(3.0)
    rt.allreduce(np.ones(4), name="late.tensor")
    rt.shutdown()


def test_stall_warning_names_tensor_and_missing_rank(launch, capfd):
    """A request waiting longer than the stall check time is reported with the ranks missing."""
    launch(_stall_job, np=2, settings={"stall_check_seconds": 1.0})
    err = capfd.readouterr()
    text = err.out + err.err
    assert "spark-hvd stall" in text
    assert "'late.tensor'" in text and "missing rank(s) [1]" in text and "submitted by rank(s) [0]" in text


def _stall_shutdown_job():
    import time
    rt.init()
    if rt.rank() == 1:
        time.sleep(4.0)
        try:
            rt.barrier()
        except rt.CollectiveError as exc:
            return "rank1: " + str(exc)
        return "rank1: no error"
    try:
        rt.allreduce(np.ones(4), name="never.answered")
    except rt.CollectiveError as exc:
        return "rank0: " + str(exc)
    return "rank0: no error"


def test_stall_shutdown_fails_every_rank(launch):
    """With a stall shutdown time, the stalled operation fails on every rank instead of hanging."""
    results = launch(_stall_shutdown_job, np=2, settings={"stall_check_seconds": 0.5, "stall_shutdown_seconds": 1.5})
    assert results[0].startswith("rank0: stalled operations exceeded"), results[0]
    assert "'never.answered'" in results[0]
    assert results[1].startswith("rank1: ") and "no error" not in results[1], results[1]


def _affinity():
    import os
    rt.init()
    cpus = sorted(os.sched_getaffinity(0))
    total = rt.allreduce(np.ones(1), op=rt.Sum)[0]
    rt.shutdown()
    return cpus, total


def test_bind_cpus_gives_ranks_disjoint_cpus(launch):
    """With bind_cpus, each local rank runs on its own share of the CPUs and collectives still work."""
    import os

    usable = len(os.sched_getaffinity(0))
    results = launch(_affinity, np=2, settings={"bind_cpus": True})
    (cpus0, total0), (cpus1, total1) = results
    assert total0 == total1 == 2.0
    if usable >= 2:
        assert cpus0 and cpus1 and not set(cpus0) & set(cpus1)
        assert len(cpus0) == len(cpus1) == usable // 2


def _dynamic_timeline(path):
    import os

    rt.init()
    rt.allreduce(np.ones(2), name="before.start")
    created_early = sorted(os.listdir("."))
    rt.start_timeline(path)
    rt.allreduce(np.ones(2), name="after.start")
    rt.stop_timeline()
    rt.shutdown()
    return created_early


def test_dynamic_timeline_writes_nothing_until_started(launch, tmp_path):
    """HOROVOD_TIMELINE=DYNAMIC (as Horovod's own tests set it) creates no file until
    start_timeline() is called, which then writes the operations that follow."""
    work = tmp_path / "cwd"
    work.mkdir()
    path = str(tmp_path / "trace.json")
    import os

    old = os.getcwd()
    os.chdir(work)  # ranks inherit the working directory: a file named DYNAMIC would land here
    try:
        results = launch(_dynamic_timeline, np=2, args=(path,), env={"HOROVOD_TIMELINE": "DYNAMIC"})
    finally:
        os.chdir(old)
    assert results[0] == [] and not os.listdir(work)
    names = {e["args"]["name"] for e in json.loads(open(path).read()) if e.get("name") == "process_name"}
    assert "after.start" in names and "before.start" not in names
