"""Shared setup for spark_hvd.tensorflow and spark_hvd.keras tests: the check harness importable in
modules and ranks, and one launched world per size for the checks of the training, Keras 2 and collective modules."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from harness import SIZES  # noqa: E402  (importable once HERE's parent is on sys.path, as tests/conftest.py does)


@pytest.fixture(scope="session", params=SIZES, ids=lambda n: f"np{n}")
def world(request):
    """One world per size runs the checks of the training and collective modules, so each rank
    imports TensorFlow and joins the job once per size; the training checks go first, ahead of the
    collective checks that provoke errors on purpose."""
    import test_keras2
    import test_tf_collectives
    import test_tf_training
    from tf_world import launch

    checks = test_tf_training.CHECKS + test_keras2.CHECKS + test_tf_collectives.CHECKS
    names = [check.__name__ for check in checks]
    assert len(set(names)) == len(names), f"check names repeat across the modules: {names}"
    return launch(checks, request.param, timeout=480)
