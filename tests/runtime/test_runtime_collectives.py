"""Every collective at world sizes 1, 2 and 3 with real processes, one launch per world."""

import pytest

import runtime_checks as checks

ALL = list(checks.CHECKS)


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"np{n}")
def world_results(request, launch):
    """Launch a world of the given size once and run every check in it."""
    return request.param, launch(checks.run_checks, np=request.param, args=(ALL,))


@pytest.mark.parametrize("check", ALL)
def test_check_passes_on_every_rank(world_results, check):
    """Each check ran to completion on every rank of the world (values derived from rank and size)."""
    size, results = world_results
    assert len(results) == size
    for rank, per_rank in enumerate(results):
        assert check in per_rank, f"rank {rank} did not run {check}"


def test_allreduce_matrix_covers_every_case(world_results):
    """The allreduce matrix ran the same number of dtype x op x length cases on every rank."""
    size, results = world_results
    counts = {r["allreduce_matrix"]["value"] for r in results}
    assert counts == {2 * (9 * 5 * 4 + 3 * 5)}


def test_join_returns_last_rank(world_results):
    """join() returns, on every rank, the rank that joined last (the one with most steps)."""
    size, results = world_results
    assert [r["join"]["value"] for r in results] == [size - 1] * size
