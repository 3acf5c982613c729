"""DistributedOptimizer at world sizes 1, 2 and 3: equivalence with single-process training on the
concatenated batch, local accumulation, compression, overlap with backward, unused parameters,
gradient clipping, groups and its error messages."""

import copy
import time
import warnings

import pytest
import torch
import torch.nn.functional as F

from torch_world import assert_passed, close, launch

BATCH = 4  # rows per rank per micro-batch


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _data(size, steps, micro=1):
    """The full data of every step: size * micro * BATCH rows, identical on every rank."""
    g = torch.Generator().manual_seed(42)
    rows = size * micro * BATCH
    return [(torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g)) for _ in range(steps)]


def _my_rows(x, rank, micro=1):
    """This rank's rows of a step's full batch, as ``micro`` micro-batches."""
    per_rank = micro * BATCH
    mine = x[rank * per_rank:(rank + 1) * per_rank]
    return list(mine.split(BATCH))


def _reference(model, data, make_optimizer):
    """Single-process training on the concatenated batches."""
    model = copy.deepcopy(model)
    opt = make_optimizer(model)
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def _distributed(hvd, rank, model, data, make_optimizer, micro=1, **options):
    opt = hvd.DistributedOptimizer(make_optimizer(model), named_parameters=model.named_parameters(),
                                   backward_passes_per_step=micro, **options)
    for x, y in data:
        opt.zero_grad()
        for xs, ys in zip(_my_rows(x, rank, micro), _my_rows(y, rank, micro)):
            (F.cross_entropy(model(xs), ys) / micro).backward()
        opt.step()
    return opt


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _assert_same_params(got, want, atol, what):
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        close(p.detach(), q.detach(), atol, f"{what}: {name}")


def _assert_equal_across_ranks(hvd, model):
    for name, p in model.named_parameters():
        gathered = hvd.allgather(p.detach().unsqueeze(0))
        assert all(torch.equal(gathered[0], g) for g in gathered), f"{name} differs between ranks"


def check_matches_single_process_training(hvd, rank, size):
    """Five momentum-SGD steps on 2+ ranks (after broadcast_parameters from rank 0 of
    differently initialised models) leave parameters within 1e-5 of single-process training
    on the concatenated batch, and identical on every rank."""
    model = _model(seed=rank)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    _assert_same_params(model, _model(seed=0), 0.0, "after broadcast_parameters")
    data = _data(size, steps=5)
    want = _reference(_model(seed=0), data, _sgd)
    _distributed(hvd, rank, model, data, _sgd)
    _assert_same_params(model, want, 1e-5, "after training")
    _assert_equal_across_ranks(hvd, model)


def check_backward_passes_per_step(hvd, rank, size):
    """With backward_passes_per_step=2 the first backward leaves the local gradient untouched, the
    second starts the reduction, training matches single-process training, and a third backward
    before step() raises Horovod's AssertionError."""
    data = _data(size, steps=3, micro=2)
    want = _reference(_model(), data, _sgd)
    model = _model()
    _distributed(hvd, rank, model, data, _sgd, micro=2)
    _assert_same_params(model, want, 1e-5, "bpps=2")

    model = _model()
    local = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(), backward_passes_per_step=2)
    x, y = data[0]
    xs, ys = _my_rows(x, rank, 2)[0], _my_rows(y, rank, 2)[0]
    F.cross_entropy(model(xs), ys).backward()
    F.cross_entropy(local(xs), ys).backward()
    for p, q in zip(model.parameters(), local.parameters()):
        close(p.grad, q.grad, 0.0, "gradient after the first of two passes")
    F.cross_entropy(model(xs), ys).backward()
    if size > 1:
        try:
            F.cross_entropy(model(xs), ys).backward()
        except AssertionError as exc:
            assert "backward_passes_per_step" in str(exc)
        else:
            raise AssertionError("a third backward pass before step() did not raise")
    opt.synchronize()


def check_fp16_compression(hvd, rank, size):
    """Compression.fp16 trains to within float16 precision of single-process training."""
    data = _data(size, steps=3)
    want = _reference(_model(), data, _sgd)
    model = _model()
    _distributed(hvd, rank, model, data, _sgd, compression=hvd.Compression.fp16)
    _assert_same_params(model, want, 5e-3, "fp16")
    _assert_equal_across_ranks(hvd, model)


class _Probe(torch.autograd.Function):
    """Identity whose backward runs between the last layer's and the first layer's gradients."""

    @staticmethod
    def forward(ctx, x, callback):
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.callback()
        return grad, None


def check_allreduce_starts_during_backward(hvd, rank, size):
    """With one request per gradient (bucket_cap_mb=0, Horovod's way): while backward is still
    running (before the first layer's gradient exists), the last layer's gradient allreduce has
    been started and completes: communication overlaps backward."""
    if size == 1:
        return  # Horovod does not communicate in a world of one; nothing to overlap.
    first, last = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
    model = torch.nn.Sequential(first, last)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), bucket_cap_mb=0)
    seen = {}

    def during_backward():
        pending = opt._handles.get(last.weight)
        seen["started"] = pending is not None and pending.started and pending.handle is not None
        seen["first_pending"] = first.weight in opt._handles
        deadline = time.monotonic() + 60
        while seen["started"] and not hvd.poll(pending.handle) and time.monotonic() < deadline:
            time.sleep(0.001)
        seen["completed"] = seen["started"] and hvd.poll(pending.handle)

    x = torch.randn(BATCH, 6)
    out = last(_Probe.apply(first(x), during_backward))
    out.sum().backward()
    opt.step()
    assert seen == {"started": True, "first_pending": False, "completed": True}, seen


def _two_headed():
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"trunk": torch.nn.Linear(4, 4), "a": torch.nn.Linear(4, 2), "b": torch.nn.Linear(4, 2)})


def _two_headed_loss(model, r):
    head = model["a"] if r == 0 else model["b"]
    return head(model["trunk"](torch.ones(2, 4) * (r + 1))).sum()


def check_unused_parameters(hvd, rank, size):
    """Rank 0 uses head a only, the other ranks head b only: step() completes on every rank (no
    hang), every gradient is the sum of the ranks' gradients over size (zeros where a rank had
    none), and parameters stay identical across ranks. Alone, the unused head keeps grad None."""
    model = _two_headed()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    _two_headed_loss(model, rank).backward()
    opt.synchronize()
    expected = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for r in range(size):
        local = _two_headed()
        _two_headed_loss(local, r).backward()
        for name, p in local.named_parameters():
            if p.grad is not None:
                expected[name] += p.grad / size
    for name, p in model.named_parameters():
        if size == 1 and name.startswith("b."):
            assert p.grad is None, name
        else:
            close(p.grad, expected[name], 1e-6, name)
    with opt.skip_synchronize():
        opt.step()
    _assert_equal_across_ranks(hvd, model)


def check_clipping_between_synchronize_and_step(hvd, rank, size):
    """synchronize(); clip_grad_norm_(); step() inside skip_synchronize() applies the clipped
    averaged gradient without a warning; step() after synchronize() without it warns."""
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x, y = _data(size, steps=1)[0]
    F.cross_entropy(model(_my_rows(x, rank)[0]), _my_rows(y, rank)[0]).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
    assert norm <= 0.01 + 1e-6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opt.skip_synchronize():
            opt.step()
    _assert_equal_across_ranks(hvd, model)
    opt.zero_grad()
    F.cross_entropy(model(_my_rows(x, rank)[0]), _my_rows(y, rank)[0]).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("skip_synchronize" in str(w.message) for w in caught)


def check_zero_grad_between_backward_and_step(hvd, rank, size):
    """zero_grad() while gradients are being reduced raises Horovod's AssertionError."""
    model = _model()
    opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters())
    model(torch.ones(2, 6)).sum().backward()
    if size > 1:
        try:
            opt.zero_grad()
        except AssertionError as exc:
            assert "zero_grad" in str(exc)
        else:
            raise AssertionError("zero_grad() between backward and step did not raise")
    opt.step()
    opt.zero_grad()


def check_groups_and_predivide(hvd, rank, size):
    """groups=2, explicit groups (one holding an unused parameter) and gradient_predivide_factor
    train like plain DistributedOptimizer; op=Sum sums the gradients."""
    data = _data(size, steps=2)
    want = _reference(_model(), data, _sgd)
    for options in ({"groups": 2}, {"gradient_predivide_factor": 2.0}):
        model = _model()
        _distributed(hvd, rank, model, data, _sgd, **options)
        _assert_same_params(model, want, 1e-5, str(options))
    model = _model()
    extra = torch.nn.Parameter(torch.zeros(3))
    params = list(model.parameters()) + [extra]
    named = list(model.named_parameters()) + [("extra", extra)]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), named_parameters=named,
                                   groups=[[params[0], extra], [params[2], params[3]]])
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(_my_rows(x, rank)[0]), _my_rows(y, rank)[0]).backward()
        opt.step()
    _assert_same_params(model, want, 1e-5, "explicit groups")
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                   op=hvd.Sum)
    model(torch.ones(1, 6)).sum().backward()
    opt.synchronize()
    local = _model()
    local(torch.ones(1, 6)).sum().backward()
    scale = size if size > 1 else 1
    for p, q in zip(model.parameters(), local.parameters()):
        close(p.grad, q.grad * scale, 1e-5, "op=Sum")


def check_bucket_cap_mb(hvd, rank, size):
    """bucket_cap_mb groups gradients into buckets filled from the last parameter to the first
    (a tensor larger than the cap gets a bucket of its own), and training with buckets of any
    size matches single-process training; the last layers' bucket starts during backward."""
    data = _data(size, steps=3)
    want = _reference(_model(), data, _sgd)
    names = [n for n, _ in _model().named_parameters()]
    expected = {
        1e-9: [[n] for n in reversed(names)],
        120 / (1 << 20): [["2.bias", "2.weight"], ["0.bias"], ["0.weight"]],
        25: [list(reversed(names))],
    }
    for cap, buckets in expected.items():
        model = _model()
        opt = _distributed(hvd, rank, model, data, _sgd, bucket_cap_mb=cap)
        assert opt.buckets == buckets, (cap, opt.buckets)
        _assert_same_params(model, want, 1e-5, f"bucket_cap_mb={cap}")
    if size > 1:
        first, last = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
        model = torch.nn.Sequential(first, last)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), bucket_cap_mb=120 / (1 << 20))
        assert opt.buckets == [["1.bias", "1.weight"], ["0.bias"], ["0.weight"]], opt.buckets
        seen = {}

        def during_backward():
            pending = next((v for k, v in opt._handles.items() if isinstance(k, tuple) and len(k) == 2
                            and k[0] is last.bias and k[1] is last.weight), None)
            seen["started"] = pending is not None and pending.started and pending.handle is not None
            seen["first_pending"] = any(t is first.weight for key in opt._handles if isinstance(key, tuple) for t in key)

        out = last(_Probe.apply(first(torch.randn(BATCH, 6)), during_backward))
        out.sum().backward()
        opt.step()
        assert seen == {"started": True, "first_pending": False}, seen
    model = _model()
    for options, phrase in (({"bucket_cap_mb": -1}, "bucket_cap_mb=-1 is invalid"),
                            ({"bucket_cap_mb": "25"}, "expected a number of MiB"),
                            ({"bucket_cap_mb": 25, "groups": 2}, "both say how gradients are grouped")):
        try:
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **options)
        except ValueError as exc:
            assert phrase in str(exc), (phrase, str(exc))
        else:
            raise AssertionError(f"{options} did not raise ValueError")


class _Mixed(torch.nn.Module):
    """A sparse embedding, a float32 layer and a float64 layer: one bucket holds gradients that
    cannot share a flat buffer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 4, sparse=True)
        self.hidden = torch.nn.Linear(4, 5)
        self.head = torch.nn.Linear(5, 3).double()

    def forward(self, ids):
        return self.head(torch.tanh(self.hidden(self.emb(ids).mean(dim=1))).double())


class _Halving:
    """Stands in for a compressor of the user's own (sends half of each gradient)."""

    @staticmethod
    def compress(tensor):
        return tensor * 0.5, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor * 2.0


def check_buckets_flat_and_split(hvd, rank, size):
    """A bucket of dense gradients of one dtype is reduced as one flat request; a bucket mixing
    sparse, float32 and float64 gradients is split into requests that each can carry, and fp16
    compression and a compressor of the user's own (gradients compressed one by one) keep training
    equal to single-process training."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 10, (size * 2, 3), generator=g)
    y = torch.randint(0, 3, (size * 2,), generator=g)
    ref = _Mixed()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(2):
        ref_opt.zero_grad()
        F.cross_entropy(ref(ids), y).backward()
        ref_opt.step()
    mine = slice(rank * 2, rank * 2 + 2)
    # The float32 layer as one flat request, the float64 layer as another, and the sparse
    # embedding on its own; with sparse_as_dense its densified gradient shares the float32
    # buffer and is handed back sparse.
    for sparse_as_dense, want_kinds in ((False, ["_Flat", "_Flat", "_Sparse"]), (True, ["_Flat", "_Flat"])):
        model = _Mixed()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                       named_parameters=model.named_parameters(), bucket_cap_mb=25,
                                       sparse_as_dense=sparse_as_dense)
        assert len(opt.buckets) == 1, opt.buckets
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(model(ids[mine]), y[mine]).backward()
            if size > 1:
                (pending,) = opt._handles.values()
                kinds = sorted(type(part).__name__ for part in pending.parts)
                assert kinds == want_kinds, (sparse_as_dense, kinds)
            opt.step()
            assert model.emb.weight.grad.is_sparse, sparse_as_dense
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            close(p.detach(), q.detach(), 1e-6, f"mixed bucket, sparse_as_dense={sparse_as_dense}: {name}")

    data = _data(size, steps=3)
    want = _reference(_model(), data, _sgd)
    model = _model()
    seen = {}
    opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(), bucket_cap_mb=25)
    for x, yy in data:
        opt.zero_grad()
        F.cross_entropy(model(_my_rows(x, rank)[0]), _my_rows(yy, rank)[0]).backward()
        if size > 1:
            seen.update({type(pending).__name__: len(key) for key, pending in opt._handles.items()})
        opt.step()
    _assert_same_params(model, want, 1e-5, "one flat bucket")
    assert size == 1 or seen == {"_Flat": 4}, seen
    for compression, atol in ((hvd.Compression.fp16, 5e-3), (_Halving, 1e-5)):
        model = _model()
        _distributed(hvd, rank, model, data, _sgd, bucket_cap_mb=25, compression=compression)
        _assert_same_params(model, want, atol, f"buckets with {compression.__name__}")
        _assert_equal_across_ranks(hvd, model)


def check_flat_buffer_is_never_handed_out(hvd, rank, size):
    """A bucket's flat buffer is kept from step to step, but gradients stay the caller's own tensors:
    a gradient kept from an earlier step still holds that step's averaged value after later steps
    (zero_grad setting gradients to None), or is the same tensor throughout (zero_grad keeping them
    as zeroed tensors). A step in which
    a head is unused on every rank (its gradients None, reduced as zeros through the general path)
    between normal steps leaves training equal to one process's."""
    data = _data(size, steps=3)
    for set_to_none in (True, False):
        want = _reference(_model(), data, _sgd)
        model = _model()
        opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters())
        kept = []
        for x, y in data:
            opt.zero_grad(set_to_none=set_to_none)
            F.cross_entropy(model(_my_rows(x, rank)[0]), _my_rows(y, rank)[0]).backward()
            opt.step()
            kept.append([(p.grad, p.grad.clone()) for p in model.parameters()])
        _assert_same_params(model, want, 1e-5, f"set_to_none={set_to_none}")
        for step, grads in enumerate(kept):
            for i, (grad, value) in enumerate(grads):
                if set_to_none:
                    assert torch.equal(grad, value), f"gradient {i} of step {step} changed after that step"
                else:  # zeroed in place: still the tensors backward first made
                    assert grad is kept[0][i][0], f"gradient {i} was replaced at step {step}"

    def heads_loss(model, use_b, r):
        hidden = model["trunk"](torch.ones(2, 4) * (r + 1))
        return model["a"](hidden).sum() + (model["b"](hidden).sum() if use_b else 0)

    reference = _two_headed()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    model = _two_headed()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for use_b in (True, False, True):
        # One process: the gradient of the ranks' mean loss is the mean of their gradients.
        ref_opt.zero_grad()
        (sum(heads_loss(reference, use_b, r) for r in range(size)) / size).backward()
        ref_opt.step()
        opt.zero_grad()
        heads_loss(model, use_b, rank).backward()
        opt.step()
    _assert_same_params(model, reference, 1e-6, "a head unused in the middle step")
    _assert_equal_across_ranks(hvd, model)


def check_wrapping_keeps_optimizer_identity(hvd, rank, size):
    """The wrapped optimizer is an instance of the original class with its state and param groups,
    works with an LR scheduler, and param groups with several groups get unique default names."""
    model = _model()
    base = torch.optim.Adam([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.01}])
    model(torch.ones(1, 6)).sum().backward()
    base.step()
    opt = hvd.DistributedOptimizer(base)
    assert isinstance(opt, torch.optim.Adam) and type(opt).__name__ == "Adam"
    assert opt.state_dict()["state"].keys() == base.state_dict()["state"].keys()
    assert len(set(opt._parameter_names.values())) == 4
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.zero_grad()
    model(torch.ones(1, 6)).sum().backward()
    opt.step()
    scheduler.step()
    assert opt.param_groups[1]["lr"] == 0.005


def check_sparse_gradients(hvd, rank, size):
    """Sparse embedding gradients reduce both as sparse (allgather) and with sparse_as_dense, for
    SGD and for SparseAdam (which takes only sparse gradients: sparse_as_dense hands it a sparse
    gradient again), and every case matches single-process training."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 10, (size, 5), generator=g)

    def make():
        torch.manual_seed(0)
        return torch.nn.Embedding(10, 3, sparse=True)

    for kind in ("SGD", "SparseAdam"):
        ref = make()
        ref_opt = getattr(torch.optim, kind)(ref.parameters(), lr=0.5)
        for _ in range(2):
            ref_opt.zero_grad()
            (ref(ids).sum(dim=(1, 2)).mean()).backward()
            ref_opt.step()
        for dense in (False, True):
            emb = make()
            opt = hvd.DistributedOptimizer(getattr(torch.optim, kind)(emb.parameters(), lr=0.5),
                                           named_parameters=emb.named_parameters(), sparse_as_dense=dense)
            for _ in range(2):
                opt.zero_grad()
                emb(ids[rank]).sum().backward()
                opt.step()
                assert emb.weight.grad.is_sparse, f"{kind} sparse_as_dense={dense}: gradient no longer sparse"
            close(emb.weight.detach(), ref.weight.detach(), 1e-6, f"{kind} sparse_as_dense={dense}")


def check_argument_errors(hvd, rank, size):
    """Duplicate names, unnamed parameters, non-tuple entries, predivide with Sum or Adasum, and
    wrapping twice are refused with ValueErrors that name the problem."""
    model = _model()
    params = list(model.named_parameters())
    cases = [
        ({"named_parameters": [("w", params[0][1]), ("w", params[1][1])] + params[2:]}, "duplicates"),
        ({"named_parameters": params[:2]}, "not named"),
        ({"named_parameters": [p for _, p in params]}, "tuples"),
        ({"op": hvd.Sum, "gradient_predivide_factor": 2.0}, "gradient_predivide_factor"),
        ({"op": hvd.Adasum, "gradient_predivide_factor": 2.0}, "gradient_predivide_factor"),
        ({"backward_passes_per_step": 0}, "backward_passes_per_step"),
    ]
    for options, phrase in cases:
        try:
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **options)
        except ValueError as exc:
            assert phrase in str(exc), (phrase, str(exc))
        else:
            raise AssertionError(f"{options} did not raise ValueError")
    for op in (hvd.Average, hvd.Adasum):
        once = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=op)
        try:
            hvd.DistributedOptimizer(once)
        except ValueError as exc:
            assert "already a DistributedOptimizer" in str(exc), str(exc)
        else:
            raise AssertionError(f"wrapping a DistributedOptimizer(op={op!r}) again was not refused")


def check_one_bucket_takes_the_one_host_path(hvd, rank, size):
    """A model whose gradients fill one bucket reduces them through the one-host fast path at every
    step (when it is on), trains like single-process training and ends identical on every rank; a
    model of several buckets negotiates each of them."""
    from harness import counting_lockstep
    from spark_hvd.runtime.api import runtime_config

    with counting_lockstep() as calls:
        data = _data(size, steps=5)
        want = _reference(_model(), data, _sgd)
        model = _model()
        _distributed(hvd, rank, model, data, _sgd)
        _assert_same_params(model, want, 1e-5, "one bucket")
        _assert_equal_across_ranks(hvd, model)
        on = size > 1 and runtime_config().lockstep_bytes > 0 and runtime_config().shm
        assert calls == ([True] * 5 if on else [False] * 5 if size > 1 else []), calls
        calls.clear()
        model = _model()
        _distributed(hvd, rank, model, data, _sgd, bucket_cap_mb=0.0001)
        _assert_same_params(model, want, 1e-5, "several buckets")
        assert calls == [], calls


def test_one_bucket_without_the_fast_path():
    """With SPARK_HVD_LOCKSTEP_BYTES=0 the same check negotiates every step and trains the same."""
    results = launch([check_one_bucket_takes_the_one_host_path], np=2, settings={"lockstep_bytes": 0})
    assert_passed(results, check_one_bucket_takes_the_one_host_path)


def check_adasum_combines_parameter_changes(hvd, rank, size):
    """DistributedOptimizer(op=Adasum): each rank steps SGD on its own gradients, and every rank
    ends at the start plus the Adasum (numpy reference) of all ranks' changes, per parameter; with
    Adam (per-rank moments) the ranks still end with equal parameters. Over 3 ranks step() refuses
    with a ValueError naming the count."""
    from harness import adasum_reference

    data = _data(size, 2)
    x, y = data[0]
    changes = []  # every rank's SGD change, computed here from its rows
    for r in range(size):
        local = _model()
        F.cross_entropy(local(_my_rows(x, r)[0]), _my_rows(y, r)[0]).backward()
        changes.append([-0.1 * p.grad.detach().clone() for p in local.parameters()])
    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    assert isinstance(opt, torch.optim.SGD)
    F.cross_entropy(model(_my_rows(x, rank)[0]), _my_rows(y, rank)[0]).backward()
    if size & (size - 1):
        try:
            opt.step()
        except ValueError as exc:
            assert "power-of-two" in str(exc), str(exc)
        else:
            raise AssertionError(f"Adasum over {size} ranks was not refused")
        return
    opt.step()
    for i, (p, s) in enumerate(zip(model.parameters(), start)):
        combined = adasum_reference([c[i].reshape(-1).double().numpy() for c in changes])
        want = s + torch.from_numpy(combined).reshape(s.shape).float()
        close(p.detach(), want, atol=1e-6, what=f"parameter {i} after the Adasum step")
    adam_model = _model()
    adam = hvd.DistributedOptimizer(torch.optim.Adam(adam_model.parameters(), lr=0.01), op=hvd.Adasum)
    for xb, yb in data:
        adam.zero_grad()
        F.cross_entropy(adam_model(_my_rows(xb, rank)[0]), _my_rows(yb, rank)[0]).backward()
        adam.step()
    flat = torch.cat([p.detach().reshape(-1) for p in adam_model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0))
    for r in range(size):
        close(gathered[r], gathered[0], what=f"rank {r}'s parameters after Adam steps with Adasum")
    assert not torch.equal(flat, torch.cat([p.detach().reshape(-1) for p in _model().parameters()]))


ALL = [check_matches_single_process_training, check_backward_passes_per_step, check_fp16_compression,
       check_allreduce_starts_during_backward, check_unused_parameters, check_clipping_between_synchronize_and_step,
       check_zero_grad_between_backward_and_step, check_groups_and_predivide, check_bucket_cap_mb,
       check_buckets_flat_and_split, check_flat_buffer_is_never_handed_out, check_wrapping_keeps_optimizer_identity,
       check_sparse_gradients, check_argument_errors, check_one_bucket_takes_the_one_host_path,
       check_adasum_combines_parameter_changes]


@pytest.mark.parametrize("check", ALL, ids=lambda c: c.__name__[len("check_"):])
def test_distributed_optimizer(world, check):
    """The optimizer check (its docstring says what it asserts) passed on every rank."""
    assert_passed(world, check)


def check_autotune_picks_a_bucket_size_on_every_rank(hvd, rank, size):
    """Under HOROVOD_AUTOTUNE, an optimizer without bucket_cap_mb tries every candidate after the
    warm-up, keeps the fastest, forms the same buckets on every rank, and still trains exactly."""
    from spark_hvd.torch.optimizer import BUCKET_CANDIDATES

    data = _data(size, steps=14)
    want = _reference(_model(), data, _sgd)
    model = _model()
    opt = _distributed(hvd, rank, model, data, _sgd)
    trials = opt.bucket_trials
    assert [cap for cap, _ in trials] == list(BUCKET_CANDIDATES), trials
    assert all(seconds > 0 for _, seconds in trials)
    kept = min(trials, key=lambda t: t[1])[0]
    names = [n for n, _ in model.named_parameters()]
    assert opt.buckets == ([] if kept == 0 else [list(reversed(names))]), (kept, opt.buckets)
    assert hvd.allgather_object(opt.buckets) == [opt.buckets] * size
    _assert_same_params(model, want, 1e-5, "autotuned buckets")
    explicit = hvd.DistributedOptimizer(_sgd(_model()), bucket_cap_mb=25)
    assert explicit.bucket_trials == []  # a size the user chose is kept


def test_autotune_chooses_bucket_size():
    """Autotune's bucket search at np=2 (warm-up 1 sample of 2 steps, then 4 samples of 2 steps)."""
    results = launch([check_autotune_picks_a_bucket_size_on_every_rank], np=2,
                     env={"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1",
                          "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "2"})
    assert_passed(results, check_autotune_picks_a_bucket_size_on_every_rank)
