"""Make the shared check harness (tests/harness.py) importable from every test module and rank."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
