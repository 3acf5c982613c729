"""Shared setup for spark_hvd.tensorflow and spark_hvd.keras tests: the check harness importable in modules and ranks."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
