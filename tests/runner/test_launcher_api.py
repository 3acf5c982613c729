"""spark_hvd.runner.run(fn) with real processes: results, the worker contract, failures."""

from __future__ import annotations

import os
import signal
import time

import pytest

from spark_hvd.runner import RankFailedError, run

CONTRACT = ["RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE"]


def report_environment(scale, *, offset):
    env = os.environ
    return {
        "value": int(env["SPARK_HVD_RANK"]) * scale + offset,
        "spark_hvd": {name: env["SPARK_HVD_" + name] for name in CONTRACT},
        "horovod": {name: env["HOROVOD_" + name] for name in CONTRACT},
        "secret": env["SPARK_HVD_SECRET"],
        "rendezvous": env["SPARK_HVD_RENDEZVOUS_ADDR"],
        "settings": (env["SPARK_HVD_FUSION_THRESHOLD"], env["SPARK_HVD_START_TIMEOUT"]),
        "extra": env["MY_FLAG"],
        "unbuffered": env["PYTHONUNBUFFERED"],
    }


def test_results_in_rank_order_with_worker_contract():
    """Every rank's return value comes back in rank order; each saw the full worker contract."""
    results = run(report_environment, args=(10,), kwargs={"offset": 1}, np=3, env={"MY_FLAG": "on"},
                  start_timeout=7, settings={"fusion_threshold": 4096}, timeout=60)
    assert [r["value"] for r in results] == [1, 11, 21]
    for rank, result in enumerate(results):
        expected = {"RANK": str(rank), "SIZE": "3", "LOCAL_RANK": str(rank), "LOCAL_SIZE": "3",
                    "CROSS_RANK": "0", "CROSS_SIZE": "1"}
        assert result["spark_hvd"] == expected
        assert result["horovod"] == expected
        assert len(bytes.fromhex(result["secret"])) >= 16
        assert result["rendezvous"].startswith("127.0.0.1:")
        assert result["settings"] == ("4096", "7")
        assert (result["extra"], result["unbuffered"]) == ("on", "1")
    assert len({r["secret"] for r in results}) == 1


def fail_on_rank_one():
    if os.environ["SPARK_HVD_RANK"] == "1":
        raise ValueError("bad value 42")
    time.sleep(60)


def test_exception_on_one_rank_is_reraised_with_rank_and_traceback():
    """Rank 1 raising stops rank 0 and raises RankFailedError naming rank 1, the type, message, traceback."""
    with pytest.raises(RankFailedError) as info:
        run(fail_on_rank_one, np=2, timeout=60)
    error = info.value
    assert error.rank == 1
    assert error.exc_type == "ValueError"
    assert str(error).startswith("rank 1 raised ValueError: bad value 42")
    assert "in fail_on_rank_one" in error.remote_traceback
    assert error.remote_traceback.rstrip().endswith("ValueError: bad value 42")
    assert isinstance(error.original, ValueError)
    assert isinstance(error, RuntimeError)


def die_on_rank_one():
    if os.environ["SPARK_HVD_RANK"] == "1":
        print("rank 1 is about to die", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
    return "too late"


def test_rank_killed_by_signal_is_reported_with_its_last_output():
    """A rank that dies without raising is named with its signal and its last output lines."""
    with pytest.raises(RankFailedError) as info:
        run(die_on_rank_one, np=2, timeout=60)
    assert info.value.rank == 1
    assert "rank 1 was killed by signal SIGKILL" in str(info.value)
    assert info.value.exc_type is None
    assert "[1]<stdout>:rank 1 is about to die" in info.value.output_tail


def say_hello():
    print(f"hello {os.environ['SPARK_HVD_RANK']}")
    print(f"warning {os.environ['SPARK_HVD_RANK']}", file=__import__("sys").stderr)


def test_output_lines_are_prefixed_with_the_rank(capfd):
    """Lines printed by rank r reach the caller as [r]<stdout>:... and [r]<stderr>:..."""
    assert run(say_hello, np=2, timeout=60) == [None, None]
    out, err = capfd.readouterr()
    assert sorted(line for line in out.splitlines() if "hello" in line) == \
        ["[0]<stdout>:hello 0", "[1]<stdout>:hello 1"]
    assert "[1]<stderr>:warning 1" in err.splitlines()


def sleep_long():
    time.sleep(60)


def test_timeout_stops_every_rank():
    """When timeout passes first, run() raises TimeoutError naming the ranks still running."""
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] were still running"):
        run(sleep_long, np=2, timeout=1)


@pytest.mark.parametrize("np", [0, -1, 1.5, True])
def test_invalid_np_is_rejected(np):
    """np must be an int of at least 1."""
    with pytest.raises(ValueError, match="np="):
        run(sleep_long, np=np)


def _deep(levels):
    if levels:
        return _deep(levels - 1)
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C reaches every process of the terminal's group
    time.sleep(30)


def interrupted_on_rank_one():
    if os.environ["SPARK_HVD_RANK"] == "1":
        # Ctrl-C as in a terminal's foreground job: a suite started in the background (make test &)
        # hands its processes SIGINT ignored, and a fresh interpreter keeps it ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _deep(20)


def test_an_interrupted_rank_says_so_in_one_line(capfd):
    """A rank that gets Ctrl-C (SIGINT) prints one line saying it was interrupted, not a traceback of
    its stack, and the caller hears which rank it was."""
    with pytest.raises(RankFailedError) as info:
        run(interrupted_on_rank_one, np=2, timeout=60)
    assert info.value.rank == 1
    _, err = capfd.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("[1]<stderr>:")]
    assert lines == ["[1]<stderr>:spark-hvd: rank 1 interrupted (KeyboardInterrupt)"], lines
