"""SparkHvdStrategy training at world sizes 1, 2 and 3: equivalence with one process on the global
batch (plain, accumulated, manual, compressed), overlap with backward, the injected sampler,
metrics logged with sync_dist, rank-0 checkpoints, sync_batchnorm and its error messages."""

import os

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins import TorchCheckpointIO
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_world import assert_passed, close, shared_dir, trainer
from spark_hvd.lightning import SparkHvdStrategy

BATCH = 4  # rows per rank per micro-batch
STEPS = 4  # optimizer steps


def _net(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _rows(n):
    g = torch.Generator().manual_seed(42)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _loader(*tensors):
    return DataLoader(TensorDataset(*tensors), batch_size=BATCH)


def _global_order(rows, seed=0):
    """The order in which the ranks together see the rows in the first epoch: the injected
    DistributedSampler shuffles training data with the seed and deals position i to rank i % size."""
    return torch.tensor(list(DistributedSampler(range(rows), num_replicas=1, rank=0, shuffle=True, seed=seed)))


class Classifier(pl.LightningModule):
    """A small classifier trained with momentum SGD; records the gradients on_after_backward sees."""

    def __init__(self, seed):
        super().__init__()
        self.net = _net(seed)
        self.seen_grads = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def on_after_backward(self):
        self.seen_grads.append([p.grad.detach().clone() for p in self.net.parameters()])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class ManualAccumulating(Classifier):
    """Manual optimization accumulating two micro-batches, the first without gradient sync."""

    def __init__(self, seed):
        super().__init__(seed)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self.net(x), y) / 2
        if batch_idx % 2 == 0:
            with opt.toggle_model(sync_grad=False):
                self.manual_backward(loss)
        else:
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()


class DirectBackward(Classifier):
    """Manual optimization that wrongly calls loss.backward() itself."""

    def __init__(self, seed):
        super().__init__(seed)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        F.cross_entropy(self.net(x), y).backward()


def _reference(x, y, rows_per_step):
    """Single-process training on the global batches; the trained net and its first gradients."""
    order = _global_order(len(x))
    x, y = x[order], y[order]
    net = _net(0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    first = None
    for step in range(STEPS):
        rows = slice(step * rows_per_step, (step + 1) * rows_per_step)
        opt.zero_grad()
        F.cross_entropy(net(x[rows]), y[rows]).backward()
        if first is None:
            first = [p.grad.clone() for p in net.parameters()]
        opt.step()
    return net, first


def _assert_same_params(got, want, atol, what):
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        close(p.detach(), q.detach(), atol, f"{what}: {name}")


def _assert_equal_across_ranks(hvd, module):
    for name, p in module.named_parameters():
        gathered = hvd.allgather(p.detach().unsqueeze(0))
        assert all(torch.equal(gathered[0], g) for g in gathered), f"{name} differs between ranks"


def check_matches_single_process_training(hvd, rank, size):
    """Four momentum-SGD steps from differently seeded models leave every rank's parameters within
    1e-5 of one process trained on the global batch (rank 0's initial parameters), identical on
    every rank; on_after_backward already sees the averaged gradient."""
    x, y = _rows(size * BATCH * STEPS)
    want, first_grads = _reference(x, y, size * BATCH)
    module = Classifier(seed=rank)  # different on purpose: the strategy starts every rank from rank 0's
    trainer(max_steps=STEPS).fit(module, _loader(x, y))
    _assert_same_params(module.net, want, 1e-5, "after training")
    assert len(module.seen_grads) == STEPS
    for got, expected in zip(module.seen_grads[0], first_grads):
        close(got, expected, 1e-6, "gradient seen by on_after_backward")
    _assert_equal_across_ranks(hvd, module)


def check_gradient_accumulation(hvd, rank, size):
    """With accumulate_grad_batches=2 the first micro-batch's gradient stays local (on_after_backward
    sees this rank's own half-weighted gradient) and training matches one process on the global
    batch of both micro-batches."""
    x, y = _rows(size * BATCH * 2 * STEPS)
    want, _ = _reference(x, y, size * BATCH * 2)
    module = Classifier(seed=rank)
    trainer(max_steps=STEPS, accumulate_grad_batches=2).fit(module, _loader(x, y))
    _assert_same_params(module.net, want, 1e-5, "accumulated")
    assert len(module.seen_grads) == 2 * STEPS
    local = _net(0)
    mine = _global_order(len(x))[rank:size * BATCH:size]  # this rank's first micro-batch
    (F.cross_entropy(local(x[mine]), y[mine]) / 2).backward()
    for got, expected in zip(module.seen_grads[0], [p.grad for p in local.parameters()]):
        close(got, expected, 1e-6, "gradient of the first, local micro-batch")


def check_manual_optimization(hvd, rank, size):
    """Manual optimization with manual_backward, accumulating over two micro-batches with
    toggle_model(sync_grad=False) for the first, matches one process on the global batch."""
    x, y = _rows(size * BATCH * 2 * STEPS)
    want, _ = _reference(x, y, size * BATCH * 2)
    module = ManualAccumulating(seed=rank)
    trainer(max_steps=STEPS).fit(module, _loader(x, y))
    _assert_same_params(module.net, want, 1e-5, "manual")
    _assert_equal_across_ranks(hvd, module)


def check_fp16_compression(hvd, rank, size):
    """compression=hvd.Compression.fp16 trains to within float16 precision of one process."""
    x, y = _rows(size * BATCH * STEPS)
    want, _ = _reference(x, y, size * BATCH)
    module = Classifier(seed=rank)
    trainer(max_steps=STEPS, strategy=SparkHvdStrategy(compression=hvd.Compression.fp16)).fit(module, _loader(x, y))
    _assert_same_params(module.net, want, 5e-3, "fp16")
    _assert_equal_across_ranks(hvd, module)


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


class Probed(pl.LightningModule):
    """Two layers with a probe between them that looks at the last layer's reduction during backward."""

    def __init__(self, hvd):
        super().__init__()
        self.first, self.last = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
        self.hvd = hvd
        self.seen = {}

    def _during_backward(self):
        pending = self.trainer.strategy._averager._pending

        def started(p):
            # Reductions are keyed by bucket (its .params), or by the id of a parameter reduced alone.
            return next((v for k, v in pending.items()
                         if any(q is p for q in getattr(k, "params", ())) or k == id(p)), None)

        last, first = started(self.last.weight), started(self.first.weight)
        self.seen["last_started"] = last is not None
        self.seen["first_started"] = first is not None
        if last is not None:
            last.handle.wait()
            self.seen["last_completed"] = True

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.last(_Probe.apply(self.first(x), self._during_backward)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def check_allreduce_overlaps_backward(hvd, rank, size):
    """While backward still runs (before the first layer's gradient exists) the bucket of the last
    layer's gradients has been started and completes: communication overlaps backward. The
    buckets are sized to hold the last layer (108 bytes) alone."""
    if size == 1:
        return  # a world of one does not communicate; nothing to overlap
    x, y = _rows(size * BATCH)
    module = Probed(hvd)
    trainer(max_steps=1, strategy=SparkHvdStrategy(bucket_cap_mb=110 / 2 ** 20)).fit(module, _loader(x, y))
    assert module.seen == {"last_started": True, "first_started": False, "last_completed": True}, module.seen


def check_gradients_travel_in_one_bucket(hvd, rank, size):
    """With the default buckets a small model's gradients are one flat reduction, and the
    averaged gradients are those of per-parameter reductions (bucket_cap_mb=0)."""
    if size == 1:
        return
    x, y = _rows(size * BATCH)
    grads = {}
    for cap in (25.0, 0.0):
        torch.manual_seed(0)
        module = Probed(hvd)
        t = trainer(max_steps=1, strategy=SparkHvdStrategy(bucket_cap_mb=cap))

        class Grab(pl.Callback):
            def on_after_backward(self, trainer, pl_module):
                grads[cap] = [p.grad.clone() for p in pl_module.parameters()]
                grads[f"buckets {cap}"] = [len(b.params) for b in trainer.strategy._averager._buckets]

        t.callbacks.append(Grab())
        t.fit(module, _loader(x, y))
    assert grads["buckets 25.0"] == [4] and grads["buckets 0.0"] == []
    for a, b in zip(grads[25.0], grads[0.0]):
        torch.testing.assert_close(a, b)


class Recorder(pl.LightningModule):
    """Records the dataset indices every step sees."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.train_seen, self.val_seen = [], []

    def training_step(self, batch, batch_idx):
        self.train_seen.extend(batch[0].tolist())
        return self.weight.sum() * 0

    def validation_step(self, batch, batch_idx):
        self.val_seen.extend(batch[0].tolist())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def check_distributed_sampler(hvd, rank, size):
    """Every dataloader gets a DistributedSampler for this rank: training rows are shuffled the same
    way on every rank (with rank 0's seed, even when ranks were seeded differently) and dealt
    round-robin, so the ranks' shares are disjoint and cover the data; validation rows are not
    shuffled (rank r sees r, r+size, ...)."""
    rows = 36
    indices = torch.arange(rows)
    module = Recorder()
    t = trainer(max_epochs=1)
    t.fit(module, _loader(indices), _loader(indices))
    assert t.distributed_sampler_kwargs == {"num_replicas": size, "rank": rank, "seed": 0}
    assert module.train_seen == _global_order(rows)[rank::size].tolist(), module.train_seen
    shares = hvd.allgather_object(module.train_seen)
    assert sorted(i for share in shares for i in share) == list(range(rows)), shares
    assert module.val_seen == list(range(rank, rows, size)), module.val_seen

    os.environ["PL_GLOBAL_SEED"] = str(5 + rank)  # what seed_everything(5 + rank) leaves behind
    try:
        module = Recorder()
        trainer(max_epochs=1).fit(module, _loader(indices))
    finally:
        del os.environ["PL_GLOBAL_SEED"]
    shares = hvd.allgather_object(module.train_seen)
    assert sorted(i for share in shares for i in share) == list(range(rows)), shares
    assert module.train_seen == _global_order(rows, seed=5)[rank::size].tolist(), module.train_seen


class Logging(pl.LightningModule):
    """Logs rank-dependent values with and without sync_dist."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        self.log("train_rank", float(self.global_rank), on_step=True, on_epoch=False, sync_dist=True)
        return self.weight.sum() * 0

    def validation_step(self, batch, batch_idx):
        rank = float(self.global_rank)
        self.log("val_mean", rank, sync_dist=True, batch_size=BATCH)
        self.log("val_weighted", rank, sync_dist=True, batch_size=self.global_rank + 1)
        self.log("val_sum", 1.0, sync_dist=True, reduce_fx="sum")
        self.log("val_max", rank, sync_dist=True, reduce_fx="max")
        self.log("val_min", rank, sync_dist=True, reduce_fx="min")
        self.log("val_local", rank)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def check_logged_metrics(hvd, rank, size):
    """self.log(..., sync_dist=True) reduces over the ranks (mean, batch-size-weighted mean, sum,
    max, min); without sync_dist a value stays this rank's own."""
    rows = 24
    loader = _loader(torch.arange(rows))
    module = Logging()
    t = trainer(max_steps=2)
    t.fit(module, loader)
    close(t.callback_metrics["train_rank"], torch.tensor((size - 1) / 2), 1e-6, "train_rank")
    (metrics,) = t.validate(module, loader, verbose=False)
    weights = [r + 1 for r in range(size)]
    want = {"val_mean": (size - 1) / 2, "val_weighted": sum(r * w for r, w in enumerate(weights)) / sum(weights),
            "val_sum": rows / BATCH, "val_max": size - 1, "val_min": 0.0, "val_local": float(rank)}
    for name, value in want.items():
        assert abs(metrics[name] - value) < 1e-6, (name, metrics[name], value)


class MetricObjects(pl.LightningModule):
    """Logs torchmetrics Metric objects fed rank-dependent values: a sum and a concatenation."""

    def __init__(self):
        super().__init__()
        import torchmetrics

        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.total = torchmetrics.SumMetric()
        self.values = torchmetrics.CatMetric()

    def validation_step(self, batch, batch_idx):
        self.total.update(torch.tensor(float(self.global_rank + 1)))
        self.values.update(torch.full((self.global_rank + 1,), float(self.global_rank)))
        self.log("val_total", self.total)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def check_torchmetrics_sync(hvd, rank, size):
    """A torchmetrics Metric logged with self.log is computed over every rank's updates (the sum of
    rank + 1 over the ranks), CatMetric gathers states of different lengths in rank order, and the
    Metrics get their own sync functions back when the Trainer is done."""
    module = MetricObjects()
    loader = _loader(torch.arange(BATCH))  # one batch per rank
    t = trainer()
    (metrics,) = t.validate(module, loader, verbose=False)
    assert abs(metrics["val_total"] - size * (size + 1) / 2) < 1e-6, (metrics, size)
    assert module.total.dist_sync_fn is None, "the Metric kept the strategy's sync function after the Trainer"
    assert module.values.dist_sync_fn is None
    from spark_hvd.lightning.metrics import MetricSync

    sync = MetricSync(module)
    assert sync.count == 2
    want = torch.cat([torch.full((r + 1,), float(r)) for r in range(size)])
    # compute() squeezes a one-element result to a scalar, as at size 1.
    close(module.values.compute().reshape(-1), want, 0.0, "CatMetric over the ranks")
    sync.remove()


class CountingIO(TorchCheckpointIO):
    """Records every checkpoint this process writes."""

    def __init__(self):
        super().__init__()
        self.saved = []

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.saved.append(os.path.basename(str(path)))
        super().save_checkpoint(checkpoint, path, storage_options=storage_options)


def check_checkpoints_written_by_rank_zero(hvd, rank, size):
    """ModelCheckpoint and trainer.save_checkpoint write each file once, from rank 0; the file holds
    the trained parameters every rank has, and a run resumed from it continues its step count."""
    x, y = _rows(size * BATCH * 2)
    with shared_dir(hvd) as directory:
        io = CountingIO()
        module = Classifier(seed=rank)
        t = trainer(max_epochs=2, enable_checkpointing=True, strategy=SparkHvdStrategy(checkpoint_io=io),
                    callbacks=[ModelCheckpoint(dirpath=directory, save_top_k=-1)])
        t.fit(module, _loader(x, y))
        t.save_checkpoint(os.path.join(directory, "manual.ckpt"))
        saved = hvd.allgather_object(io.saved)
        expected = ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "manual.ckpt"]
        assert saved == [expected] + [[]] * (size - 1), saved
        hvd.barrier()
        assert sorted(os.listdir(directory)) == expected, os.listdir(directory)
        state = torch.load(os.path.join(directory, "epoch=1-step=4.ckpt"), weights_only=False)["state_dict"]
        for name, value in module.state_dict().items():
            close(state[name], value, 0.0, f"checkpointed {name}")

        resumed = Classifier(seed=rank + 7)
        t = trainer(max_epochs=3, strategy=SparkHvdStrategy(checkpoint_io=CountingIO()))
        t.fit(resumed, _loader(x, y), ckpt_path=os.path.join(directory, "manual.ckpt"))
        assert t.global_step == 6 and t.current_epoch == 3, (t.global_step, t.current_epoch)
        _assert_equal_across_ranks(hvd, resumed)
        hvd.barrier()  # every rank has read the checkpoint before rank 0 removes the directory


class Normed(pl.LightningModule):
    """A net with batch normalization that records the class of its normalization layer in training."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3))
        self.classes = set()

    def training_step(self, batch, batch_idx):
        self.classes.add(type(self.net[1]).__name__)
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def check_sync_batchnorm(hvd, rank, size):
    """Trainer(sync_batchnorm=True) trains with spark-hvd's SyncBatchNorm (running statistics those of
    the global batch, on every rank) and gives the layer back as a BatchNorm1d afterwards."""
    x, y = _rows(size * BATCH)
    module = Normed(seed=rank)
    trainer(max_steps=1, sync_batchnorm=True).fit(module, _loader(x, y))
    assert module.classes == {"SyncBatchNorm"}, module.classes
    assert type(module.net[1]) is torch.nn.BatchNorm1d, type(module.net[1])
    reference = Normed(seed=0).net
    reference(x)
    close(module.net[1].running_mean, reference[1].running_mean, 1e-6, "running_mean")
    close(module.net[1].running_var, reference[1].running_var, 1e-5, "running_var")


def check_argument_errors(hvd, rank, size):
    """Several devices per process, a bad compression and a direct loss.backward() each fail with a
    message naming the value and the fix."""
    try:
        trainer(devices=2)
    except ValueError as exc:
        assert "devices=1" in str(exc) and "2 devices" in str(exc), str(exc)
    else:
        raise AssertionError("Trainer(devices=2) did not raise ValueError")
    try:
        SparkHvdStrategy(compression="fp16")
    except ValueError as exc:
        assert "compression='fp16'" in str(exc) and "Compression.fp16" in str(exc), str(exc)
    else:
        raise AssertionError("compression='fp16' did not raise ValueError")
    try:
        SparkHvdStrategy(bucket_cap_mb=-1)
    except ValueError as exc:
        assert "bucket_cap_mb=-1" in str(exc) and "MiB >= 0" in str(exc), str(exc)
    else:
        raise AssertionError("bucket_cap_mb=-1 did not raise ValueError")
    x, y = _rows(size * BATCH)
    try:
        trainer(max_steps=1).fit(DirectBackward(seed=0), _loader(x, y))
    except RuntimeError as exc:
        assert "manual_backward" in str(exc), str(exc)
    else:
        raise AssertionError("loss.backward() outside Lightning's backward did not raise")


ALL = [check_matches_single_process_training, check_gradient_accumulation, check_manual_optimization,
       check_fp16_compression, check_allreduce_overlaps_backward, check_gradients_travel_in_one_bucket,
       check_distributed_sampler, check_logged_metrics,
       check_torchmetrics_sync, check_checkpoints_written_by_rank_zero, check_sync_batchnorm, check_argument_errors]


@pytest.mark.parametrize("check", ALL, ids=lambda c: c.__name__[len("check_"):])
def test_lightning_training(world, check):
    """The training check (its docstring says what it asserts) passed on every rank."""
    assert_passed(world, check)
