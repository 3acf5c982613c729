"""Horovod's ``horovod.tensorflow.keras`` on spark-hvd: the Keras 3 API of :mod:`spark_hvd.keras`.

``import spark_hvd.tensorflow.keras as hvd`` is the same API as ``import spark_hvd.keras as hvd``,
and Horovod's submodule paths (``spark_hvd.tensorflow.keras.callbacks``, ``...elastic``) name the
same modules as ``spark_hvd.keras.callbacks`` and ``spark_hvd.keras.elastic``. With
``TF_USE_LEGACY_KERAS=1`` (``tf.keras`` is Keras 2's ``tf_keras``) ``SyncBatchNormalization`` here
is a ``tf_keras`` layer, as Horovod's is a ``tf.keras`` one.
"""

import sys

from spark_hvd.keras import *  # noqa: F401,F403
from spark_hvd.keras import __all__, callbacks, elastic  # noqa: F401

from spark_hvd.keras.keras2 import legacy_keras_selected

if legacy_keras_selected():  # tf.keras is Keras 2's tf_keras: so is Horovod's layer here
    from spark_hvd.keras.keras2 import sync_batch_normalization_class

    SyncBatchNormalization = sync_batch_normalization_class()  # noqa: F811

sys.modules[__name__ + ".callbacks"] = callbacks
sys.modules[__name__ + ".elastic"] = elastic
