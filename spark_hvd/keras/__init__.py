"""Horovod's Keras API for Keras 3: ``import spark_hvd.keras as hvd`` (also ``spark_hvd.tensorflow.keras``).

Works on the tensorflow backend (the compiled ``train_step`` included) and on the torch backend
(``KERAS_BACKEND=torch``); the matching binding is imported on first use, so a torch-only
installation never imports TensorFlow.
"""

from spark_hvd.keras import callbacks, elastic
from spark_hvd.keras.basics import (
    cross_rank,
    cross_size,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from spark_hvd.keras.compression import Compression
from spark_hvd.keras.layers import SyncBatchNormalization
from spark_hvd.keras.optimizer import DistributedOptimizer, PartialDistributedOptimizer, load_model
from spark_hvd.keras.values import (
    allgather,
    allgather_object,
    allreduce,
    broadcast,
    broadcast_global_variables,
    broadcast_object,
    broadcast_variables,
)
from spark_hvd.runtime import (
    Adasum,
    Average,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    global_process_set,
    remove_process_set,
)

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "is_homogeneous", "start_timeline", "stop_timeline",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "DistributedOptimizer", "PartialDistributedOptimizer", "load_model",
    "allreduce", "allgather", "broadcast", "broadcast_object", "allgather_object",
    "broadcast_global_variables", "broadcast_variables", "callbacks", "elastic", "SyncBatchNormalization",
]
