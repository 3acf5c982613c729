"""Fixtures of the Spark layer's tests: one local SparkSession per test module (and session kind).

A module that sets ``SESSION_KINDS = ("classic", "connect")`` runs every test that uses the
``spark`` fixture twice: on a classic session and on a Spark Connect session
(``SparkSession.builder.remote("local[2]")``); pytest finishes one kind before it starts the next,
so the module holds one session at a time. A test marked ``@pytest.mark.session_kinds("classic")``
runs on those kinds only: for a check whose code path does not depend on the kind of session,
a second run on Connect would only repeat the first.
"""

from __future__ import annotations

from typing import Iterator

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "petastorm: needs petastorm (pyarrow<15); runs in .venv-petastorm via make test-petastorm")
    config.addinivalue_line(
        "markers", "session_kinds(*kinds): run a test of a SESSION_KINDS module on these session kinds only")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    kinds = getattr(metafunc.module, "SESSION_KINDS", None)
    if kinds and "spark" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("session_kinds")
        if marker is not None:
            unknown = set(marker.args) - set(kinds)
            if unknown:
                raise pytest.UsageError(f"{metafunc.definition.nodeid}: session_kinds names {sorted(unknown)}, "
                                        f"which the module's SESSION_KINDS {tuple(kinds)} do not include")
            kinds = [kind for kind in kinds if kind in marker.args]
        metafunc.parametrize("spark", list(kinds), indirect=True, scope="module")


@pytest.fixture(scope="module")
def spark(request: pytest.FixtureRequest) -> Iterator["object"]:
    """A local[2] SparkSession on loopback, shared by the tests of one module and stopped after it."""
    from spark_hvd.spark.session import LOCAL_ENVIRONMENT, local_session

    kind = getattr(request, "param", "classic")
    with pytest.MonkeyPatch.context() as patch:
        # Read by the JVM launcher and the Python workers when the session starts.
        for name, value in LOCAL_ENVIRONMENT.items():
            patch.setenv(name, value)
        session = local_session("spark-hvd-tests", connect=kind == "connect")
        try:
            yield session
        finally:
            session.stop()
