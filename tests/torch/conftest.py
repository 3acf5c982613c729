"""Shared setup for spark_hvd.torch tests: the check harness importable in test modules and ranks, and
one launched world per size for the checks of every module that runs checks in a world."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from harness import SIZES  # noqa: E402  (importable once HERE's parent is on sys.path, as tests/conftest.py does)

# In this order in each world: checks that change the world's state (process sets, join, an elastic
# reset) come after the others, and a module's checks keep their order.
WORLD_MODULES = ("test_autograd", "test_collectives", "test_optimizer", "test_state_broadcast",
                 "test_sync_batch_norm", "test_process_sets", "test_join", "test_elastic")


@pytest.fixture(scope="session", params=SIZES, ids=lambda n: f"np{n}")
def world(request):
    """One world per size runs the checks (each module's ``ALL``) of every module in WORLD_MODULES,
    so each rank imports torch and joins a job once per size rather than once per module and size."""
    import importlib

    from torch_world import launch

    checks = [check for name in WORLD_MODULES for check in importlib.import_module(name).ALL]
    names = [check.__name__ for check in checks]
    assert len(set(names)) == len(names), f"check names repeat across the modules: {names}"
    return launch(checks, np=request.param, timeout=600)
