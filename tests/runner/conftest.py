"""Fixtures for launcher tests."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest


@pytest.fixture
def script(tmp_path: Path):
    """Write a Python script (dedented) into tmp_path and return its path as str."""

    def write(body: str, name: str = "job.py") -> str:
        path = tmp_path / name
        path.write_text(textwrap.dedent(body))
        return str(path)

    return write
