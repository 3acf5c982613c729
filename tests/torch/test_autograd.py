"""Gradients of the differentiable collectives are Horovod's, at world sizes 1, 2 and 3.

Each rank weights its output by (rank + 1) before summing, so the expected gradients are
simple functions of rank and size.
"""

import pytest
import torch

from torch_world import assert_passed, close


def _mean_weight(size):
    return (size + 1) / 2


def check_allreduce_gradient(hvd, rank, size):
    """d/dx of allreduce is allreduce of the output gradients with the same op and factors."""
    for op, factor in ((hvd.Average, _mean_weight(size)), (hvd.Sum, size * (size + 1) / 2)):
        x = torch.ones(3, 2, requires_grad=True)
        (hvd.allreduce(x, op=op) * (rank + 1)).sum().backward()
        close(x.grad, torch.full((3, 2), factor), 1e-6, f"allreduce op={op!r}")
    x = torch.ones(4, requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=1.5) * (rank + 1)).sum().backward()
    close(x.grad, torch.full((4,), 3.0 * size * (size + 1) / 2), 1e-6, "allreduce scaled")


def check_allreduce_fp16_gradient(hvd, rank, size):
    """Gradients flow through allreduce with fp16 compression and come back as float32."""
    x = torch.ones(5, requires_grad=True)
    (hvd.allreduce(x, compression=hvd.Compression.fp16) * (rank + 1)).sum().backward()
    close(x.grad, torch.full((5,), _mean_weight(size)), 1e-3, "fp16")


def check_grouped_allreduce_gradient(hvd, rank, size):
    """Each tensor of grouped_allreduce gets the gradient allreduce would give it."""
    a = torch.ones(2, requires_grad=True)
    b = torch.ones(3, 3, requires_grad=True)
    outs = hvd.grouped_allreduce([a, b], op=hvd.Sum)
    ((outs[0] * (rank + 1)).sum() + (outs[1] * 2 * (rank + 1)).sum()).backward()
    total = size * (size + 1) / 2
    close(a.grad, torch.full((2,), total), 1e-6, "a")
    close(b.grad, torch.full((3, 3), 2 * total), 1e-6, "b")


def _gather_weights(rows, size, rank):
    """Per-row weights of the gathered output on ``rank``: (rank + 1) * (row + 1)."""
    return (rank + 1) * torch.arange(1, rows + 1, dtype=torch.float64).unsqueeze(1)


def check_allgather_gradient(hvd, rank, size):
    """d/dx of allgather: the averaged output gradients, rows of this rank's slice (rank r owns r+1 rows)."""
    total_rows = size * (size + 1) // 2
    x = torch.zeros(rank + 1, 2, dtype=torch.float64, requires_grad=True)
    y = hvd.allgather(x)
    assert y.shape == (total_rows, 2)
    (y * _gather_weights(total_rows, size, rank)).sum().backward()
    offset = rank * (rank + 1) // 2
    rows = torch.arange(offset + 1, offset + rank + 2, dtype=torch.float64).unsqueeze(1)
    close(x.grad, (_mean_weight(size) * rows).expand(rank + 1, 2), 1e-9, "allgather")


def check_grouped_allgather_gradient(hvd, rank, size):
    """grouped_allgather gives each tensor allgather's gradient."""
    total_rows = size * (size + 1) // 2
    a = torch.zeros(rank + 1, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    ya, yb = hvd.grouped_allgather([a, b])
    ((ya * _gather_weights(total_rows, size, rank).squeeze(1)).sum() + (yb * (rank + 1)).sum()).backward()
    offset = rank * (rank + 1) // 2
    close(a.grad, _mean_weight(size) * torch.arange(offset + 1, offset + rank + 2, dtype=torch.float64), 1e-9)
    close(b.grad, torch.full((1, 3), _mean_weight(size), dtype=torch.float64), 1e-9)


def check_broadcast_gradient(hvd, rank, size):
    """d/dx of broadcast: the averaged output gradient on the root rank, zeros on the others."""
    root = size - 1
    x = torch.full((2, 2), float(rank), requires_grad=True)
    y = hvd.broadcast(x, root_rank=root)
    close(y.detach(), torch.full((2, 2), float(root)))
    (y * (rank + 1)).sum().backward()
    want = _mean_weight(size) if rank == root else 0.0
    close(x.grad, torch.full((2, 2), want), 1e-6, "broadcast")


def check_alltoall_gradient(hvd, rank, size):
    """d/dx of alltoall sends the output gradients back: rows sent to rank j get j's weight (j + 1)."""
    splits = [j + 1 for j in range(size)]
    x = torch.zeros(sum(splits), 2, requires_grad=True)
    out, received = hvd.alltoall(x, splits=splits)
    assert not received.requires_grad
    (out * (rank + 1)).sum().backward()
    want = torch.cat([torch.full((j + 1, 2), float(j + 1)) for j in range(size)])
    close(x.grad, want, 1e-6, "alltoall with splits")
    x = torch.zeros(2 * size, requires_grad=True)
    (hvd.alltoall(x) * (rank + 1)).sum().backward()
    close(x.grad, torch.arange(1, size + 1, dtype=torch.float32).repeat_interleave(2), 1e-6, "even alltoall")


def check_reducescatter_gradient(hvd, rank, size):
    """d/dx of reducescatter: the allgathered output gradients, times size for op=Sum."""
    rows = 2 * size + 1
    blocks = [len(b) for b in torch.tensor_split(torch.arange(rows), size)]
    weights = torch.cat([torch.full((n, 2), float(j + 1)) for j, n in enumerate(blocks)])
    for op, factor in ((hvd.Average, 1.0), (hvd.Sum, float(size))):
        x = torch.ones(rows, 2, requires_grad=True)
        (hvd.reducescatter(x, op=op) * (rank + 1)).sum().backward()
        close(x.grad, weights * factor, 1e-6, f"reducescatter op={op!r}")
    a = torch.ones(rows, requires_grad=True)
    (ya,) = hvd.grouped_reducescatter([a], op=hvd.Sum, postscale_factor=0.5)
    (ya * (rank + 1)).sum().backward()
    close(a.grad, weights[:, 0] * size * 0.5, 1e-6, "grouped_reducescatter")


ALL = [check_allreduce_gradient, check_allreduce_fp16_gradient, check_grouped_allreduce_gradient,
       check_allgather_gradient, check_grouped_allgather_gradient, check_broadcast_gradient,
       check_alltoall_gradient, check_reducescatter_gradient]


@pytest.mark.parametrize("check", ALL, ids=lambda c: c.__name__[len("check_"):])
def test_gradient(world, check):
    """The gradient check (its docstring says what it asserts) passed on every rank."""
    assert_passed(world, check)
