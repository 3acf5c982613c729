"""spark-hvd-run command-line validation: everything is checked before any process starts."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from spark_hvd.runner import cli
from spark_hvd.runner.cli import UsageError, main, parse_options


def _error_of(argv, capsys) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_a_host_that_ssh_cannot_reach_is_named_before_any_rank_starts(capsys, tmp_path):
    """-H with a host no resolver knows: the options are valid (another host, reached over SSH), and
    the run exits 1 after the SSH check, naming the host, SSH's reason and the fix, with no rank
    started (a rank would have written its file)."""
    marker = tmp_path / "started"
    argv = ["-np", "2", "-H", "node7.invalid:2", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    options = parse_options(argv)
    assert options.remote and options.ssh[:1] == ["ssh"] and "BatchMode=yes" in options.ssh
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "1 of 1 host(s) did not answer over SSH (node7.invalid: exit code 255" in err
    assert "ssh-copy-id" in err and "SPARK_HVD_SSH_COMMAND" in err
    assert not marker.exists()


def test_ssh_flags_and_command_reach_the_ssh_command_line(tmp_path):
    """--ssh-port, --ssh-identity-file and SPARK_HVD_SSH_COMMAND make up the SSH command line; a
    job on this machine only needs no SSH."""
    key = tmp_path / "key"
    key.write_text("not a real key")
    environ = dict(os.environ, SPARK_HVD_SSH_COMMAND="ssh -F /dev/null")
    options = parse_options(["-np", "3", "-H", "localhost:1,node7.invalid:2", "--ssh-port", "2222",
                             "--ssh-identity-file", str(key), sys.executable, "t.py"], environ)
    assert options.ssh == ["ssh", "-F", "/dev/null", "-o", "BatchMode=yes", "-T", "-p", "2222", "-i", str(key)]
    assert [(h.name, h.slots) for h in options.hosts] == [("localhost", 1), ("node7.invalid", 2)]
    assert parse_options(["-np", "2", "-H", "localhost:2", sys.executable, "t.py"]).ssh is None
    with pytest.raises(UsageError, match="--ssh-port 0 is invalid"):
        parse_options(["-np", "2", "-H", "node7.invalid:2", "--ssh-port", "0", sys.executable, "t.py"])
    with pytest.raises(UsageError, match="--ssh-identity-file '/no/such/key' cannot be read"):
        parse_options(["-np", "2", "-H", "node7.invalid:2", "-i", "/no/such/key", sys.executable, "t.py"])
    with pytest.raises(UsageError, match="SSH client 'no-such-ssh'"):
        parse_options(["-np", "2", "-H", "node7.invalid:2", sys.executable, "t.py"],
                      dict(os.environ, SPARK_HVD_SSH_COMMAND="no-such-ssh -v"))


def test_a_horovodrun_command_line_parses_with_only_the_program_renamed(tmp_path):
    """horovodrun's flags mean what they mean there: -p is the SSH port, -i the key, --gloo the
    built-in backend, --disable-cache, --hierarchical-allreduce, --timeline-mark-cycles and
    --log-level reach the ranks' settings."""
    key = tmp_path / "key"
    key.write_text("not a real key")
    options = parse_options(["-np", "4", "-H", "localhost:2,node7.invalid:2", "-p", "2200", "-i", str(key), "--gloo",
                             "--disable-cache", "--hierarchical-allreduce", "--timeline-mark-cycles", "--log-level",
                             "TRACE", "--start-timeout", "30", "--verbose", sys.executable, "train.py"])
    assert options.num_proc == 4 and options.ssh[-4:] == ["-p", "2200", "-i", str(key)]
    assert options.settings == {"cache_capacity": 0, "hierarchical_allreduce": True, "timeline_mark_cycles": True,
                                "log_level": "DEBUG", "start_timeout": 30.0}
    with pytest.raises(UsageError, match="--mpi and --gloo"):
        parse_options(["-np", "2", "--mpi", "--gloo", sys.executable, "train.py"])


def test_a_hostfile_lists_hosts_in_either_form(tmp_path):
    """--hostfile takes HOST slots=N and HOST:N lines (comments and blank lines ignored); its
    mistakes name the file and line; -H and --hostfile together are refused."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the job's hosts\nlocalhost slots=2\n\n127.0.0.1:1  # this machine too\n")
    options = parse_options(["-np", "3", "--hostfile", str(hostfile), sys.executable, "t.py"])
    assert [(h.name, h.slots) for h in options.hosts] == [("localhost", 2), ("127.0.0.1", 1)]
    assert options.ssh is None
    hostfile.write_text("localhost slots=2\nlocalhost max_slots=3\n")
    with pytest.raises(UsageError, match="line 2 is 'localhost max_slots=3'; expected HOST slots=N"):
        parse_options(["-np", "2", "--hostfile", str(hostfile), sys.executable, "t.py"])
    hostfile.write_text("localhost:1\nlocalhost:1\n")
    with pytest.raises(UsageError, match="names host 'localhost' twice"):
        parse_options(["-np", "2", "--hostfile", str(hostfile), sys.executable, "t.py"])
    with pytest.raises(UsageError, match="cannot be read"):
        parse_options(["-np", "2", "--hostfile", str(tmp_path / "missing"), sys.executable, "t.py"])
    with pytest.raises(UsageError, match="-H and --hostfile both name hosts"):
        parse_options(["-np", "2", "-H", "localhost:2", "--hostfile", str(hostfile), sys.executable, "t.py"])


@pytest.mark.parametrize("hosts", ["localhost:2", "127.0.0.1:1,localhost:1", f"{socket.gethostname()}:2", "localhost:3"])
def test_local_hosts_are_accepted(hosts):
    """-H naming only this machine, with slots for -np ranks (more are fine, as in horovodrun), is accepted."""
    options = parse_options(["-np", "2", "-H", hosts, sys.executable, "train.py"])
    assert options.num_proc == 2


@pytest.mark.parametrize("hosts, expected", [
    ("localhost:1", "have 1 slot(s) but -np is 2"),
    ("localhost:1,127.0.0.1:0", "slot count '0'"),
    ("localhost:0", "slot count '0'"),
    ("localhost:x", "slot count 'x'"),
])
def test_host_slots_must_hold_np_ranks(hosts, expected):
    """Slot counts in -H that are invalid or fewer than -np are rejected with the numbers."""
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


@pytest.mark.parametrize("flag", ["-np", "--num-proc"])
def test_np_synonyms_and_command_arguments_pass_through(flag):
    """-np/--num-proc are synonyms (-p is the SSH port, as in horovodrun); after the command (or --) every argument belongs to it."""
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
