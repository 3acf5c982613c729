"""Lifecycle and topology for Keras 3 programs, on whichever backend Keras runs (tensorflow or torch).

``init`` and ``shutdown`` go through the backend's binding (so graph-mode TensorFlow numbering
starts afresh with each world); everything else comes straight from the runtime.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Iterable, Optional, Sequence, Union

import spark_hvd.runtime as _rt

__all__ = ["is_keras2", "legacy_keras_selected", "layer_list", "backend_name", "binding", "init", "shutdown",
           "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size", "is_homogeneous",
           "start_timeline", "stop_timeline"]

_BINDINGS = {"tensorflow": "spark_hvd.tensorflow", "torch": "spark_hvd.torch"}


def is_keras2(obj: Any) -> bool:
    """Whether ``obj`` (an optimizer, model, layer or callback) or its class comes from Keras 2's
    ``tf_keras`` package (what ``tf.keras`` is with ``TF_USE_LEGACY_KERAS=1``)."""
    cls = obj if isinstance(obj, type) else type(obj)
    return any(c.__module__.split(".")[0] == "tf_keras" for c in cls.__mro__)


def legacy_keras_selected() -> bool:
    """Whether ``tf.keras`` is Keras 2's ``tf_keras`` in this process (``TF_USE_LEGACY_KERAS``, as
    TensorFlow reads it)."""
    import os

    return os.environ.get("TF_USE_LEGACY_KERAS", "").strip().lower() in ("1", "true", "yes")


def layer_list(local_layers: Any) -> list:
    """``local_layers`` (None, a Keras 3 or Keras 2 layer, or a sequence of them) as a list of
    layers; ValueError naming the first item that is not a layer."""
    import keras

    def is_layer(obj: Any) -> bool:
        return isinstance(obj, keras.layers.Layer) or (is_keras2(obj) and hasattr(obj, "trainable_weights"))

    if local_layers is None:
        return []
    if is_layer(local_layers):
        return [local_layers]
    layers = list(local_layers)
    bad = [i for i, layer in enumerate(layers) if not is_layer(layer)]
    if bad:
        raise ValueError(f"local_layers[{bad[0]}] is a {type(layers[bad[0]]).__name__}; every local layer must be "
                         "a Keras layer (keras.layers.Layer, or tf_keras's)")
    return layers


def backend_name() -> str:
    """The Keras backend in use; ValueError for one spark-hvd has no binding for (jax, numpy, openvino)."""
    import keras

    name = keras.config.backend()
    if name not in _BINDINGS:
        raise ValueError(
            f"Keras runs on the {name!r} backend, which spark-hvd does not support; set KERAS_BACKEND to "
            "'tensorflow' or 'torch' before importing keras"
        )
    return name


def binding() -> ModuleType:
    """spark_hvd.tensorflow or spark_hvd.torch, whichever matches the Keras backend (imported on first use)."""
    return importlib.import_module(_BINDINGS[backend_name()])


def init(comm: Optional[Sequence[int]] = None, process_sets: Optional[Union[str, Iterable[Any]]] = None) -> None:
    """Join the job started by the launcher (a one-process world without one); see spark_hvd.tensorflow.init."""
    binding().init(comm=comm, process_sets=process_sets)


def shutdown() -> None:
    """Leave the job: afterwards collectives raise until :func:`init` is called again."""
    binding().shutdown()


is_initialized = _rt.is_initialized
rank = _rt.rank
size = _rt.size
local_rank = _rt.local_rank
local_size = _rt.local_size
cross_rank = _rt.cross_rank
cross_size = _rt.cross_size
is_homogeneous = _rt.is_homogeneous
start_timeline = _rt.start_timeline
stop_timeline = _rt.stop_timeline
