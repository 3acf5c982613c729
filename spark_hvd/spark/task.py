"""What a rank started by :func:`spark_hvd.spark.run` can ask of its Spark task
(Horovod's ``horovod.spark.task``)."""

from __future__ import annotations

import os
from typing import List

__all__ = ["get_available_devices"]

_TASK_GPUS = "SPARK_HVD_TASK_GPUS"  # spark_hvd.spark.launch.task.TASK_GPUS_VARIABLE


def get_available_devices() -> List[str]:
    """The addresses of the GPUs Spark assigned to this rank's task (``spark.task.resource.gpu.amount``),
    as strings (``['0']``); empty when the cluster schedules no GPUs or outside a Spark task.

    As in Horovod, a rank pins its device with it, e.g.
    ``torch.cuda.set_device(int(get_available_devices()[0]))``. With ``use_gpu`` unset or True the
    rank's ``CUDA_VISIBLE_DEVICES`` already holds these addresses.
    """
    value = os.environ.get(_TASK_GPUS, "")
    return [address for address in value.split(",") if address]
