"""Former home of the local-session helpers; kept so existing imports work (see ``session``)."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from spark_hvd.spark.session import LOCAL_ENVIRONMENT, local_session, local_spark_conf

__all__ = ["LOCAL_ENVIRONMENT", "local_spark_conf", "build_local_session"]


def build_local_session(app_name: str = "spark-hvd", num_cores: int = 2,
                        conf: Optional[Mapping[str, Any]] = None) -> Any:
    """A classic local SparkSession: :func:`spark_hvd.spark.local_session`."""
    return local_session(app_name, num_cores, conf)
