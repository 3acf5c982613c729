"""SyncBatchNorm at world sizes 1, 2 and 3 behaves like BatchNorm on the union of the ranks' batches."""

import pytest
import torch

from torch_world import assert_passed, close


def _union_batch(size, shape_tail):
    """Every rank's rows (rank r has r + 2 rows) in one tensor, identical on all ranks."""
    g = torch.Generator().manual_seed(5)
    rows = sum(r + 2 for r in range(size))
    return torch.randn(rows, *shape_tail, generator=g, dtype=torch.float64) * 3 + 1


def _slice(size, rank):
    start = sum(r + 2 for r in range(rank))
    return slice(start, start + rank + 2)


def _compare(hvd, rank, size, dims, momentum):
    shape_tail = (4,) if dims == 1 else (4, 3, 2)
    union = _union_batch(size, shape_tail)
    weights = torch.randn(union.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    cls = torch.nn.BatchNorm1d if dims == 1 else torch.nn.BatchNorm2d
    ref = cls(4, momentum=momentum).double()
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(7))
        ref.bias.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(8))
    sync = hvd.SyncBatchNorm(4, momentum=momentum).double()
    sync.load_state_dict(ref.state_dict())
    for step in range(2):
        x_ref = union.clone().requires_grad_()
        out_ref = ref(x_ref)
        (out_ref * weights).sum().backward()
        x = union[_slice(size, rank)].clone().requires_grad_()
        out = sync(x)
        (out * weights[_slice(size, rank)]).sum().backward()
        what = f"{dims}d momentum={momentum} step {step}"
        close(out.detach(), out_ref.detach()[_slice(size, rank)], 1e-10, what + " output")
        close(x.grad, x_ref.grad[_slice(size, rank)], 1e-10, what + " input gradient")
        weight_grad = hvd.allreduce(sync.weight.grad, op=hvd.Sum)
        close(weight_grad, ref.weight.grad, 1e-10, what + " summed weight gradient")
        close(sync.running_mean, ref.running_mean, 1e-10, what + " running mean")
        close(sync.running_var, ref.running_var, 1e-10, what + " running var")
        sync.zero_grad()
        ref.zero_grad()
    sync.eval()
    ref.eval()
    close(sync(union[_slice(size, rank)]), ref(union)[_slice(size, rank)], 1e-10, "eval mode")


def check_matches_batch_norm_on_union(hvd, rank, size):
    """Outputs, input gradients, summed weight gradients and running statistics of SyncBatchNorm on
    each rank's slice equal BatchNorm's on the union batch (1d and 2d inputs, uneven slices,
    momentum 0.1 and cumulative); eval mode uses the running statistics."""
    for dims, momentum in ((1, 0.1), (2, None)):
        _compare(hvd, rank, size, dims, momentum)


def check_convert_and_float32(hvd, rank, size):
    """convert_sync_batchnorm swaps BatchNorm layers for SyncBatchNorm keeping their parameters,
    and float32 inputs give float32 outputs normalised over all ranks."""
    model = torch.nn.Sequential(torch.nn.Conv1d(2, 3, 1), torch.nn.BatchNorm1d(3))
    with torch.no_grad():
        model[1].weight.fill_(2.0)
    converted = hvd.SyncBatchNorm.convert_sync_batchnorm(model)
    assert isinstance(converted[1], hvd.SyncBatchNorm)
    assert converted[1].weight is model[1].weight
    norm = hvd.SyncBatchNorm(2)
    x = torch.full((2, 2, 5), float(rank))
    out = norm(x)
    assert out.dtype == torch.float32
    mean = sum(range(size)) / size
    var = sum((r - mean) ** 2 for r in range(size)) / size
    want = (rank - mean) / (var + norm.eps) ** 0.5
    close(out, torch.full((2, 2, 5), want), 1e-4)
    try:
        norm(torch.ones(3))
    except ValueError as exc:
        assert "2D" in str(exc)
    else:
        raise AssertionError("1D input was accepted")


ALL = [check_matches_batch_norm_on_union, check_convert_and_float32]


@pytest.mark.parametrize("check", ALL, ids=lambda c: c.__name__[len("check_"):])
def test_sync_batch_norm(world, check):
    """The SyncBatchNorm check (its docstring says what it asserts) passed on every rank."""
    assert_passed(world, check)
