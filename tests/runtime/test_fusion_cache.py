"""The same checks with fusion, the response cache, eager small messages or shared memory turned off."""

import pytest

import runtime_checks as checks
from harness import assert_passed, launch

SUBSET = [checks.allreduce_matrix, checks.grouped_and_async_cases, checks.object_cases, checks.reducescatter_cases,
          checks.join_cases, checks.repeated_small_allreduces]


@pytest.mark.parametrize(
    "settings",
    [
        {"fusion_threshold": 0},
        {"cache_capacity": 0},
        {"cache_capacity": 3, "fusion_threshold": 4096},
        {"cycle_time_ms": 2.0},
        {"eager_threshold": 0},
        {"shm": False},
    ],
    ids=["fusion-off", "cache-off", "cache-tiny-evicting", "cycle-time", "eager-off", "tcp-only"],
)
def test_checks_pass_with_settings(settings):
    """Results do not depend on fusion, caching or the cycle time: every check passes at np=2."""
    results = launch(SUBSET, np=2, settings=settings)
    for check in SUBSET:
        assert_passed(results, check)
