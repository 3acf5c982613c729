"""Horovod's TensorFlow 2 API on spark-hvd: ``import spark_hvd.tensorflow as hvd`` replaces horovod.tensorflow.

Every collective works eagerly and inside ``tf.function`` (Keras 3 compiles ``train_step``), on
``tf.Tensor``, ``tf.Variable`` and ``tf.IndexedSlices``, with Horovod's gradients.
"""

from typing import Any

from spark_hvd.tensorflow import elastic, util
from spark_hvd.tensorflow.basics import (
    Adasum,
    Average,
    HorovodInternalError,
    Max,
    Min,
    NotInitializedError,
    ProcessSet,
    Product,
    ReduceOp,
    Sum,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    global_process_set,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_rank_op,
    local_size,
    local_size_op,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    process_set_included_op,
    rank,
    rank_op,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    size_op,
    start_timeline,
    stop_timeline,
)
from spark_hvd.tensorflow.bridge import executing_eagerly as _executing_eagerly
from spark_hvd.tensorflow.compression import Compression
from spark_hvd.tensorflow.functions import (
    allgather_object,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from spark_hvd.tensorflow.gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from spark_hvd.tensorflow.mpi_ops import (
    _allreduce,
    _grouped_allreduce,
    _grouped_reducescatter,
    _reducescatter,
    allgather,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    grouped_allgather,
    join,
)
from spark_hvd.tensorflow.reductions import allreduce, grouped_allreduce, grouped_reducescatter, reducescatter

__all__ = [
    # lifecycle and topology
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "is_homogeneous", "start_timeline", "stop_timeline",
    "rank_op", "size_op", "local_rank_op", "local_size_op", "process_set_included_op",
    # build probes
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
    "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    # ops, process sets, errors
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "HorovodInternalError", "NotInitializedError",
    # collectives
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_",
    "alltoall", "reducescatter", "grouped_reducescatter", "barrier", "join",
    "_allreduce", "_grouped_allreduce", "_reducescatter", "_grouped_reducescatter", "_executing_eagerly",
    # training
    "broadcast_variables", "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
    "allgather_object", "DistributedGradientTape", "PartialDistributedGradientTape", "elastic",
    "SyncBatchNormalization", "util",
]


def __getattr__(name: str) -> Any:
    # Horovod has hvd.SyncBatchNormalization here; the layer is the Keras binding's (a layer above
    # this one), so it is looked up on first use instead of imported with this package.
    if name == "SyncBatchNormalization":
        # As tf.keras: Keras 2's layer when TF_USE_LEGACY_KERAS makes tf.keras tf_keras.
        from spark_hvd.keras.keras2 import legacy_keras_selected, sync_batch_normalization_class

        if legacy_keras_selected():
            return sync_batch_normalization_class()
        from spark_hvd.keras.layers import SyncBatchNormalization

        return SyncBatchNormalization
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
