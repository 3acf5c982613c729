"""Spark ML estimator for PyTorch Lightning: ``LightningEstimator(...).fit(df)`` returns a ``LightningModel``.

Needs ``pytorch-lightning`` 2.x: ``pip install "spark-hvd[lightning]"``.
"""

try:
    import pytorch_lightning  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        'spark_hvd.spark.lightning needs PyTorch Lightning 2 (the pytorch-lightning package): '
        'pip install "spark-hvd[lightning]"'
    ) from exc

from spark_hvd.spark.lightning.estimator import LightningEstimator
from spark_hvd.spark.lightning.model import LightningModel

# Horovod's names in horovod.spark.lightning.
TorchEstimator = LightningEstimator
TorchModel = LightningModel

__all__ = ["LightningEstimator", "LightningModel", "TorchEstimator", "TorchModel"]
