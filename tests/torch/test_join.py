"""join() with uneven data at world sizes 1, 2 and 3: ranks that run out call join(), the others
keep training with the joined ranks contributing zeros, and join() returns the last rank."""

import pytest
import torch
import torch.nn.functional as F

from torch_world import assert_passed, close


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _batches(r):
    """Rank r has r + 2 batches: the data is uneven across ranks."""
    g = torch.Generator().manual_seed(100 + r)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)) for _ in range(r + 2)]


def _reference(size):
    """Simulate the job in one process: at step t the gradient is the sum over ranks that still
    have data of their gradients, divided by size (joined ranks contribute zeros)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [_batches(r) for r in range(size)]
    for t in range(size + 1):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(size):
            if t < len(data[r]):
                local = _model()
                local.load_state_dict(model.state_dict())
                x, y = data[r][t]
                F.mse_loss(local(x), y).backward()
                for g, p in zip(grads, local.parameters()):
                    g += p.grad / size
        opt.zero_grad()
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        opt.step()
    return model


def check_join_with_uneven_batches(hvd, rank, size):
    """Training with DistributedOptimizer over uneven data, averaging a metric each step, ends with
    join() returning size - 1 on every rank; after a broadcast from that rank every model equals
    the single-process simulation, and unnamed collectives still agree afterwards."""
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for x, y in _batches(rank):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        hvd.allreduce(loss.detach(), name="metric.loss")
    last = hvd.join()
    assert last == size - 1, f"join() returned {last}"
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    want = _reference(size)
    for p, q in zip(model.parameters(), want.parameters()):
        close(p.detach(), q.detach(), 1e-6, "after join")
    close(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(size)), what="unnamed after join")


def check_joined_rank_contributes_zeros(hvd, rank, size):
    """While rank 0 has joined, the others' allreduce Sum sees zeros from it and Average divides by
    the full size; join() returns the rank that joined last."""
    if rank == 0:
        last = hvd.join()
    else:
        got = hvd.allreduce(torch.full((3,), float(rank)), op=hvd.Sum, name="while.joined")
        close(got, torch.full((3,), float(sum(range(1, size)))), what="Sum")
        got = hvd.allreduce(torch.full((3,), float(rank)), name="while.joined.avg")
        close(got, torch.full((3,), sum(range(1, size)) / size), 1e-6, "Average")
        if rank == size - 1:
            # Completes only once every other rank has joined, so this rank joins last.
            hvd.allreduce(torch.ones(1), name="after.the.others")
        last = hvd.join()
    assert last == (size - 1 if size > 1 else 0), last


ALL = [check_join_with_uneven_batches, check_joined_rank_contributes_zeros]


@pytest.mark.parametrize("check", ALL, ids=lambda c: c.__name__[len("check_"):])
def test_join(world, check):
    """The join check (its docstring says what it asserts) passed on every rank."""
    assert_passed(world, check)
