"""``DistributedOptimizer``: gradients averaged over all ranks, communicated while backward runs.

Gradients are reduced in buckets (torch DDP's ``bucket_cap_mb``): a hook counts each gradient
backward produces, and a bucket's allreduce starts the moment its last gradient is ready, so
communication overlaps the rest of backward; ``step()`` waits for them.
"""

from __future__ import annotations

import warnings
import weakref
from contextlib import contextmanager
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch._utils

import spark_hvd.runtime as _rt
from spark_hvd.torch.basics import Adasum, Average, Max, global_process_set
from spark_hvd.torch.buckets import BUCKET_CANDIDATES, DEFAULT_BUCKET_CAP_MB, BucketTuner, FlatBuffer, bucket_params, \
    copy_all, copy_grads
from spark_hvd.torch.compression import Compression, Compressor
from spark_hvd.torch.handles import Handle, enqueue
from spark_hvd.torch.mpi_ops import sparse_allreduce_async
from spark_hvd.runtime.kinds import ALLREDUCE

__all__ = ["DistributedOptimizer", "_DistributedOptimizer", "_DistributedAdasumOptimizer",  # the latter: Horovod's base class name, for isinstance
           "BUCKET_CANDIDATES"]

_TOO_MANY_PASSES = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally."
)
_ZERO_GRAD_RACE = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)


def _named(optimizer: torch.optim.Optimizer,
           named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]]) -> List[Tuple[str, torch.Tensor]]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        # One index across all groups, so names stay unique with several param groups.
        return [(f"allreduce.noname.{i}", p) for i, p in enumerate(params)]
    named = list(named_parameters)
    bad = [entry for entry in named if not (isinstance(entry, tuple) and len(entry) == 2)]
    if bad:
        raise ValueError(
            f"named_parameters should be a sequence of (name, parameter) tuples, usually "
            f"model.named_parameters(); got an entry {bad[0]!r:.80}"
        )
    seen, duplicates = set(), []
    for name, _ in named:
        if name in seen:
            duplicates.append(name)
        seen.add(name)
    if duplicates:
        raise ValueError(
            f"Parameter names in named_parameters must be unique; found duplicates: {sorted(set(duplicates))}. "
            "Pass model.named_parameters() of one model, or prefix the names of each model."
        )
    named_ids = {id(p) for _, p in named}
    unnamed = [i for i, p in enumerate(params) if id(p) not in named_ids]
    if unnamed:
        raise ValueError(
            f"named_parameters was specified, but {len(unnamed)} parameter(s) of the optimizer are not named "
            f"(positions {unnamed[:10]} in optimizer.param_groups order). Pass the named_parameters() of "
            "every module whose parameters the optimizer updates."
        )
    return named


def _split(items: Sequence[torch.Tensor], parts: int) -> List[Tuple[torch.Tensor, ...]]:
    """``parts`` contiguous slices of near-equal length (the first ones one longer)."""
    parts = max(1, min(parts, len(items)))
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append(tuple(items[start:stop]))
        start = stop
    return [g for g in out if g]


class _Group(tuple):
    """Parameters reduced as one request. Hashed and compared by identity: a plain tuple of
    tensors hashes every member on each dict access, which made each gradient hook cost time in
    proportion to its group's size (a 162-tensor bucket: 160 us per hook)."""

    __slots__ = ()
    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other


_ELEMENTWISE = (Compression.none, Compression.fp16)


class _Pending:
    """A parameter's or a group's reduction in ``_handles``: ``finish`` waits for it and leaves the
    reduced gradients in the parameters' ``.grad``."""

    __slots__ = ()
    started = True
    """Whether a request was sent (false only for :data:`_ACCUMULATING`)."""

    def finish(self, optimizer: _DistributedOptimizer) -> None:
        raise NotImplementedError


class _Accumulating(_Pending):
    """A gradient still accumulating locally (``backward_passes_per_step`` > 1): nothing was sent;
    ``synchronize()`` drops it and reduces what has accumulated."""

    __slots__ = ()
    started = False

    def finish(self, optimizer: _DistributedOptimizer) -> None:
        """Nothing to wait for."""


_ACCUMULATING = _Accumulating()


class _Dense(_Pending):
    """One dense gradient reduced on its own: the tensor sent (reduced in place) and its compression context."""

    __slots__ = ("handle", "param", "sent", "ctx")

    def __init__(self, handle: Handle, param: torch.Tensor, sent: torch.Tensor, ctx: Any) -> None:
        self.handle = handle
        self.param = param
        self.sent = sent
        self.ctx = ctx

    def finish(self, optimizer: _DistributedOptimizer) -> None:
        optimizer._unpack(self.param, self.handle.wait(), self.sent, self.ctx)


class _Sparse(_Pending):
    """One sparse gradient, allgathered (its result replaces ``.grad``)."""

    __slots__ = ("handle", "param")

    def __init__(self, handle: Handle, param: torch.Tensor) -> None:
        self.handle = handle
        self.param = param

    def finish(self, optimizer: _DistributedOptimizer) -> None:
        self.param.grad = self.handle.wait()


class _Grouped(_Pending):
    """A group's gradients compressed one by one by a compressor of the user's own and reduced as one
    grouped request: each tensor sent with its compression context."""

    __slots__ = ("handle", "params", "packed")

    def __init__(self, handle: Handle, params: Tuple[torch.Tensor, ...],
                 packed: List[Tuple[torch.Tensor, Any]]) -> None:
        self.handle = handle
        self.params = params
        self.packed = packed

    def finish(self, optimizer: _DistributedOptimizer) -> None:
        for p, reduced, (sent, ctx) in zip(self.params, self.handle.wait(), self.packed):
            optimizer._unpack(p, reduced, sent, ctx)


class _Flat(_Pending):
    """Gradients reduced as one flat buffer, as DDP's buckets: the buffer sent (reduced in place),
    its compression context, the parameters it covers and their gradients (whose shapes the result
    is split into), and the buffer's views in those shapes when it was sent uncompressed."""

    __slots__ = ("handle", "params", "sent", "compression", "grads", "views", "direct")

    def __init__(self, handle: Handle, params: Tuple[torch.Tensor, ...], sent: torch.Tensor, compression: Any,
                 grads: List[torch.Tensor], views: Optional[List[torch.Tensor]], direct: bool) -> None:
        self.handle = handle
        self.params = params
        self.sent = sent
        self.compression = compression
        self.grads = grads
        self.views = views
        self.direct = direct
        """Whether ``grads`` are the parameters' own ``.grad`` tensors (none was densified)."""

    def finish(self, optimizer: _DistributedOptimizer) -> None:
        self.handle.wait()
        if self.direct and self.views is not None:
            copy_grads(self.grads, self.views)
            return
        if self.views is not None:
            pieces = self.views
        else:
            reduced = optimizer._compression.decompress(self.sent, self.compression)
            pieces = torch._utils._unflatten_dense_tensors(reduced, self.grads)
        targets, sources = [], []
        for p, piece in zip(self.params, pieces):
            if p.grad.is_sparse:  # reduced as dense (sparse_as_dense): sparse again, see _unpack
                p.grad = piece.to_sparse(p.grad.sparse_dim())
            else:
                targets.append(p.grad)
                sources.append(piece)
        with torch.no_grad():
            copy_all(targets, sources)


class _Parts(_Pending):
    """A group reduced in several requests (gradients of several dtypes, or sparse ones)."""

    __slots__ = ("parts",)

    def __init__(self, parts: List[_Pending]) -> None:
        self.parts = parts

    def finish(self, optimizer: _DistributedOptimizer) -> None:
        for part in self.parts:
            part.finish(optimizer)


class _DistributedOptimizer:
    """Methods mixed in front of the wrapped optimizer's class (see :func:`DistributedOptimizer`)."""

    def _hvd_setup(self, named: List[Tuple[str, torch.Tensor]], compression: Compressor,
                   backward_passes_per_step: int, op: int, gradient_predivide_factor: float,
                   groups: Union[None, int, Sequence[Sequence[torch.Tensor]]], sparse_as_dense: bool,
                   process_set: Any, bucket_cap_mb: Optional[float] = None) -> None:
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        trainable = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        names = {p: name for name, p in named}
        self._parameter_names: Dict[torch.Tensor, str] = {p: names[p] for p in trainable}
        # Per-parameter state is keyed by id(p): hashing a tensor calls Python code, and every
        # gradient hook looks its parameter up several times a step.
        self._allreduce_delay: Dict[int, int] = {id(p): backward_passes_per_step for p in trainable}
        self._handles: Dict[Any, _Pending] = {}
        self._accumulating = False  # whether _handles holds placeholders (see _Accumulating)
        self._synchronized = False
        self._should_synchronize = True
        self._group_of: Dict[int, Tuple[torch.Tensor, ...]] = {}
        self._group_ready: Dict[Tuple[torch.Tensor, ...], int] = {}
        self._flat_buffers: Dict[Tuple[_Group, int], FlatBuffer] = {}
        # Groups whose parameters share one dtype and device, with the positions of all their members.
        self._uniform: Dict[_Group, Tuple[int, ...]] = {}
        self._ungrouped: List[torch.Tensor] = list(trainable)  # parameters reduced one by one
        self._communicating: Optional[bool] = None  # _communicate, as asked by this step's first hook
        self._hook_handles: List[Any] = []
        self._trainable = trainable
        self._bucket_tuner: Optional[BucketTuner] = None
        if not groups:
            # Groups of the user's own are kept as given (Horovod's meaning); otherwise buckets.
            if bucket_cap_mb is None:
                self._bucket_tuner = BucketTuner.from_runtime()
            cap = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
            groups = bucket_params(trainable, cap) if cap > 0 else None
        self._set_groups(groups, trainable)
        # Hooks always: an elastic world of one may grow, and reductions start in the first
        # backward after that.
        self._register_hooks(trainable)

    @property
    def bucket_trials(self) -> List[Tuple[float, float]]:
        """With autotune: each bucket size tried (MiB, 0 for one request per gradient) and the
        slowest rank's seconds per step under it; the fastest is kept once all are tried."""
        return list(self._bucket_tuner.trials) if self._bucket_tuner is not None else []

    def _use_buckets(self, cap_mb: float) -> None:
        """Regroup the gradients (between steps, when nothing is pending)."""
        self._group_of.clear()
        self._group_ready.clear()
        self._flat_buffers.clear()
        self._uniform.clear()
        self._ungrouped = list(self._trainable)
        if cap_mb > 0:
            self._set_groups(bucket_params(self._trainable, cap_mb), self._trainable)

    def _slowest_seconds(self, seconds: float, index: int) -> float:
        """The largest of the ranks' ``seconds`` per step of the bucket autotune's sample ``index``."""
        handle = enqueue(ALLREDUCE, [torch.tensor([seconds], dtype=torch.float64)], name=
                         f"spark_hvd.bucket_autotune.{index}", op=Max, process_set=self.process_set)
        return float(handle.wait()[0])

    @property
    def buckets(self) -> List[List[str]]:
        """The parameter names of each grouped reduction (buckets or groups), in the order their
        gradients are expected to be ready; empty when every gradient is reduced on its own."""
        return [[self._parameter_names[p] for p in group] for group in self._group_ready]

    @property
    def _communicate(self) -> bool:
        """Whether gradients are reduced now: a rank outside the process set, like a world of one,
        just applies its own gradients (asked each time, as an elastic world changes size)."""
        ps = self.process_set
        return ps is not None and ps.size() > 1 and ps.included()

    # -- configuration ---------------------------------------------------------------------------
    def _set_groups(self, groups: Any, trainable: List[torch.Tensor]) -> None:
        if groups is None or groups == 0:
            return
        if isinstance(groups, int):
            if groups < 0:
                raise ValueError(f"groups={groups} is invalid: expected a number of groups >= 0 or a list of lists")
            chosen = _split(trainable, groups)
        else:
            known = {p for p in trainable}
            chosen = []
            for i, group in enumerate(groups):
                group = tuple(group)
                stray = [j for j, p in enumerate(group) if p not in known]
                if stray:
                    raise ValueError(
                        f"groups[{i}] holds tensors at positions {stray} that are not trainable parameters of "
                        "this optimizer; groups must list the optimizer's parameters (requires_grad=True)"
                    )
                taken = [j for j, p in enumerate(group) if id(p) in self._group_of]
                if taken:
                    raise ValueError(f"groups[{i}] repeats parameters already in an earlier group (positions {taken})")
                for p in group:
                    self._group_of[id(p)] = group
                chosen.append(group)
        for group in map(_Group, chosen):
            for p in group:
                self._group_of[id(p)] = group
            self._group_ready[group] = 0
            if len(group) > 1 and len({(p.dtype, p.device) for p in group}) == 1:
                self._uniform[group] = tuple(range(len(group)))
        self._ungrouped = [p for p in trainable if id(p) not in self._group_of]

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes accumulate locally before gradients are reduced."""
        if passes < 1:
            raise ValueError(f"backward_passes_per_step={passes} is invalid: expected at least 1")
        self.backward_passes_per_step = passes
        for key in self._allreduce_delay:
            self._allreduce_delay[key] = passes

    def _register_hooks(self, trainable: List[torch.Tensor]) -> None:
        owner = weakref.ref(self)

        def make_hook(p: torch.Tensor) -> Any:
            def hook(param: torch.Tensor) -> None:
                optimizer = owner()
                # A discarded optimizer must not keep reducing gradients of a live model.
                if optimizer is not None:
                    optimizer._gradient_ready(p)

            return hook

        for p in trainable:
            self._hook_handles.append(p.register_post_accumulate_grad_hook(make_hook(p)))

    def __del__(self) -> None:
        for handle in getattr(self, "_hook_handles", ()):
            handle.remove()

    # -- reduction ------------------------------------------------------------------------------------
    def _scales(self) -> Tuple[float, float]:
        if self.op == Average:
            # Split the averaging around the sum; the runtime divides by the size afterwards.
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _outgoing(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor that carries ``p``'s gradient: ``p.grad`` itself, or a dense copy of a sparse
        gradient with sparse_as_dense (``p.grad`` stays sparse, see :meth:`_unpack`)."""
        if p.grad is None:
            # Another rank may have used this parameter this step; contribute zeros so it is not kept waiting.
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse and self.sparse_as_dense:
            return p.grad.to_dense()
        return p.grad

    def _start(self, p: torch.Tensor) -> _Dense | _Sparse:
        grad = self._outgoing(p)
        name = self._parameter_names[p]
        if grad.is_sparse:
            return _Sparse(sparse_allreduce_async(grad, name=name, op=self.op, process_set=self.process_set), p)
        sent, ctx = self._compression.compress(grad)
        pre, post = self._scales()
        handle = enqueue(ALLREDUCE, [sent], inplace=True, name=name, op=self.op, prescale_factor=pre,
                         postscale_factor=post, process_set=self.process_set)
        return _Dense(handle, p, sent, ctx)

    def _start_group(self, group: Tuple[torch.Tensor, ...]) -> _Pending:
        members = self._uniform.get(group)
        if members is not None and self._compression in _ELEMENTWISE:
            # Every step of most models: dense gradients of one dtype and device, one buffer.
            grads = [p.grad for p in group]
            if not any(g is None or g.is_sparse for g in grads):
                return self._start_flat(group, members, grads, direct=True)
        grads = [self._outgoing(p) for p in group]
        if self._compression not in _ELEMENTWISE:
            # A compressor of the user's own may depend on each tensor: compress them one by one
            # and reduce them as one grouped request.
            packed = [self._compression.compress(g) for g in grads]
            pre, post = self._scales()
            handle = enqueue(ALLREDUCE, [s for s, _ in packed], grouped=True, inplace=True,
                             name=self._parameter_names[group[0]], op=self.op, prescale_factor=pre,
                             postscale_factor=post, process_set=self.process_set)
            return _Grouped(handle, group, packed)
        # One request per dtype and device, its gradients copied end to end into one flat buffer
        # (the runtime would fuse a grouped request's tensors the same way, but each would stay a
        # request of its own, with its own negotiation and bookkeeping). Sparse gradients, which
        # backward hands over only at run time, are reduced on their own.
        parts: List[_Pending] = []
        dense: Dict[Tuple[torch.dtype, torch.device], List[int]] = {}
        for i, (p, grad) in enumerate(zip(group, grads)):
            if grad.is_sparse:
                parts.append(self._start(p))
            else:
                dense.setdefault((grad.dtype, grad.device), []).append(i)
        for members in dense.values():
            if len(members) == 1:
                parts.append(self._start(group[members[0]]))
            else:
                parts.append(self._start_flat(group, tuple(members), [grads[i] for i in members], direct=False))
        return parts[0] if len(parts) == 1 else _Parts(parts)

    def _start_flat(self, group: Tuple[torch.Tensor, ...], members: Tuple[int, ...], grads: List[torch.Tensor],
                    direct: bool) -> _Flat:
        """Reduce ``grads`` (the gradients of ``group[i]`` for i in ``members``, one dtype and
        device) as one flat buffer."""
        key = (group, members[0])
        buffer = self._flat_buffers.get(key)
        if buffer is None or not buffer.holds(members, grads[0]):
            buffer = self._flat_buffers[key] = FlatBuffer(members, grads, self._parameter_names[group[members[0]]]
                                                          + ".flat")
        sent, ctx = self._compression.compress(buffer.fill(grads))
        pre, post = self._scales()
        name = buffer.name
        own = sent is buffer.flat and buffer.array is not None
        handle: Any = None
        if own and len(members) == len(group) and len(self._group_ready) == 1 and not self._ungrouped:
            # The step's only reduction (the same on every rank, in the same order): the ranks
            # exchange it without negotiating it (shared memory on one host, direct links
            # between hosts).
            handle = _rt.allreduce_lockstep(buffer.array, op=self.op, name=name, prescale_factor=pre,
                                            postscale_factor=post, process_set=self.process_set)
        if handle is None and own:
            # The buffer is this optimizer's own, contiguous tensor: the runtime reduces its
            # memory in place, with none of the checks and staging a caller's tensor needs.
            handle = _rt.allreduce_async(buffer.array, op=self.op, name=name, prescale_factor=pre,
                                         postscale_factor=post, out=buffer.array, process_set=self.process_set)
        elif handle is None:
            handle = enqueue(ALLREDUCE, [sent], inplace=True, name=name, op=self.op, prescale_factor=pre,
                             postscale_factor=post, process_set=self.process_set)
        views = buffer.views if sent is buffer.flat else None
        params = group if len(members) == len(group) else tuple(group[i] for i in members)
        return _Flat(handle, params, sent, ctx, grads, views, direct)

    def _gradient_ready(self, p: torch.Tensor) -> None:
        communicate = self._communicating
        if communicate is None:  # asked once per step (synchronize() forgets it)
            communicate = self._communicating = self._communicate
        if not communicate:
            return
        key = id(p)
        delay = self._allreduce_delay[key]
        if delay <= 0:
            raise AssertionError(_TOO_MANY_PASSES)
        self._allreduce_delay[key] = delay - 1
        if delay > 1:
            self._handles[p] = _ACCUMULATING
            self._accumulating = True
            return
        if self._handles:
            self._handles.pop(p, None)  # the placeholder of the passes before
        group = self._group_of.get(key)
        if group is None:
            self._handles[p] = self._start(p)
            return
        self._group_ready[group] += 1
        if self._group_ready[group] == len(group):
            self._handles[group] = self._start_group(group)

    def _unpack(self, p: torch.Tensor, result: torch.Tensor, sent: torch.Tensor, ctx: Any) -> None:
        """Make ``p.grad`` hold a reduced gradient (already there when it was reduced in place)."""
        if p.grad.is_sparse:
            # Reduced as dense (sparse_as_dense); the wrapped optimizer gets the layout backward
            # produced, which optimizers such as SparseAdam require: whole rows for an embedding.
            p.grad = self._compression.decompress(result, ctx).to_sparse(p.grad.sparse_dim())
        elif sent is not p.grad:
            with torch.no_grad():
                p.grad.copy_(self._compression.decompress(result, ctx))

    def synchronize(self) -> None:
        """Wait until every gradient has been reduced over all ranks (starting any not yet started).

        Afterwards ``p.grad`` holds the averaged gradient on every rank. Call it before modifying
        gradients (clipping), then ``step()`` inside ``skip_synchronize()``.
        """
        self._communicating = None
        if not self._communicate:
            self._synchronized = True
            return
        handles = self._handles
        if self._accumulating:
            # Placeholders mark gradients still accumulating locally: reduce what has accumulated.
            handles = self._handles = {key: pending for key, pending in handles.items() if pending.started}
            self._accumulating = False
        for p in self._ungrouped:
            if p not in handles:
                handles[p] = self._start(p)
        for group in self._group_ready:
            if group not in handles:
                handles[group] = self._start_group(group)
        for pending in handles.values():
            pending.finish(self)
        handles.clear()
        self._allreduce_delay = dict.fromkeys(self._allreduce_delay, self.backward_passes_per_step)
        self._group_ready = dict.fromkeys(self._group_ready, 0)
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this context, ``step()`` does not synchronize (use after an explicit ``synchronize()``)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        """Synchronize (unless inside ``skip_synchronize()``), then apply the wrapped optimizer's update."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                    "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.",
                    stacklevel=2,
                )
            self.synchronize()
        self._synchronized = False
        result = super().step(closure)  # type: ignore[misc]
        tuner = self._bucket_tuner
        if tuner is not None and not tuner.done and self._communicate:
            tuner.after_step(self._slowest_seconds, self._use_buckets)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients; refused while reductions are pending (between backward and step)."""
        if self._handles:
            raise AssertionError(_ZERO_GRAD_RACE)
        super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load the wrapped optimizer's state and forget any pending reduction."""
        self._handles = {}
        self._accumulating = False
        self._communicating = None
        self._synchronized = False
        self._should_synchronize = True
        for key in self._allreduce_delay:
            self._allreduce_delay[key] = self.backward_passes_per_step
        super().load_state_dict(state_dict)  # type: ignore[misc]


class _DistributedAdasumOptimizer:
    """Horovod's Adasum optimizer: every rank applies the wrapped optimizer to its own gradients,
    then the ranks combine the parameters' changes (not the gradients) with Adasum
    (:func:`spark_hvd.runtime.ops.adasum`, each parameter on its own) and every rank sets its
    parameters to where they started plus the combined change. The wrapped optimizer's state
    (momenta, Adam's moments) stays each rank's own, as in Horovod."""

    def _hvd_adasum_setup(self, named: List[Tuple[str, torch.Tensor]], compression: Compressor,
                          process_set: Any) -> None:
        self._compression = compression
        self.process_set = process_set
        self._parameter_names = {p: name for name, p in named}

    def _trainable(self) -> List[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]  # type: ignore

    def synchronize(self) -> None:
        """Nothing to wait for: the changes are combined inside ``step()``."""

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Accepted for code written for the averaging optimizer; ``step()`` combines as always."""
        yield

    def step(self, closure: Any = None) -> Any:
        """The wrapped optimizer's step on this rank's gradients, then the parameters' changes
        combined over the ranks with Adasum (a blocking grouped allreduce)."""
        params = self._trainable()
        with torch.no_grad():
            starts = [p.detach().clone() for p in params]
        result = super().step(closure)  # type: ignore[misc]
        if not params:
            return result
        with torch.no_grad():
            sent, contexts = zip(*(self._compression.compress(p.detach() - start) for p, start in zip(params, starts)))
            handle = enqueue(ALLREDUCE, list(sent), grouped=True, inplace=True, name=None, op=Adasum,
                             process_set=self.process_set)
            combined = handle.wait()
            for p, start, change, ctx in zip(params, starts, combined, contexts):
                p.copy_(start + self._compression.decompress(change, ctx).to(p.dtype))
        return result


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
    compression: Compressor = Compression.none,
    backward_passes_per_step: int = 1,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Union[None, int, Sequence[Sequence[torch.Tensor]]] = None,
    sparse_as_dense: bool = False,
    process_set: Any = global_process_set,
    bucket_cap_mb: Optional[float] = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Gradients are averaged in buckets of about ``bucket_cap_mb`` MiB, each bucket's allreduce
    starting from a hook as soon as backward has accumulated all of its gradients, overlapping
    communication with the rest of backward; ``step()`` waits for them.
    The returned object is an instance of a subclass of the optimizer's class (so ``isinstance``
    and learning-rate schedulers keep working) sharing its state and param groups.

    Arguments:
        optimizer: The torch optimizer to wrap.
        named_parameters: ``model.named_parameters()``; names key the allreduce operations (and
            must be unique). Without them, parameters are numbered.
        compression: ``Compression.none`` or ``Compression.fp16`` (gradients travel as float16).
        backward_passes_per_step: Backward passes accumulated locally before one reduction.
        op: ``Average`` (default), ``Sum``, or ``Adasum``: each rank steps the wrapped optimizer on
            its own gradients and the ranks combine the parameters' changes with Adasum (a
            power-of-two number of ranks; ``backward_passes_per_step`` means calling ``step()``
            after that many backward passes, and ``groups``/``bucket_cap_mb`` do not apply).
            Horovod's guide for the learning rate with Adasum: the best single-worker rate, scaled
            by ``hvd.local_size()`` where GPUs reduce within a host, else by about 2-2.5.
        gradient_predivide_factor: With op=Average, gradients are scaled by 1/factor before the
            sum and factor/size after it.
        num_groups: Deprecated spelling of ``groups`` as a number.
        groups: A number of groups to split the parameters into, or a list of lists of parameters;
            each group is reduced as one grouped operation once all its gradients are ready.
        sparse_as_dense: Reduce sparse gradients as dense tensors (otherwise they are allgathered);
            the reduced gradient is made sparse again before the wrapped optimizer's step.
        process_set: Ranks that average their gradients (default: all ranks).
        bucket_cap_mb: Reduce gradients in buckets of about this many MiB (torch DDP's
            ``bucket_cap_mb``; default :data:`DEFAULT_BUCKET_CAP_MB`, 25): buckets are filled from
            the last parameter to the first (a larger gradient gets one of its own), and each is
            reduced as one request, its gradients copied into one flat buffer, once all of them
            are ready, so a model with hundreds of parameter tensors sends a few requests per
            step. ``0`` reduces each gradient on its own as soon as it is ready (Horovod's way).
            ``optimizer.buckets`` lists the buckets. Not combined with ``groups``. Left unset
            while the runtime autotunes (``HOROVOD_AUTOTUNE``), the sizes in
            :data:`BUCKET_CANDIDATES` are each tried for a sample of steps after the warm-up and
            the fastest is kept (``optimizer.bucket_trials``).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, (_DistributedOptimizer, _DistributedAdasumOptimizer)):
        raise ValueError("optimizer is already a DistributedOptimizer; wrap the plain optimizer once")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError(
            f"gradient_predivide_factor={gradient_predivide_factor} is only supported with op=Average, got op={op!r}"
        )
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} is invalid: expected a value > 0")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r} is invalid: expected an int >= 1")
    if num_groups:
        warnings.warn("num_groups is deprecated; pass groups=<number> instead", DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if bucket_cap_mb is not None:
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb >= 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} is invalid: expected a number of MiB >= 0, e.g. "
                             "bucket_cap_mb=25, or 0 to reduce each gradient on its own")
        if groups:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} and groups={groups!r} both say how gradients are "
                             "grouped: expected one of them; drop groups to use buckets, or bucket_cap_mb to use "
                             "your groups")
    named = _named(optimizer, named_parameters)
    if op == Adasum:
        adasum = type(optimizer.__class__.__name__, (_DistributedAdasumOptimizer, optimizer.__class__), {})
        wrapped_adasum = adasum.__new__(adasum)
        wrapped_adasum.__dict__.update(optimizer.__dict__)
        wrapped_adasum._hvd_adasum_setup(named, compression, process_set)
        return wrapped_adasum
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    # Adopt the optimizer's attributes instead of constructing anew: its state (a loaded
    # checkpoint), defaults and hooks carry over, and constructors with required arguments work.
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._hvd_setup(named, compression, backward_passes_per_step, op, gradient_predivide_factor, groups,
                       sparse_as_dense, process_set, bucket_cap_mb)
    return wrapped
