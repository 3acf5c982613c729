"""Fixtures of the Spark layer's tests: one local SparkSession at a time, shared by consecutive
test modules of the same session kind.

A module that sets ``SESSION_KINDS = ("classic", "connect")`` runs every test that uses the
``spark`` fixture twice: on a classic session and on a Spark Connect session
(``SparkSession.builder.remote("local[2]")``); pytest finishes one kind before it starts the next,
so the module holds one session at a time. A test marked ``@pytest.mark.session_kinds("classic")``
runs on those kinds only: for a check whose code path does not depend on the kind of session,
a second run on Connect would only repeat the first.

A session is stopped when the next test to run does not take the ``spark`` fixture of the same
kind (another kind, a module with a session of its own, or the end of the run), and kept
otherwise: stopping it ends its Python workers, and with them the warm processes their ranks are
forked from, which the next module would pay for again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Iterator, Optional

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


class _SharedSession:
    """The one local session the ``spark`` fixture hands out, with the environment it started under."""

    def __init__(self) -> None:
        self.kind: Optional[str] = None
        self.session: Any = None
        self._patch: Optional[pytest.MonkeyPatch] = None

    def get(self, kind: str) -> Any:
        if self.kind != kind:
            self.stop()
            from spark_hvd.spark.session import LOCAL_ENVIRONMENT, local_session

            self._patch = pytest.MonkeyPatch()
            # Read by the JVM launcher and the Python workers when the session starts.
            for name, value in LOCAL_ENVIRONMENT.items():
                self._patch.setenv(name, value)
            self.session = local_session("spark-hvd-tests", connect=kind == "connect")
            self.kind = kind
        return self.session

    def stop(self) -> None:
        session, patch = self.session, self._patch
        self.kind, self.session, self._patch = None, None, None
        try:
            if session is not None:
                session.stop()
        finally:
            if patch is not None:
                patch.undo()


_HERE = Path(__file__).resolve().parent
_SHARED = _SharedSession()
_NEXT_ITEM: Dict[str, Optional[pytest.Item]] = {"item": None}


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: Optional[pytest.Item]) -> Iterator[None]:
    # Fixtures are finalized inside this hook: let the spark fixture see which test comes next.
    _NEXT_ITEM["item"] = nextitem
    yield


def _kind_wanted(item: Optional[pytest.Item]) -> Optional[str]:
    """The session kind ``item`` takes the ``spark`` fixture of, or None."""
    if item is None or "spark" not in getattr(item, "fixturenames", ()) or \
            not Path(str(item.path)).is_relative_to(_HERE):
        return None
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("spark", "classic") if callspec is not None else "classic"


@pytest.fixture(scope="module")
def spark(request: pytest.FixtureRequest) -> Iterator["object"]:
    """A local[2] SparkSession on loopback for the tests of one module, kept for the next module
    when it takes the same kind of session."""
    kind = getattr(request, "param", "classic")
    yield _SHARED.get(kind)
    if _kind_wanted(_NEXT_ITEM["item"]) != kind:
        _SHARED.stop()
