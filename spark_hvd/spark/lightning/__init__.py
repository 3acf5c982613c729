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

from spark_hvd.spark.exports import lazy_exports

_EXPORTS = {
    "LightningEstimator": "spark_hvd.spark.lightning.estimator",
    "LightningModel": "spark_hvd.spark.lightning.model",
    "TorchEstimator": "spark_hvd.spark.lightning.estimator:LightningEstimator",
    "TorchModel": "spark_hvd.spark.lightning.model:LightningModel",
}
"""Each public name and the module that defines it (imported on first use)."""

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
