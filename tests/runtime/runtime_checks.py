"""Checks of the runtime's collectives that run inside launched worlds (see tests/harness.py).

Each is ``check(rt, rank, size)`` with ``rt`` the spark_hvd.runtime module; expected values come
from (rank, size) alone, and a failure raises AssertionError with a description.
"""

from __future__ import annotations

import time

import numpy as np

import spark_hvd.runtime as rt
from harness import adasum_reference

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8"]
OPS = [rt.Sum, rt.Average, rt.Min, rt.Max, rt.Product]
LENGTHS = [0, 1, 7, 1001, 300_007]  # empty, one element, not divisible by 2 or 3, several chunks


def to_wire(values: np.ndarray, dtype: str) -> np.ndarray:
    """Small integer-valued float64 values as an array of the wire dtype (bfloat16 as raw bits)."""
    if dtype == "bfloat16":
        return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return values.astype(dtype)


def from_wire(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (array.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return array.astype(np.float64)


def contribution(rank: int, length: int, op: int) -> np.ndarray:
    base = np.arange(length, dtype=np.float64)
    if op == rt.Product:
        return 1.0 + (base + rank) % 2  # stays small for int8 products
    return (base + 3 * rank) % 7


def expected_reduction(size: int, length: int, op: int, dtype: str) -> np.ndarray:
    stack = np.stack([contribution(r, length, op) for r in range(size)]) if length else np.zeros((size, 0))
    if op == rt.Sum:
        return stack.sum(0)
    if op == rt.Min:
        return stack.min(0)
    if op == rt.Max:
        return stack.max(0)
    if op == rt.Product:
        return stack.prod(0)
    total = stack.sum(0)
    return np.trunc(total / size) if dtype.startswith(("int", "uint")) else total / size


def tolerance(dtype: str, size: int) -> float:
    return {"float16": 2e-2, "bfloat16": 5e-2, "float32": 1e-6}.get(dtype, 1e-12) * size


def _close(got: np.ndarray, want: np.ndarray, dtype: str, size: int, what: str) -> None:
    got64 = from_wire(got, dtype)
    if dtype.startswith(("int", "uint")):
        assert np.array_equal(got64, want), f"{what}: got {got64[:8]} want {want[:8]}"
    else:
        assert np.allclose(got64, want, rtol=tolerance(dtype, size), atol=tolerance(dtype, size)), \
            f"{what}: got {got64[:8]} want {want[:8]}"


def allreduce_matrix(rt, rank: int, size: int) -> int:
    """Every op x dtype x length, in place and out of place; returns the number of cases."""
    cases = 0
    for dtype in DTYPES:
        for op in OPS:
            for length in LENGTHS:
                if length > 1001 and dtype not in ("float32", "bfloat16", "int64"):
                    continue  # the chunked path once per storage width is enough
                data = to_wire(contribution(rank, length, op), dtype)
                want = expected_reduction(size, length, op, dtype)
                extra = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
                what = f"allreduce {rt.ReduceOp(op).name} {dtype} n={length}"
                out = rt.allreduce(data, op=op, **extra)
                _close(out, want, dtype, size, what + " (out of place)")
                assert np.array_equal(data, to_wire(contribution(rank, length, op), dtype)), \
                    what + ": the input changed"
                inplace = data.copy()
                result = rt.allreduce(inplace, op=op, out=inplace, **extra)
                assert result is inplace or np.shares_memory(result, inplace), what + ": not in place"
                _close(inplace, want, dtype, size, what + " (in place)")
                cases += 2
    return cases


def scaled_allreduce(rt, rank: int, size: int) -> None:
    data = np.full(5, rank + 1.0, dtype=np.float32)
    out = rt.allreduce(data, op=rt.Sum, prescale_factor=2.0, postscale_factor=0.25)
    assert np.allclose(out, 0.5 * size * (size + 1) / 2), out
    ints = rt.allreduce(np.full(3, rank + 1, dtype=np.int32), op=rt.Average, postscale_factor=2.0)
    assert np.array_equal(ints, np.full(3, int(np.trunc(size * (size + 1) / 2 / size)) * 2)), ints


def allgather_cases(rt, rank: int, size: int) -> None:
    for dtype in DTYPES:
        mine = to_wire(np.full((rank, 3), rank, dtype=np.float64), dtype)  # rank 0 sends no rows
        extra = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
        got = rt.allgather(mine, **extra)
        want = np.concatenate([np.full((r, 3), r, dtype=np.float64) for r in range(size)])
        assert got.shape == want.shape, (dtype, got.shape, want.shape)
        _close(got.reshape(-1), want.reshape(-1), dtype, size, f"allgather {dtype}")
    big = rt.allgather(np.full(200_001 + rank, rank, dtype=np.float32))
    assert big.size == sum(200_001 + r for r in range(size))
    assert big[-1] == size - 1 and big[0] == 0
    scalar_rows = rt.allgather(np.array([rank], dtype=np.int64))
    assert scalar_rows.tolist() == list(range(size))
    grouped = rt.grouped_allgather([np.array([rank]), np.full((2, 2), rank, dtype=np.int8)])
    assert grouped[0].tolist() == list(range(size)) and grouped[1].shape == (2 * size, 2)


def broadcast_cases(rt, rank: int, size: int) -> None:
    for root in range(size):
        for dtype in ("float32", "int8", "bfloat16", "float64"):
            for length in (0, 1, 1001, 700_001):
                if length > 1001 and dtype != "float32":
                    continue
                mine = to_wire(np.arange(length, dtype=np.float64) % 50 + rank, dtype)
                extra = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
                got = rt.broadcast(mine, root_rank=root, **extra)
                want = np.arange(length, dtype=np.float64) % 50 + root
                _close(got, want, dtype, 1, f"broadcast root={root} {dtype} n={length}")
                inplace = mine.copy()
                rt.broadcast(inplace, root_rank=root, out=inplace, **extra)
                _close(inplace, want, dtype, 1, f"in-place broadcast root={root} {dtype}")


def alltoall_cases(rt, rank: int, size: int) -> None:
    for dtype in ("float32", "int64", "uint8", "bfloat16"):
        splits = [(rank + j) % 3 for j in range(size)]
        rows = [np.full((splits[j], 2), rank * 10 + j, dtype=np.float64) for j in range(size)]
        data = to_wire(np.concatenate(rows) if rows else np.zeros((0, 2)), dtype)
        extra = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
        got, received = rt.alltoall(data, splits=splits, **extra)
        want_splits = [(j + rank) % 3 for j in range(size)]
        assert received.tolist() == want_splits, (received, want_splits)
        want = np.concatenate([np.full((want_splits[j], 2), j * 10 + rank, dtype=np.float64) for j in range(size)])
        _close(got.reshape(-1), want.reshape(-1), dtype, 1, f"alltoall {dtype}")
    even, counts = rt.alltoall(np.arange(size * 2, dtype=np.int32) + 100 * rank)
    assert counts.tolist() == [2] * size
    assert even.tolist() == [100 * j + 2 * rank + k for j in range(size) for k in range(2)]


def reducescatter_cases(rt, rank: int, size: int) -> None:
    rows = 2 * size + 1
    for dtype in ("float32", "int32", "float16", "bfloat16"):
        for op in (rt.Sum, rt.Average, rt.Max):
            data = to_wire(np.arange(rows * 2, dtype=np.float64).reshape(rows, 2) % 5 + rank, dtype)
            extra = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
            got = rt.reducescatter(data, op=op, **extra)
            stack = np.stack([np.arange(rows * 2, dtype=np.float64).reshape(rows, 2) % 5 + r for r in range(size)])
            full = {rt.Sum: stack.sum(0), rt.Max: stack.max(0)}.get(op)
            if full is None:
                full = stack.sum(0) / size
                if dtype.startswith("int"):
                    full = np.trunc(full)
            counts = [rows // size + (1 if i < rows % size else 0) for i in range(size)]
            lo = sum(counts[:rank])
            want = full[lo:lo + counts[rank]]
            assert got.shape == want.shape, (got.shape, want.shape)
            _close(got.reshape(-1), want.reshape(-1), dtype, size, f"reducescatter {dtype} {op}")
    grouped = rt.grouped_reducescatter([np.ones((size, 2), np.float32), np.ones((size * 3,), np.float64)], op=rt.Sum)
    assert grouped[0].tolist() == [[size, size]] and grouped[1].tolist() == [size] * 3


def grouped_and_async_cases(rt, rank: int, size: int) -> None:
    outs = rt.grouped_allreduce([np.full(3, rank, np.float32), np.full(2, rank, np.int64)], op=rt.Sum)
    assert outs[0].tolist() == [sum(range(size))] * 3 and outs[1].tolist() == [sum(range(size))] * 2
    # Submit 40 named requests in a rank-dependent order; the engine agrees on one order.
    names = [f"async.{i}" for i in range(40)]
    order = names[rank:] + names[:rank] if rank % 2 == 0 else list(reversed(names))
    handles = {n: rt.allreduce_async(np.full(17, int(n.split(".")[1]) + rank, np.float64), op=rt.Sum, name=n)
               for n in order}
    for n in names:
        i = int(n.split(".")[1])
        assert rt.synchronize(handles[n]).tolist() == [size * i + sum(range(size))] * 17
        assert rt.poll(handles[n])


def object_cases(rt, rank: int, size: int) -> None:
    # Ranks pass objects of different types; names come from counters, so nobody waits forever.
    sent = {"rank": rank, "fn": (lambda x: x + rank)} if rank == 0 else [rank]
    got = rt.broadcast_object(sent, root_rank=0)
    assert got["rank"] == 0 and got["fn"](1) == 1
    gathered = rt.allgather_object(("r", rank, "x" * rank))
    assert gathered == [("r", r, "x" * r) for r in range(size)]


def barrier_and_process_sets(rt, rank: int, size: int) -> None:
    """Collectives inside a set of the even ranks; afterwards unnamed collectives of the whole job
    still pair up, although only the members issued the set's unnamed ones."""
    rt.barrier()
    evens = rt.add_process_set([r for r in range(size) if r % 2 == 0])
    if evens.included():
        out = rt.allreduce(np.array([rank + 1.0]), op=rt.Sum, process_set=evens)
        assert out.tolist() == [sum(r + 1.0 for r in range(size) if r % 2 == 0)]
        got = rt.broadcast(np.array([rank]), root_rank=evens.ranks[-1], process_set=evens)
        assert got.tolist() == [evens.ranks[-1]]
        rt.barrier(process_set=evens)
    assert rt.allreduce(np.array([1.0]), op=rt.Sum).tolist() == [float(size)]
    rt.barrier()


def join_cases(rt, rank: int, size: int) -> int:
    """Rank r runs r + 1 steps, then joins. Allreduces go on with joined ranks contributing zeros;
    an allgather that would need a joined rank fails (a RuntimeError, as in Horovod) on the ranks
    that asked for it, and the next operations work."""
    for step in range(rank + 1):
        got = rt.allreduce(np.full(4, 1.0, np.float32), op=rt.Sum, name=f"join.step.{step}")
        active = sum(1 for r in range(size) if r >= step)
        assert got.tolist() == [float(active)] * 4, (step, got)
        if step == 0:
            gathered = rt.allgather(np.full((1,), rank), name="join.gather.0")
            assert gathered.tolist() == list(range(size)), gathered
            continue
        # Every rank below `step` has joined by now: the allreduce above waited for them.
        try:
            rt.allgather(np.full((1,), rank), name=f"join.gather.{step}")
        except rt.RankMismatchError as exc:
            assert isinstance(exc, RuntimeError) and "joined" in str(exc), exc
        else:
            raise AssertionError(f"step {step}: allgather with joined ranks did not fail")
    return rt.join()


def storage_views_and_counters(rt, rank: int, size: int) -> None:
    """bfloat16 given as int16 storage works for every collective; unnamed names agree after join."""
    raw = to_wire(np.full(3, rank + 1.0), "bfloat16").view(np.int16)
    gathered = rt.allgather(raw, dtype="bfloat16")
    assert from_wire(gathered.view(np.uint16), "bfloat16").tolist() == [r + 1.0 for r in range(size) for _ in range(3)]
    summed = rt.allreduce(raw, op=rt.Sum, dtype="bfloat16")
    assert from_wire(summed.view(np.uint16), "bfloat16").tolist() == [sum(range(1, size + 1))] * 3
    if rank == size - 1:
        rt.allreduce(np.ones(1))  # an extra unnamed operation on one rank only...
    rt.join()
    # ...yet the next unnamed operation still pairs up across ranks.
    assert rt.allreduce(np.ones(1), op=rt.Sum).tolist() == [float(size)]
    assert rt.is_homogeneous()



def polled_async_rounds(rt, rank: int, size: int) -> int:
    """Requests submitted while earlier ones are in flight, waited for with poll() alone: the
    engine thread must pick every one up by itself (no wake-up may be lost). Returns rounds."""
    rng = np.random.default_rng(rank)
    rounds = 300
    for step in range(rounds):
        handles = []
        for i in range(4):
            handles.append(rt.allreduce_async(np.full(4, float(rank + i)), op=rt.Sum, name=f"polled.{i}"))
            spin_until = time.perf_counter() + rng.uniform(0, 100e-6)
            while time.perf_counter() < spin_until:  # land the next submission at varied moments
                pass
        deadline = time.monotonic() + 20.0
        for i, handle in enumerate(handles):
            while not rt.poll(handle):
                assert time.monotonic() < deadline, f"round {step}: request {i} was never picked up"
                time.sleep(0.0001)
            assert rt.synchronize(handle).tolist() == [float(sum(range(size)) + size * i)] * 4
    return rounds



def duplicate_names(rt, rank: int, size: int) -> None:
    """A second request under a name still in flight is refused at once with a ValueError (as in
    Horovod) and changes nothing; once the first has finished the name is free again. The last rank
    submits only after a barrier, so on the others the first request is surely still in flight."""
    last = size - 1

    def submit():
        return (rt.allreduce_async(np.full(3, float(rank)), op=rt.Sum, name="dup"),
                rt.grouped_allreduce_async([np.ones(1), np.ones(1)], op=rt.Sum, name="dup.grouped"))

    if rank == last:
        rt.barrier()
        first, group = submit()
    else:
        first, group = submit()
        for name in ("dup", "dup.grouped.1"):  # the second is the name of the group's second member
            try:
                rt.allreduce_async(np.full(3, 100.0), op=rt.Sum, name=name)
            except ValueError as exc:
                assert "same name" in str(exc) and repr(name) in str(exc), exc
            else:
                raise AssertionError(f"a second in-flight request named {name!r} was accepted")
        rt.barrier()
    assert [a.tolist() for a in rt.synchronize(group)] == [[float(size)]] * 2
    assert rt.synchronize(first).tolist() == [float(sum(range(size)))] * 3
    again = rt.allreduce(np.full(3, 1.0), op=rt.Sum, name="dup")
    assert again.tolist() == [float(size)] * 3


def unwaited_async_is_announced(rt, rank: int, size: int) -> None:
    """A rank that submits an asynchronous allreduce and then does other work, neither waiting for
    it nor polling it, still has it announced (its engine thread looks at the queue every few
    milliseconds): the ranks blocked on that allreduce finish while the busy rank is still away,
    which it learns from files they leave in a directory of this host (the ranks of these checks
    share one), not from the runtime. Tried with the coordinator (rank 0) and with the last rank."""
    import os
    import shutil
    import tempfile

    from harness import wait_until

    folder = rt.broadcast_object(tempfile.mkdtemp(prefix="spark-hvd-unwaited-") if rank == 0 else None, root_rank=0,
                                 name="unwaited.folder")
    try:
        for busy in sorted({0, size - 1}):
            name = f"unwaited.{busy}"
            buf = np.full(3, float(rank + 1))
            if rank == busy:
                handle = rt.allreduce_async(buf, op=rt.Sum, name=name)
                others = [os.path.join(folder, f"{busy}.{r}") for r in range(size) if r != busy]
                assert wait_until(lambda: all(os.path.exists(p) for p in others), 60.0), \
                    f"ranks {[r for r in range(size) if r != busy]} never finished rank {busy}'s unwaited allreduce"
                result = rt.synchronize(handle)
            else:
                result = rt.allreduce(buf, op=rt.Sum, name=name)
                open(os.path.join(folder, f"{busy}.{rank}"), "w").close()
            assert result.tolist() == [float(size * (size + 1) // 2)] * 3
            rt.barrier()
    finally:
        rt.barrier()
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


def repeated_small_allreduces(rt, rank: int, size: int) -> int:
    """Training-step-like traffic: the same names every step with new values, small enough to
    travel inside the negotiation messages (in a set of two with rank 0, the other member computes
    them from rank 0's contribution without waiting for the answer), some too large, some past the
    budget of one message; ranks take turns arriving late. Every result is exact and the same bits
    on every rank, in the whole job and in a process set of rank 0 and the last rank. Returns the
    number of results compared."""
    pair = rt.add_process_set([0, size - 1]) if size > 1 else None
    cases = [("float32", rt.Average, 1.0, 1.0, 5_000), ("float64", rt.Sum, 1.0, 1.0, 1),
             ("float32", rt.Sum, 0.5, 3.0, 300), ("float16", rt.Average, 1.0, 1.0, 64),
             ("int32", rt.Max, 1.0, 1.0, 7), ("float32", rt.Min, 1.0, 1.0, 9_000)]  # the last: 36 KB
    compared = 0
    for step in range(30):
        if rank == step % size:
            time.sleep(0.002)  # arrive late: the others' contributions wait here, or this rank's there
        for process_set in ([rt.global_process_set] + ([pair] if pair is not None and pair.included() else [])):
            members = process_set.ranks
            got = []
            for i, (dtype, op, pre, post, length) in enumerate(cases):
                mine = ((np.arange(length) + 5 * rank + step) % 11).astype(np.float64)
                out = rt.allreduce(mine.astype(dtype), op=op, prescale_factor=pre, postscale_factor=post,
                                   name=f"steps.{i}", process_set=process_set)
                stack = np.stack([((np.arange(length) + 5 * r + step) % 11) * pre for r in members])
                want = {rt.Sum: stack.sum(0), rt.Average: stack.sum(0) / len(members), rt.Max: stack.max(0),
                        rt.Min: stack.min(0)}[op] * post
                _close(out, want, dtype, len(members), f"step {step} case {i} set {members}")
                got.append(out)
            # A burst of asynchronous requests beyond what one message carries (8 x 4 KiB fit).
            burst = [rt.allreduce_async(np.full(1024, float(rank + step + j), np.float32), op=rt.Sum,
                                        name=f"steps.burst.{j}", process_set=process_set) for j in range(12)]
            for j, handle in enumerate(burst):
                out = rt.synchronize(handle)
                assert out.tolist() == [float(sum(r + step + j for r in members))] * 1024, (step, j, out[:4])
                got.append(out)
            digest = np.frombuffer(b"".join(a.tobytes() for a in got), np.uint8).astype(np.int64)
            everyone = rt.allgather(np.array([[int(digest.sum()), int((digest * np.arange(digest.size)).sum())]]),
                                    name="steps.digest", process_set=process_set)
            assert (everyone == everyone[0]).all(), f"step {step}: ranks hold different bits {everyone.tolist()}"
            compared += len(got)
    # A disagreement is reported as before, and the names work again afterwards.
    if size > 1:
        try:
            rt.allreduce(np.ones(3 + (rank == size - 1), np.float32), op=rt.Sum, name="steps.0")
        except rt.RankMismatchError as exc:
            assert "shapes" in str(exc), exc
        else:
            raise AssertionError("mismatched small allreduce did not fail")
    again = rt.allreduce(np.full(5_000, float(rank), np.float32), op=rt.Average, name="steps.0")
    assert again.tolist() == [sum(range(size)) / size] * 5_000
    return compared


def adasum_cases(rt, rank: int, size: int) -> int:
    """op=Adasum against a numpy reference of the same inputs: every float dtype, shapes, groups
    (each array combined on its own), async, in place, scaling; orthogonal vectors sum, parallel
    ones average; integer arrays, reducescatter and a world that is not a power of two are refused
    before any communication. Returns the number of cases compared."""
    if size & (size - 1):
        try:
            rt.allreduce(np.ones(4, np.float32), op=rt.Adasum)
        except ValueError as exc:
            assert "power-of-two" in str(exc) and str(size) in str(exc), str(exc)
        else:
            raise AssertionError(f"Adasum over {size} ranks was not refused")
        return 0
    cases = 0
    for dtype, tol in (("float64", 1e-12), ("float32", 1e-5), ("float16", 2e-3), ("bfloat16", 2e-2)):
        inputs = [np.random.default_rng(40 + r).normal(size=(3, 5)) for r in range(size)]
        want = adasum_reference([v.reshape(-1) for v in inputs]).reshape(3, 5)
        extra = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
        got = from_wire(rt.allreduce(to_wire(inputs[rank], dtype), op=rt.Adasum, **extra), dtype)
        assert got.shape == (3, 5) and np.allclose(got, want, rtol=tol, atol=tol), (dtype, got, want)
        cases += 1
    # Each array of a group on its own: the second one's vectors are orthogonal (one nonzero
    # element per rank), so it sums, while the first one's are parallel, so it averages.
    parallel = np.arange(1.0, 7.0) * (rank + 1)
    orthogonal = np.zeros(size * 2)
    orthogonal[2 * rank] = rank + 1.0
    first, second = rt.grouped_allreduce([parallel, orthogonal], op=rt.Adasum)
    assert np.allclose(first, np.arange(1.0, 7.0) * (size + 1) / 2), first
    assert np.allclose(second, [r + 1.0 if i % 2 == 0 else 0.0 for r in range(size) for i in range(2)]), second
    cases += 2
    # Async and polled, in place, with scaling: prescale before the combination, postscale after.
    data = np.random.default_rng(7 + rank).normal(size=1001).astype(np.float32)
    want = adasum_reference([np.random.default_rng(7 + r).normal(size=1001).astype(np.float32) * 2.0
                             for r in range(size)]) * 0.5
    handle = rt.allreduce_async(data, op=rt.Adasum, out=data, prescale_factor=2.0, postscale_factor=0.5)
    while not rt.poll(handle):
        time.sleep(0.001)
    assert rt.synchronize(handle) is data and np.allclose(data, want, rtol=1e-5, atol=1e-6)
    cases += 1
    zero = rt.allreduce(np.zeros(3) if rank else np.ones(3), op=rt.Adasum)  # a zero vector changes nothing
    assert np.allclose(zero, np.ones(3)), zero
    for call, error, text in ((lambda: rt.allreduce(np.ones(3, np.int32), op=rt.Adasum), ValueError, "int32"),
                              (lambda: rt.reducescatter(np.ones(4 * size, np.float32), op=rt.Adasum),
                               NotImplementedError, "reducescatter")):
        try:
            call()
        except error as exc:
            assert text in str(exc), str(exc)
        else:
            raise AssertionError(f"{text} with op=Adasum was not refused")
    after = rt.allreduce(np.ones(2), op=rt.Sum)  # the refusals sent nothing
    assert np.allclose(after, size), after
    return cases


ALL = [
    allreduce_matrix, scaled_allreduce, allgather_cases, broadcast_cases, alltoall_cases, reducescatter_cases,
    grouped_and_async_cases, object_cases, barrier_and_process_sets, join_cases, storage_views_and_counters,
    polled_async_rounds, duplicate_names, unwaited_async_is_announced, repeated_small_allreduces, adasum_cases,
]
