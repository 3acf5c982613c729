"""Sealed payload files: only the job secret's holder can write what a launcher will unpickle."""

from __future__ import annotations

import pytest

from spark_hvd.runtime.errors import TamperedError as TamperedPayloadError
from spark_hvd.runner.payload import read_sealed, write_sealed
from spark_hvd.runtime.config import new_secret


def test_round_trip_and_no_temporary_file_left(tmp_path):
    """What is written is read back unchanged, and only the final file remains."""
    secret = new_secret()
    write_sealed(tmp_path / "result.0", secret, b"payload bytes")
    assert read_sealed(tmp_path / "result.0", secret) == b"payload bytes"
    assert [p.name for p in tmp_path.iterdir()] == ["result.0"]


def test_modified_bytes_are_refused(tmp_path):
    """Flipping one byte of the payload makes the reader refuse it."""
    secret = new_secret()
    path = tmp_path / "result.0"
    write_sealed(path, secret, b"payload bytes")
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 1
    path.write_bytes(bytes(blob))
    with pytest.raises(TamperedPayloadError, match="not sealed with this job's secret"):
        read_sealed(path, secret)


def test_other_secret_and_other_file_name_are_refused(tmp_path):
    """A payload sealed with another secret, or renamed to another rank's file, is refused."""
    secret = new_secret()
    write_sealed(tmp_path / "result.0", new_secret(), b"x")
    with pytest.raises(TamperedPayloadError):
        read_sealed(tmp_path / "result.0", secret)
    write_sealed(tmp_path / "result.1", secret, b"x")
    (tmp_path / "result.1").rename(tmp_path / "result.2")
    with pytest.raises(TamperedPayloadError):
        read_sealed(tmp_path / "result.2", secret)
