"""``DistributedGradientTape``: gradients averaged over the ranks as ``tape.gradient()`` returns them.

The reduction itself, :class:`GradientReduction`, is shared with the Keras ``DistributedOptimizer``.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import tensorflow as tf

from spark_hvd.tensorflow.basics import Adasum, Average, global_process_set, size
from spark_hvd.tensorflow.compression import Compression, Compressor
from spark_hvd.tensorflow.mpi_ops import _grouped_allreduce
from spark_hvd.tensorflow.reductions import grouped_allreduce

__all__ = ["GradientReduction", "DistributedGradientTape", "PartialDistributedGradientTape"]

Groups = Union[None, int, Sequence[Sequence[tf.Variable]]]


def _elementwise(compression: Any) -> bool:
    """Whether ``compression`` acts on each element alone (none, fp16: this module's or Keras's), so a
    flat tensor of many gradients may go through it."""
    if compression in (Compression.none, Compression.fp16):
        return True
    keras_compression = sys.modules.get("spark_hvd.keras.compression")  # loaded when Keras passed it
    return keras_compression is not None and compression in (keras_compression.Compression.none,
                                                             keras_compression.Compression.fp16)


@dataclass(frozen=True)
class GradientReduction:
    """How gradients are combined across ranks; :meth:`reduce` does it."""

    compression: Any = Compression.none
    """Compression.none, or Compression.fp16 (gradients travel as float16)."""
    sparse_as_dense: bool = False
    """Reduce ``tf.IndexedSlices`` as dense tensors instead of allgathering them."""
    op: int = Average
    """Average, Sum or Adasum (each gradient combined on its own, a power-of-two number of ranks)."""
    gradient_predivide_factor: float = 1.0
    """With Average: scale by 1/factor before the sum and factor/size after it."""
    groups: Groups = None
    """None (one grouped operation for all gradients), a number of groups, or lists of variables."""
    process_set: Any = global_process_set
    """The ranks that average their gradients."""

    def __post_init__(self) -> None:
        if self.gradient_predivide_factor != 1.0 and self.op != Average:
            raise ValueError(f"gradient_predivide_factor={self.gradient_predivide_factor} is only supported with "
                             f"op=Average, got op={self.op!r}")
        if self.gradient_predivide_factor <= 0:
            raise ValueError(f"gradient_predivide_factor={self.gradient_predivide_factor} is invalid: expected > 0")
        groups = self.groups
        if groups is not None and not isinstance(groups, (list, tuple)) and (
                isinstance(groups, bool) or not isinstance(groups, int) or groups < 0):
            raise ValueError(f"groups={groups!r} is invalid: expected a number of groups >= 0 or a list of lists "
                             "of tf.Variable")

    def active(self) -> bool:
        """Whether this rank exchanges gradients at all (a member of a process set of 2 or more)."""
        ps = self.process_set
        if ps is None:
            return size() > 1
        return ps.included() and ps.size() > 1

    def reduce(self, grads: Sequence[Any], variables: Optional[Sequence[Any]] = None) -> List[Any]:
        """Return ``grads`` combined over the ranks, in order (None stays None).

        Afterwards every rank holds the same combined gradients. ``variables`` (one per gradient)
        is needed only when ``groups`` lists variables.
        """
        grads = list(grads)
        if not self.active():
            return grads
        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        pre, post = (1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor) \
            if self.op == Average else (1.0, 1.0)
        out: List[Any] = list(grads)
        sparse = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
        if sparse:
            for i, g in zip(sparse, grouped_allreduce([grads[i] for i in sparse], op=self.op,
                                                      process_set=self.process_set)):
                out[i] = g
        groups = self._groups(grads, variables)
        # The only request of this call, on every rank alike: it may skip negotiation.
        alone = not sparse and len(groups) == 1 and self.process_set in (None, global_process_set)
        for group in groups:
            reduced = self._reduce_group([grads[i] for i in group], pre, post, alone)
            for i, g in zip(group, reduced):
                out[i] = g
        return out

    def _reduce_group(self, grads: List[Any], pre: float, post: float, alone: bool) -> List[Any]:
        """One group's dense gradients, reduced as one grouped operation.

        With an element-wise compression (none, fp16) the gradients of each dtype travel end to
        end in one flat tensor: one request for the runtime to negotiate, stage and fuse instead
        of one per gradient. A compressor of the user's own may depend on each tensor, so it gets
        them one by one. When that flat tensor is the call's only request (``alone``), every rank
        issues it in the same order, so the ranks skip negotiating it (the program-order path,
        :func:`spark_hvd.runtime.allreduce_lockstep`).
        """
        if not _elementwise(self.compression) or self.op == Adasum:  # Adasum: each gradient on its own
            return grouped_allreduce(grads, compression=self.compression, op=self.op, prescale_factor=pre,
                                     postscale_factor=post, process_set=self.process_set)
        grads = [tf.convert_to_tensor(g) for g in grads]
        by_dtype: Dict[Any, List[int]] = {}
        for i, g in enumerate(grads):
            by_dtype.setdefault(g.dtype, []).append(i)
        parts = list(by_dtype.values())
        flats = [tf.concat([tf.reshape(grads[i], [-1]) for i in part], axis=0) if len(part) > 1 else grads[part[0]]
                 for part in parts]
        if alone and len(flats) == 1:
            sent, ctx = self.compression.compress(flats[0])
            out = _grouped_allreduce([sent], op=self.op, prescale_factor=pre, postscale_factor=post,
                                     process_set=self.process_set, _lockstep=True)[0]
            reduced = [self.compression.decompress(out, ctx)]
        else:
            reduced = grouped_allreduce(flats, compression=self.compression, op=self.op, prescale_factor=pre,
                                        postscale_factor=post, process_set=self.process_set)
        out: List[Any] = [None] * len(grads)
        for part, flat in zip(parts, reduced):
            if len(part) == 1:
                out[part[0]] = flat
                continue
            pieces = tf.split(flat, [tf.size(grads[i]) for i in part])
            for i, piece in zip(part, pieces):
                out[i] = tf.reshape(piece, tf.shape(grads[i]))
        return out

    def _groups(self, grads: Sequence[Any], variables: Optional[Sequence[Any]]) -> List[List[int]]:
        dense = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
        # bfloat16 cannot share a grouped operation with other dtypes.
        bf16 = {i for i in dense if tf.convert_to_tensor(grads[i]).dtype == tf.bfloat16}
        groups = self.groups
        if isinstance(groups, (list, tuple)):
            if variables is None:
                raise ValueError("groups lists variables, so the gradients' variables are needed; pass sources "
                                 "that are tf.Variable objects")
            where = {_key(var): n for n, members in enumerate(groups) for var in members}
            chosen: Dict[Any, List[int]] = {}
            for i in dense:
                chosen.setdefault((where.get(_key(variables[i]), ("alone", i)), i in bf16), []).append(i)
            return list(chosen.values())
        out: List[List[int]] = []
        for members in ([i for i in dense if i not in bf16], [i for i in dense if i in bf16]):
            parts = max(1, min(int(groups) if groups else 1, len(members)))
            base, extra = divmod(len(members), parts)
            start = 0
            for p in range(parts):
                stop = start + base + (1 if p < extra else 0)
                out.append(members[start:stop])
                start = stop
        return [g for g in out if g]


def _key(var: Any) -> Any:
    return var.ref() if hasattr(var, "ref") else id(var)


class _DistributedGradientTape:
    """Methods placed in front of the wrapped tape's class (see :func:`DistributedGradientTape`)."""

    _hvd_reduction: GradientReduction
    _hvd_local: Dict[Any, bool]
    _hvd_scale_local: bool

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE, **unused: Any) -> Any:
        """The gradients of ``target`` with respect to ``sources``, combined over the ranks.

        Afterwards every rank holds the same gradients for every source not registered with
        :meth:`register_local_source`; local sources keep this rank's own gradient (divided by
        the number of ranks, unless ``scale_local_gradients=False``).
        """
        grads = super().gradient(target, sources, output_gradients=output_gradients,  # type: ignore[misc]
                                 unconnected_gradients=unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat = tf.nest.flatten(grads)
        local = [self._is_local(s) for s in flat_sources]
        shared = [i for i, is_local in enumerate(local) if not is_local]
        reduced = self._hvd_reduction.reduce([flat[i] for i in shared], [flat_sources[i] for i in shared])
        out = list(flat)
        for i, g in zip(shared, reduced):
            out[i] = g
        if self._hvd_scale_local and self._hvd_reduction.active():
            n = float(self._hvd_reduction.process_set.size())
            for i, is_local in enumerate(local):
                g = out[i]
                if is_local and isinstance(g, tf.IndexedSlices):
                    out[i] = tf.IndexedSlices(g.values / n, g.indices, g.dense_shape)
                elif is_local and g is not None:
                    out[i] = g / tf.cast(n, g.dtype)
        return tf.nest.pack_sequence_as(grads, out)

    def _is_local(self, source: Any) -> bool:
        return _key(source) in self._hvd_local

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient on this rank: it is not combined with other ranks' gradients.

        ``source`` is a tf.Variable or a Keras variable (then the tf.Variable it holds counts too).
        """
        self._hvd_local[_key(source)] = True
        inner = getattr(source, "value", None)
        if isinstance(inner, tf.Variable):
            self._hvd_local[_key(inner)] = True

    def get_local_and_global_gradients(self, target: Any, sources: Sequence[Any],
                                       output_gradients: Any = None) -> Tuple[List[Tuple[Any, Any]],
                                                                              List[Tuple[Any, Any]]]:
        """``(local, shared)`` lists of ``(source, gradient)`` pairs from :meth:`gradient`, in source order."""
        grads = self.gradient(target, sources, output_gradients=output_gradients)
        pairs = list(zip(sources, grads))
        return ([p for p in pairs if self._is_local(p[0])], [p for p in pairs if not self._is_local(p[0])])


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                            compression: Compressor = Compression.none, sparse_as_dense: bool = False,
                            op: int = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups: Groups = None, process_set: Any = global_process_set,
                            scale_local_gradients: bool = True) -> tf.GradientTape:
    """Wrap ``gradtape`` so that ``gradient()`` returns gradients combined over all ranks.

    Afterwards (each ``gradient()`` call) every rank holds the same averaged gradients, so the
    same optimizer step keeps the models equal. The result is an instance of a subclass of the
    tape's class sharing its recording, so it works after the ``with`` block that recorded, or
    as the context manager itself. Works eagerly and inside ``tf.function``.

    Arguments:
        gradtape: The tf.GradientTape to wrap.
        device_dense, device_sparse: Accepted for Horovod compatibility (data moves through host memory).
        compression: Compression.none or Compression.fp16.
        sparse_as_dense: Reduce tf.IndexedSlices gradients as dense tensors (otherwise allgathered).
        op: Average (default), Sum or Adasum (each gradient combined on its own over a power-of-two
            number of ranks; tf.IndexedSlices need sparse_as_dense=True).
        gradient_predivide_factor: With Average, scale by 1/factor before the sum and factor/size after.
        num_groups: Deprecated spelling of ``groups`` as a number.
        groups: None (all gradients in one grouped operation), a number of groups, or lists of
            variables whose gradients travel together (others travel alone).
        process_set: The ranks that average their gradients (default: all ranks).
        scale_local_gradients: Divide gradients of local sources by the number of ranks.
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise ValueError(f"gradtape must be a tf.GradientTape, got {type(gradtape).__name__}")
    if num_groups:
        warnings.warn("num_groups is deprecated; pass groups=<number> instead", DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    reduction = GradientReduction(compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                                  gradient_predivide_factor=gradient_predivide_factor,
                                  groups=list(groups) if isinstance(groups, (list, tuple)) else groups,
                                  process_set=process_set)
    base = type(gradtape)
    if isinstance(gradtape, _DistributedGradientTape):
        raise ValueError("gradtape is already a DistributedGradientTape; wrap the plain tape once")
    cls = type(base.__name__, (_DistributedGradientTape, base), {"__module__": base.__module__})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._hvd_reduction = reduction
    tape._hvd_local = {}
    tape._hvd_scale_local = scale_local_gradients
    return tape


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                                   compression: Compressor = Compression.none, sparse_as_dense: bool = False,
                                   op: int = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups: Groups = None, process_set: Any = global_process_set,
                                   local_layers: Any = None, scale_local_gradients: bool = True) -> tf.GradientTape:
    """A :func:`DistributedGradientTape` whose ``local_layers`` keep their gradients on each rank.

    Afterwards (each ``gradient()`` call) the trainable weights of ``local_layers`` (a Keras
    layer or a list of them) have this rank's own gradients, scaled by 1/size unless
    ``scale_local_gradients=False``; every other gradient is combined as by
    DistributedGradientTape. Other arguments as for :func:`DistributedGradientTape`.
    """
    # Any Keras layer, Keras 3's or Keras 2's (tf_keras): what is used of it is its trainable weights.
    if local_layers is None:
        local_layers = []
    elif hasattr(local_layers, "trainable_weights"):
        local_layers = [local_layers]
    bad = [i for i, layer in enumerate(local_layers) if not hasattr(layer, "trainable_weights")]
    if bad:
        raise ValueError(f"local_layers[{bad[0]}] is a {type(local_layers[bad[0]]).__name__}; every local layer "
                         "must be a Keras layer")
    tape = DistributedGradientTape(gradtape, compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                                   gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups,
                                   groups=groups, process_set=process_set,
                                   scale_local_gradients=scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape
