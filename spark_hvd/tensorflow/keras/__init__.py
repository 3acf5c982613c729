"""Horovod's ``horovod.tensorflow.keras`` on spark-hvd: the Keras 3 API of :mod:`spark_hvd.keras`.

``import spark_hvd.tensorflow.keras as hvd`` is the same API as ``import spark_hvd.keras as hvd``.
"""

from spark_hvd.keras import *  # noqa: F401,F403
from spark_hvd.keras import __all__, callbacks, elastic  # noqa: F401
