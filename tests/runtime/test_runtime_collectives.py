"""Every collective at world sizes 1, 2 and 3 with real processes, one launch per world."""

import pytest

import runtime_checks as checks
from harness import SIZES, assert_passed, launch


@pytest.fixture(scope="module", params=SIZES, ids=lambda n: f"np{n}")
def world(request):
    """Launch a world of the given size once and run every check in it."""
    return request.param, launch(checks.ALL, np=request.param)


@pytest.mark.parametrize("check", checks.ALL, ids=lambda c: c.__name__)
def test_check_passes_on_every_rank(world, check):
    """Each check ran to completion on every rank of the world (values derived from rank and size)."""
    assert_passed(world[1], check)


def test_allreduce_matrix_covers_every_case(world):
    """The allreduce matrix ran the same number of dtype x op x length cases on every rank."""
    counts = set(assert_passed(world[1], checks.allreduce_matrix))
    assert counts == {2 * (9 * 5 * 4 + 3 * 5)}


def test_join_returns_last_rank(world):
    """join() returns, on every rank, the rank that joined last (the one with most steps)."""
    size, results = world
    assert assert_passed(results, checks.join_cases) == [size - 1] * size


def test_adasum_compares_every_case_in_power_of_two_worlds(world):
    """Adasum ran its comparisons against the numpy reference in worlds of 1 and 2 ranks, and
    was refused (0 cases) in a world of 3."""
    size, results = world
    assert set(assert_passed(results, checks.adasum_cases)) == {0 if size == 3 else 7}
