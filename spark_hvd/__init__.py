"""spark-hvd: Horovod-style data-parallel training for Spark pipelines."""

__all__ = ["__version__"]

__version__ = "0.1.0"
