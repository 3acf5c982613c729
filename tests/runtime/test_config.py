"""Configuration: precedence argument > environment > default, Horovod aliases, clear errors."""

import pytest

from spark_hvd.runtime.config import SETTINGS, RuntimeConfig, worker_environment


def test_defaults_without_environment():
    """With an empty environment every field takes its declared default."""
    cfg = RuntimeConfig.from_env({})
    for setting in SETTINGS:
        assert getattr(cfg, setting.field) == setting.default


def test_argument_beats_environment_beats_default():
    """An explicit argument wins over SPARK_HVD_*, which wins over the default."""
    env = {"SPARK_HVD_FUSION_THRESHOLD": "1234", "SPARK_HVD_CYCLE_TIME": "2.5"}
    cfg = RuntimeConfig.from_env(env, fusion_threshold=99)
    assert cfg.fusion_threshold == 99 and cfg.cycle_time_ms == 2.5


@pytest.mark.parametrize(
    "alias,field,raw,value",
    [
        ("HOROVOD_FUSION_THRESHOLD", "fusion_threshold", "4096", 4096),
        ("HOROVOD_CYCLE_TIME", "cycle_time_ms", "3", 3.0),
        ("HOROVOD_CACHE_CAPACITY", "cache_capacity", "0", 0),
        ("HOROVOD_TIMELINE", "timeline", "/tmp/t.json", "/tmp/t.json"),
        ("HOROVOD_STALL_CHECK_TIME_SECONDS", "stall_check_seconds", "7", 7.0),
        ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "stall_shutdown_seconds", "9", 9.0),
        ("HOROVOD_RANK", "rank", "1", 1),
    ],
)
def test_horovod_aliases_are_honoured(alias, field, raw, value):
    """Horovod's variable names configure the same knobs when ours are unset."""
    assert getattr(RuntimeConfig.from_env({alias: raw, "HOROVOD_SIZE": "2"}), field) == value


def test_our_name_wins_over_alias():
    """SPARK_HVD_* beats the HOROVOD_* alias when both are set."""
    cfg = RuntimeConfig.from_env({"SPARK_HVD_CACHE_CAPACITY": "5", "HOROVOD_CACHE_CAPACITY": "9"})
    assert cfg.cache_capacity == 5


def test_bad_value_names_variable_and_meaning():
    """A value that does not parse names the variable, the value and what it is for."""
    with pytest.raises(ValueError, match=r"SPARK_HVD_CACHE_CAPACITY='lots'.*Request signatures"):
        RuntimeConfig.from_env({"SPARK_HVD_CACHE_CAPACITY": "lots"})


def test_invalid_ranges_rejected():
    """Negative thresholds or a rank outside the world are refused with the fix."""
    with pytest.raises(ValueError, match="fusion_threshold=-1.*SPARK_HVD_FUSION_THRESHOLD"):
        RuntimeConfig(fusion_threshold=-1)
    with pytest.raises(ValueError, match="rank=3 is outside the job of size=2"):
        RuntimeConfig(rank=3, size=2)


def test_missing_worker_contract_names_variables():
    """require_worker() lists the variables a launcher should have set."""
    with pytest.raises(ValueError, match="SPARK_HVD_RANK, SPARK_HVD_SIZE.*expected, but not set"):
        RuntimeConfig.from_env({}).require_worker()


def test_worker_environment_round_trips():
    """worker_environment() writes what from_env() reads back, including Horovod's copies."""
    env = worker_environment(rank=1, size=3, local_rank=1, local_size=3, cross_rank=0, cross_size=1,
                             rendezvous_addr="127.0.0.1:5", secret="ab" * 16,
                             settings={"fusion_threshold": 10, "shm": False})
    cfg = RuntimeConfig.from_env(env)
    assert (cfg.rank, cfg.size, cfg.fusion_threshold, cfg.shm) == (1, 3, 10, False)
    assert env["HOROVOD_RANK"] == "1" and env["HOROVOD_LOCAL_SIZE"] == "3"
    with pytest.raises(TypeError, match="unknown runtime setting"):
        worker_environment(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1,
                           rendezvous_addr="x:1", secret="ab" * 16, settings={"fusion": 1})
