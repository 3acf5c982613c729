"""``GradientAverager``: a module's gradients averaged over all ranks while backward still runs.

Each parameter's allreduce starts from a hook the moment backward has accumulated its gradient,
as :func:`spark_hvd.torch.DistributedOptimizer` does, so communication overlaps the rest of
backward. Unlike the optimizer wrapper it is driven by the caller: reductions can be paused (for
Lightning's gradient accumulation), and :meth:`GradientAverager.synchronize` waits for them
right after backward, before Lightning's ``on_after_backward`` hooks and gradient clipping.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

import spark_hvd.torch as hvd
from spark_hvd.torch.compression import Compressor

__all__ = ["GradientAverager"]

_OUTSIDE_BACKWARD = (
    "the gradient of {name!r} was computed outside Lightning's backward (a direct loss.backward()?), "
    "so it cannot be averaged over the ranks; in manual optimization call self.manual_backward(loss) "
    "instead of loss.backward()"
)
_TWICE = (
    "the gradient of {name!r} was accumulated twice in one backward call while its first reduction was "
    "still running; call backward once per Lightning backward (LightningModule.backward), or use "
    "gradient accumulation (Trainer(accumulate_grad_batches=...)) instead"
)


@dataclass
class _Pending:
    """One started reduction: its handle, and how to put the result into ``p.grad``."""

    handle: Any
    sent: Optional[torch.Tensor]  # the tensor reduced in place (None for sparse gradients)
    context: Any  # the compressor's context for decompressing ``sent``


class GradientAverager:
    """Averages the gradients of ``module``'s trainable parameters over all ranks.

    After :meth:`synchronize`, every trainable parameter's ``grad`` holds the average of the
    ranks' gradients, identical on every rank (a rank that produced no gradient for a parameter
    contributes zeros). Gradients computed while :meth:`paused` stay local and are reduced, summed
    with the next ones, by the next reduction. Backward must run inside :meth:`backward_pass`: a
    gradient accumulated outside it raises RuntimeError, as it could not be averaged.

    Arguments:
        module: The module whose parameters are averaged; names key the reductions.
        compression: ``hvd.Compression.none`` or ``hvd.Compression.fp16``.
        prefix: Prefix of the reductions' names, so they never meet other operations of the job.
    """

    def __init__(self, module: torch.nn.Module, compression: Compressor = hvd.Compression.none,
                 prefix: str = "lightning.grad.") -> None:
        self._named: List[Tuple[str, torch.Tensor]] = [(prefix + name, p) for name, p in module.named_parameters()]
        self._compression = compression
        self._hooks: Dict[torch.Tensor, Any] = {}
        self._pending: Dict[torch.Tensor, _Pending] = {}
        self._paused = False
        self._in_backward = False
        self._hook_trainable()

    # -- hooks --------------------------------------------------------------------------------------
    def _hook_trainable(self) -> None:
        """Hook every parameter that requires a gradient now (some may have been unfrozen since)."""
        owner = weakref.ref(self)
        for name, p in self._named:
            if p.requires_grad and p not in self._hooks:
                self._hooks[p] = p.register_post_accumulate_grad_hook(_make_hook(owner, name))

    def remove(self) -> None:
        """Remove the hooks; gradients are no longer averaged."""
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self._pending.clear()

    def _gradient_ready(self, name: str, p: torch.Tensor) -> None:
        if not self._in_backward:
            raise RuntimeError(_OUTSIDE_BACKWARD.format(name=name))
        if self._paused or not _communicating():
            return
        if p in self._pending:
            raise RuntimeError(_TWICE.format(name=name))
        self._pending[p] = self._start(name, p)

    # -- reductions ---------------------------------------------------------------------------------
    def _start(self, name: str, p: torch.Tensor) -> _Pending:
        if p.grad is None:
            # Another rank may have used this parameter: take part with zeros so it is not kept waiting.
            p.grad = torch.zeros_like(p)
        grad = p.grad
        if grad.is_sparse:
            return _Pending(hvd.sparse_allreduce_async(grad, name=name, op=hvd.Average), None, None)
        sent, context = self._compression.compress(grad)
        return _Pending(hvd.allreduce_async_(sent, name=name, op=hvd.Average), sent, context)

    def _finish(self, p: torch.Tensor, pending: _Pending) -> None:
        result = hvd.synchronize(pending.handle)
        if pending.sent is None:
            p.grad = result
        elif pending.sent is not p.grad:
            with torch.no_grad():
                p.grad.copy_(self._compression.decompress(result, pending.context))

    def synchronize(self) -> None:
        """Finish averaging: start the reductions no hook started (in one order on every rank) and wait for all."""
        self._hook_trainable()
        if not _communicating():
            return
        try:
            for name, p in self._named:
                if p.requires_grad and p not in self._pending:
                    self._pending[p] = self._start(name, p)
            for p, pending in self._pending.items():
                self._finish(p, pending)
        finally:
            self._pending.clear()

    # -- phases -------------------------------------------------------------------------------------
    @contextmanager
    def backward_pass(self) -> Iterator[None]:
        """Within this context the hooks start reductions (unless paused)."""
        self._in_backward = True
        try:
            yield
        finally:
            self._in_backward = False

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Within this context gradients accumulate locally; the next reduction includes them."""
        previous, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = previous

    @property
    def is_paused(self) -> bool:
        """Whether gradients currently accumulate locally."""
        return self._paused


def _communicating() -> bool:
    return hvd.size() > 1


def _make_hook(owner: "weakref.ref[GradientAverager]", name: str) -> Any:
    def hook(p: torch.Tensor) -> None:
        averager = owner()
        # An averager that was dropped without remove() must not act on a live model.
        if averager is not None:
            averager._gradient_ready(name, p)

    return hook
