"""The README's Python code blocks run as written, so they cannot drift from the code.

Each block carries a marker on the line before it: ``ranks=N`` (run on N local ranks),
``spark`` (run in one Python process with a local Spark session, the spark blocks in order, one
namespace, as the cells of a notebook), ``python`` (run on its own), or ``excerpt FILE`` (its
lines, ``...`` aside, appear in FILE in this order). A block without a marker fails the test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest

from spark_hvd.runner import run

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"(?:<!-- readme-test: (?P<marker>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)

pytestmark = pytest.mark.timeout(900)


def _blocks() -> List[Tuple[str, str, int]]:
    text = (ROOT / "README.md").read_text()
    return [(m["marker"] or "", m["code"], text[:m.start()].count("\n") + 1) for m in _BLOCK.finditer(text)]


def test_every_python_block_says_how_it_is_tested():
    """A new block without a marker is caught here."""
    unmarked = [line for marker, _, line in _blocks() if not marker]
    assert not unmarked, f"README.md Python blocks without a readme-test marker at lines {unmarked}"
    assert {marker.split()[0].split("=")[0] for marker, _, _ in _blocks()} <= {"ranks", "spark", "python", "excerpt"}


@pytest.mark.parametrize("marker, code, line", [b for b in _blocks() if b[0].startswith("excerpt")],
                         ids=lambda v: str(v) if isinstance(v, int) else None)
def test_excerpts_are_the_files_own_lines(marker, code, line):
    """Every line of an excerpt (``...`` aside) is a line of its file, in the same order."""
    source = [s.strip() for s in (ROOT / marker.split(maxsplit=1)[1]).read_text().splitlines()]
    at = 0
    for wanted in (s.strip() for s in code.splitlines()):
        if not wanted or wanted == "...":
            continue
        assert wanted in source[at:], f"README line {line}: {wanted!r} is not in {marker} after line {at}"
        at = source.index(wanted, at) + 1


def _exec_block(code: str) -> str:
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(code, "README.md", "exec"), namespace)
    return "ok"


@pytest.mark.parametrize("marker, code, line", [b for b in _blocks() if b[0].startswith("ranks=")],
                         ids=lambda v: str(v) if isinstance(v, int) else None)
def test_rank_blocks_run_on_local_ranks(marker, code, line):
    """A script block runs to its end on every rank."""
    ranks = int(marker.split("=")[1])
    assert run(_exec_block, args=(code,), np=ranks, timeout=600) == ["ok"] * ranks


def _subprocess(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    from spark_hvd.spark.session import LOCAL_ENVIRONMENT

    script = tmp_path / "blocks.py"
    script.write_text(code)
    env = {**os.environ, **LOCAL_ENVIRONMENT, "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=800)


def test_python_blocks_run_on_their_own(tmp_path):
    """Each plain block runs in a fresh interpreter."""
    for marker, code, line in _blocks():
        if marker == "python":
            done = _subprocess(code, tmp_path)
            assert done.returncode == 0, f"README line {line}:\n{done.stderr[-3000:]}"


@pytest.mark.spark
def test_spark_blocks_run_in_order_on_a_local_session(tmp_path):
    """The Spark blocks run one after the other in one process and namespace, as notebook cells."""
    blocks = [(code, line) for marker, code, line in _blocks() if marker == "spark"]
    assert len(blocks) >= 3
    cells = "\n".join(f"print('cell at README line {line}', flush=True)\nexec(compile({code!r}, 'README.md line "
                      f"{line}', 'exec'), namespace)" for code, line in blocks)
    done = _subprocess("namespace = {'__name__': '__main__'}\n" + cells + "\nprint('all cells ran')\n", tmp_path)
    assert done.returncode == 0 and "all cells ran" in done.stdout, (done.stdout[-2000:], done.stderr[-4000:])
