"""spark_hvd.spark.run(): one barrier stage of ranks, on the module's local[2] session (conftest)."""

from __future__ import annotations

import dataclasses
import io
import os
import sys
import time
from typing import Any, Dict

import pytest

from spark_hvd.runner.errors import RankFailedError
from harness import is_alive, wait_until
from spark_hvd.spark.launch import barrier as runner
from spark_hvd.spark.launch import task as _task
from spark_hvd.spark.launch.barrier import run

SESSION_KINDS = ("classic", "connect")

CONTRACT = (
    "SPARK_HVD_RANK", "SPARK_HVD_SIZE", "SPARK_HVD_LOCAL_RANK", "SPARK_HVD_LOCAL_SIZE",
    "SPARK_HVD_CROSS_RANK", "SPARK_HVD_CROSS_SIZE", "SPARK_HVD_RENDEZVOUS_ADDR", "SPARK_HVD_SECRET",
    "SPARK_HVD_HOSTNAME", "SPARK_HVD_START_TIMEOUT", "HOROVOD_RANK", "EXTRA_FOR_TEST", "SPARK_HVD_TASK_CPUS",
)


# -- Pure checks: placement, slot and Python checks, error translation -------------------------


@pytest.mark.parametrize("hosts, expected", [
    (["a"], [(0, 0, 1, 0, 1)]),
    (["a", "a"], [(0, 0, 2, 0, 1), (1, 1, 2, 0, 1)]),
    # Ranks are grouped by host in order of first appearance; partition 0 stays rank 0.
    (["a", "b", "a", "b"], [(0, 0, 2, 0, 2), (2, 0, 2, 1, 2), (1, 1, 2, 0, 2), (3, 1, 2, 1, 2)]),
    # Uneven hosts: cross_* count the ranks with the same local_rank (Horovod's definition).
    (["a", "a", "b"], [(0, 0, 2, 0, 2), (1, 1, 2, 0, 1), (2, 0, 1, 1, 2)]),
])
def test_assign_ranks_groups_ranks_by_host(hosts, expected):
    """Each partition gets (rank, local_rank, local_size, cross_rank, cross_size) as Horovod defines them."""
    placements = _task.assign_ranks(hosts)
    assert [(p.rank, p.local_rank, p.local_size, p.cross_rank, p.cross_size) for p in placements] == expected


class _FakeResource:
    def __init__(self, addresses):
        self.addresses = addresses


class _FakeContext:
    def __init__(self, resources):
        self._resources = resources

    def resources(self):
        return self._resources


@pytest.mark.parametrize("resources, use_gpu, local_rank, expected", [
    ({"gpu": _FakeResource(["3"])}, None, 1, "3"),      # Spark's assignment wins
    ({"gpu": _FakeResource(["2", "5"])}, True, 0, "2,5"),
    ({}, True, 1, "1"),                                 # no assignment: the local rank's GPU
    ({}, None, 1, None),                                # nothing assigned, nothing asked: untouched
    ({"gpu": _FakeResource(["3"])}, False, 0, None),    # use_gpu=False leaves CUDA_VISIBLE_DEVICES alone
])
def test_gpu_devices_follow_spark_then_local_rank(resources, use_gpu, local_rank, expected):
    """CUDA_VISIBLE_DEVICES comes from the task's Spark GPU, else local_rank when use_gpu=True."""
    assert _task._gpu_devices(_FakeContext(resources), use_gpu, local_rank) == expected


def test_available_devices_are_the_gpus_spark_gave_the_task(monkeypatch):
    """Horovod's get_available_devices(): the task's Spark GPU addresses, handed to the rank in its
    environment whether or not use_gpu sets CUDA_VISIBLE_DEVICES."""
    from spark_hvd.spark.task import _TASK_GPUS, get_available_devices

    assert _TASK_GPUS == _task.TASK_GPUS_VARIABLE
    assert _task.task_gpus(_FakeContext({"gpu": _FakeResource(["1", "3"])})) == ["1", "3"]
    assert _task.task_gpus(_FakeContext({})) == []
    monkeypatch.setenv(_TASK_GPUS, "1,3")
    assert get_available_devices() == ["1", "3"]
    monkeypatch.setenv(_TASK_GPUS, "")
    assert get_available_devices() == []


def test_check_slots_names_both_numbers_and_the_setting():
    """Too few slots raise ValueError naming num_proc, the slot count and what to change."""
    runner.check_slots(2, 2, "local[2]")
    with pytest.raises(ValueError, match=r"num_proc=3 but the cluster has 2 task slots.*local\[3\]"):
        runner.check_slots(3, 2, "local[2]")
    with pytest.raises(ValueError, match=r"num_proc=5 but the cluster has 4 task slots.*spark\.executor\.cores"):
        runner.check_slots(5, 4, "spark://127.0.0.1:7077")
    with pytest.raises(ValueError, match=r"num_proc=2 but the cluster has 0 task slots.*add executors"):
        runner.check_slots(2, 0, "local-cluster[1,2,1024]")  # executors of its own, like a cluster's


def test_check_executor_python_names_pyspark_python(tmp_path):
    """A task Python that cannot import spark_hvd is refused in local mode with advice naming PYSPARK_PYTHON."""
    fake = tmp_path / "python-without-spark-hvd"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(ValueError, match="PYSPARK_PYTHON"):
        runner.check_executor_python(str(fake), "local[2]", {"PATH": os.defpath})
    runner.check_executor_python(sys.executable, "local[2]", {"PATH": os.defpath})
    # Executors of a cluster live elsewhere; the driver cannot probe them.
    runner.check_executor_python(str(fake), "spark://127.0.0.1:7077", {"PATH": os.defpath})


def test_spark_error_text_is_translated_when_no_rank_reported():
    """Without a reported failure, the rank is read from Spark's message, and a missing package gets advice."""
    error = runner._rank_error(None, RuntimeError(
        "Job aborted ... RuntimeError: " + _task.failure_summary(1, {"type": "KeyError", "message": "'x'"})))
    assert isinstance(error, RankFailedError) and error.rank == 1 and error.exc_type == "KeyError"
    missing = runner._rank_error(None, RuntimeError("ModuleNotFoundError: No module named 'spark_hvd'"))
    assert isinstance(missing, ValueError) and "PYSPARK_PYTHON" in str(missing)
    # Spark's own refusal, as a Connect client sees it when the slots could not be read before.
    slots = runner._rank_error(None, RuntimeError("[SPARK-24819]: Barrier execution mode does not allow run a "
                                                  "barrier stage that requires more slots ... JVM stacktrace: "
                                                  "org.apache.spark.scheduler.BarrierJobSlotsNumberCheckFailed"))
    assert isinstance(slots, ValueError) and "fewer task slots than num_proc" in str(slots)
    assert "JVM" not in str(slots)


def test_run_without_a_session_says_how_to_create_one(monkeypatch):
    """With no active SparkSession, run() raises ValueError naming SparkSession.builder."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    monkeypatch.setattr(SparkSession, "getActiveSession", classmethod(lambda cls: None))
    monkeypatch.setattr(SparkContext, "_active_spark_context", None)
    monkeypatch.setattr(SparkSession, "_instantiatedSession", None)
    with pytest.raises(ValueError, match=r"needs an active SparkSession.*SparkSession\.builder"):
        run(lambda: 0, num_proc=1)


# -- Jobs on the shared session ----------------------------------------------------------------


def _report_contract(tag: str) -> Dict[str, Any]:
    from spark_hvd.runtime import config

    from spark_hvd.spark.estimator.training import rank_threads

    from spark_hvd.spark.task import get_available_devices

    env = config.environ_snapshot()
    return {"tag": tag, "pid": os.getpid(), "threads": rank_threads(1), "devices": get_available_devices(),
            **{key: env.get(key) for key in CONTRACT}}


def test_results_come_back_in_rank_order_with_the_worker_contract(spark):
    """Every rank returns what it saw; results are in rank order and the env contract is complete."""
    results = run(_report_contract, args=("hi",), num_proc=2, start_timeout=42, env={"EXTRA_FOR_TEST": "yes"},
                  use_gpu=False, verbose=0)
    assert [r["SPARK_HVD_RANK"] for r in results] == ["0", "1"]
    assert [r["HOROVOD_RANK"] for r in results] == ["0", "1"]
    for rank, seen in enumerate(results):
        assert seen["tag"] == "hi"
        assert seen["SPARK_HVD_SIZE"] == "2"
        assert (seen["SPARK_HVD_LOCAL_RANK"], seen["SPARK_HVD_LOCAL_SIZE"]) == (str(rank), "2")
        assert (seen["SPARK_HVD_CROSS_RANK"], seen["SPARK_HVD_CROSS_SIZE"]) == ("0", "1")
        assert seen["SPARK_HVD_HOSTNAME"] == "127.0.0.1"
        assert seen["SPARK_HVD_START_TIMEOUT"] == "42"
        assert seen["EXTRA_FOR_TEST"] == "yes"
        assert seen["devices"] == []  # local[2] schedules no GPUs
        assert len(seen["SPARK_HVD_SECRET"]) == 64
        # The task's CPUs (spark.task.cpus, 1 here): the rank's math threads, even where it would
        # be alone on its host.
        assert (seen["SPARK_HVD_TASK_CPUS"], seen["threads"]) == ("1", 1)
    # One rendezvous server and one secret for the whole job; a fresh process per rank.
    assert results[0]["SPARK_HVD_RENDEZVOUS_ADDR"] == results[1]["SPARK_HVD_RENDEZVOUS_ADDR"]
    assert results[0]["SPARK_HVD_RENDEZVOUS_ADDR"].startswith("127.0.0.1:")
    assert results[0]["SPARK_HVD_SECRET"] == results[1]["SPARK_HVD_SECRET"]
    assert results[0]["pid"] != results[1]["pid"] and os.getpid() not in (results[0]["pid"], results[1]["pid"])


def _talk() -> int:
    from spark_hvd.runtime import config

    rank = config.read_setting("rank")
    print(f"hello from rank {rank}")
    print(f"warning from rank {rank}", file=sys.stderr)
    return rank


def test_output_lines_reach_the_driver_with_rank_prefixes(spark, capfd):
    """Ranks' stdout and stderr lines arrive on the given files as [rank]<stream>:line; verbose=0 prints none."""
    out, err = io.StringIO(), io.StringIO()
    assert run(_talk, use_gpu=False, stdout=out, stderr=err) == [0, 1]  # num_proc defaults to 2 slots
    assert sorted(out.getvalue().splitlines()) == ["[0]<stdout>:hello from rank 0", "[1]<stdout>:hello from rank 1"]
    assert sorted(err.getvalue().splitlines()) == [
        "[0]<stderr>:warning from rank 0", "[1]<stderr>:warning from rank 1"]

    capfd.readouterr()
    assert run(_talk, num_proc=2, use_gpu=False, verbose=0) == [0, 1]
    captured = capfd.readouterr()
    assert "hello from rank" not in captured.out + captured.err


def _fail_on_rank_1(pid_file: str) -> None:
    from spark_hvd.runtime import config

    if config.read_setting("rank") == 0:
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(pid_file + ".tmp", pid_file)
        time.sleep(300)  # only Spark aborting the stage ends this rank
        return
    deadline = time.monotonic() + 120
    while not os.path.exists(pid_file) and time.monotonic() < deadline:
        time.sleep(0.05)
    raise ValueError("boom on rank 1")


def test_exception_on_rank_1_is_raised_on_the_driver_and_stops_rank_0(spark, tmp_path):
    """Rank 1's exception surfaces as RankFailedError naming rank 1 and its message; rank 0's process dies."""
    pid_file = str(tmp_path / "rank0.pid")
    started = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run(_fail_on_rank_1, args=(pid_file,), num_proc=2, use_gpu=False, verbose=0)
    print(f"rank failure reached the driver after {time.monotonic() - started:.1f} s")
    error = info.value
    assert error.rank == 1
    assert error.exc_type == "ValueError"
    assert "rank 1" in str(error) and "boom on rank 1" in str(error)
    assert "_fail_on_rank_1" in error.remote_traceback
    assert isinstance(error.original, ValueError) and str(error.original) == "boom on rank 1"

    rank0_pid = int(open(pid_file).read())
    assert wait_until(lambda: not is_alive(rank0_pid), 60.0), "rank 0's process outlived the failed job"
    print(f"rank 0's process was gone {time.monotonic() - started:.1f} s after the call began")


def _crash_on_rank_1() -> int:
    import signal

    from spark_hvd.runtime import config

    rank = config.read_setting("rank")
    if rank == 1:
        print("rank 1 about to crash", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def test_a_crashed_rank_process_is_reported_with_its_signal_and_output(spark):
    """A rank process that dies without raising yields RankFailedError naming the signal and its last output."""
    with pytest.raises(RankFailedError) as info:
        run(_crash_on_rank_1, num_proc=2, use_gpu=False, verbose=0)
    error = info.value
    assert error.rank == 1 and error.exc_type is None
    assert "killed by signal SIGKILL" in str(error)
    assert any("rank 1 about to crash" in line for line in error.output_tail)


def _configured_loggers() -> Dict[str, str]:
    from pyspark import SparkContext

    # the driver JVM of this process (under Spark Connect, the local server's)
    log4j = SparkContext._active_spark_context._jvm.org.apache.logging.log4j
    loggers = log4j.LogManager.getContext(False).getConfiguration().getLoggers()
    return {name: str(loggers.get(name).getLevel()) for name in loggers.keySet()}


def test_the_driver_logging_configuration_is_as_before_after_a_run_and_a_failed_run(spark):
    """While a stage runs the scheduler's task-failure logs are off; afterwards no logger keeps a
    level set for that (an explicit level would let the scheduler's INFO lines through the console
    filter of every later job)."""
    before = _configured_loggers()
    run(_talk, num_proc=2, use_gpu=False, verbose=0)
    with pytest.raises(RankFailedError):
        run(_crash_on_rank_1, num_proc=2, use_gpu=False, verbose=0)
    assert _configured_loggers() == before


@pytest.mark.parametrize("call, error, pattern", [
    (dict(fn=42), TypeError, "fn must be callable"),
    (dict(fn=_talk, args=5), TypeError, "args must be a tuple or list"),
    (dict(fn=_talk, num_proc=0), ValueError, "num_proc=0 is invalid"),
    (dict(fn=_talk, start_timeout=0), ValueError, "start_timeout=0 is invalid"),
    (dict(fn=_talk, env={"X": 1}), ValueError, r"env\['X'\]=1 is invalid"),
])
def test_invalid_arguments_are_refused_before_submitting(spark, call, error, pattern):
    """Bad arguments raise TypeError/ValueError naming the value, without starting a stage."""
    with pytest.raises(error, match=pattern):
        run(**call)


def test_more_ranks_than_slots_fail_fast_naming_both_numbers(spark):
    """num_proc=3 on local[2] raises ValueError with both numbers before any stage is submitted."""
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"num_proc=3 but the cluster has 2 task slots") as info:
        run(_talk, num_proc=3, use_gpu=False)
    print(f"too-few-slots error after {time.monotonic() - started:.3f} s: {info.value}")
    assert "local[3]" in str(info.value)


def _allreduce_rank_plus_one() -> Any:
    import numpy as np

    import spark_hvd.runtime as rt

    rt.init()
    # No shutdown(): returning from fn with the runtime still up must end the rank cleanly too.
    return rt.allreduce(np.array([rt.rank() + 1.0]), op=rt.Sum)


def test_ranks_started_by_run_can_allreduce(spark):
    """Ranks placed by run() meet at the rendezvous and sum 1 + 2 = 3 on both ranks."""
    results = run(_allreduce_rank_plus_one, num_proc=2, start_timeout=60, use_gpu=False, verbose=0)
    assert [r.tolist() for r in results] == [[3.0], [3.0]]


def _return_early_on_rank_1(marker: str) -> int:
    import os

    import numpy as np

    import spark_hvd.runtime as rt
    from harness import wait_until

    rt.init()
    if rt.rank() == 1:
        rt.shutdown()
        open(marker, "w").close()
        return 1
    assert wait_until(lambda: os.path.exists(marker), 60.0), "rank 1 never left"
    rt.allreduce(np.ones(1), name="needs.rank.1")  # rank 1 has left: this fails
    return 0


def test_a_rank_that_returned_early_is_named_before_the_rank_that_lost_it(spark, tmp_path):
    """Rank 1 returns at once while rank 0 still needs it; rank 0 then fails for want of it. The
    driver names rank 1 first and gives rank 0's error as the reaction, as spark-hvd-run does."""
    with pytest.raises(RankFailedError) as info:
        run(_return_early_on_rank_1, args=(str(tmp_path / "rank1.left"),), num_proc=2)
    error = info.value
    assert error.rank == 1, error
    assert "rank 1 returned while the other ranks were still running" in str(error)
    assert error.reaction is not None and error.reaction.rank == 0
    assert "rank 1 has shut down" in error.reaction.summary, error.reaction.summary


def _task_hosts_at_the_rendezvous() -> Any:
    """The hosts the job's tasks put at the rendezvous, or the error of reading them."""
    from spark_hvd.runtime import config
    from spark_hvd.runtime.rendezvous import RendezvousClient

    client = RendezvousClient(config.read_setting("rendezvous_addr"), config.read_setting("secret"), 5.0)
    try:
        return client.get(["task/host/0", "task/host/1"], timeout=0.5, what="task hosts")
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        client.close()


def test_tasks_meet_at_the_jobs_rendezvous_without_sparks_allgather(spark):
    """The tasks place their ranks through the job's rendezvous server (the driver's on a classic
    session, partition 0's on Connect, its address passed through the store), not through Spark's
    allGather and barrier, each of which Spark answers a second late: every rank finds every task's
    host there."""
    results = run(_task_hosts_at_the_rendezvous, num_proc=2, verbose=0)
    assert results == [["127.0.0.1", "127.0.0.1"]] * 2


def test_exchange_hosts_returns_every_tasks_host_in_partition_order():
    """Three tasks that put their hosts at once each read all three, partition 0 first."""
    import threading

    from spark_hvd.runtime.rendezvous import RendezvousServer

    server = RendezvousServer("127.0.0.1", "ab" * 32)
    spec = _task.TaskSpec(num_proc=3, payload=b"", driver_sys_path=(), secret="ab" * 32, collector_address=None,
                          settings={"start_timeout": 10}, env={}, use_gpu=None, verbose=0,
                          rendezvous_address=server.address)
    seen: Dict[int, Any] = {}
    try:
        threads = [threading.Thread(target=lambda p=p: seen.__setitem__(
            p, _task._exchange_hosts(spec, server.address, p, f"h{p % 2}"))) for p in (2, 0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        server.close()
    assert seen == {p: ["h0", "h1", "h0"] for p in range(3)}


def test_exchange_hosts_names_the_tasks_that_never_arrived():
    """A task alone at the rendezvous fails after the start timeout, naming the missing partitions."""
    from spark_hvd.runtime.errors import RendezvousTimeout
    from spark_hvd.runtime.rendezvous import RendezvousServer

    server = RendezvousServer("127.0.0.1", "cd" * 32)
    spec = _task.TaskSpec(num_proc=3, payload=b"", driver_sys_path=(), secret="cd" * 32, collector_address=None,
                          settings={"start_timeout": 0.3}, env={}, use_gpu=None, verbose=0,
                          rendezvous_address=server.address)
    try:
        with pytest.raises(RendezvousTimeout, match=r"2 of 3 barrier tasks did not arrive at the rendezvous within "
                                                    r"0 s \(missing: task/host/1, task/host/2\).*START_TIMEOUT"):
            _task._exchange_hosts(spec, server.address, 0, "h0")
    finally:
        server.close()


def _warm_report() -> Dict[str, Any]:
    return {"parent": os.getppid(), "preloaded": "json.tool" in sys.modules, "rank": os.environ["SPARK_HVD_RANK"]}


def test_preloaded_ranks_of_later_jobs_fork_from_the_same_warm_processes(spark):
    """With preload, each rank is forked from a warm process of its task's Python worker that has
    imported the modules; a later job reuses those processes; SPARK_HVD_WARM_START=0 starts fresh
    interpreters, which have not imported them."""
    first = run(_warm_report, num_proc=2, verbose=0, preload=("json.tool",))
    second = run(_warm_report, num_proc=2, verbose=0, preload=("json.tool",))
    assert [r["rank"] for r in first] == ["0", "1"]
    assert all(r["preloaded"] for r in first + second)
    assert {r["parent"] for r in first} == {r["parent"] for r in second}
    assert len({r["parent"] for r in first}) == 2  # one warm process per task's Python worker
    cold = run(_warm_report, num_proc=2, verbose=0, preload=("json.tool",), env={"SPARK_HVD_WARM_START": "0"})
    assert not any(r["preloaded"] for r in cold)
    assert not {r["parent"] for r in cold} & {r["parent"] for r in first}


@pytest.mark.session_kinds("classic")
@pytest.mark.parametrize("preload", ["torch", ("torch", ""), (1,)])
def test_preload_must_be_a_sequence_of_module_names(spark, preload):
    with pytest.raises(ValueError, match=r"preload=.* is not valid: expected a sequence of module names"):
        run(_warm_report, num_proc=2, verbose=0, preload=preload)


def _connect_spec(tmp_path, secret, start_timeout=10):
    from spark_hvd.spark import Store

    store = Store.create(str(tmp_path / "store"))
    return _task.TaskSpec(num_proc=3, payload=b"", driver_sys_path=(), secret=secret, collector_address=None,
                          settings={"start_timeout": start_timeout}, env={}, use_gpu=None, verbose=0,
                          log_store=store, log_dir=store.join("jobs", "run-1"))


def test_partition_0_publishes_its_rendezvous_address_in_the_store_sealed(tmp_path):
    """What partition 0 leaves in the store is read back by the others; a file sealed with another
    secret is refused; with nothing published, the wait ends at the start timeout with the path."""
    spec = _connect_spec(tmp_path, "ef" * 32)
    _task._publish_rendezvous(spec, "10.0.0.7:4242")
    assert _task._published_rendezvous(spec) == "10.0.0.7:4242"
    with pytest.raises(Exception, match=r"seal|secret|authentic"):
        _task._published_rendezvous(dataclasses.replace(spec, secret="01" * 32))
    empty = dataclasses.replace(spec, log_dir=spec.log_store.join("jobs", "run-2"), settings={"start_timeout": 0.2})
    with pytest.raises(TimeoutError, match=r"partition 0 did not publish the job's rendezvous address at "
                                           r"\S*/jobs/run-2/rendezvous within 0 s.*SPARK_HVD_START_TIMEOUT"):
        _task._published_rendezvous(empty)


def test_partition_0_holds_the_rendezvous_until_every_other_task_is_done(tmp_path):
    """_part returns on partition 0 only once partitions 1 and 2 have said they are done."""
    import threading

    from spark_hvd.runtime.rendezvous import RendezvousServer

    spec = _connect_spec(tmp_path, "ab" * 32)
    server = RendezvousServer("127.0.0.1", spec.secret)
    try:
        holder = threading.Thread(target=_task._part, args=(spec, server.address, 0, server))
        holder.start()
        _task._part(spec, server.address, 1, None)
        holder.join(0.5)
        assert holder.is_alive()  # partition 2 has not said it is done
        _task._part(spec, server.address, 2, None)
        holder.join(10)
        assert not holder.is_alive()
    finally:
        server.close()
