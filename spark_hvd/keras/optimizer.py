"""``DistributedOptimizer`` for Keras 3: gradients averaged over the ranks before they are applied.

The wrapped optimizer's class gets a subclass whose ``apply()`` reduces the gradients first, so
it works inside ``model.fit``'s compiled step (TensorFlow backend: graph ops of
spark_hvd.tensorflow) and in the torch backend's eager step (spark_hvd.torch). With
``backward_passes_per_step=N`` the optimizer accumulates gradients locally for N steps (Keras's
own ``gradient_accumulation_steps``) and reduces only on the step that applies them.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence

import keras

import spark_hvd.runtime as _rt
from spark_hvd.keras.basics import backend_name, is_keras2, layer_list, legacy_keras_selected
from spark_hvd.keras.combining import GradientCombining, Settings
from spark_hvd.keras.compression import Compression, Compressor
from spark_hvd.runtime.ops import Average

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer", "load_model"]


class _DistributedOptimizer(GradientCombining):
    """Methods placed in front of a Keras 3 optimizer's class (see :func:`DistributedOptimizer`)."""

    def apply(self, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]] = None) -> Any:
        """Combine ``grads`` over the ranks, then apply them as the wrapped optimizer does.

        Afterwards every rank has applied the same averaged gradients (with
        backward_passes_per_step > 1: on the steps that apply the accumulated gradients).
        """
        already = self.__dict__.pop("_hvd_reduced", False)
        if self._hvd.backward_passes_per_step == 1 and not already:
            variables = list(trainable_variables) if trainable_variables is not None else \
                list(self._trainable_variables)
            grads = self._hvd_reduce(grads, variables)
        return super().apply(grads, trainable_variables)  # type: ignore[misc]

    def _backend_apply_gradients(self, grads: Sequence[Any], trainable_variables: Sequence[Any]) -> Any:
        self.__dict__["_hvd_applying"] = list(trainable_variables)
        return super()._backend_apply_gradients(grads, trainable_variables)  # type: ignore[misc]

    def _clip_gradients(self, grads: Sequence[Any]) -> Any:
        # Keras calls this once per applied update, after local accumulation: where accumulated
        # gradients are combined across ranks when backward_passes_per_step > 1.
        passes = self._hvd.backward_passes_per_step
        if passes > 1:
            grads = self._hvd_reduce(grads, self.__dict__.get("_hvd_applying", []))
            if not self._hvd.average_aggregated_gradients:
                grads = [None if g is None else g * passes for g in grads]
        return super()._clip_gradients(grads)  # type: ignore[misc]

    def _compute_gradients(self, loss: Any, var_list: Sequence[Any], grad_loss: Any = None, tape: Any = None) -> List[Any]:
        """Horovod's helper (TensorFlow backend): ``(gradient, variable)`` pairs of ``loss``, combined over the ranks.

        ``loss`` is a tensor recorded on ``tape`` or a callable. With backward_passes_per_step > 1
        the gradients are returned local and combined when applied.
        """
        import tensorflow as tf

        var_list = list(var_list)
        if tape is None:
            tape = tf.GradientTape()
        if callable(loss):
            with tape:
                tape.watch(var_list)
                loss = loss()
        grads = tape.gradient(loss, var_list, grad_loss)
        if self._hvd.backward_passes_per_step == 1:
            grads = self._hvd_reduce(grads, var_list)
            self.__dict__["_hvd_reduced"] = True
        return list(zip(grads, var_list))


_WRAPPED: Dict[tuple, type] = {}


def _wrapped_class(base: type, settings: Settings, methods: type = _DistributedOptimizer) -> type:
    """The subclass of ``base`` with ``methods`` in front (Keras 3's, or Keras 2's of
    :mod:`spark_hvd.keras.keras2`), carrying ``settings``."""
    key = (base, settings, methods)
    try:
        return _WRAPPED[key]
    except (KeyError, TypeError):
        pass
    # Same name and module as the wrapped class: a saved model names the plain optimizer, and
    # load_model() below wraps it again.
    cls = type(base.__name__, (methods, base),
               {"_hvd": settings, "__module__": base.__module__, "__qualname__": base.__qualname__})
    try:
        _WRAPPED[key] = cls
    except TypeError:  # unhashable groups: no caching
        pass
    return cls


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None, device_dense: str = "",
                         device_sparse: str = "", compression: Compressor = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0, op: int = Average,
                         backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None, process_set: Any = _rt.global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap a Keras 3 optimizer so that gradients are averaged across ranks before they are applied.

    Returns an optimizer of a subclass of ``optimizer``'s class, built from its config (so
    pass a fresh optimizer, as with Horovod). Afterwards, in ``model.fit`` or any
    ``apply_gradients`` call, every rank applies the same combined gradients, so models that
    start equal stay equal. Works on the tensorflow backend (also inside the compiled step;
    compile with ``jit_compile=False`` where XLA would be used, since the collectives are
    Python-function ops) and on the torch backend.

    Arguments:
        optimizer: A keras.optimizers.Optimizer, or a Keras 2 optimizer of ``tf_keras``
            (``tf.keras.optimizers.*`` and ``...legacy.*`` with ``TF_USE_LEGACY_KERAS=1``; see
            :mod:`spark_hvd.keras.keras2`).
        name: Accepted for Horovod compatibility.
        device_dense, device_sparse: Accepted for Horovod compatibility.
        compression: Compression.none or Compression.fp16 (gradients travel as float16).
        sparse_as_dense: Reduce sparse (IndexedSlices) gradients as dense tensors.
        gradient_predivide_factor: With Average, scale by 1/factor before the sum and factor/size after.
        op: Average (default), Sum or Adasum (each gradient combined on its own, over a power-of-two
            number of ranks, as Horovod's Keras optimizer does).
        backward_passes_per_step: Steps whose gradients accumulate locally before one reduction
            and one update (Keras's gradient_accumulation_steps).
        average_aggregated_gradients: With backward_passes_per_step > 1, apply the mean of the
            accumulated gradients instead of their sum (Horovod's default is the sum).
        num_groups: Deprecated spelling of ``groups`` as a number.
        groups: A number of grouped operations to split the gradients into (default: one).
        process_set: The ranks that average their gradients (default: all ranks).
        scale_local_gradients: Divide gradients of registered local variables by the number of ranks.
    """
    keras2 = is_keras2(optimizer)
    if not keras2:
        backend_name()
    if not keras2 and not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(f"optimizer must be a Keras optimizer (keras.optimizers.Optimizer, or tf_keras's for Keras 2), "
                         f"got {type(optimizer).__module__}.{type(optimizer).__name__}")
    if isinstance(optimizer, GradientCombining):
        raise ValueError("optimizer is already a DistributedOptimizer; wrap the plain optimizer once")
    if op != Average and gradient_predivide_factor != 1.0:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} is only supported with op=Average")
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} is invalid: expected a value > 0")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r} is invalid: expected an int >= 1")
    if num_groups:
        warnings.warn("num_groups is deprecated; pass groups=<number> instead", DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if groups is not None and (isinstance(groups, bool) or not isinstance(groups, int) or groups < 0):
        raise ValueError(f"groups={groups!r} is invalid: expected a number of groups >= 0")
    config = optimizer.get_config()
    # Keras 3 accumulates through the optimizer's own gradient_accumulation_steps; Keras 2's
    # optimizers have none, and spark_hvd.keras.keras2 accumulates itself.
    accumulate = None if keras2 else config.get("gradient_accumulation_steps")
    if backward_passes_per_step > 1 and not keras2:
        if accumulate and accumulate != backward_passes_per_step:
            raise ValueError(
                f"the optimizer accumulates gradients over gradient_accumulation_steps={accumulate}, but "
                f"backward_passes_per_step={backward_passes_per_step}; set only one of them"
            )
        config["gradient_accumulation_steps"] = backward_passes_per_step
    elif accumulate:
        backward_passes_per_step = int(accumulate)
        average_aggregated_gradients = True  # Keras's own accumulation means the mean
    settings = Settings(compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                         gradient_predivide_factor=float(gradient_predivide_factor), groups=groups,
                         process_set=process_set, backward_passes_per_step=backward_passes_per_step,
                         average_aggregated_gradients=average_aggregated_gradients,
                         scale_local_gradients=scale_local_gradients)
    if keras2:
        from spark_hvd.keras.keras2 import Keras2Distributed

        return _wrapped_class(type(optimizer), settings, Keras2Distributed).from_config(config)
    return _wrapped_class(type(optimizer), settings).from_config(config)


def PartialDistributedOptimizer(optimizer: Any, name: Optional[str] = None, device_dense: str = "",
                                device_sparse: str = "", compression: Compressor = Compression.none,
                                sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                                op: int = Average, backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False, groups: Any = None,
                                process_set: Any = _rt.global_process_set, local_layers: Any = None,
                                scale_local_gradients: bool = True) -> Any:
    """A :func:`DistributedOptimizer` whose ``local_layers`` keep their gradients on each rank.

    Afterwards the trainable weights of ``local_layers`` (a layer or a list of layers) get this
    rank's own gradients, scaled by 1/size unless ``scale_local_gradients=False``; all other
    gradients are combined as by DistributedOptimizer.
    """
    local_layers = layer_list(local_layers)
    wrapped = DistributedOptimizer(optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
                                   gradient_predivide_factor=gradient_predivide_factor, op=op,
                                   backward_passes_per_step=backward_passes_per_step,
                                   average_aggregated_gradients=average_aggregated_gradients, groups=groups,
                                   process_set=process_set, scale_local_gradients=scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            wrapped.register_local_var(var)
    return wrapped


def load_model(filepath: str, custom_optimizers: Optional[Sequence[type]] = None,
               custom_objects: Optional[Dict[str, Any]] = None, compression: Compressor = Compression.none,
               **distributed: Any) -> Any:
    """Load a model saved by Keras and wrap its optimizer in a :func:`DistributedOptimizer`.

    The optimizer is rebuilt as the distributed subclass of its saved class before its saved
    state is loaded into it, so training resumes with the saved slots and iteration count.
    ``custom_optimizers`` lists optimizer classes of your own; ``distributed`` takes further
    DistributedOptimizer options (op, backward_passes_per_step, ...). A model Keras 2 saved
    (``tf_keras``: an ``.h5`` file, a SavedModel directory or a ``.keras`` file of Keras 2.x), or
    any file with ``TF_USE_LEGACY_KERAS=1``, is loaded by ``tf_keras`` with its optimizer wrapped
    the same way.
    """
    settings = Settings(compression=compression, sparse_as_dense=distributed.pop("sparse_as_dense", False),
                         op=distributed.pop("op", Average),
                         gradient_predivide_factor=float(distributed.pop("gradient_predivide_factor", 1.0)),
                         groups=distributed.pop("groups", None),
                         process_set=distributed.pop("process_set", _rt.global_process_set),
                         backward_passes_per_step=int(distributed.pop("backward_passes_per_step", 1)),
                         average_aggregated_gradients=bool(distributed.pop("average_aggregated_gradients", False)),
                         scale_local_gradients=bool(distributed.pop("scale_local_gradients", True)))
    if distributed:
        raise ValueError(f"load_model got unknown options {sorted(distributed)}; expected DistributedOptimizer options")
    keras2 = _saved_by_keras2(filepath)
    if keras2:
        import tf_keras

        from spark_hvd.keras.keras2 import Keras2Distributed

        library, base, methods = tf_keras, tf_keras.optimizers.Optimizer, Keras2Distributed
    else:
        library, base, methods = keras, keras.optimizers.Optimizer, _DistributedOptimizer
    classes = [c for c in vars(library.optimizers).values() if isinstance(c, type) and issubclass(c, base)]
    classes += list(custom_optimizers or [])
    objects = {c.__name__: _wrapped_class(c, settings, methods) for c in classes}
    objects.update(custom_objects or {})
    model = library.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if keras2 and optimizer is not None and not isinstance(optimizer, GradientCombining):
        # Keras 2's HDF5 loader builds its own optimizer classes whatever custom_objects say:
        # the distributed subclass takes over the loaded one's configuration and state.
        model.optimizer = _rewrapped(optimizer, model, _wrapped_class(type(optimizer), settings, methods))
    return model


def _rewrapped(optimizer: Any, model: Any, cls: type) -> Any:
    """A ``cls`` optimizer (a Keras 2 distributed subclass) with ``optimizer``'s config and variables."""
    from spark_hvd.keras.callbacks import optimizer_variables

    values = [v.numpy() for v in optimizer_variables(optimizer)]
    wrapped = cls.from_config(optimizer.get_config())
    if values:
        if hasattr(wrapped, "build"):
            wrapped.build(model.trainable_variables)
        else:  # a legacy optimizer creates its slots this way
            wrapped._create_all_weights(model.trainable_variables)
        for variable, value in zip(optimizer_variables(wrapped), values):
            variable.assign(value)
    return wrapped


def _saved_by_keras2(filepath: Any) -> bool:
    """Whether ``filepath`` is for Keras 2's ``tf_keras`` to load: ``TF_USE_LEGACY_KERAS`` is set, or
    the file is HDF5, a SavedModel directory, or a ``.keras`` archive Keras 2.x wrote."""
    import json
    import os
    import zipfile

    path = os.fspath(filepath)
    if legacy_keras_selected():
        return True
    if os.path.isdir(path):
        return os.path.exists(os.path.join(path, "saved_model.pb"))
    try:
        with open(path, "rb") as f:
            if f.read(8) == b"\x89HDF\r\n\x1a\n":
                return True
        with zipfile.ZipFile(path) as archive:
            version = str(json.loads(archive.read("metadata.json")).get("keras_version", ""))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return False
    return version.startswith("2.")
