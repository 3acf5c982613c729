"""``SyncBatchNorm``: batch normalization whose statistics cover the batches of all ranks."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from spark_hvd.torch.basics import Sum, global_process_set
from spark_hvd.torch.handles import enqueue
from spark_hvd.runtime.kinds import ALLREDUCE

__all__ = ["SyncBatchNorm"]


class _SumOverRanks(torch.autograd.Function):
    """Allreduce-Sum whose gradient is the Sum of the ranks' gradients.

    Every rank's loss depends on the summed statistics, so the gradient reaching one rank's
    contribution is the sum of what all ranks' losses send back: exactly this backward.
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, process_set: Any) -> torch.Tensor:
        ctx.process_set = process_set
        return enqueue(ALLREDUCE, [tensor], op=Sum, process_set=process_set).wait()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[Optional[torch.Tensor], None]:
        grad = enqueue(ALLREDUCE, [grad_output.contiguous()], op=Sum, process_set=ctx.process_set).wait()
        return grad, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over N-dimensional input (N, C, ...) with statistics synchronized
    across ranks in training mode, for CPU and (staged) CUDA tensors alike.

    In training the mean and variance are those of the union of all ranks' batches, and the
    running statistics are updated from them identically on every rank; gradients flow through
    the shared statistics as if the union batch had been normalized in one process. In eval
    mode (with ``track_running_stats``) it is plain batch normalization with the running stats.
    Every rank must call ``forward`` the same number of times.

    Arguments:
        num_features: Number of channels ``C`` of input shaped ``(N, C, ...)``.
        eps: Added to the variance for numerical stability. Default 1e-5.
        momentum: Weight of the new batch in the running statistics; None for a cumulative
            average. Default 0.1.
        affine: Whether to learn a per-channel scale and shift. Default True.
        track_running_stats: Whether to keep running statistics (used in eval mode). Default True.
        process_set: The ranks whose batches are normalized together (default: all ranks).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: Any = global_process_set) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, ...), got {input.dim()}D input")

    def _size(self) -> int:
        return self.process_set.size() if self.process_set is not None else 1

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"expected input with {self.num_features} channels in dimension 1, got shape {tuple(input.shape)}"
            )
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats or self._size() == 1:
            return F.batch_norm(input, self.running_mean if not self.training or self.track_running_stats else None,
                                self.running_var if not self.training or self.track_running_stats else None,
                                self.weight, self.bias, use_batch_stats, factor, self.eps)
        return self._synchronized_forward(input, factor)

    def _synchronized_forward(self, input: torch.Tensor, factor: float) -> torch.Tensor:
        channels = input.shape[1]
        # Statistics in at least float32: float16 sums of squares overflow quickly.
        stat_dtype = torch.promote_types(input.dtype, torch.float32)
        x = input.transpose(0, 1).reshape(channels, -1).to(stat_dtype)
        local_count = torch.tensor([float(x.shape[1])], dtype=stat_dtype)
        local = torch.cat([local_count, x.sum(dim=1), (x * x).sum(dim=1)])
        total = _SumOverRanks.apply(local, self.process_set)
        count = total[0].detach()
        if float(count) <= 1:
            raise ValueError(
                f"SyncBatchNorm needs more than one value per channel across all ranks in training, got {int(count)}"
            )
        mean = total[1 : channels + 1] / count
        var = (total[channels + 1 :] / count - mean * mean).clamp_min(0.0)
        if self.track_running_stats:
            with torch.no_grad():
                unbiased = var * (count / (count - 1))
                self.running_mean.mul_(1 - factor).add_(mean.detach().to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.detach().to(self.running_var.dtype), alpha=factor)
        shape = [1, channels] + [1] * (input.dim() - 2)
        invstd = torch.rsqrt(var + self.eps)
        out = (input.to(stat_dtype) - mean.reshape(shape)) * invstd.reshape(shape)
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        return out.to(input.dtype)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_set: Any = global_process_set) -> torch.nn.Module:
        """Replace every ``BatchNorm*d`` layer of ``module`` with a :class:`SyncBatchNorm` that
        keeps its parameters and running statistics; return the converted module."""
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_set=process_set)
            if module.affine:
                with torch.no_grad():
                    converted.weight = module.weight
                    converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.train(module.training)
        for child_name, child in module.named_children():
            converted.add_module(child_name, cls.convert_sync_batchnorm(child, process_set))
        return converted
