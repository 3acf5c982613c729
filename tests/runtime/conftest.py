"""Shared helpers for runtime tests: worlds of real processes launched through spark_hvd.runner."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


@pytest.fixture(scope="session")
def launch():
    """run(fn, np=N, ...) from the local launcher, with a generous overall timeout."""
    from spark_hvd.runner import run

    def _launch(fn, np, args=(), settings=None, env=None, timeout=240):
        return run(fn, args=args, np=np, settings=settings, env=env, timeout=timeout)

    return _launch
