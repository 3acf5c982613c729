"""The environment Keras needs in Spark's processes: the TensorFlow backend, quiet TensorFlow logs.

Rank processes get :data:`RANK_ENVIRONMENT` from ``run(env=...)`` when they start; the Python
workers that run ``KerasModel.transform`` are Spark's, already running, so
:func:`prepare_worker` sets the same variables there before the first ``import keras``.
"""

from __future__ import annotations

import os
import sys
from typing import Dict

__all__ = ["RANK_ENVIRONMENT", "prepare_worker"]

RANK_ENVIRONMENT: Dict[str, str] = {
    "KERAS_BACKEND": "tensorflow",
    # 2: TensorFlow's C++ layer prints errors only (no start-up banners in every rank's output).
    "TF_CPP_MIN_LOG_LEVEL": "2",
}
"""Variables every rank process of a KerasEstimator fit starts with."""


def prepare_worker() -> None:
    """In a Spark Python worker, before Keras is first imported there: the variables of
    :data:`RANK_ENVIRONMENT` that are not set already (a worker that imported Keras keeps its
    backend: a saved ``.keras`` model loads on any)."""
    if "keras" in sys.modules:
        return
    for name, value in RANK_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
