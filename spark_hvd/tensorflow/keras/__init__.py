"""Horovod's ``horovod.tensorflow.keras`` on spark-hvd: the Keras 3 API of :mod:`spark_hvd.keras`.

``import spark_hvd.tensorflow.keras as hvd`` is the same API as ``import spark_hvd.keras as hvd``,
and Horovod's submodule paths (``spark_hvd.tensorflow.keras.callbacks``, ``...elastic``) name the
same modules as ``spark_hvd.keras.callbacks`` and ``spark_hvd.keras.elastic``.
"""

import sys

from spark_hvd.keras import *  # noqa: F401,F403
from spark_hvd.keras import __all__, callbacks, elastic  # noqa: F401

sys.modules[__name__ + ".callbacks"] = callbacks
sys.modules[__name__ + ".elastic"] = elastic
