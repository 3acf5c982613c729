"""PyTorch Lightning 2 on spark-hvd: ``Trainer(strategy=SparkHvdStrategy())`` trains data-parallel.

Needs ``pytorch-lightning`` 2.x: ``pip install "spark-hvd[lightning]"``.
"""

try:
    import pytorch_lightning  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        'spark_hvd.lightning needs PyTorch Lightning 2 (the pytorch-lightning package): pip install "spark-hvd[lightning]"'
    ) from exc

from spark_hvd.lightning.environment import SparkHvdEnvironment
from spark_hvd.lightning.layer_sync import SparkHvdSyncBatchNorm
from spark_hvd.lightning.strategy import SparkHvdStrategy

__all__ = ["SparkHvdStrategy", "SparkHvdEnvironment", "SparkHvdSyncBatchNorm"]
