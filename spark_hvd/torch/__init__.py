"""Horovod's PyTorch API on spark-hvd: ``import spark_hvd.torch as hvd`` replaces horovod.torch.

Changing that one import line is all a Horovod PyTorch training script needs.
"""

from spark_hvd.torch.autograd import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from spark_hvd.torch.basics import (
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
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    nccl_problem,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from spark_hvd.torch.compression import Compression
from spark_hvd.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from spark_hvd.torch.handles import Handle, poll, synchronize
from spark_hvd.torch.mpi_ops import (
    allgather_async,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    join,
    reducescatter_async,
    sparse_allreduce_async,
)
from spark_hvd.torch.optimizer import DistributedOptimizer
from spark_hvd.torch.sync_batch_norm import SyncBatchNorm
from spark_hvd.torch import elastic  # noqa: E402  (hvd.elastic, as in Horovod)

__all__ = [
    # lifecycle and topology
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "is_homogeneous", "start_timeline", "stop_timeline",
    # build probes
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built", "nccl_problem",
    "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    # ops, process sets, errors
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "HorovodInternalError", "NotInitializedError",
    # collectives
    "Handle", "poll", "synchronize",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_",
    "sparse_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_async", "broadcast_", "broadcast_async_",
    "alltoall", "alltoall_async",
    "reducescatter", "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
    "barrier", "join",
    # training
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
    "DistributedOptimizer", "SyncBatchNorm",
    # elastic training
    "elastic",
]
