"""Fixtures of the Spark layer's tests: one local SparkSession per test module."""

from __future__ import annotations

from typing import Iterator

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "petastorm: needs petastorm (pyarrow<15); runs in .venv-petastorm via make test-petastorm")


@pytest.fixture(scope="module")
def spark() -> Iterator["object"]:
    """A local[2] SparkSession on loopback, shared by the tests of one module and stopped after it."""
    from spark_hvd.spark._session import LOCAL_ENVIRONMENT, build_local_session

    with pytest.MonkeyPatch.context() as patch:
        # Read by the JVM launcher and the Python workers when the session starts.
        for name, value in LOCAL_ENVIRONMENT.items():
            patch.setenv(name, value)
        session = build_local_session("spark-hvd-tests")
        try:
            yield session
        finally:
            session.stop()
