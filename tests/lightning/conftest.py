"""Shared setup for spark_hvd.lightning tests: make the check harness importable in test modules and ranks."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
