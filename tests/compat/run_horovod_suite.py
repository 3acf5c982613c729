"""Run one of Horovod's own test suites against spark-hvd and print what it reports.

    python tests/compat/run_horovod_suite.py HOROVOD_SRC [--suite torch|tensorflow|tensorflow2_keras|keras|tensorflow_keras]
        [--np 2 3] [-k EXPR]

HOROVOD_SRC is a Horovod checkout or a bare git directory of one (its HEAD is read). The suite
(``test/parallel/test_<suite>.py``, default torch) is not ours to vendor, so this script copies
it into a temporary folder, swaps its Horovod import lines for spark-hvd's (``import
horovod.torch as hvd`` becomes ``import spark_hvd.torch as hvd``; see ``SUITES`` for the others),
points its ``utils`` import at a copy of ``test/utils/common.py`` (whose one Horovod import, a
thread helper used only by GPU tests, gets a stand-in), and runs it unmodified otherwise under
``spark-hvd-run -np N python -m pytest`` in one launch per size. The suite's ``tearDown`` calls
``hvd.barrier(); hvd.shutdown()`` after every test, so one launch re-initializes the runtime once
per test. The ranks run with a stall deadline (``--stall-shutdown``), as a job would, so that a test
failing on some ranks only ends its pending collective everywhere instead of hanging the launch.

It prints the counts per size and rank, and every test that did not pass with its first error
line. The exit status is 0 when every launch ran to its end (whatever the tests said), so the
counts, not the status, are the result.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

COMMON = "test/utils/common.py"

_VERSION_HELPER = '''
def is_version_greater_equal_than(ver, target):
    """Stand-in for horovod.common.util.is_version_greater_equal_than."""
    from packaging import version

    return version.parse(ver) >= version.parse(target)
'''

# Per suite: the Horovod lines it imports and what replaces each. Helpers that Horovod keeps in
# modules spark-hvd does not have get a stand-in or the same function from spark-hvd.
SUITES: Dict[str, Dict[str, str]] = {
    "torch": {"import horovod.torch as hvd": "import spark_hvd.torch as hvd"},
    "tensorflow": {
        "import horovod.tensorflow as hvd": "import spark_hvd.tensorflow as hvd",
        "from horovod.tensorflow.util import _executing_eagerly":
            "from spark_hvd.tensorflow import _executing_eagerly",
        # The suite reaches the same helper as hvd.util._executing_eagerly (two tests).
        "hvd.util._executing_eagerly": "hvd._executing_eagerly",
    },
    "tensorflow2_keras": {
        "import horovod.tensorflow.keras as hvd": "import spark_hvd.tensorflow.keras as hvd",
        "import horovod.keras as hvd_keras": "import spark_hvd.keras as hvd_keras",
        "from horovod.common.util import is_version_greater_equal_than": _VERSION_HELPER,
    },
    # TensorFlow 1 suites: on TensorFlow 2 every test of theirs is skipped by their own marks.
    "keras": {"import horovod.keras as hvd": "import spark_hvd.keras as hvd"},
    "tensorflow_keras": {
        "import horovod.tensorflow.keras as hvd": "import spark_hvd.tensorflow.keras as hvd",
        "from horovod.common.util  import is_version_greater_equal_than": _VERSION_HELPER,
    },
}
# Packages a suite imports that spark-hvd's own dependencies do not bring.
NEEDS: Dict[str, Tuple[str, ...]] = {
    "tensorflow": ("tensorflow",),
    "tensorflow2_keras": ("tensorflow", "parameterized"),
    "keras": ("tensorflow",),
    "tensorflow_keras": ("tensorflow",),
}

# Helper modules a suite imports besides test/utils/common.py, with their own swaps.
HELPERS: Dict[str, Dict[str, Dict[str, str]]] = {
    "tensorflow": {"test/parallel/base_test_tensorflow.py": {
        "from horovod.tensorflow.util import _executing_eagerly":
            "from spark_hvd.tensorflow import _executing_eagerly"}},
}


def suite_path(name: str) -> str:
    return f"test/parallel/test_{name}.py"


def _swap(text: str, path: str, swaps: Dict[str, str]) -> str:
    for old, new in swaps.items():
        if old not in text:
            raise SystemExit(f"{path} does not contain {old!r}; is this Horovod's source?")
        text = text.replace(old, new)
    leftovers = [line for line in text.splitlines() if re.match(r"\s*(import|from) horovod\b", line)]
    if leftovers:
        raise SystemExit(f"{path} still imports Horovod after the swap: {leftovers}")
    return text

_IN_THREAD = '''
def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Stand-in for horovod.runner.util.threads.in_thread: start ``target`` on a daemon thread."""
    import threading

    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
'''


def read_source(src: Path, path: str) -> str:
    """A file of the Horovod source: from the work tree, or from HEAD of a (bare) git directory."""
    if (src / path).is_file():
        return (src / path).read_text()
    git_dir = src / ".git" if (src / ".git").exists() else src
    out = subprocess.run(["git", "--git-dir", str(git_dir), "show", f"HEAD:{path}"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"cannot read {path} from {src}: {out.stderr.strip()}; expected a Horovod checkout "
                         "or its git directory (fetch github:horovod/horovod)")
    return out.stdout


def prepare(src: Path, workdir: Path, suite_name: str = "torch") -> Path:
    """Write the import-swapped suite and its helper modules under ``workdir``; return the suite."""
    path = suite_path(suite_name)
    swapped = _swap(read_source(src, path), path, SUITES[suite_name])
    for helper, swaps in HELPERS.get(suite_name, {}).items():
        (workdir / helper).parent.mkdir(parents=True, exist_ok=True)
        (workdir / helper).write_text(_swap(read_source(src, helper), helper, swaps))
    common = read_source(src, COMMON)
    common = common.replace("from horovod.runner.util.threads import in_thread", _IN_THREAD)
    # The GPU-launcher helpers use the `mock` backport; the standard library's is the same API.
    common = common.replace("import mock\n", "from unittest import mock\n")
    target = workdir / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(swapped)
    (workdir / COMMON).parent.mkdir(parents=True, exist_ok=True)
    (workdir / COMMON).write_text(common)
    return target


# TensorFlow's test cases run each test in graph and in eager mode, reported as subtests
# ("SUBFAILED[graph_mode] ...", "157 subtests passed").
_RESULT = re.compile(r"^((?:SUB)?(?:PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS))(?:\[(\w+)\])?\s+(?:\[\d+\]\s+)?"
                     r"(\S+)(?:\s+-\s+(.*))?$")
_SUMMARY = re.compile(r"^=*\s*(\d+ [\w ]+?(?:, \d+ [\w ]+?)*) in [\d.]+s", re.M)


def parse_rank_output(text: str) -> Tuple[Dict[str, int], Dict[str, str]]:
    """Counts from pytest's last summary line, and every non-passing test with its reason."""
    counts: Dict[str, int] = {}
    for match in _SUMMARY.finditer(text):
        counts = {}
        for part in match.group(1).split(","):
            number, _, word = part.strip().partition(" ")
            if number.isdigit():
                counts[{"errors": "error", "warnings": "warning", "subtests passed": "subtests passed"}.get(
                    word, word)] = int(number)
    problems: Dict[str, str] = {}
    for line in text.splitlines():
        found = _RESULT.match(line.strip())
        if found and found.group(1) not in ("PASSED", "XPASS", "SUBPASSED") and "::" in found.group(3):
            name = found.group(3).split("::")[-1] + (f"[{found.group(2)}]" if found.group(2) else "")
            problems[name] = f"{found.group(1)}: {(found.group(4) or '').strip()[:160]}"
    return counts, problems


def run_size(suite: Path, np: int, launcher: str, keyword: str, timeout: float, test_timeout: int,
             stall_shutdown: float, outdir: Path) -> Tuple[int, float, List[Tuple[Dict[str, int], Dict[str, str]]]]:
    cmd = [launcher, "-np", str(np), "--output-filename", str(outdir),
           sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", "--color=no",
           f"--timeout={test_timeout}", str(suite)]
    if keyword:
        cmd[cmd.index("-rA")+1:cmd.index("-rA")+1] = ["-k", keyword]
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", COLUMNS="400")
    # A test that fails on some ranks only (an assertion before a collective the others then never
    # join) would leave them waiting: the stall deadline fails that collective on every rank, and
    # the next test's init() starts a fresh world everywhere.
    env.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", "10")
    env.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(stall_shutdown))
    start = time.monotonic()
    try:
        outdir.mkdir(parents=True, exist_ok=True)
        with open(outdir / "launcher.stderr", "w") as launcher_err:
            proc = subprocess.run(cmd, cwd=suite.parent, env=env, stdout=subprocess.DEVNULL,
                                  stderr=launcher_err, text=True, timeout=timeout)
        code = proc.returncode
        if code not in (0, 1):
            sys.stderr.write((outdir / "launcher.stderr").read_text()[-4000:])
    except subprocess.TimeoutExpired:
        code = -1
    elapsed = time.monotonic() - start
    per_rank = []
    for rank in range(np):
        out_file = outdir / f"rank.{rank}" / "stdout"
        text = out_file.read_text(errors="replace") if out_file.exists() else ""
        per_rank.append(parse_rank_output(text))
    return code, elapsed, per_rank


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("horovod_src", type=Path, help="Horovod checkout or git directory")
    parser.add_argument("--suite", choices=sorted(SUITES), default="torch",
                        help="which of Horovod's suites to run: test/parallel/test_<suite>.py (default torch)")
    parser.add_argument("--np", type=int, nargs="+", default=[2, 3], help="world sizes, one launch each")
    parser.add_argument("-k", dest="keyword", default="", help="pytest -k expression (default: every test)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for one whole launch")
    parser.add_argument("--test-timeout", type=int, default=300, help="seconds for one test (pytest-timeout)")
    parser.add_argument("--stall-shutdown", type=float, default=30.0,
                        help="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS for the ranks (default 30): ends a collective "
                             "that a rank's failed assertion left the others waiting on")
    parser.add_argument("--keep", type=Path, help="keep the prepared suite and the rank outputs here")
    parser.add_argument("--launcher", default=str(Path(sys.executable).with_name("spark-hvd-run")),
                        help="the spark-hvd-run executable")
    args = parser.parse_args(argv)
    missing = [name for name in NEEDS.get(args.suite, ()) if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"Horovod's {suite_path(args.suite)} imports {', '.join(missing)}, which {sys.executable} "
                         f"lacks: pip install {' '.join(missing)}")
    if not Path(args.launcher).exists() and shutil.which(args.launcher) is None:
        raise SystemExit(f"launcher {args.launcher!r} not found; install spark-hvd (make venv) or pass --launcher")
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="spark-hvd-horovod-suite-"))
    if args.keep and workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    suite = prepare(args.horovod_src, workdir, args.suite)
    failed_launch = False
    try:
        for np in args.np:
            code, elapsed, per_rank = run_size(suite, np, args.launcher, args.keyword, args.timeout,
                                               args.test_timeout, args.stall_shutdown, workdir / f"np{np}")
            print(f"== {suite_path(args.suite)} under spark-hvd-run -np {np}: one launch, {elapsed:.0f} s, exit {code} ==")
            for rank, (counts, problems) in enumerate(per_rank):
                shown = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no summary (launch died)"
                print(f"rank {rank}: {shown}")
            union: Dict[str, str] = {}
            for counts, problems in per_rank:
                for name, why in problems.items():
                    union.setdefault(name, why)
            for name in sorted(union):
                print(f"  {name}: {union[name]}")
            failed_launch |= code not in (0, 1) or not all(c for c, _ in per_rank)
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed_launch else 0


if __name__ == "__main__":
    sys.exit(main())
