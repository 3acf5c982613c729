"""The collective grid of spark_hvd.torch at world sizes 1, 2 and 3, in the launched world per size that every check module shares (conftest.py)."""

import pytest
import torch

from torch_world import assert_passed, close, tolerance

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.uint8, torch.bool]
LENGTHS = [0, 1, 7]


def _ops(hvd, dtype):
    if dtype == torch.bool:
        return [hvd.Sum, hvd.Min, hvd.Max]
    return [hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product]


def _contribution(r, length, op, hvd):
    base = torch.arange(length, dtype=torch.float64)
    if op == hvd.Product:
        return 1.0 + (base + r) % 2
    return (base + 3 * r) % 7


def _expected(hvd, size, length, op, dtype):
    stack = torch.stack([_contribution(r, length, op, hvd) for r in range(size)])
    if dtype == torch.bool:
        stack = stack != 0
        return {hvd.Sum: stack.any(0), hvd.Min: stack.all(0), hvd.Max: stack.any(0)}[op]
    if op == hvd.Sum:
        want = stack.sum(0)
    elif op == hvd.Min:
        want = stack.min(0).values
    elif op == hvd.Max:
        want = stack.max(0).values
    elif op == hvd.Product:
        want = stack.prod(0)
    else:
        want = stack.sum(0) / size
        if not dtype.is_floating_point:
            want = torch.trunc(want)
    return want.to(dtype)


def check_topology(hvd, rank, size):
    """rank/size/local/cross topology and the build probes answer consistently for a local job."""
    assert hvd.is_initialized()
    assert (hvd.rank(), hvd.size()) == (rank, size)
    assert (hvd.local_rank(), hvd.local_size()) == (rank, size)
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
    assert hvd.is_homogeneous() is True
    for probe in (hvd.gloo_built, hvd.nccl_built, hvd.cuda_built, hvd.rocm_built, hvd.ddl_built, hvd.ccl_built,
                  hvd.mpi_enabled, hvd.gloo_enabled):
        assert probe() is False, probe.__name__
    assert isinstance(hvd.mpi_built(), bool)


def check_allreduce_every_dtype_and_op(hvd, rank, size):
    """allreduce of every dtype and op, on empty, one-element and odd-length tensors, matches the
    reduction of the ranks' contributions computed locally; the input is left unchanged."""
    for dtype in DTYPES:
        for op in _ops(hvd, dtype):
            for length in LENGTHS:
                mine = _contribution(rank, length, op, hvd).to(dtype)
                before = mine.clone()
                got = hvd.allreduce(mine, op=op)
                what = f"allreduce {dtype} op={op!r} length={length}"
                close(got, _expected(hvd, size, length, op, dtype), tolerance(dtype), what)
                assert torch.equal(mine, before), what + ": input modified"


def check_allreduce_variants(hvd, rank, size):
    """allreduce_async, allreduce_ and allreduce_async_ give allreduce's result; the in-place
    forms return the very tensor they were given, which then holds the result."""
    want = torch.full((5,), float(sum(range(size))) / size)
    handle = hvd.allreduce_async(torch.full((5,), float(rank)))
    close(hvd.synchronize(handle), want, 1e-6, "allreduce_async")
    assert hvd.poll(handle) is True
    t = torch.full((5,), float(rank))
    assert hvd.allreduce_(t) is t
    close(t, want, 1e-6, "allreduce_")
    t = torch.full((5,), float(rank))
    handle = hvd.allreduce_async_(t, op=hvd.Sum)
    assert hvd.synchronize(handle) is t
    close(t, want * size, 1e-6, "allreduce_async_ Sum")


def check_allreduce_scaling_and_average_flag(hvd, rank, size):
    """prescale/postscale multiply before and after the sum; the deprecated average= flag maps to
    Average/Sum and clashes with op= with a ValueError."""
    t = torch.full((3,), float(rank + 1))
    total = float(size * (size + 1) / 2)
    close(hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5), torch.full((3,), total))
    close(hvd.allreduce(t, op=hvd.Sum, postscale_factor=3.0), torch.full((3,), 3 * total))
    close(hvd.allreduce(t, average=False), torch.full((3,), total))
    close(hvd.allreduce(t, average=True), torch.full((3,), total / size), 1e-6)
    try:
        hvd.allreduce(t, average=True, op=hvd.Sum)
    except ValueError as exc:
        assert "op" in str(exc)
    else:
        raise AssertionError("average= together with op= did not raise ValueError")


def check_allreduce_fp16_compression(hvd, rank, size):
    """Compression.fp16 returns a float32 tensor close to the uncompressed average."""
    t = torch.linspace(-1, 1, 33) * (rank + 1)
    got = hvd.allreduce(t, compression=hvd.Compression.fp16)
    want = torch.linspace(-1, 1, 33) * (size + 1) / 2
    close(got, want, 2e-3, "fp16 compression")


def check_non_contiguous_tensors(hvd, rank, size):
    """Transposed (non-contiguous) tensors reduce correctly, in place and out of place."""
    base = torch.arange(12.0).reshape(3, 4) + rank
    view = base.t()
    want = (torch.arange(12.0).reshape(3, 4) * size + sum(range(size))).t()
    close(hvd.allreduce(view, op=hvd.Sum), want.contiguous(), what="out of place")
    assert hvd.allreduce_(view, op=hvd.Sum) is view
    close(view, want, what="in place view")
    close(base, want.t(), what="storage under the view")


def check_scalar_and_zero_dim(hvd, rank, size):
    """0-dim tensors keep their shape through allreduce and broadcast."""
    s = torch.tensor(float(rank))
    got = hvd.allreduce(s, op=hvd.Sum)
    assert got.shape == torch.Size([]) and got.item() == sum(range(size))
    b = torch.tensor(rank + 5)
    hvd.broadcast_(b, root_rank=size - 1)
    assert b.shape == torch.Size([]) and b.item() == size - 1 + 5


def check_grouped_allreduce(hvd, rank, size):
    """grouped_allreduce (all four forms) reduces each tensor of the list like allreduce."""
    def inputs():
        return [torch.full((4,), float(rank)), torch.full((2, 3), float(2 * rank))]

    mean = sum(range(size)) / size
    wants = [torch.full((4,), mean), torch.full((2, 3), 2 * mean)]
    for got, want in zip(hvd.grouped_allreduce(inputs()), wants):
        close(got, want, 1e-6, "grouped_allreduce")
    for got, want in zip(hvd.synchronize(hvd.grouped_allreduce_async(inputs())), wants):
        close(got, want, 1e-6, "grouped_allreduce_async")
    tensors = inputs()
    out = hvd.grouped_allreduce_(tensors, op=hvd.Sum)
    assert all(a is b for a, b in zip(out, tensors))
    close(tensors[1], wants[1] * size, 1e-6, "grouped_allreduce_")
    tensors = inputs()
    hvd.synchronize(hvd.grouped_allreduce_async_(tensors))
    close(tensors[0], wants[0], 1e-6, "grouped_allreduce_async_")


def check_allgather_uneven(hvd, rank, size):
    """allgather concatenates rank r's (r+1) rows in rank order, for every dtype; allgather_async
    and grouped_allgather agree."""
    for dtype in DTYPES:
        mine = (torch.arange(2 * (rank + 1)).reshape(rank + 1, 2) + 10 * rank).to(dtype)
        want = torch.cat([(torch.arange(2 * (r + 1)).reshape(r + 1, 2) + 10 * r).to(dtype) for r in range(size)])
        close(hvd.allgather(mine), want, what=f"allgather {dtype}")
        close(hvd.synchronize(hvd.allgather_async(mine)), want, what=f"allgather_async {dtype}")
    outs = hvd.grouped_allgather([torch.full((rank + 1,), rank), torch.full((1, 2), float(rank))])
    close(outs[0], torch.cat([torch.full((r + 1,), r) for r in range(size)]))
    close(outs[1], torch.cat([torch.full((1, 2), float(r)) for r in range(size)]))
    outs = hvd.synchronize(hvd.grouped_allgather_async([torch.full((2,), rank)]))
    close(outs[0], torch.arange(size).repeat_interleave(2))


def check_broadcast_forms(hvd, rank, size):
    """broadcast, broadcast_async, broadcast_ and broadcast_async_ deliver the root's values;
    the out-of-place forms leave the input alone."""
    root = size - 1
    for dtype in DTYPES:
        mine = (torch.arange(6).reshape(2, 3) + rank).to(dtype)
        want = (torch.arange(6).reshape(2, 3) + root).to(dtype)
        before = mine.clone()
        close(hvd.broadcast(mine, root), want, what=f"broadcast {dtype}")
        close(hvd.synchronize(hvd.broadcast_async(mine, root_rank=root)), want, what=f"broadcast_async {dtype}")
        assert torch.equal(mine, before)
        assert hvd.broadcast_(mine, root) is mine
        close(mine, want, what=f"broadcast_ {dtype}")
    t = torch.full((3,), float(rank))
    hvd.synchronize(hvd.broadcast_async_(t, 0))
    close(t, torch.zeros(3), what="broadcast_async_")


def check_alltoall(hvd, rank, size):
    """alltoall with splits sends (j+1) rows to rank j and returns the received rows plus the
    received splits (int32 by default, the splits' dtype for a tensor); without splits it splits
    evenly and returns the tensor alone; alltoall_async returns both."""
    splits = [j + 1 for j in range(size)]
    rows = sum(splits)
    mine = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) + 100 * rank
    out, received = hvd.alltoall(mine, splits=splits)
    start = sum(range(1, rank + 1))
    want = torch.cat([(torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) + 100 * r)[start:start + rank + 1]
                      for r in range(size)])
    close(out, want, what="alltoall rows")
    close(received, torch.full((size,), rank + 1, dtype=torch.int32), what="received splits")
    out, received = hvd.alltoall(mine, splits=torch.tensor(splits, dtype=torch.int64))
    assert received.dtype == torch.int64
    even = torch.arange(2 * size) + 10 * rank
    got = hvd.alltoall(even)
    assert isinstance(got, torch.Tensor)
    close(got, torch.tensor([v for r in range(size) for v in (10 * r + 2 * rank, 10 * r + 2 * rank + 1)]))
    out, received = hvd.synchronize(hvd.alltoall_async(even))
    close(out, got)
    close(received, torch.full((size,), 2, dtype=torch.int32))


def check_reducescatter(hvd, rank, size):
    """reducescatter gives rank r block r of the reduction (blocks as even as possible, earlier
    ranks taking the extra rows); grouped_reducescatter and the async forms agree."""
    rows = 2 * size + 1
    mine = torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3) * (rank + 1)
    total = torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3) * (size * (size + 1) / 2)
    block = list(torch.tensor_split(total, size))[rank]
    close(hvd.reducescatter(mine, op=hvd.Sum), block, 1e-9, "reducescatter Sum")
    close(hvd.synchronize(hvd.reducescatter_async(mine)), block / size, 1e-9, "reducescatter_async Average")
    outs = hvd.grouped_reducescatter([mine, mine * 2], op=hvd.Sum)
    close(outs[1], block * 2, 1e-9, "grouped_reducescatter")
    outs = hvd.synchronize(hvd.grouped_reducescatter_async([mine], op=hvd.Sum, postscale_factor=0.5))
    close(outs[0], block * 0.5, 1e-9, "grouped_reducescatter_async postscale")
    halves = hvd.reducescatter(torch.ones(size * 2, dtype=torch.float16) * (rank + 1), op=hvd.Sum)
    close(halves, torch.full((2,), size * (size + 1) / 2, dtype=torch.float16), what="float16")


def check_other_dtypes_move(hvd, rank, size):
    """Dtypes without a reduction (uint32, float8) still broadcast and allgather; complex tensors
    allreduce; reducing an unreducible dtype raises a ValueError naming it."""
    u = torch.tensor([rank, 7]).to(torch.uint32)
    close(hvd.allgather(u), torch.tensor([v for r in range(size) for v in (r, 7)]).to(torch.uint32))
    f8 = torch.tensor([float(rank), 0.5]).to(torch.float8_e4m3fn)
    close(hvd.broadcast(f8, 0).float(), torch.tensor([0.0, 0.5]))
    c = torch.tensor([complex(rank, 1)])
    close(hvd.allreduce(c, op=hvd.Sum), torch.tensor([complex(sum(range(size)), size)]))
    try:
        hvd.allreduce(u)
    except ValueError as exc:
        assert "uint32" in str(exc)
    else:
        raise AssertionError("allreduce of uint32 did not raise ValueError")


def check_adasum_and_bool_average_refused(hvd, rank, size):
    """op=Adasum combines float tensors as the numpy reference of the same inputs does, from every
    allreduce form and in a power-of-two world (in a world of 3 it is refused with a ValueError
    naming the count); reducescatter refuses it with a RuntimeError, as Horovod's test expects,
    before any communication; Average of bool raises a ValueError."""
    import numpy as np

    from harness import adasum_reference

    inputs = [torch.from_numpy(np.random.default_rng(11 + r).normal(size=(4, 3))).float() for r in range(size)]
    calls = {
        "allreduce": lambda x: hvd.allreduce(x, op=hvd.Adasum),
        "allreduce_async_": lambda x: hvd.synchronize(hvd.allreduce_async_(x.clone(), op=hvd.Adasum)),
        "grouped_allreduce": lambda x: hvd.grouped_allreduce([x, x.double()], op=hvd.Adasum)[1].float(),
    }
    if size & (size - 1) == 0:
        want = torch.from_numpy(adasum_reference([t.reshape(-1).numpy() for t in inputs]).reshape(4, 3)).float()
        for what, call in calls.items():
            close(call(inputs[rank]), want, what=f"{what} with op=Adasum", atol=1e-5)
    else:
        for what, call in calls.items():
            try:
                call(inputs[rank])
            except ValueError as exc:
                assert "power-of-two" in str(exc) and f"got {size}" in str(exc), (what, str(exc))
            else:
                raise AssertionError(f"{what} with op=Adasum over {size} ranks was not refused")
    x = torch.ones(2 * size)
    for what, call in {"reducescatter": lambda: hvd.reducescatter(x, op=hvd.Adasum),
                       "grouped_reducescatter_async": lambda: hvd.grouped_reducescatter_async([x], op=hvd.Adasum),
                       }.items():
        try:
            call()
        except RuntimeError as exc:
            assert "Adasum is defined for allreduce" in str(exc), (what, str(exc))
        else:
            raise AssertionError(f"{what} with op=Adasum did not raise RuntimeError")
    try:
        hvd.allreduce(torch.ones(2, dtype=torch.bool), op=hvd.Average)
    except ValueError as exc:
        assert "not" in str(exc)
    else:
        raise AssertionError("Average of bool did not raise ValueError")
    close(hvd.allreduce(x, op=hvd.Sum), torch.full((2 * size,), float(size)), what="after the refusals")


def check_reducescatter_refuses_scalars(hvd, rank, size):
    """A 0-dimensional tensor given to reducescatter, reducescatter_async or grouped_reducescatter
    raises a ValueError naming it (as Horovod refuses scalars), on every rank and before any
    communication, so the next collective still agrees."""
    scalar = torch.tensor(float(rank))
    calls = [("tensor", lambda: hvd.reducescatter(scalar, op=hvd.Average)),
             ("tensor", lambda: hvd.reducescatter_async(scalar)),
             ("tensors[1]", lambda: hvd.grouped_reducescatter([torch.zeros(3, 1), scalar])),
             ("tensors[0]", lambda: hvd.grouped_reducescatter_async([scalar]))]
    for what, call in calls:
        try:
            call()
        except ValueError as exc:
            assert f"{what} is 0-dimensional" in str(exc) and "reshape" in str(exc), str(exc)
        else:
            raise AssertionError(f"reducescatter of a scalar as {what} did not raise ValueError")
    close(hvd.reducescatter(torch.ones(size), op=hvd.Sum), torch.full((1,), float(size)))


def _sparse_rows(rank, rows=6, cols=3):
    """Rank r's sparse tensor: rows r % rows and (r + 2) % rows hold r + 1."""
    dense = torch.zeros(rows, cols)
    dense[rank % rows] += rank + 1
    dense[(rank + 2) % rows] += rank + 1
    return dense


def check_sparse_allreduce_async(hvd, rank, size):
    """sparse_allreduce_async returns a handle that can be called, as in Horovod, or passed to
    poll/synchronize; either way the result is a sparse tensor whose dense form equals the dense
    allreduce (Average and Sum), identical on every rank."""
    mine = _sparse_rows(rank).to_sparse()
    want = sum(_sparse_rows(r) for r in range(size))
    for i, op in enumerate((hvd.Average, hvd.Sum)):
        handle = hvd.sparse_allreduce_async(mine, name=f"sparse.{i}", op=op)
        got = handle()
        assert got.is_sparse
        close(got.to_dense(), want / size if op == hvd.Average else want, 1e-6, f"handle() op={op!r}")
        assert hvd.poll(handle) and hvd.synchronize(handle) is got
    handle = hvd.sparse_allreduce_async(mine, None, hvd.Sum)
    close(hvd.synchronize(handle).to_dense(), want, 1e-6, "synchronize(handle)")
    empty = torch.zeros(4, 2).to_sparse()
    close(hvd.sparse_allreduce_async(empty, "sparse.empty", hvd.Average)().to_dense(), torch.zeros(4, 2))


def check_shape_mismatch_fails_every_rank(hvd, rank, size):
    """Ranks reducing different shapes under one name all get a HorovodInternalError (a RuntimeError,
    as in Horovod), and the runtime stays usable."""
    if size > 1:
        try:
            hvd.allreduce(torch.ones(rank + 1), name="mismatched")
        except hvd.HorovodInternalError as exc:
            assert isinstance(exc, RuntimeError) and "mismatched" in str(exc)
        else:
            raise AssertionError("a shape mismatch across ranks did not raise")
    close(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(size)))


def check_names_are_per_kind(hvd, rank, size):
    """As in Horovod, an allreduce and a broadcast in flight under the same name do not collide,
    and an empty name counts as no name."""
    reduced = hvd.allreduce_async(torch.ones(2), name="shared", op=hvd.Sum)
    sent = hvd.broadcast_async(torch.full((3,), float(rank)), 0, name="shared")
    close(hvd.synchronize(sent), torch.zeros(3))
    close(hvd.synchronize(reduced), torch.full((2,), float(size)))
    close(hvd.allreduce(torch.ones(1), name="", op=hvd.Sum), torch.full((1,), float(size)))


def check_barrier_poll_handles(hvd, rank, size):
    """barrier returns on every rank; poll eventually reports completion; synchronize twice gives
    the same result; a foreign handle is refused with ValueError."""
    hvd.barrier()
    handle = hvd.allreduce_async(torch.ones(3))
    first = hvd.synchronize(handle)
    assert hvd.poll(handle) and hvd.synchronize(handle) is first
    try:
        hvd.synchronize(12345)
    except ValueError:
        pass
    else:
        raise AssertionError("synchronize(12345) did not raise ValueError")


def check_timeline(hvd, rank, size):
    """start_timeline/stop_timeline record named collectives in a Chrome trace written by rank 0."""
    import json
    import os
    import tempfile

    directory = hvd.broadcast_object(tempfile.mkdtemp(prefix="hvd-timeline-") if rank == 0 else None, 0)
    path = os.path.join(directory, "timeline.json")
    hvd.start_timeline(path)
    hvd.allreduce(torch.ones(4), name="timeline.probe")
    hvd.stop_timeline()
    if rank == 0:
        with open(path) as trace:
            events = json.load(trace)
        assert any("timeline.probe" in json.dumps(event) for event in events), events[:5]


ALL = [check_topology, check_timeline, check_allreduce_every_dtype_and_op, check_allreduce_variants,
       check_allreduce_scaling_and_average_flag, check_allreduce_fp16_compression, check_non_contiguous_tensors,
       check_scalar_and_zero_dim, check_grouped_allreduce, check_allgather_uneven, check_broadcast_forms,
       check_alltoall, check_reducescatter, check_reducescatter_refuses_scalars, check_sparse_allreduce_async,
       check_other_dtypes_move, check_adasum_and_bool_average_refused,
       check_shape_mismatch_fails_every_rank, check_names_are_per_kind, check_barrier_poll_handles]


@pytest.mark.parametrize("check", ALL, ids=lambda c: c.__name__[len("check_"):])
def test_collective(world, check):
    """The check (its docstring says what it asserts) passed on every rank."""
    assert_passed(world, check)
