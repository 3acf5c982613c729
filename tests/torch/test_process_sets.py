"""Process sets at world sizes 1, 2 and 3: every collective, the autograd forms and
DistributedOptimizer accept ``process_set=`` and involve only its members."""

import pytest
import torch

from torch_world import assert_passed, close


def _members(size):
    """The even ranks (rank 0 alone at size 1 and 2; ranks 0 and 2 at size 3)."""
    return list(range(0, size, 2))


def check_init_registers_process_sets(hvd, rank, size):
    """init(process_sets=[ProcessSet(ranks)]) registers the given objects; rank(), size() and
    included() describe the set; remove_process_set makes later use a ValueError."""
    ps = hvd.ProcessSet(_members(size))
    hvd.init(process_sets=[ps])
    assert ps.process_set_id not in (None, 0)
    assert ps.size() == len(_members(size)) and ps.included() == (rank in _members(size))
    if ps.included():
        assert ps.rank() == _members(size).index(rank)
    assert hvd.global_process_set.size() == size
    assert hvd.remove_process_set(ps) is True
    if ps.included():
        try:
            hvd.allreduce(torch.ones(1), process_set=ps)
        except ValueError as exc:
            assert "removed" in str(exc)
        else:
            raise AssertionError("a removed process set was accepted")


def check_collectives_within_a_set(hvd, rank, size):
    """Members of the even-rank set get results computed over the members only, for allreduce,
    grouped_allreduce, allgather, broadcast, alltoall, reducescatter, barrier and the object
    collectives; a non-member passing the set gets a ValueError."""
    members = _members(size)
    ps = hvd.add_process_set(members)
    n = len(members)
    if rank not in members:
        try:
            hvd.allreduce(torch.ones(1), process_set=ps)
        except ValueError as exc:
            assert "not a member" in str(exc)
        else:
            raise AssertionError("a non-member was allowed to use the process set")
        return
    close(hvd.allreduce(torch.full((2,), float(rank)), op=hvd.Sum, process_set=ps),
          torch.full((2,), float(sum(members))))
    outs = hvd.grouped_allreduce([torch.full((1,), float(rank))], op=hvd.Max, process_set=ps)
    close(outs[0], torch.full((1,), float(members[-1])))
    close(hvd.allgather(torch.tensor([rank]), process_set=ps), torch.tensor(members))
    close(hvd.broadcast(torch.tensor([rank]), root_rank=members[-1], process_set=ps), torch.tensor([members[-1]]))
    out, received = hvd.alltoall(torch.tensor([rank] * n), splits=[1] * n, process_set=ps)
    close(out, torch.tensor(members))
    close(hvd.reducescatter(torch.ones(n, 2), op=hvd.Sum, process_set=ps), torch.full((1, 2), float(n)))
    hvd.barrier(process_set=ps)
    assert hvd.broadcast_object(("root", rank), root_rank=members[0], process_set=ps) == ("root", 0)
    assert hvd.allgather_object(rank, process_set=ps) == members
    hvd.remove_process_set(ps)


def check_autograd_within_a_set(hvd, rank, size):
    """allgather's gradient inside a set uses the set's ranks: each member gets its own rows of
    the averaged output gradient."""
    members = _members(size)
    ps = hvd.add_process_set(members)
    if rank in members:
        x = torch.zeros(2, requires_grad=True)
        (hvd.allgather(x, process_set=ps) * (rank + 1)).sum().backward()
        mean_weight = sum(m + 1 for m in members) / len(members)
        close(x.grad, torch.full((2,), mean_weight), 1e-6)
    hvd.remove_process_set(ps)


def check_distributed_optimizer_within_a_set(hvd, rank, size):
    """DistributedOptimizer(process_set=...) averages gradients over the members only."""
    members = _members(size)
    ps = hvd.add_process_set(members)
    if rank in members:
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1, bias=False)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                       named_parameters=model.named_parameters(), process_set=ps)
        model(torch.full((1, 2), float(rank + 1))).sum().backward()
        opt.synchronize()
        mean = sum(m + 1 for m in members) / len(members)
        close(model.weight.grad, torch.full((1, 2), mean), 1e-6)
        with opt.skip_synchronize():
            opt.step()
    hvd.remove_process_set(ps)


def check_distributed_optimizer_outside_its_set_trains_alone(hvd, rank, size):
    """An optimizer restricted to the even ranks, built on every rank as Horovod scripts do: the
    even ranks average their gradients, an odd rank steps on its own gradient without waiting for
    anyone."""
    evens = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(), process_set=evens)
    model(torch.full((1, 2), float(rank + 1))).sum().backward()
    opt.step()
    grad = sum(r + 1 for r in evens.ranks) / evens.size() if rank % 2 == 0 else rank + 1
    close(model.weight.detach(), torch.full((1, 2), -float(grad)), 1e-6)
    hvd.barrier()
    hvd.remove_process_set(evens)


ALL = [check_init_registers_process_sets, check_collectives_within_a_set, check_autograd_within_a_set,
       check_distributed_optimizer_within_a_set, check_distributed_optimizer_outside_its_set_trains_alone]


@pytest.mark.parametrize("check", ALL, ids=lambda c: c.__name__[len("check_"):])
def test_process_sets(world, check):
    """The process-set check (its docstring says what it asserts) passed on every rank."""
    assert_passed(world, check)
