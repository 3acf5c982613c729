"""What every distributed Keras optimizer class here shares, for Keras 3 and Keras 2 alike: its
settings, its local variables, and the combination of gradients over the ranks (TensorFlow
tensors through spark_hvd.tensorflow, torch tensors through spark_hvd.torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence

import spark_hvd.runtime as _rt
from spark_hvd.keras.basics import backend_name
from spark_hvd.keras.compression import Compression
from spark_hvd.runtime.ops import Adasum, Average

__all__ = ["Settings", "GradientCombining"]


@dataclass(frozen=True)
class Settings:
    """The distribution options of one DistributedOptimizer, kept on its class so copies made by
    ``from_config`` are distributed too."""

    compression: Any
    sparse_as_dense: bool
    op: int
    gradient_predivide_factor: float
    groups: Any
    process_set: Any
    backward_passes_per_step: int
    average_aggregated_gradients: bool
    scale_local_gradients: bool


def _key(var: Any) -> int:
    return id(var)


def _split(items: List[int], parts: int) -> List[List[int]]:
    parts = max(1, min(parts, len(items)))
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for p in range(parts):
        stop = start + base + (1 if p < extra else 0)
        out.append(items[start:stop])
        start = stop
    return [g for g in out if g]


def _reduce_torch(grads: List[Any], settings: Settings) -> List[Any]:
    import torch

    import spark_hvd.torch as thvd

    pre, post = _scales(settings)
    out = list(grads)
    dense = [i for i, g in enumerate(grads) if g is not None]
    groups = settings.groups if isinstance(settings.groups, int) and settings.groups > 0 else 1
    # Adasum combines each gradient on its own: never flattened together.
    elementwise = settings.compression in (Compression.none, Compression.fp16) and settings.op != Adasum
    for group in _split(dense, groups):
        # With an element-wise compression the gradients of each dtype and device travel end to
        # end in one flat tensor: one request instead of one per gradient (a compressor of the
        # user's own gets them one by one).
        parts: Dict[Any, List[int]] = {}
        for i in group:
            key = (grads[i].dtype, grads[i].device) if elementwise else i
            parts.setdefault(key, []).append(i)
        sent = [torch._utils._flatten_dense_tensors([grads[i] for i in part]) if len(part) > 1 else grads[part[0]]
                for part in parts.values()]
        packed = [settings.compression.compress(t) for t in sent]
        reduced = thvd.grouped_allreduce([p[0] for p in packed], op=settings.op, prescale_factor=pre,
                                         postscale_factor=post, process_set=settings.process_set)
        for part, r, (_, ctx) in zip(parts.values(), reduced, packed):
            result = settings.compression.decompress(r, ctx)
            if len(part) == 1:
                out[part[0]] = result
            else:
                for i, piece in zip(part, torch._utils._unflatten_dense_tensors(result, [grads[i] for i in part])):
                    out[i] = piece
    return out


def _scales(settings: Settings) -> tuple:
    if settings.op == Average:
        return 1.0 / settings.gradient_predivide_factor, settings.gradient_predivide_factor
    return 1.0, 1.0


def _active(settings: Settings) -> bool:
    ps = settings.process_set
    return ps.included() and ps.size() > 1 if ps is not None else _rt.size() > 1


class GradientCombining:
    """What every distributed optimizer class here has, for Keras 3 and Keras 2 alike: its
    local variables and the combination of gradients over the ranks."""

    _hvd: Settings

    def _hvd_local(self) -> Dict[int, Any]:
        local = self.__dict__.get("_hvd_local_vars")
        if local is None:
            local = {}
            self.__dict__["_hvd_local_vars"] = local
        return local

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient on this rank: it is not combined with other ranks' gradients."""
        self._hvd_local()[_key(var)] = var

    def _hvd_reduce(self, grads: Sequence[Any], variables: Sequence[Any]) -> List[Any]:
        """``grads`` combined over the ranks (local variables keep theirs, scaled by 1/size)."""
        grads = list(grads)
        settings = self._hvd
        if not _active(settings):
            return grads
        local = self._hvd_local()
        shared = [i for i, v in enumerate(variables) if _key(v) not in local]
        if self._hvd_on_tensorflow():
            from spark_hvd.tensorflow.gradient_tape import GradientReduction

            reduction = GradientReduction(compression=settings.compression, sparse_as_dense=settings.sparse_as_dense,
                                          op=settings.op, gradient_predivide_factor=settings.gradient_predivide_factor,
                                          groups=settings.groups, process_set=settings.process_set)
            reduced = reduction.reduce([grads[i] for i in shared], [variables[i] for i in shared])
        else:
            reduced = _reduce_torch([grads[i] for i in shared], settings)
        out = list(grads)
        for i, g in zip(shared, reduced):
            out[i] = g
        if local and settings.scale_local_gradients:
            n = float(settings.process_set.size() if settings.process_set is not None else _rt.size())
            for i, v in enumerate(variables):
                if _key(v) in local and out[i] is not None:
                    out[i] = _divide(out[i], n)
        return out

    def _hvd_on_tensorflow(self) -> bool:
        """Whether the gradients are TensorFlow tensors (Keras 3's backend says)."""
        return backend_name() == "tensorflow"


def _divide(grad: Any, n: float) -> Any:
    if hasattr(grad, "values") and hasattr(grad, "indices") and hasattr(grad, "dense_shape"):
        import tensorflow as tf

        return tf.IndexedSlices(grad.values / n, grad.indices, grad.dense_shape)
    return grad / n
