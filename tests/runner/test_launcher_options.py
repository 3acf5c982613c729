"""spark-hvd-run command-line validation: everything is checked before any process starts."""

from __future__ import annotations

import socket
import sys

import pytest

from spark_hvd.runner import cli
from spark_hvd.runner.cli import UsageError, main, parse_options


def _error_of(argv, capsys) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_remote_host_is_rejected_with_a_pointer_to_spark(capsys):
    """-H with another machine's name fails, naming the host and spark_hvd.spark.run."""
    err = _error_of(["-np", "2", "-H", "node7.example.com:2", sys.executable, "train.py"], capsys)
    assert err.startswith("spark-hvd-run: error: ")
    assert "'node7.example.com'" in err
    assert "spark_hvd.spark.run" in err


@pytest.mark.parametrize("hosts", ["localhost:2", "127.0.0.1:1,localhost:1", f"{socket.gethostname()}:2"])
def test_local_hosts_are_accepted(hosts):
    """-H naming only this machine, with slots adding up to -np, is accepted."""
    options = parse_options(["-np", "2", "-H", hosts, sys.executable, "train.py"])
    assert options.num_proc == 2


@pytest.mark.parametrize("hosts, expected", [
    ("localhost:1", "gives 1 slot(s) but -np is 2"),
    ("localhost:3", "gives 3 slot(s) but -np is 2"),
    ("localhost:0", "slot count '0'"),
    ("localhost:x", "slot count 'x'"),
])
def test_host_slots_must_add_up_to_np(hosts, expected):
    """Slot counts in -H that are invalid or do not add up to -np are rejected with the numbers."""
    with pytest.raises(UsageError) as info:
        parse_options(["-np", "2", "-H", hosts, sys.executable, "train.py"])
    assert expected in str(info.value)


@pytest.mark.parametrize("argv, expected", [
    (["-np", "0", sys.executable, "t.py"], "-np 0 is invalid: expected at least 1 process"),
    (["-np", "-3", sys.executable, "t.py"], "-np -3 is invalid"),
    ([sys.executable, "t.py"], "-np is required"),
    (["-np", "2"], "no command given"),
    (["-np", "2", "--"], "no command given"),
    (["-np", "2", "no-such-program-here", "t.py"], "'no-such-program-here' was not found"),
    (["-np", "2", "--fusion-threshold-mb", "-1", sys.executable], "--fusion-threshold-mb -1.0 is invalid"),
    (["-np", "2", "--cycle-time-ms", "-1", sys.executable], "--cycle-time-ms -1.0 is invalid"),
    (["-np", "2", "--cache-capacity", "-1", sys.executable], "--cache-capacity -1 is invalid"),
    (["-np", "2", "--start-timeout", "0", sys.executable], "--start-timeout 0.0 is invalid"),
])
def test_bad_arguments_are_rejected(argv, expected, capsys):
    """Bad -np, a missing or unknown command, and negative knobs give exit 2 and a clear message."""
    assert expected in _error_of(argv, capsys)


def test_non_integer_np_is_rejected_by_the_parser(capsys):
    """-np that is not an integer stops the command with argparse's usage error."""
    with pytest.raises(SystemExit) as info:
        main(["-np", "two", sys.executable, "t.py"])
    assert info.value.code == 2
    assert "invalid int value: 'two'" in capsys.readouterr().err


def test_unwritable_paths_are_rejected(tmp_path, capsys):
    """A timeline in a missing directory, or an output directory that is a file, is refused."""
    err = _error_of(["-np", "1", "--timeline-filename", str(tmp_path / "missing" / "t.json"),
                     sys.executable], capsys)
    assert "does not exist" in err
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    err = _error_of(["-np", "1", "--output-filename", str(blocker), sys.executable], capsys)
    assert "is not a directory" in err


@pytest.mark.parametrize("flag", ["-np", "-p", "--num-proc"])
def test_np_synonyms_and_command_arguments_pass_through(flag):
    """-np/-p/--num-proc are synonyms; after the command (or --) every argument belongs to it."""
    options = parse_options([flag, "3", "--", sys.executable, "train.py", "-np", "5", "--verbose"])
    assert options.num_proc == 3
    assert options.command == [sys.executable, "train.py", "-np", "5", "--verbose"]
    assert options.verbose is False


def test_flags_become_runtime_settings(tmp_path):
    """Tuning flags map to runtime settings; MiB become bytes; unset flags are not passed on."""
    options = parse_options(["-np", "1", "--fusion-threshold-mb", "0.5", "--cache-capacity", "0",
                             "--timeline-filename", str(tmp_path / "t.json"), sys.executable])
    assert options.settings == {"fusion_threshold": 512 * 1024, "cache_capacity": 0,
                                "timeline": str(tmp_path / "t.json")}


def test_usage_error_is_a_value_error():
    """Command-line mistakes are ValueErrors, like every user mistake in spark-hvd."""
    assert issubclass(cli.UsageError, ValueError)
