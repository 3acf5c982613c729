"""torchmetrics ``Metric`` objects of a LightningModule, synchronized over the spark-hvd job.

A torchmetrics Metric gathers its states across processes through ``torch.distributed``, which a
spark-hvd job does not start, so by default each rank's ``compute()`` sees its own data only.
:class:`MetricSync` gives every Metric of the module (that has no sync function of its own) a
gather through spark-hvd for the time of the fit, and gives the original functions back after.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch

import spark_hvd.torch as hvd

__all__ = ["gather_all_tensors", "MetricSync"]


def gather_all_tensors(result: torch.Tensor, group: Optional[Any] = None) -> List[torch.Tensor]:
    """Every rank's ``result`` in rank order, each on ``result``'s device (shapes may differ):
    the ``dist_sync_fn`` contract of torchmetrics."""
    process_set = group if isinstance(group, hvd.ProcessSet) else hvd.global_process_set
    gathered = hvd.allgather_object(result.detach().cpu(), process_set=process_set)
    return [tensor.to(result.device) for tensor in gathered]


def _distributed() -> bool:
    return hvd.is_initialized() and hvd.size() > 1


class MetricSync:
    """Installs :func:`gather_all_tensors` on the module's torchmetrics Metrics; :meth:`remove` undoes it."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._changed: List[Tuple[Any, Optional[Callable[..., Any]], Callable[..., bool]]] = []
        try:
            from torchmetrics import Metric
        except ImportError:  # no torchmetrics, no Metric objects to synchronize
            return
        for child in module.modules():
            if isinstance(child, Metric) and child.dist_sync_fn is None:
                self._changed.append((child, child.dist_sync_fn, child.distributed_available_fn))
                child.dist_sync_fn = gather_all_tensors
                child.distributed_available_fn = _distributed

    @property
    def count(self) -> int:
        """How many Metrics synchronize through spark-hvd."""
        return len(self._changed)

    def remove(self) -> None:
        """Give every Metric its own sync functions back."""
        for metric, sync_fn, available_fn in self._changed:
            metric.dist_sync_fn = sync_fn
            metric.distributed_available_fn = available_fn
        self._changed = []
