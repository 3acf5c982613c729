"""``GradientAverager``: a module's gradients averaged over all ranks while backward still runs.

The gradients are reduced in buckets, as :func:`spark_hvd.torch.DistributedOptimizer` does: a
hook counts each gradient backward accumulates, and a bucket's one flat allreduce starts the
moment its last gradient is ready, so communication overlaps the rest of backward and a step
costs one request per bucket rather than one per parameter. Unlike the optimizer wrapper it is
driven by the caller: reductions can be paused (for Lightning's gradient accumulation), and
:meth:`GradientAverager.synchronize` waits for them right after backward, before Lightning's
``on_after_backward`` hooks and gradient clipping.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch._utils

import spark_hvd.runtime as _rt
import spark_hvd.torch as hvd
from spark_hvd.torch.buckets import DEFAULT_BUCKET_CAP_MB, FlatBuffer, bucket_params, copy_grads
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
    """One started reduction: its handle, and how to put the result into the gradients."""

    handle: Any
    sent: Optional[torch.Tensor]  # the tensor reduced in place (None for sparse gradients)
    context: Any  # the compressor's context for decompressing ``sent``
    buffer: Optional[FlatBuffer] = None  # a bucket's flat buffer, whose views go back to the gradients


class _Bucket:
    """Parameters whose gradients travel in one flat buffer: their names, the count of those
    ready this backward, and the buffer (made at the first reduction, kept after)."""

    __slots__ = ("params", "name", "ready", "buffer")

    def __init__(self, params: Tuple[torch.Tensor, ...], name: str) -> None:
        self.params = params
        self.name = name
        self.ready = 0
        self.buffer: Optional[FlatBuffer] = None


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
        bucket_cap_mb: Gradients per bucket (MiB); 0 reduces each gradient on its own.
    """

    def __init__(self, module: torch.nn.Module, compression: Compressor = hvd.Compression.none,
                 prefix: str = "lightning.grad.", bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> None:
        self._named: List[Tuple[str, torch.Tensor]] = [(prefix + name, p) for name, p in module.named_parameters()]
        self._names: Dict[int, str] = {id(p): name for name, p in self._named}
        self._params: Dict[int, torch.Tensor] = {id(p): p for _, p in self._named}
        self._compression = compression
        self._bucket_cap_mb = bucket_cap_mb
        self._hooks: Dict[int, Any] = {}
        self._pending: Dict[Any, _Pending] = {}  # by bucket, or by parameter id for one reduced alone
        self._seen: set = set()  # ids of the parameters whose gradient this backward already counted
        self._buckets: List[_Bucket] = []
        self._bucket_of: Dict[int, _Bucket] = {}
        self._paused = False
        self._in_backward = False
        self._hook_trainable()

    # -- hooks --------------------------------------------------------------------------------------
    def _hook_trainable(self) -> None:
        """Hook every parameter that requires a gradient now (some may have been unfrozen since),
        and bucket the trainable parameters anew when that set changed."""
        owner = weakref.ref(self)
        added = False
        for name, p in self._named:
            if p.requires_grad and id(p) not in self._hooks:
                self._hooks[id(p)] = p.register_post_accumulate_grad_hook(_make_hook(owner, name))
                added = True
        if added:
            self._rebucket()

    def _rebucket(self) -> None:
        # Buckets of one dtype and device each, from the model alone: the same on every rank.
        trainable = [p for _, p in self._named if id(p) in self._hooks]
        kinds: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
        for p in trainable:
            kinds.setdefault((p.dtype, p.device), []).append(p)
        self._buckets, self._bucket_of = [], {}
        if self._bucket_cap_mb <= 0 or not self._compression_is_elementwise():
            return
        for members in kinds.values():
            for params in bucket_params(members, self._bucket_cap_mb):
                if len(params) > 1:
                    bucket = _Bucket(params, self._names[id(params[0])] + ".flat")
                    self._buckets.append(bucket)
                    for p in params:
                        self._bucket_of[id(p)] = bucket

    def _compression_is_elementwise(self) -> bool:
        return self._compression in (hvd.Compression.none, hvd.Compression.fp16)

    def remove(self) -> None:
        """Remove the hooks; gradients are no longer averaged."""
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self._pending.clear()
        self._seen.clear()

    def _gradient_ready(self, name: str, p: torch.Tensor) -> None:
        if not self._in_backward:
            raise RuntimeError(_OUTSIDE_BACKWARD.format(name=name))
        if self._paused or not _communicating():
            return
        key = id(p)
        if key in self._seen:
            raise RuntimeError(_TWICE.format(name=name))
        self._seen.add(key)
        bucket = self._bucket_of.get(key)
        if bucket is None:
            self._pending[key] = self._start(name, p)
            return
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._pending[bucket] = self._start_bucket(bucket)

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

    def _start_bucket(self, bucket: _Bucket) -> _Pending:
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in bucket.params]
        if any(g.is_sparse for g in grads):
            # Sparse gradients appear only at run time: this bucket's members go one by one.
            parts = [(id(p), self._start(self._names[id(p)], p)) for p in bucket.params]
            return _Pending(parts, None, None)
        buffer = bucket.buffer
        members = tuple(range(len(grads)))
        if buffer is None or not buffer.holds(members, grads[0]):
            buffer = bucket.buffer = FlatBuffer(members, grads, bucket.name)
        sent, context = self._compression.compress(buffer.fill(grads))
        if sent is buffer.flat and buffer.array is not None:
            # The averager's own contiguous CPU buffer: reduced in place, without a caller tensor's
            # staging; when it holds every gradient of the step (the same request on every rank, in
            # the same order), the ranks exchange it without negotiating it (the program-order path).
            handle = None
            if len(self._buckets) == 1 and len(bucket.params) == len(self._hooks):
                handle = _rt.allreduce_lockstep(buffer.array, op=hvd.Average, name=bucket.name)
            if handle is None:
                handle = _rt.allreduce_async(buffer.array, op=hvd.Average, name=bucket.name, out=buffer.array)
            return _Pending(handle, None, None, buffer)
        return _Pending(hvd.allreduce_async_(sent, name=bucket.name, op=hvd.Average), sent, context, buffer)

    def _finish(self, key: Any, pending: _Pending) -> None:
        if isinstance(key, _Bucket):
            if isinstance(pending.handle, list):  # a bucket with sparse gradients, reduced one by one
                for part_key, part in pending.handle:
                    self._finish(part_key, part)
                return
            self._finish_bucket(key, pending)
            return
        p = self._params[key]
        result = hvd.synchronize(pending.handle)
        if pending.sent is None:
            p.grad = result
        elif pending.sent is not p.grad:
            with torch.no_grad():
                p.grad.copy_(self._compression.decompress(result, pending.context))

    def _finish_bucket(self, bucket: _Bucket, pending: _Pending) -> None:
        buffer = pending.buffer
        assert buffer is not None, "a bucket's reduction has its buffer"
        if pending.sent is None:
            pending.handle.wait()  # reduced in place in the buffer
            reduced = buffer.views
        else:
            result = self._compression.decompress(hvd.synchronize(pending.handle), pending.context)
            reduced = list(torch._utils._unflatten_dense_tensors(result.reshape(-1), [p.grad for p in bucket.params]))
        copy_grads([p.grad for p in bucket.params], reduced)

    def synchronize(self) -> None:
        """Finish averaging: start the reductions no hook started (in one order on every rank) and wait for all."""
        self._hook_trainable()
        if not _communicating():
            return
        try:
            for bucket in self._buckets:
                if bucket not in self._pending:
                    self._pending[bucket] = self._start_bucket(bucket)
            for name, p in self._named:
                if p.requires_grad and id(p) not in self._bucket_of and id(p) not in self._pending:
                    self._pending[id(p)] = self._start(name, p)
            for key, pending in self._pending.items():
                self._finish(key, pending)
        finally:
            self._pending.clear()
            self._seen.clear()
            for bucket in self._buckets:
                bucket.ready = 0

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
