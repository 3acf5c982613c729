"""hvd.elastic at world sizes 1, 2 and 3: states commit, restore and sync from rank 0; the elastic
sampler deals an epoch's rest to a new world without loss or repetition; elastic.run restores the
last commit and forms a new world after a failure."""

import pytest
import torch

from torch_world import assert_passed, close


def check_torch_state_commits_restores_and_syncs(hvd, rank, size):
    """sync() gives every rank rank 0's model, optimizer and values, and commits them; restore()
    brings back the last commit; commit() keeps the current values."""
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(float(rank + 1))
        model.bias.fill_(float(rank))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1), momentum=0.5)
    state = hvd.elastic.TorchState(model, optimizer, epoch=10 + rank, history=[rank])
    state.sync()
    close(model.weight.detach(), torch.ones(1, 2))
    assert state.epoch == 10 and state.history == [0] and optimizer.param_groups[0]["lr"] == 0.1
    with torch.no_grad():
        model.weight.fill_(7.0)
    state.epoch, state.history = 11, [0, 1]
    state.restore()
    close(model.weight.detach(), torch.ones(1, 2))
    assert state.epoch == 10 and state.history == [0]
    with torch.no_grad():
        model.weight.fill_(5.0)
    state.epoch = 12
    state.commit()  # no elastic launcher: no host updates, nothing raised
    with torch.no_grad():
        model.weight.fill_(0.0)
    state.restore()
    close(model.weight.detach(), torch.full((1, 2), 5.0))
    assert state.epoch == 12


def check_sampler_deals_the_rest_of_an_epoch_to_a_new_world(hvd, rank, size):
    """A sampler state from a world of 3 whose ranks each processed 4 samples, synced into this
    world: together the ranks hold exactly the epoch's order from position 12 on, once each."""
    dataset = list(range(30))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=7)
    sampler.set_epoch(2)
    order = list(sampler._order())
    previous_world = {"epoch": 2, "start": 0, "done": 4, "dealt_to": 3, "seed": 7, "shuffle": True, "length": 30}
    sampler.sync_from(previous_world)
    assert sampler.processed_num == 12
    mine = list(sampler)
    assert len(sampler) == len(mine) == len(range(rank, 18, size))
    everyone = hvd.allgather_object(mine)
    dealt = [i for part in everyone for i in part]
    assert sorted(dealt) == sorted(order[12:]) and len(dealt) == len(set(dealt)) == 18


def check_run_restores_the_last_commit_after_a_failure(hvd, rank, size):
    """A training function that fails in the middle (a collective error on every rank, as a lost
    peer causes) is called again in a fresh world after its state went back to the last commit;
    the steps it had not committed are done once more, the committed ones not."""
    from spark_hvd.runtime.errors import CollectiveError

    calls = []
    state = hvd.elastic.ObjectState(step=0, total=0)

    @hvd.elastic.run
    def train(state):
        calls.append(state.step)
        while state.step < 6:
            state.total += int(hvd.allreduce(torch.tensor([1]), op=hvd.Sum).item())
            state.step += 1
            if state.step % 2 == 0:
                state.commit()
            if state.step == 5 and len(calls) == 1:
                raise CollectiveError("a peer was lost (simulated on every rank)")
        return state.total

    assert train(state) == 6 * size
    assert calls == [0, 4], calls  # called again from the commit after step 4
    assert hvd.is_initialized() and hvd.size() == size


ALL = [check_torch_state_commits_restores_and_syncs, check_sampler_deals_the_rest_of_an_epoch_to_a_new_world,
       check_run_restores_the_last_commit_after_a_failure]


@pytest.mark.parametrize("check", ALL, ids=lambda c: c.__name__[len("check_"):])
def test_elastic(world, check):
    """The elastic check (its docstring says what it asserts) passed on every rank."""
    assert_passed(world, check)
