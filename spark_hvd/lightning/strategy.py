"""``SparkHvdStrategy``: PyTorch Lightning 2 data-parallel training over the spark-hvd runtime.

One process per device, started by ``spark-hvd-run`` or ``spark_hvd.spark.run``. Parameters
start from rank 0's, gradients are averaged while backward runs, every dataloader gets a
``DistributedSampler``, and logging, checkpoints and Lightning's collectives go through spark-hvd.
"""

from __future__ import annotations

import numbers
import os
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple, TypeVar, Union

import torch
from lightning_fabric.plugins import CheckpointIO
from lightning_fabric.utilities.optimizer import _optimizers_to_device
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from pytorch_lightning.plugins.layer_sync import TorchSyncBatchNorm
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies.parallel import ParallelStrategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_only

import spark_hvd.torch as hvd
from spark_hvd.lightning.environment import SparkHvdEnvironment
from spark_hvd.lightning.gradients import GradientAverager
from spark_hvd.lightning.layer_sync import SparkHvdSyncBatchNorm
from spark_hvd.lightning.metrics import MetricSync
from spark_hvd.torch.compression import Compressor
from spark_hvd.torch.buckets import DEFAULT_BUCKET_CAP_MB

__all__ = ["SparkHvdStrategy"]

T = TypeVar("T")

_OPS_BY_NAME = {"mean": hvd.Average, "avg": hvd.Average, "sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min,
                "product": hvd.Product, "prod": hvd.Product}


def _torch_ops() -> List[Tuple[Any, int]]:
    """torch.distributed's ReduceOp members that Lightning passes (absent from builds without it)."""
    if not torch.distributed.is_available():
        return []
    ops = torch.distributed.ReduceOp
    return [(ops.SUM, hvd.Sum), (ops.AVG, hvd.Average), (ops.MAX, hvd.Max), (ops.MIN, hvd.Min),
            (ops.PRODUCT, hvd.Product)]


def _resolve_op(reduce_op: Any) -> int:
    """Lightning's reduce_op ('mean', 'sum', ..., a torch ReduceOp, or a spark-hvd op) as a spark-hvd op."""
    if reduce_op is None:
        return hvd.Sum  # as torch.distributed.all_reduce, whose default Lightning keeps for None
    if isinstance(reduce_op, str) and reduce_op.lower() in _OPS_BY_NAME:
        return _OPS_BY_NAME[reduce_op.lower()]
    if isinstance(reduce_op, hvd.ReduceOp) and reduce_op != hvd.Adasum:
        return reduce_op
    for torch_op, op in _torch_ops():
        if not isinstance(reduce_op, (str, int)) and reduce_op == torch_op:
            return op
    raise ValueError(
        f"reduce_op={reduce_op!r} is not supported by SparkHvdStrategy: expected one of "
        f"{sorted(_OPS_BY_NAME)}, torch.distributed.ReduceOp.SUM/AVG/MAX/MIN/PRODUCT, or a spark_hvd.torch op "
        "(Sum, Average, Min, Max, Product)"
    )


def _process_set(group: Any) -> Any:
    if group is None:
        return hvd.global_process_set
    if isinstance(group, hvd.ProcessSet):
        return group
    raise ValueError(
        f"group={group!r} is not supported by SparkHvdStrategy: pass None (all ranks) or a "
        "spark_hvd.torch.ProcessSet registered with hvd.add_process_set; torch.distributed groups do not exist here"
    )


def _local_gpu(local_rank: int) -> torch.device:
    """The GPU of the rank with this local rank: its own index, or the only GPU the process sees."""
    count = torch.cuda.device_count()
    if count == 1:
        # One visible GPU: spark_hvd.spark.run gives each task its own through CUDA_VISIBLE_DEVICES.
        return torch.device("cuda", 0)
    if local_rank < count:
        return torch.device("cuda", local_rank)
    raise ValueError(
        f"local rank {local_rank} has no GPU of its own: this process sees {count} GPUs; start at most "
        f"{count} processes per host, or train with Trainer(accelerator='cpu')"
    )


def _lightning_seed() -> int:
    """The seed Lightning gives the samplers it injects: that of ``seed_everything``, else 0."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


class _GatherRows(torch.autograd.Function):
    """Stacks every rank's tensor; the gradient reaching a rank's tensor is the sum over ranks of the
    gradients of its slot (what Lightning's all_gather(sync_grads=True) promises, as torch.distributed.nn)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, process_set: Any) -> torch.Tensor:
        ctx.process_set = process_set
        ctx.slot = list(process_set.ranks).index(hvd.rank())
        return hvd.synchronize(hvd.allgather_async(tensor.unsqueeze(0), process_set=process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        summed = hvd.synchronize(hvd.allreduce_async(grad.contiguous(), op=hvd.Sum, process_set=ctx.process_set))
        return summed[ctx.slot], None


class SparkHvdStrategy(ParallelStrategy):
    """Data-parallel training on the processes of a spark-hvd job, one device each.

    ``Trainer(strategy=SparkHvdStrategy(), accelerator="cpu" or "gpu", devices=1)`` in a script
    started by ``spark-hvd-run -np N`` (or in a function run by ``spark_hvd.spark.run``) trains on
    N processes: the model starts from rank 0's parameters, the gradients' averages over the ranks
    start bucket by bucket as soon as backward has produced a bucket's gradients (one flat
    reduction per bucket, as DDP's ``bucket_cap_mb``) and are complete before ``on_after_backward``,
    gradient clipping and the optimizer step; every dataloader gets a ``DistributedSampler`` for
    this rank; ``self.log(..., sync_dist=True)``, ``barrier``, ``broadcast``, ``all_gather`` and
    ``reduce`` run through spark-hvd, and so do the states of the module's torchmetrics ``Metric``
    objects (unless given a ``dist_sync_fn`` of their own); checkpoints are written by rank 0 alone.
    On GPUs each process takes its local rank's GPU (or the only one it sees).
    ``Trainer(sync_batchnorm=True)`` uses :class:`spark_hvd.torch.SyncBatchNorm`. Building the
    Trainer joins the job (``hvd.init()``).

    Arguments:
        accelerator: Lightning accelerator; normally chosen by ``Trainer(accelerator=...)``.
        checkpoint_io: Lightning checkpoint plugin; rank 0 alone calls it to save.
        precision_plugin: Lightning precision plugin; normally chosen by ``Trainer(precision=...)``.
        compression: ``hvd.Compression.none`` (default) or ``hvd.Compression.fp16``: gradients
            travel as float16.
        bucket_cap_mb: MiB of gradients reduced together (DDP's default, 25); 0 reduces each
            gradient on its own.
    """

    strategy_name = "spark_hvd"

    def __init__(self, accelerator: Any = None, checkpoint_io: Optional[CheckpointIO] = None,
                 precision_plugin: Optional[Precision] = None, compression: Compressor = hvd.Compression.none,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> None:
        if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
            raise ValueError(
                f"compression={compression!r} is not a compressor: expected hvd.Compression.none or "
                "hvd.Compression.fp16 (import spark_hvd.torch as hvd)"
            )
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb < 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} is not valid: expected MiB >= 0 (0: one reduction "
                             f"per gradient), e.g. {DEFAULT_BUCKET_CAP_MB}")
        super().__init__(accelerator=accelerator, parallel_devices=None, cluster_environment=SparkHvdEnvironment(),
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._compression = compression
        self._bucket_cap_mb = float(bucket_cap_mb)
        self._averager: Optional[GradientAverager] = None
        self._applied_layer_sync: Optional[Any] = None
        self._sampler_seed: Optional[int] = None
        self._metric_sync: Optional[MetricSync] = None

    # -- the world and the device -------------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        """Always True, also alone: samplers and metric reductions behave the same at every size."""
        return True

    @property
    def root_device(self) -> torch.device:
        """This process's device: its local rank's GPU with a CUDA accelerator, else the Trainer's device."""
        devices = self.parallel_devices
        if not devices:
            return torch.device("cpu")
        if devices[0].type == "cuda":
            return _local_gpu(self.local_rank)
        return devices[0]

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        """This rank's share of every dataset: one replica per process of the job, shuffled with rank 0's seed."""
        kwargs: Dict[str, Any] = {"num_replicas": self.world_size, "rank": self.global_rank}
        if self._sampler_seed is not None:
            kwargs["seed"] = self._sampler_seed
        return kwargs

    def _check_devices(self) -> None:
        devices = self.parallel_devices or []
        if len(devices) <= 1:
            return
        if devices[0].type == "cuda" and len(devices) == torch.cuda.device_count():
            return  # devices="auto" or -1: the host's GPUs, of which this process takes its own
        raise ValueError(
            f"the Trainer gave SparkHvdStrategy {len(devices)} devices ({', '.join(map(str, devices))}) for one "
            "process, but it trains on one device per process: pass Trainer(devices=1) and start one process "
            "per device (spark-hvd-run -np N)"
        )

    def set_world_ranks(self) -> None:
        """Join the job and tell Lightning's rank-zero utilities this process's rank."""
        self._check_devices()
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        """Join the job (if the Trainer did not), then select this process's device."""
        self.set_world_ranks()
        super().setup_environment()

    def model_to_device(self) -> None:
        """Move the model to this process's device."""
        assert self.model is not None
        self.model.to(self.root_device)

    # -- training set-up ----------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        """Place the model, start every rank from rank 0's parameters and buffers, and (when fitting)
        set up the optimizers and the gradient averaging."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync is not None:
            if isinstance(self._layer_sync, TorchSyncBatchNorm):
                # torch.nn.SyncBatchNorm needs a torch.distributed process group, which this job has not.
                self._layer_sync = SparkHvdSyncBatchNorm()
            self.model = self._layer_sync.apply(self.model)
            self._applied_layer_sync = self._layer_sync
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0, prefix="lightning.setup.")
        # Ranks seeded differently (seed_everything(seed + rank)) would shuffle into overlapping shares.
        self._sampler_seed = hvd.broadcast_object(_lightning_seed(), root_rank=0, name="lightning.setup.sampler_seed")
        # torchmetrics Metrics gather through torch.distributed by default, which this job has not.
        self._remove_metric_sync()
        self._metric_sync = MetricSync(self.model)
        if fitting:
            self.setup_optimizers(trainer)
            self._remove_averager()
            self._averager = GradientAverager(self.model, compression=self._compression,
                                              bucket_cap_mb=self._bucket_cap_mb)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Backward through the precision plugin, then wait for the gradients' averages (unless accumulating)."""
        averager = self._averager
        if averager is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        with averager.backward_pass():
            self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        if not averager.is_paused:
            # Before the post-backward hooks: on_after_backward and clipping see averaged gradients, as with DDP.
            averager.synchronize()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Within this context (Lightning's gradient accumulation) gradients stay local; the next
        backward outside it averages their sum."""
        if self._averager is None:
            yield
            return
        with self._averager.paused():
            yield

    def _remove_metric_sync(self) -> None:
        if self._metric_sync is not None:
            self._metric_sync.remove()
            self._metric_sync = None

    def _remove_averager(self) -> None:
        if self._averager is not None:
            self._averager.remove()
            self._averager = None

    def teardown(self) -> None:
        """Stop averaging gradients, give batch-norm layers their classes back and torchmetrics Metrics
        their sync functions, and release the device."""
        self._remove_averager()
        self._remove_metric_sync()
        if self._applied_layer_sync is not None and self.model is not None:
            self.model = self._applied_layer_sync.revert(self.model)
            self._applied_layer_sync = None
        super().teardown()

    # -- collectives --------------------------------------------------------------------------------
    def barrier(self, name: Optional[str] = None, *args: Any, **kwargs: Any) -> None:
        """Return once every rank has reached this barrier."""
        hvd.barrier()

    def broadcast(self, obj: T, src: int = 0) -> T:
        """Return rank ``src``'s ``obj`` on every rank (any picklable object; a tensor keeps this rank's device)."""
        size = self.world_size
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < size:
            raise ValueError(f"src={src!r} is not a rank of this job of {size} processes: expected 0..{size - 1}")
        payload = obj.detach().cpu() if isinstance(obj, torch.Tensor) else obj
        result = hvd.broadcast_object(payload, root_rank=src)
        if isinstance(result, torch.Tensor) and isinstance(obj, torch.Tensor):
            return result.to(obj.device)  # type: ignore[return-value]
        return result

    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        """Every rank's ``tensor`` stacked in rank order: shape ``(ranks, *tensor.shape)``, the same on every rank.

        With ``sync_grads`` the result is differentiable: a rank's tensor receives the sum over the
        ranks of the gradients of its slot. The shapes must agree on every rank.
        """
        process_set = _process_set(group)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"all_gather takes a tensor, got {type(tensor).__name__}; "
                            "LightningModule.all_gather accepts collections of tensors")
        if sync_grads and tensor.requires_grad:
            return _GatherRows.apply(tensor, process_set)
        return hvd.synchronize(hvd.allgather_async(tensor.detach().unsqueeze(0), process_set=process_set))

    def reduce(self, tensor: Union[torch.Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[str, Any]] = "mean") -> Union[torch.Tensor, Any]:
        """Combine ``tensor`` over the ranks; afterwards the result is the same on every rank.

        ``reduce_op`` is 'mean' (default), 'sum', 'max', 'min', 'product', a
        ``torch.distributed.ReduceOp`` or a spark-hvd op. A tensor is reduced in place like
        DDPStrategy's and returned (a new tensor when it requires a gradient: the reduction is then
        differentiable); a mean of integers comes back as floating point, as truncating it would bias
        Lightning's weighted means. A Python number gives a Python number.
        """
        op = _resolve_op(reduce_op)
        process_set = _process_set(group)
        if isinstance(tensor, torch.Tensor):
            value = tensor
        elif isinstance(tensor, numbers.Number):
            value = torch.tensor(tensor)
        else:
            raise TypeError(f"reduce takes a tensor or a number, got {type(tensor).__name__}; reduce each "
                            "tensor of a collection separately")
        if op == hvd.Average and not (value.is_floating_point() or value.is_complex()):
            value = value.to(torch.get_default_dtype())
        if value.requires_grad:
            value = hvd.allreduce(value, op=op, process_set=process_set)
        else:
            value = hvd.allreduce_(value, op=op, process_set=process_set)
        return value if isinstance(tensor, torch.Tensor) else value.item()
