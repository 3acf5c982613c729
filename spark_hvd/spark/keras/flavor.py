"""Which Keras an object of a KerasEstimator fit belongs to: Keras 3 (``keras``) or Keras 2
(``tf_keras``, what ``tf.keras`` is with ``TF_USE_LEGACY_KERAS=1``), and the few operations whose
spelling differs between the two.

A fit uses the Keras of its model throughout: the checks on the driver, the ``.keras`` bytes the
ranks and checkpoints carry (whose ``metadata.json`` names the Keras version that wrote them, so
the loader picks the same Keras), the ranks' optimizer and callbacks, and ``KerasModel.transform``.
"""

from __future__ import annotations

import io
import json
import zipfile
from types import ModuleType
from typing import Any, List

import numpy as np

from spark_hvd.keras.basics import is_keras2
from spark_hvd.keras.callbacks import optimizer_variables

__all__ = ["keras_of", "keras_named", "saved_keras", "is_model", "is_optimizer", "to_numpy", "optimizer_values"]


def keras_named(keras2: bool) -> ModuleType:
    """``tf_keras`` when ``keras2``, else ``keras``."""
    if keras2:
        import tf_keras

        return tf_keras
    import keras

    return keras


def keras_of(obj: Any) -> ModuleType:
    """The Keras module ``obj`` (a model, optimizer, loss, callback or class) comes from."""
    return keras_named(is_keras2(obj))


def is_model(obj: Any) -> bool:
    """Whether ``obj`` is a model of either Keras."""
    return isinstance(obj, keras_of(obj).Model)


def is_optimizer(obj: Any) -> bool:
    """Whether ``obj`` is an optimizer of either Keras (Keras 2's legacy optimizers included)."""
    module = keras_of(obj)
    if isinstance(obj, module.optimizers.Optimizer):
        return True
    return is_keras2(obj) and isinstance(obj, module.optimizers.legacy.Optimizer)


def saved_keras(data: bytes) -> ModuleType:
    """The Keras that wrote ``data`` (a ``.keras`` archive): its ``metadata.json`` names the version."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            version = str(json.loads(archive.read("metadata.json")).get("keras_version", ""))
    except (KeyError, ValueError, zipfile.BadZipFile):
        version = ""
    return keras_named(version.startswith("2."))


def to_numpy(value: Any) -> np.ndarray:
    """A tensor of either Keras (any backend of Keras 3) as a numpy array."""
    if is_keras2(value) or type(value).__module__.startswith("tensorflow"):
        return np.asarray(value)
    import keras

    return keras.ops.convert_to_numpy(value)


def optimizer_values(optimizer: Any) -> List[np.ndarray]:
    """The values of the optimizer's variables, in order."""
    return [np.asarray(to_numpy(v)) for v in optimizer_variables(optimizer)]
