"""SparkHvdStrategy's collectives and world at sizes 1, 2 and 3: barrier, broadcast, all_gather,
reduce and reduce_boolean_decision, the cluster environment Lightning sees, and their errors."""

import os

import pytest
import torch
from lightning_utilities.core.rank_zero import rank_zero_only

from lightning_world import assert_passed, close, shared_dir, trainer
from spark_hvd.lightning import SparkHvdEnvironment


def _raises(kind, phrases, call):
    try:
        call()
    except kind as exc:
        for phrase in phrases:
            assert phrase in str(exc), (phrase, str(exc))
    else:
        raise AssertionError(f"{call} did not raise {kind.__name__}")


def check_world(hvd, rank, size):
    """The Trainer and its cluster environment report the launcher's ranks and sizes, only rank 0 is
    global zero (also for Lightning's rank_zero_only), and ranks cannot be reassigned."""
    t = trainer()
    strategy = t.strategy
    assert (t.global_rank, t.local_rank, t.node_rank, t.world_size) == (rank, hvd.local_rank(), hvd.cross_rank(), size)
    assert t.is_global_zero == (rank == 0) and rank_zero_only.rank == rank
    env = strategy.cluster_environment
    assert isinstance(env, SparkHvdEnvironment) and env.creates_processes_externally
    assert SparkHvdEnvironment.detect(), "a process started by the launcher was not detected"
    assert env.main_address == "127.0.0.1" and env.main_port > 0, (env.main_address, env.main_port)
    env.set_global_rank(rank)
    env.set_world_size(size)
    _raises(ValueError, [f"global rank {rank + 1}", f"rank {rank}"], lambda: env.set_global_rank(rank + 1))
    _raises(ValueError, [f"world size {size + 1}", f"{size} processes"], lambda: env.set_world_size(size + 1))
    assert strategy.root_device == torch.device("cpu")


def check_barrier(hvd, rank, size):
    """After barrier() returns on any rank, every rank has done what it did before the barrier."""
    with shared_dir(hvd) as directory:
        with open(os.path.join(directory, f"before-{rank}"), "w"):
            pass
        trainer().strategy.barrier("files written")
        assert sorted(os.listdir(directory)) == sorted(f"before-{r}" for r in range(size))


def check_broadcast(hvd, rank, size):
    """broadcast returns the source rank's object on every rank (a tensor on this rank's device),
    and refuses a source that is not a rank."""
    strategy = trainer().strategy
    root = size - 1
    assert strategy.broadcast({"rank": rank, "path": f"/tmp/{rank}"}, src=root) == {"rank": root, "path": f"/tmp/{root}"}
    assert strategy.broadcast(f"from {rank}") == "from 0"
    got = strategy.broadcast(torch.full((2, 3), float(rank)), src=root)
    close(got, torch.full((2, 3), float(root)), 0.0, "broadcast tensor")
    _raises(ValueError, [f"src={size}", f"0..{size - 1}"], lambda: strategy.broadcast(1, src=size))


def check_all_gather(hvd, rank, size):
    """all_gather stacks every rank's tensor in rank order (shape (size, *shape), also for scalars);
    with sync_grads a rank's tensor receives the sum over ranks of its slot's gradients."""
    strategy = trainer().strategy
    got = strategy.all_gather(torch.full((2, 3), float(rank)))
    close(got, torch.arange(size, dtype=torch.float32).reshape(size, 1, 1).expand(size, 2, 3), 0.0, "all_gather")
    close(strategy.all_gather(torch.tensor(rank)), torch.arange(size), 0.0, "scalars")
    x = (torch.tensor([1.0, 2.0]) * (rank + 1)).requires_grad_()
    gathered = strategy.all_gather(x, sync_grads=True)
    close(gathered, torch.stack([torch.tensor([1.0, 2.0]) * (r + 1) for r in range(size)]), 0.0, "gathered values")
    # rank r's loss weighs slot s by (r + 1) * (s + 1): slot s's gradient summed over ranks is (s + 1) * sum(r + 1)
    weights = (rank + 1) * torch.arange(1, size + 1, dtype=torch.float32).reshape(size, 1)
    (gathered * weights).sum().backward()
    close(x.grad, torch.full((2,), (rank + 1) * size * (size + 1) / 2), 1e-6, "gradient of all_gather")
    _raises(TypeError, ["tensor", "list"], lambda: strategy.all_gather([1, 2]))


def check_reduce(hvd, rank, size):
    """reduce combines over the ranks by name ('mean', 'sum', 'max', 'min'), torch ReduceOp or
    spark-hvd op; in place for tensors, a float mean for integers, a number for numbers; it is
    differentiable for tensors that require a gradient, and bad ops or groups name the value."""
    strategy = trainer().strategy
    value = lambda: torch.tensor([float(rank), 1.0])  # noqa: E731
    cases = [("mean", [(size - 1) / 2, 1.0]), ("avg", [(size - 1) / 2, 1.0]), ("sum", [size * (size - 1) / 2, size]),
             ("max", [size - 1, 1.0]), ("min", [0.0, 1.0]), (torch.distributed.ReduceOp.SUM, [size * (size - 1) / 2, size]),
             (hvd.Max, [size - 1, 1.0])]
    for op, want in cases:
        tensor = value()
        got = strategy.reduce(tensor, reduce_op=op)
        assert got is tensor, f"{op}: not reduced in place"
        close(got, torch.tensor(want), 1e-6, f"reduce_op={op}")
    close(strategy.reduce(value()), torch.tensor([(size - 1) / 2, 1.0]), 1e-6, "default op")
    mean = strategy.reduce(torch.tensor(rank))
    assert mean.dtype == torch.float32 and abs(mean.item() - (size - 1) / 2) < 1e-6, mean
    total = strategy.reduce(rank, reduce_op="sum")
    assert total == size * (size - 1) // 2 and isinstance(total, int), total
    x = torch.tensor([float(rank + 1)], requires_grad=True)
    (strategy.reduce(x, reduce_op="sum") * (rank + 1)).sum().backward()
    close(x.grad, torch.tensor([size * (size + 1) / 2]), 1e-6, "gradient of reduce")
    _raises(ValueError, ["reduce_op='median'", "'mean'"], lambda: strategy.reduce(value(), reduce_op="median"))
    _raises(ValueError, ["group='world'", "ProcessSet"], lambda: strategy.reduce(value(), group="world"))
    _raises(TypeError, ["tensor or a number", "list"], lambda: strategy.reduce([1.0]))


def check_reduce_boolean_decision(hvd, rank, size):
    """reduce_boolean_decision gives every rank the all() (or any()) of the ranks' decisions."""
    strategy = trainer().strategy
    assert strategy.reduce_boolean_decision(rank == 0) == (size == 1)
    assert strategy.reduce_boolean_decision(rank == 0, all=False) is True
    assert strategy.reduce_boolean_decision(True) is True


def check_process_set_group(hvd, rank, size):
    """A spark_hvd ProcessSet serves as Lightning's group: reduce and all_gather over its ranks only."""
    if size == 1:
        return  # no proper subset to form
    evens = hvd.add_process_set(list(range(0, size, 2)))
    try:
        strategy = trainer().strategy
        if rank % 2 == 0:
            got = strategy.reduce(torch.tensor([float(rank)]), group=evens, reduce_op="sum")
            close(got, torch.tensor([float(sum(range(0, size, 2)))]), 0.0, "reduce over the even ranks")
            gathered = strategy.all_gather(torch.tensor([rank]), group=evens)
            close(gathered, torch.tensor([[r] for r in range(0, size, 2)]), 0.0, "all_gather over the even ranks")
    finally:
        hvd.remove_process_set(evens)


ALL = [check_world, check_barrier, check_broadcast, check_all_gather, check_reduce, check_reduce_boolean_decision,
       check_process_set_group]


@pytest.mark.parametrize("check", ALL, ids=lambda c: c.__name__[len("check_"):])
def test_lightning_collective(world, check):
    """The collective check (its docstring says what it asserts) passed on every rank."""
    assert_passed(world, check)
