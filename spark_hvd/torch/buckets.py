"""Gradient buckets: parameters grouped by size for one flat reduction each, and the flat buffer a
bucket's gradients are copied into (shared by ``DistributedOptimizer`` and Lightning's
``GradientAverager``), and the search for the fastest bucket size under autotune."""

from __future__ import annotations

import logging
import time
from typing import Callable, List, Optional, Tuple

import torch
import torch._utils

__all__ = ["DEFAULT_BUCKET_CAP_MB", "bucket_params", "FlatBuffer", "copy_all", "copy_grads", "NUMPY_DTYPES",
           "BUCKET_CANDIDATES", "BucketTuner"]

log = logging.getLogger("spark_hvd.torch")

DEFAULT_BUCKET_CAP_MB = 25.0
"""Bucket size (MiB) when none is given: torch DDP's. Measured on CPU ranks (see the README), it
trains a small tabular model, a CNN and a model with 162 parameter tensors faster than one request
per gradient, and a model of large layers as fast."""

NUMPY_DTYPES = frozenset({torch.float32, torch.float64, torch.float16})
"""Dtypes whose CPU tensors the runtime takes as numpy arrays as they are (bfloat16 needs staging)."""

BUCKET_CANDIDATES: Tuple[float, ...] = (0.0, 1.0, 4.0, 25.0)
"""Bucket sizes (MiB; 0: one request per gradient) autotune tries when no bucket size was given."""


def bucket_params(trainable: List[torch.Tensor], cap_mb: float) -> List[Tuple[torch.Tensor, ...]]:
    """Buckets of at most ``cap_mb`` MiB of gradients each (a larger tensor gets one of its own),
    filled in reverse registration order: backward produces the last layers' gradients first, so
    the first bucket is complete, and its reduction starts, while backward still runs. The order
    depends only on the model, so every rank forms the same buckets."""
    cap = cap_mb * (1 << 20)
    out: List[Tuple[torch.Tensor, ...]] = []
    current: List[torch.Tensor] = []
    filled = 0
    for p in reversed(trainable):
        nbytes = p.numel() * p.element_size()
        if current and filled + nbytes > cap:
            out.append(tuple(current))
            current, filled = [], 0
        current.append(p)
        filled += nbytes
    if current:
        out.append(tuple(current))
    return out


class FlatBuffer:
    """The buffer a part of a bucket is copied into every step, kept from step to step (allocating
    it, and splitting the result into views, cost more than the copies): the buffer, its views in
    the gradients' shapes, and, for a CPU buffer the runtime reduces in place, its numpy array;
    ``name`` names its reduction."""

    __slots__ = ("members", "flat", "dtype", "device", "views", "array", "name")

    def __init__(self, members: Tuple[int, ...], grads: List[torch.Tensor], name: str = "") -> None:
        self.members = members
        self.flat = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype, device=grads[0].device)
        self.dtype = self.flat.dtype
        self.device = self.flat.device
        self.views = list(torch._utils._unflatten_dense_tensors(self.flat, grads))
        self.array = self.flat.numpy() if self.flat.device.type == "cpu" and self.flat.dtype in NUMPY_DTYPES \
            else None
        self.name = name

    def holds(self, members: Tuple[int, ...], first: torch.Tensor) -> bool:
        """Whether this buffer suits gradients ``members`` whose first is ``first`` (same dtype and device)."""
        if self.members != members or self.dtype != first.dtype:
            return False
        # A CPU buffer asks only whether the gradient is on the CPU (cheaper than comparing devices).
        return first.is_cpu if self.array is not None else self.device == first.device

    def fill(self, grads: List[torch.Tensor]) -> torch.Tensor:
        copy_all(self.views, grads)
        return self.flat


def copy_grads(grads: List[torch.Tensor], sources: List[torch.Tensor]) -> None:
    """Copy ``sources`` into ``grads``, recording nothing for autograd (``torch.no_grad()`` only
    when a gradient is part of a graph, after ``backward(create_graph=True)``: entering it costs
    more than the copy of a small model's gradients)."""
    if any(g.requires_grad for g in grads):
        with torch.no_grad():
            copy_all(grads, sources)
    else:
        copy_all(grads, sources)


def copy_all(targets: List[torch.Tensor], sources: List[torch.Tensor]) -> None:
    """Copy each of ``sources`` into the matching tensor of ``targets`` (one foreach call where torch has it)."""
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(targets, sources)
        return
    for target, source in zip(targets, sources):
        target.copy_(source)


class BucketTuner:
    """Tries each of :data:`BUCKET_CANDIDATES` for a sample of steps after a warm-up, then keeps the
    fastest. Every rank decides from the same numbers (the slowest rank's seconds per step, agreed by
    an allreduce at the end of each sample), so all form the same buckets at the same step."""

    def __init__(self, warmup_steps: int, steps_per_sample: int) -> None:
        self.warmup_steps = warmup_steps
        self.steps_per_sample = steps_per_sample
        self.plan: List[float] = list(BUCKET_CANDIDATES)
        self.trials: List[Tuple[float, float]] = []
        """Each bucket size tried (MiB) and the slowest rank's seconds per step under it."""
        self.current = DEFAULT_BUCKET_CAP_MB
        self.steps = 0
        self.in_sample = -1  # warming up
        self.mark = 0.0
        self.done = False
        """Whether the fastest size was kept (no more steps are counted)."""

    @classmethod
    def from_runtime(cls) -> Optional[BucketTuner]:
        """A tuner with the runtime's warm-up and sample length when it autotunes (``HOROVOD_AUTOTUNE``), else None."""
        from spark_hvd.runtime.api import runtime_config

        config = runtime_config()
        if config is None or not config.autotune:
            return None
        steps = config.autotune_steps_per_sample
        return cls(config.autotune_warmup_samples * steps, steps)

    def after_step(self, slowest: Callable[[float, int], float], regroup: Callable[[float], None]) -> None:
        """Count a step; at the end of the warm-up or of a sample, ``regroup`` to the next bucket size
        (MiB), or to the fastest once all were tried.

        ``slowest(seconds, index)`` returns the largest of every rank's ``seconds`` per step in sample
        ``index`` (an allreduce: every rank calls it at the same step)."""
        if self.done:
            return
        self.steps += 1
        if self.in_sample < 0:
            if self.steps >= self.warmup_steps:
                self._next(regroup)
            return
        self.in_sample += 1
        if self.in_sample < self.steps_per_sample:
            return
        seconds = (time.perf_counter() - self.mark) / self.steps_per_sample
        self.trials.append((self.current, slowest(seconds, len(self.trials))))
        self._next(regroup)

    def _next(self, regroup: Callable[[float], None]) -> None:
        if self.plan:
            self.current = self.plan.pop(0)
            regroup(self.current)
            self.in_sample = 0
            self.mark = time.perf_counter()
            return
        best = min(self.trials, key=lambda trial: trial[1])
        self.current = best[0]
        self.done = True
        regroup(best[0])
        log.info("spark-hvd autotune: keeping bucket_cap_mb=%s (%.3g ms per step; tried %s)", best[0],
                 best[1] * 1e3, ", ".join(f"{c}: {s * 1e3:.3g} ms" for c, s in self.trials))
