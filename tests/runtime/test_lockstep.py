"""The program-order path (``allreduce_lockstep``, and blocking allreduces), over one host's
shared-memory mailboxes and over TCP links between hosts: the same results as the negotiated
allreduce, a mismatch fails every rank (blocking allreduces in another order go negotiated instead),
a joined rank sends the others back to the negotiated path, and a lost or stalled peer ends the
wait with CollectiveError."""

import json
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from harness import assert_passed, launch, rank_processes


def _data(rank, dtype, n=1000):
    return ((np.arange(n) % 17) * (rank + 1) - 5.0 * rank).astype(dtype)


def matches_the_negotiated_allreduce(hvd, rank, size):
    """Every dtype and op, with pre- and postscale factors: the fast path's result is the bits the
    negotiated allreduce gives, on every rank; a world of one has no fast path."""
    done = 0
    for dtype in (np.float32, np.float64, np.float16):
        for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max):
            for pre, post in ((1.0, 1.0), (0.5, 3.0)):
                fast = _data(rank, dtype)
                handle = hvd.allreduce_lockstep(fast, op=op, name="grads", prescale_factor=pre,
                                                postscale_factor=post)
                if size == 1:
                    assert handle is None
                    continue
                assert handle is not None
                assert handle.wait() is fast
                slow = hvd.allreduce_async(_data(rank, dtype), op=op, name="slow", prescale_factor=pre,
                                           postscale_factor=post).wait()
                assert fast.tobytes() == slow.tobytes(), (dtype, op, pre, post, fast[:5], slow[:5])
                done += 1
    return done


def many_steps_in_a_row(hvd, rank, size):
    """A thousand steps, alternating between the two slots, each with the right sum."""
    if size == 1:
        return 0
    buf = np.empty(6209, np.float32)
    for step in range(1000):
        buf.fill(step + rank)
        assert hvd.allreduce_lockstep(buf, op=hvd.Sum, name="grads") is not None
        expected = size * step + size * (size - 1) / 2
        assert buf[0] == expected and buf[-1] == expected, (step, buf[0], expected)
    return 1000


def what_takes_the_negotiated_path(hvd, rank, size):
    """Over the byte limit, integer dtypes, Product and process sets: None, the array untouched."""
    cases = [(np.ones(300_000, np.float32), hvd.Sum, None), (np.ones(8, np.int64), hvd.Sum, None),
             (np.ones(8, np.float32), hvd.Product, None)]
    if size > 1:
        cases.append((np.ones(8, np.float32), hvd.Sum, hvd.add_process_set(list(range(size)))))
    for array, op, ps in cases:
        before = array.copy()
        kwargs = {"process_set": ps} if ps is not None else {}
        assert hvd.allreduce_lockstep(array, op=op, name="big", **kwargs) is None
        assert np.array_equal(array, before)
    return len(cases)


def _steps(hvd):
    """How many requests the session's program-order path has reduced (None: it has none)."""
    from spark_hvd.runtime.api import _session

    lockstep = _session().lockstep
    return None if lockstep is None else lockstep.reduced


def blocking_allreduces_take_it(hvd, rank, size):
    """A blocking allreduce is a step of the program-order path: a new array, ``out`` given or the
    input itself, every op; unnamed ones keep drawing the same names as the negotiated path's (an
    unnamed asynchronous one after them still matches); torch's blocking allreduces take it too.
    Integers, Product, process sets and asynchronous requests are negotiated."""
    import torch

    import spark_hvd.torch as thvd

    if size == 1:
        return 0
    before = _steps(hvd)
    x = _data(rank, np.float32, 10)
    expected = sum(_data(r, np.float32, 10) for r in range(size))
    got = hvd.allreduce(x, op=hvd.Sum)
    assert got is not x and np.array_equal(got, expected) and np.array_equal(x, _data(rank, np.float32, 10))
    out = np.empty_like(x)
    assert hvd.allreduce(x, op=hvd.Average, out=out) is out and np.allclose(out, expected / size)
    assert hvd.allreduce(x, op=hvd.Max, name="inplace", out=x) is x
    assert np.array_equal(x, np.maximum.reduce([_data(r, np.float32, 10) for r in range(size)]))
    assert float(hvd.allreduce(np.array([rank], np.float64), op=hvd.Min)[0]) == 0.0
    assert _steps(hvd) == before + 4
    grouped = hvd.grouped_allreduce([np.ones(2, np.float32)], op=hvd.Sum)  # a list, negotiated
    assert isinstance(grouped, list) and len(grouped) == 1 and float(grouped[0][0]) == size, grouped
    assert float(hvd.allreduce_async(np.ones(1, np.float32), op=hvd.Sum).wait()[0]) == size
    assert int(hvd.allreduce(np.ones(3, np.int64), op=hvd.Sum)[0]) == size
    assert float(hvd.allreduce(np.full(1, 2.0, np.float32), op=hvd.Product)[0]) == 2.0 ** size
    assert _steps(hvd) == before + 4
    tensor = torch.full((3,), float(rank + 1))
    assert torch.equal(thvd.allreduce(tensor, op=thvd.Sum), torch.full((3,), float(sum(range(1, size + 1)))))
    assert thvd.allreduce_(tensor, op=thvd.Sum) is tensor and float(tensor[0]) == sum(range(1, size + 1))
    assert _steps(hvd) == before + 6
    return _steps(hvd) - before


def the_same_bytes_in_another_shape_fail(hvd, rank, size):
    """Blocking allreduces of the same bytes in different shapes (rank 0 a matrix, the others a cube):
    the negotiated path's shape check fails every rank, as Horovod's does; the next request works."""
    if size == 1:
        return None
    shape = (4, 6) if rank == 0 else (2, 3, 4)
    try:
        hvd.allreduce(np.ones(shape, np.float32), name="shaped")
    except hvd.RankMismatchError as exc:
        message = str(exc)
    else:
        raise AssertionError("no error for different shapes")
    assert float(hvd.allreduce(np.ones(1, np.float32), op=hvd.Sum, name="after.shaped")[0]) == size
    return message


def blocking_allreduces_in_another_order_go_negotiated(hvd, rank, size):
    """Two threads of each rank make blocking allreduces, in one order on rank 0 and the other on
    the others (as Horovod's negotiation allows): no error, every result right. Whether the next
    blocking allreduce takes the program-order path again (on one host it does; over the links,
    which cannot go on from such a step, it is negotiated)."""
    import threading
    import time

    if size == 1:
        return None
    results = {}

    def reduce(name, delay):
        time.sleep(delay)
        results[name] = float(hvd.allreduce(np.full(4, rank + 1.0, np.float32), op=hvd.Sum, name=name)[0])

    first, second = ("a", "b") if rank == 0 else ("b", "a")
    threads = [threading.Thread(target=reduce, args=(first, 0.0)), threading.Thread(target=reduce, args=(second, 0.3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    total = float(sum(range(1, size + 1)))
    assert results == {"a": total, "b": total}, results
    steps = _steps(hvd)
    assert float(hvd.allreduce(np.ones(1, np.float32), op=hvd.Sum, name="after")[0]) == size
    return _steps(hvd) == steps + 1


def a_blocking_allreduce_meets_a_negotiated_one(hvd, rank, size):
    """Rank 0 makes a blocking allreduce (program order) where the others make the same request
    asynchronously and wait for it (negotiated): the others decline rank 0's step after a while, so
    every rank ends up negotiating it, with the right result and no error; the path then stays off.
    The seconds rank 0 waited."""
    import time

    if size == 1:
        return None
    data = np.full(4, rank + 1.0, np.float32)
    start = time.monotonic()
    if rank == 0:
        got = hvd.allreduce(data, op=hvd.Sum, name="either")
    else:
        got = hvd.allreduce_async(data, op=hvd.Sum, name="either").wait(timeout=60)
    waited = time.monotonic() - start
    assert float(got[0]) == sum(range(1, size + 1)), got
    steps = _steps(hvd)
    assert float(hvd.allreduce(np.ones(1, np.float32), op=hvd.Sum, name="after")[0]) == size
    assert _steps(hvd) == steps  # negotiated
    return waited


def test_fast_path_results_and_limits():
    """At np=2 and np=3, each of the checks above on every rank, in one world per size."""
    checks = [matches_the_negotiated_allreduce, many_steps_in_a_row, what_takes_the_negotiated_path,
              blocking_allreduces_take_it, the_same_bytes_in_another_shape_fail]
    for np_ in (1, 2, 3):
        results = launch(checks, np=np_, settings={"lockstep_bytes": 1 << 20})
        counts = assert_passed(results, matches_the_negotiated_allreduce)
        assert counts == [0 if np_ == 1 else 24] * np_
        assert assert_passed(results, many_steps_in_a_row) == [0 if np_ == 1 else 1000] * np_
        assert_passed(results, what_takes_the_negotiated_path)
        assert assert_passed(results, blocking_allreduces_take_it) == [0 if np_ == 1 else 6] * np_
        for message in assert_passed(results, the_same_bytes_in_another_shape_fail):
            assert np_ == 1 or "shape" in message, message


@pytest.mark.parametrize("np_", [2, 3])
def test_a_step_that_others_negotiate_is_declined(np_):
    results = launch([a_blocking_allreduce_meets_a_negotiated_one], np=np_)
    waited = assert_passed(results, a_blocking_allreduce_meets_a_negotiated_one)
    assert 0.3 < waited[0] < 10, waited


@pytest.mark.parametrize("np_", [2, 3])
def test_blocking_allreduces_in_another_order_are_negotiated(np_):
    results = launch([blocking_allreduces_in_another_order_go_negotiated], np=np_)
    assert assert_passed(results, blocking_allreduces_in_another_order_go_negotiated) == [True] * np_


def off_when_disabled_or_across_hosts(hvd, rank, size):
    return hvd.allreduce_lockstep(np.ones(8, np.float32), name="grads") is None


@pytest.mark.parametrize("settings", [{"lockstep_bytes": 0}, {"shm": False}], ids=["disabled", "no-shm"])
def test_no_fast_path_without_shared_memory_or_when_disabled(settings):
    """SPARK_HVD_LOCKSTEP_BYTES=0, or ranks that do not share memory: every request gets None."""
    results = launch([off_when_disabled_or_across_hosts], np=2, settings=settings)
    assert assert_passed(results, off_when_disabled_or_across_hosts) == [True, True]


def mismatch_fails_every_rank(hvd, rank, size):
    """Rank 0 reduces another request than the others at the same step: RankMismatchError on every
    rank, and from then on the negotiated path, which still works."""
    buf = np.ones(100 if rank == 0 else 50, np.float32)
    try:
        hvd.allreduce_lockstep(buf, op=hvd.Sum, name="grads")
    except hvd.RankMismatchError as exc:
        message = str(exc)
    else:
        raise AssertionError("no mismatch raised")
    assert hvd.allreduce_lockstep(np.ones(8, np.float32), name="grads") is None
    assert float(hvd.allreduce(np.ones(1), op=hvd.Sum, name="after")[0]) == size
    return message


def join_falls_back_everywhere(hvd, rank, size):
    """Rank 0 joins at once; the others' fast-path reduction returns None (it waited for a rank that
    joined), the negotiated one completes with rank 0 contributing zeros, and the fast path stays
    off on every rank after the join."""
    if rank == 0:
        hvd.join()
    else:
        buf = np.full(10, float(rank), np.float32)
        assert hvd.allreduce_lockstep(buf, op=hvd.Sum, name="grads") is None
        assert buf[0] == rank  # untouched
        out = hvd.allreduce(buf, op=hvd.Sum, name="grads")
        assert out[0] == sum(range(1, size)), out
        hvd.join()
    assert hvd.allreduce_lockstep(np.ones(8, np.float32), name="grads") is None
    return True


def test_a_mismatch_fails_every_rank_and_the_runtime_goes_on():
    results = launch([mismatch_fails_every_rank], np=2)
    messages = assert_passed(results, mismatch_fails_every_rank)
    for message in messages:
        assert "different request" in message and "SPARK_HVD_LOCKSTEP_BYTES=0" in message, message


@pytest.mark.parametrize("np_", [2, 3])
def test_a_joined_rank_sends_the_others_to_the_negotiated_path(np_):
    results = launch([join_falls_back_everywhere], np=np_)
    assert assert_passed(results, join_falls_back_everywhere) == [True] * np_


VICTIM = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    import numpy as np
    import spark_hvd.runtime as rt

    out_dir, victim, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rt.init()
    rank = rt.rank()
    data = np.ones(6209, np.float32)
    assert rt.allreduce_lockstep(data, op=rt.Sum, name="grads") is not None
    if rank == victim:
        if mode == "kill":
            time.sleep(1.0)
            open(os.path.join(out_dir, "at"), "w").write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        open(os.path.join(out_dir, "at"), "w").write(repr(time.time()))
        time.sleep(30)  # alive, but never arrives at the next step
        sys.exit(0)
    errors = []
    steps = 0
    try:
        while True:
            rt.allreduce_lockstep(data, op=rt.Sum, name="grads")
            steps += 1
    except rt.CollectiveError as exc:
        errors.append((time.time(), str(exc), exc.lost_rank))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"errors": errors, "steps": steps}, f)
    os._exit(0)
    """
)


@pytest.mark.parametrize("layout", ["one host", "three hosts"])
@pytest.mark.parametrize("mode", ["kill", "stall"])
def test_a_lost_or_stalled_peer_ends_the_wait(tmp_path, mode, layout):
    """Rank 1 of 3 is killed (or stops taking part, with a stall shutdown time of 2 s) while the
    others wait for its step, over the mailboxes or over the links between (simulated) hosts: they
    raise CollectiveError naming rank 1 in bounded time."""
    script = tmp_path / "victim.py"
    script.write_text(VICTIM)
    settings = {"stall_shutdown_seconds": 2.0} if mode == "stall" else {}

    def host(rank):
        return dict(local_rank=0, local_size=1, cross_rank=rank, cross_size=3, host_key=f"host{rank}")

    with rank_processes(3, [sys.executable, str(script), str(tmp_path), "1", mode], settings,
                        rank_options=host if layout == "three hosts" else None) as procs:
        for rank in (0, 2):
            procs[rank].wait(timeout=60)
    at = float((tmp_path / "at").read_text())
    for rank in (0, 2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        (failed_at, message, lost), = report["errors"]
        print(f"rank {rank} ({mode}): {failed_at - at:.2f} s: {message}")
        assert "rank 1" in message or lost == 1, message
        assert failed_at - at < (10.0 if mode == "kill" else 12.0)


# -- across hosts: the same checks over the TCP links, each rank its own (simulated) host ----------------
ACROSS_HOSTS = textwrap.dedent(
    """
    import json, os, sys
    sys.path[:0] = [sys.argv[3], os.path.dirname(sys.argv[3])]
    import test_lockstep
    from harness import run_checks

    out_dir, names = sys.argv[1], sys.argv[2].split(",")
    outcomes = run_checks([getattr(test_lockstep, n) for n in names])
    with open(os.path.join(out_dir, f"rank{os.environ['SPARK_HVD_RANK']}.json"), "w") as f:
        json.dump(outcomes, f)
    """
)


def _across_hosts(tmp_path, checks, size, settings=None):
    """Run ``checks`` in a world of ``size`` ranks, each on a host of its own (its own host key: TCP
    between every pair); each rank's outcomes."""
    script = tmp_path / "job.py"
    script.write_text(ACROSS_HOSTS)

    def host(rank):
        return dict(local_rank=0, local_size=1, cross_rank=rank, cross_size=size, host_key=f"host{rank}")

    command = [sys.executable, str(script), str(tmp_path), ",".join(c.__name__ for c in checks),
               str(Path(__file__).parent)]
    with rank_processes(size, command, settings, rank_options=host) as procs:
        for proc in procs:
            assert proc.wait(timeout=180) == 0
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(size)]


def over_the_links(hvd, rank, size):
    """The session's program-order path is the TCP links' (no mailboxes: the ranks share no host)."""
    from spark_hvd.runtime.api import _session

    lockstep = _session().lockstep
    return type(lockstep).__name__ if lockstep is not None else None


@pytest.mark.parametrize("np_", [2, 3])
def test_across_hosts_the_links_give_the_negotiated_results(tmp_path, np_):
    """Ranks on different hosts reduce through the program-order links: bit-equal to the negotiated
    allreduce for every dtype, op and scale, a thousand steps in a row, and the same limits."""
    checks = [over_the_links, matches_the_negotiated_allreduce, many_steps_in_a_row, what_takes_the_negotiated_path,
              blocking_allreduces_take_it]
    results = _across_hosts(tmp_path, checks, np_)
    assert assert_passed(results, over_the_links) == ["LinkLockstep"] * np_
    assert assert_passed(results, matches_the_negotiated_allreduce) == [24] * np_
    assert assert_passed(results, many_steps_in_a_row) == [1000] * np_
    assert_passed(results, what_takes_the_negotiated_path)
    assert assert_passed(results, blocking_allreduces_take_it) == [6] * np_


def test_across_hosts_a_mismatch_or_a_join_leaves_the_links(tmp_path):
    """Over the links too: a mismatch raises on every rank naming the other request and the runtime
    goes on negotiated; in a fresh world a rank that joins sends the others to the negotiated path."""
    messages = assert_passed(_across_hosts(tmp_path, [mismatch_fails_every_rank], 3), mismatch_fails_every_rank)
    for message in messages:
        assert "different request" in message and "program-order path" in message, message
    os.makedirs(tmp_path / "join")
    results = _across_hosts(tmp_path / "join", [join_falls_back_everywhere], 3)
    assert assert_passed(results, join_falls_back_everywhere) == [True] * 3
    os.makedirs(tmp_path / "order")
    check = blocking_allreduces_in_another_order_go_negotiated
    assert assert_passed(_across_hosts(tmp_path / "order", [check], 3), check) == [False] * 3
    os.makedirs(tmp_path / "decline")
    check = a_blocking_allreduce_meets_a_negotiated_one
    waited = assert_passed(_across_hosts(tmp_path / "decline", [check], 3), check)
    assert 0.3 < waited[0] < 10, waited


def test_across_hosts_no_links_when_disabled(tmp_path):
    """SPARK_HVD_LOCKSTEP_LINK_BYTES=0: no links, every request negotiated."""
    results = _across_hosts(tmp_path, [over_the_links, off_when_disabled_or_across_hosts], 2,
                            {"lockstep_link_bytes": 0})
    assert assert_passed(results, over_the_links) == [None, None]
    assert assert_passed(results, off_when_disabled_or_across_hosts) == [True, True]
