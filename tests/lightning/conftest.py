"""Shared setup for spark_hvd.lightning tests: the check harness importable in test modules and ranks,
and one launched world per size for the checks of every module."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from harness import SIZES  # noqa: E402  (importable once HERE's parent is on sys.path, as tests/conftest.py does)


@pytest.fixture(scope="session", params=SIZES, ids=lambda n: f"np{n}")
def world(request):
    """One world per size runs the checks of the training and collective modules, so each rank
    imports Lightning and joins the job once per size."""
    import test_lightning_collectives
    import test_lightning_training
    from lightning_world import launch

    return launch(test_lightning_training.ALL + test_lightning_collectives.ALL, np=request.param)
