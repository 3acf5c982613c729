"""broadcast_parameters, broadcast_optimizer_state, broadcast_object and allgather_object at world
sizes 1, 2 and 3."""

import pytest
import torch
import torch.nn.functional as F

from torch_world import assert_passed, close


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))


def _train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(torch.randn(6, 5, generator=g)), torch.randn(6, 2, generator=g)).backward()
        opt.step()


def _same_state(a, b, what):
    """Two optimizer state_dicts are equal: tensors exactly, everything else by ==."""
    assert a["param_groups"] == b["param_groups"], f"{what}: param groups differ"
    assert a["state"].keys() == b["state"].keys(), f"{what}: state keys differ"
    for key, state in a["state"].items():
        assert state.keys() == b["state"][key].keys(), what
        for name, value in state.items():
            other = b["state"][key][name]
            if isinstance(value, torch.Tensor):
                close(other, value, 0.0, f"{what}: state[{key}][{name}]")
            else:
                assert type(other) is type(value) and other == value, f"{what}: state[{key}][{name}]"


def check_broadcast_parameters_forms(hvd, rank, size):
    """state_dict (buffers included), named_parameters() generators and parameters() lists all end
    up equal to the root's values on every rank."""
    root = size - 1
    for form in ("state_dict", "named_parameters", "parameters"):
        model = _model(seed=rank)
        model[1].running_mean.fill_(float(rank))
        params = {"state_dict": lambda: model.state_dict(), "named_parameters": lambda: model.named_parameters(),
                  "parameters": lambda: list(model.parameters())}[form]()
        hvd.broadcast_parameters(params, root_rank=root)
        want = _model(seed=root)
        for p, q in zip(model.parameters(), want.parameters()):
            close(p.detach(), q.detach(), what=form)
        if form == "state_dict":
            close(model[1].running_mean, torch.full((4,), float(root)), what="buffer")
    try:
        hvd.broadcast_parameters({"a": torch.zeros(1), "b": 3}, root_rank=0)
    except ValueError as exc:
        assert "'b'" in str(exc)
    else:
        raise AssertionError("a non-tensor value did not raise ValueError")


def _make(kind, model):
    if kind == "SGD":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    if kind == "Adam":
        return torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.95), amsgrad=True)
    return torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)


def check_optimizer_state_round_trip(hvd, rank, size):
    """After the root trained a few steps (and changed its learning rate), broadcast_optimizer_state
    gives every rank the root's exact state (moments, step, lr, betas, amsgrad) for SGD, Adam and
    AdamW, whether the others had no state or different state; training on then stays identical."""
    root = 0
    for kind in ("SGD", "Adam", "AdamW"):
        model = _model(seed=0)
        opt = _make(kind, model)
        if rank == root:
            _train(model, opt, steps=3, seed=7)
            opt.param_groups[0]["lr"] *= 0.5
        elif rank == 2:
            _train(model, opt, steps=1, seed=99)  # stale state, to be replaced
        hvd.broadcast_parameters(model.state_dict(), root_rank=root)
        hvd.broadcast_optimizer_state(opt, root_rank=root)
        mine = opt.state_dict()
        theirs = hvd.broadcast_object(mine, root_rank=root)
        _same_state(theirs, mine, kind)
        if kind != "SGD":
            step = next(iter(mine["state"].values()))["step"]
            assert float(step) == 3.0, f"{kind}: step {step}"
        _train(model, opt, steps=2, seed=11)
        for name, p in model.named_parameters():
            gathered = hvd.allgather(p.detach().unsqueeze(0))
            assert all(torch.equal(gathered[0], g) for g in gathered), f"{kind}: {name} diverged"


def _gathered_equal(hvd, value, what):
    """``value`` (a tensor or an optimizer state_dict) is the same on every rank as on rank 0."""
    theirs = hvd.broadcast_object(value, root_rank=0)
    if isinstance(value, torch.Tensor):
        close(value, theirs, 0.0, what)
    else:
        _same_state(theirs, value, what)


def check_optimizer_state_fresh_root(hvd, rank, size):
    """As in Horovod, optimizers that never stepped first create their state with one step on zero
    gradients: afterwards every rank holds the root's state (Adam's step is 1, SGD's momentum
    buffer, created under weight decay, is the root's), the parameters keep their values,
    gradients that existed are kept, parameters without one get zeros, frozen parameters keep
    None, and the learning rate is the root's."""
    for kind in ("Adam", "SGD"):
        model = _model(seed=0)
        model[0].bias.requires_grad_(False)
        if kind == "Adam":
            opt = torch.optim.Adam(model.parameters(), lr=0.001 * (rank + 1))
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1), momentum=0.9, weight_decay=0.5)
        model[2].weight.grad = torch.full_like(model[2].weight, float(rank + 7))
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        state = opt.state_dict()
        assert len(state["state"]) == sum(1 for p in model.parameters() if p.requires_grad), kind
        _gathered_equal(hvd, state, kind)
        if kind == "Adam":
            assert all(float(s["step"]) == 1.0 for s in state["state"].values()), kind
            assert opt.param_groups[0]["lr"] == 0.001
        else:
            assert opt.param_groups[0]["lr"] == 0.1
        for name, p in model.named_parameters():
            close(p.detach(), before[name], 0.0, f"{kind}: {name} moved by the state-creating step")
        assert model[0].bias.grad is None, kind
        close(model[2].weight.grad, torch.full_like(model[2].weight, float(rank + 7)), 0.0, f"{kind}: kept grad")
        close(model[0].weight.grad, torch.zeros_like(model[0].weight), 0.0, f"{kind}: zero grad")


def check_optimizer_state_root_loaded_others_fresh(hvd, rank, size):
    """A DistributedOptimizer whose root loaded trained state while the other ranks are fresh:
    the fresh ranks create their state without any collective (no rank waits on the root), then
    every rank holds the root's state, and training on keeps the ranks identical."""
    for kind in ("SGD", "Adam", "AdamW"):
        model = _model(seed=0)
        base = _make(kind, model)
        if rank == 0:
            _train(model, base, steps=2, seed=3)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        _gathered_equal(hvd, opt.state_dict(), kind)
        if kind != "SGD":
            assert all(float(s["step"]) == 2.0 for s in opt.state_dict()["state"].values()), kind
        _train(model, opt, steps=1, seed=rank)
        for name, p in model.named_parameters():
            _gathered_equal(hvd, p.detach(), f"{kind}: {name}")


# Every optimizer of torch.optim that steps without a closure on dense gradients, with options
# that differ between ranks (values after the first exercise tuples and booleans).
_OPTIONS = [
    {"lr": 0.1, "momentum": 0.8, "weight_decay": 0.2, "nesterov": True, "betas": (0.9, 0.999), "etas": (0.8, 2.4),
     "step_sizes": (1e-5, 100), "lambd": 1e-3, "rho": 0.8},
    {"lr": 0.2, "momentum": 0.9, "weight_decay": 0.1, "nesterov": False, "betas": (0.8, 0.9), "etas": (0.25, 1.75),
     "step_sizes": (1e-7, 5), "lambd": 1e-2, "rho": 0.95},
]
_OPTIMIZERS = ["ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop",
               "Rprop", "SGD"]


def check_optimizer_options_of_every_group(hvd, rank, size):
    """For every optimizer class, fresh on every rank with rank-specific options in two param
    groups, broadcast_optimizer_state leaves every group with the root's options, of the root's
    types; a DistributedOptimizer step afterwards keeps the ranks identical."""
    import inspect

    for kind in _OPTIMIZERS:
        cls = getattr(torch.optim, kind)
        accepted = inspect.signature(cls.__init__).parameters

        def options(index):
            picked = _OPTIONS[index % 2]
            return {k: v for k, v in picked.items() if k in accepted}

        model = _model(seed=0)
        groups = [{"params": model[0].parameters(), **options(rank + 1)},
                  {"params": model[2].parameters(), **options(rank)}]
        opt = hvd.DistributedOptimizer(cls(groups, **options(rank)), named_parameters=model.named_parameters())
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        for index, want in enumerate((options(1), options(0))):
            for key, value in want.items():
                got = opt.param_groups[index][key]
                assert type(got) is type(value) and got == value, f"{kind} group {index} {key}: {got!r} != {value!r}"
        _train(model, opt, steps=1, seed=rank)
        for name, p in model.named_parameters():
            _gathered_equal(hvd, p.detach(), f"{kind}: {name}")


def check_optimizer_state_sparse_model(hvd, rank, size):
    """With model= naming a sparse embedding, the state-creating step gives it a sparse zero
    gradient (SGD with momentum then keeps a sparse momentum buffer) and the state, sparse
    tensors included, arrives from the root; SparseAdam gets sparse gradients without model=;
    Adagrad, whose constructor creates its state, takes no step and keeps grad None."""
    for kind in ("SGD", "Adagrad", "SparseAdam"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(6, 3, sparse=True))
        if kind == "SGD":
            opt = torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1), momentum=0.9)
        else:
            opt = getattr(torch.optim, kind)(model.parameters(), lr=0.1 * (rank + 1))
        hvd.broadcast_optimizer_state(opt, root_rank=0, model=None if kind == "SparseAdam" else model)
        if kind == "Adagrad":
            assert model[0].weight.grad is None
        else:
            assert model[0].weight.grad.is_sparse, kind
        assert opt.param_groups[0]["lr"] == 0.1, kind
        state = opt.state_dict()
        theirs = hvd.broadcast_object(state, root_rank=0)
        assert theirs["param_groups"] == state["param_groups"], kind
        for key, entry in state["state"].items():
            for name, value in entry.items():
                other = theirs["state"][key][name]
                if isinstance(value, torch.Tensor):
                    assert value.layout == other.layout, (kind, name)
                    close(value.to_dense(), other.to_dense(), 0.0, f"{kind}: {name}")
                else:
                    assert value == other, (kind, name)
        opt.zero_grad()
        model(torch.tensor([rank % 6, 5])).sum().backward()
        opt.step()


def check_optimizer_state_with_distributed_optimizer(hvd, rank, size):
    """broadcast_optimizer_state accepts a DistributedOptimizer and leaves it usable."""
    model = _model(seed=0)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1)),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.01
    _train(model, opt, steps=2, seed=1)


def check_broadcast_object_any_types(hvd, rank, size):
    """broadcast_object returns the root's object on every rank even when the other ranks pass
    objects of other types (the default name does not depend on the object); allgather_object
    returns every rank's object in rank order."""
    obj = {"rank": rank, "payload": list(range(rank))} if rank == 0 else ("not", "a", "dict", rank)
    assert hvd.broadcast_object(obj, root_rank=0) == {"rank": 0, "payload": []}
    got = hvd.broadcast_object(torch.full((2,), float(rank)) if rank == size - 1 else None, root_rank=size - 1)
    close(got, torch.full((2,), float(size - 1)))
    assert hvd.broadcast_object(lambda v: v + rank, root_rank=0)(1) == 1
    gathered = hvd.allgather_object({"r": rank} if rank % 2 else [rank])
    assert gathered == [({"r": r} if r % 2 else [r]) for r in range(size)]
    assert hvd.allgather_object(rank, name="named.gather") == list(range(size))


ALL = [check_broadcast_parameters_forms, check_optimizer_state_round_trip, check_optimizer_state_fresh_root,
       check_optimizer_state_root_loaded_others_fresh, check_optimizer_options_of_every_group,
       check_optimizer_state_sparse_model, check_optimizer_state_with_distributed_optimizer,
       check_broadcast_object_any_types]


@pytest.mark.parametrize("check", ALL, ids=lambda c: c.__name__[len("check_"):])
def test_state_broadcast(world, check):
    """The check (its docstring says what it asserts) passed on every rank."""
    assert_passed(world, check)
