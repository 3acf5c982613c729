"""Gradient buckets: parameters grouped by size for one flat reduction each, and the flat buffer a
bucket's gradients are copied into (shared by ``DistributedOptimizer`` and Lightning's
``GradientAverager``)."""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch._utils

__all__ = ["DEFAULT_BUCKET_CAP_MB", "bucket_params", "FlatBuffer", "copy_all", "NUMPY_DTYPES"]

DEFAULT_BUCKET_CAP_MB = 25.0
"""Bucket size (MiB) when none is given: torch DDP's. Measured on CPU ranks (see the README), it
trains a small tabular model, a CNN and a model with 162 parameter tensors faster than one request
per gradient, and a model of large layers as fast."""

NUMPY_DTYPES = frozenset({torch.float32, torch.float64, torch.float16})
"""Dtypes whose CPU tensors the runtime takes as numpy arrays as they are (bfloat16 needs staging)."""


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
    the gradients' shapes, and, for a CPU buffer the runtime reduces in place, its numpy array."""

    __slots__ = ("members", "flat", "views", "array")

    def __init__(self, members: Tuple[int, ...], grads: List[torch.Tensor]) -> None:
        self.members = members
        self.flat = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype, device=grads[0].device)
        self.views = list(torch._utils._unflatten_dense_tensors(self.flat, grads))
        self.array = self.flat.numpy() if self.flat.device.type == "cpu" and self.flat.dtype in NUMPY_DTYPES \
            else None

    def fill(self, grads: List[torch.Tensor]) -> torch.Tensor:
        copy_all(self.views, grads)
        return self.flat


def copy_all(targets: List[torch.Tensor], sources: List[torch.Tensor]) -> None:
    """Copy each of ``sources`` into the matching tensor of ``targets`` (one foreach call where torch has it)."""
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(targets, sources)
        return
    for target, source in zip(targets, sources):
        target.copy_(source)
