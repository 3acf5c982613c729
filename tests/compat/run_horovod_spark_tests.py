"""Run Horovod's integration tests of its Spark API against spark-hvd and print what they report.

    python tests/compat/run_horovod_spark_tests.py HOROVOD_SRC [--file torch lightning keras spark]
        [-k EXPR] [--test-timeout 600]

HOROVOD_SRC is a Horovod checkout or a bare git directory of one (its HEAD is read). Each file
(``test/integration/test_spark_<name>.py``) is copied with ``test/utils/common.py`` and
``test/utils/spark_common.py`` into a temporary folder and run by pytest unmodified, in a Python
whose ``horovod`` package is an alias of spark-hvd: ``import horovod.spark.torch as hvd_spark``
imports ``spark_hvd.spark.torch``, ``from horovod.spark.common.store import LocalStore`` takes
spark-hvd's ``LocalStore``, and so on for every module the two share a name for. That is the
import swap a migrating user makes, done for every import line at once.

What the files also import from Horovod's internals (``horovod.spark.common.util``, the
estimators' ``remote`` modules, ``horovod.runner.*``) is not spark-hvd's surface. Those names
resolve to placeholders, so the files still import and the tests that do not touch them run;
a test that calls or reads one fails with ``HorovodPrivateHelper: <name> is a private helper of
Horovod``, and the report counts it apart. Four helpers the tests only use to decide whether to
skip get stand-ins: ``gloo_built()`` is True, ``mpi_built()`` and ``is_open_mpi()`` are False (no
MPI launcher here), ``in_thread`` starts a daemon thread.

It prints, per file, the counts and every test that did not pass with its first error line,
marked ``[private]`` when it failed on a private helper. The exit status is 0 when every file
ran to its end (whatever the tests said), so the counts, not the status, are the result.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_horovod_suite import parse_rank_output, read_source  # noqa: E402

FILES = {"torch": "test_spark_torch.py", "lightning": "test_spark_lightning.py", "keras": "test_spark_keras.py",
         "spark": "test_spark.py"}
UTILS = ("test/utils/common.py", "test/utils/spark_common.py")
PRIVATE = "is a private helper of Horovod"

# The ``horovod`` package of the run: every ``horovod.X`` module is a proxy of ``spark_hvd.X``
# when spark-hvd has that module; what spark-hvd lacks is a placeholder that fails when used.
ALIAS_PACKAGE = '''"""``horovod`` as an alias of spark-hvd, for running Horovod's tests with the imports swapped."""

import importlib
import importlib.abc
import importlib.util
import sys
import threading
import types

PRIVATE = "''' + PRIVATE + '''"


class HorovodPrivateHelper(AttributeError):
    """A test reached a part of Horovod that is not spark-hvd's surface."""


class Placeholder:
    """Stands for a Horovod internal: importing it works, using it fails with its name."""

    def __init__(self, name):
        object.__setattr__(self, "_name", name)

    def _fail(self, *args, **kwargs):
        raise HorovodPrivateHelper(f"{self._name} {PRIVATE}, not part of spark-hvd's surface")

    # Calling, iterating or computing with a Horovod internal (a constant included) fails by name.
    __call__ = __iter__ = __enter__ = __len__ = __index__ = __int__ = __float__ = _fail
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __lt__ = __gt__ = _fail

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{self._name}.{attr}")

    def __mro_entries__(self, bases):
        self._fail()

    def __repr__(self):
        return f"<placeholder of Horovod's {self._name}>"


def _in_thread(target, args=(), name=None, daemon=True, silent=False):
    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    thread.start()
    return thread


STAND_INS = {
    "horovod.common.util": {"gloo_built": lambda: True, "mpi_built": lambda: False,
                            "nccl_built": lambda: False, "is_version_greater_equal_than": None},
    "horovod.runner.mpi_run": {"is_open_mpi": lambda *args, **kwargs: False},
    "horovod.runner.util.threads": {"in_thread": _in_thread},
}


def _version_at_least(ver, target):
    from packaging import version

    return version.parse(ver) >= version.parse(target)


STAND_INS["horovod.common.util"]["is_version_greater_equal_than"] = _version_at_least


def _ours(name):
    """spark-hvd's module of the same name as Horovod's ``name``, or None."""
    target = "spark_hvd" + name[len("horovod"):]
    try:
        if importlib.util.find_spec(target) is None:
            return None
    except ModuleNotFoundError:
        return None
    return importlib.import_module(target)


class Proxy(types.ModuleType):
    """``horovod.X``: the attributes of ``spark_hvd.X`` (None when it has no such module), then
    stand-ins, then the submodules spark-hvd has, then placeholders."""

    def __init__(self, name, ours):
        super().__init__(name)
        self.__path__ = []
        self._ours = ours
        if ours is not None:
            self.__doc__ = ours.__doc__

    def __reduce__(self):
        # Pickled by name, as cloudpickle pickles plain modules (Horovod's tests pickle functions
        # that use horovod.spark.run).
        return importlib.import_module, (self.__name__,)

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        ours = self.__dict__.get("_ours")
        if ours is not None and hasattr(ours, attr):
            return getattr(ours, attr)
        stand_in = STAND_INS.get(self.__name__, {})
        if attr in stand_in:
            return stand_in[attr]
        if _ours(f"{self.__name__}.{attr}") is not None:
            return importlib.import_module(f"{self.__name__}.{attr}")
        return Placeholder(f"{self.__name__}.{attr}")


class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("horovod."):
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return Proxy(spec.name, _ours(spec.name))

    def exec_module(self, module):
        parent, _, child = module.__name__.rpartition(".")
        setattr(sys.modules[parent], child, module)


sys.meta_path.insert(0, Finder())
_root = _ours("horovod")
__version__ = "0.28.1"
__path__ = []


def __getattr__(attr):
    if attr.startswith("__"):
        raise AttributeError(attr)
    if hasattr(_root, attr):
        return getattr(_root, attr)
    return importlib.import_module(f"horovod.{attr}")
'''

# A line of -rA's short summary: "FAILED file::Class::test - first line of the error".
_STATUS = re.compile(r"^(FAILED|ERROR)\s+(\S+?)(?:\s+-\s+(.*))?$")


def prepare(src: Path, workdir: Path, names: List[str]) -> List[Path]:
    """Write the alias package, the helpers and the chosen test files under ``workdir``."""
    shim = workdir / "alias" / "horovod"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").write_text(ALIAS_PACKAGE)
    # Horovod's helpers import the ``mock`` backport; the standard library's is the same API.
    (workdir / "alias" / "mock.py").write_text("from unittest.mock import *  # noqa: F401,F403\n"
                                               "from unittest.mock import _patch  # noqa: F401\n")
    for helper in UTILS:
        (workdir / helper).parent.mkdir(parents=True, exist_ok=True)
        (workdir / helper).write_text(read_source(src, helper))
    paths = []
    for name in names:
        path = workdir / "test" / "integration" / FILES[name]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(read_source(src, f"test/integration/{FILES[name]}"))
        paths.append(path)
    return paths


def run_file(path: Path, workdir: Path, keyword: str, test_timeout: int, timeout: float
             ) -> Tuple[int, float, Dict[str, int], Dict[str, str]]:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", "--color=no",
           f"--timeout={test_timeout}", str(path)]
    if keyword:
        cmd += ["-k", keyword]
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", COLUMNS="400", SPARK_LOCAL_IP="127.0.0.1",
               PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join([str(workdir / "alias"), os.environ.get("PYTHONPATH", "")]))
    start = time.monotonic()
    log = workdir / f"{path.stem}.log"
    try:
        with open(log, "w") as out:
            code = subprocess.run(cmd, cwd=path.parent, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        code = -1
    text = log.read_text(errors="replace")
    counts, problems = parse_rank_output(text)
    for line in text.splitlines():  # -rA's short summary holds each failure's first error line
        found = _STATUS.match(line.strip())
        if found and "::" in found.group(2):
            problems[found.group(2).split("::")[-1]] = f"{found.group(1)}: {(found.group(3) or '').strip()[:200]}"
    return code, time.monotonic() - start, counts, problems


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("horovod_src", type=Path, help="Horovod checkout or git directory")
    parser.add_argument("--file", dest="files", nargs="+", choices=sorted(FILES), default=sorted(FILES),
                        help="which test/integration/test_spark_<name>.py files (default all)")
    parser.add_argument("-k", dest="keyword", default="", help="pytest -k expression (default: every test)")
    parser.add_argument("--test-timeout", type=int, default=600, help="seconds for one test")
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds for one file")
    parser.add_argument("--keep", type=Path, help="write the files and logs here instead of a temporary folder")
    args = parser.parse_args(argv)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="horovod-spark-tests-"))
    workdir.mkdir(parents=True, exist_ok=True)
    status = 0
    for path in prepare(args.horovod_src, workdir, args.files):
        code, elapsed, counts, problems = run_file(path, workdir, args.keyword, args.test_timeout, args.timeout)
        private = sorted(name for name, why in problems.items() if PRIVATE in why)
        summary = ", ".join(f"{n} {word}" for word, n in counts.items()) or "no summary"
        print(f"{path.name}: {summary} in {elapsed:.0f} s ({len(private)} of the failures on Horovod's private "
              f"helpers; log {workdir / (path.stem + '.log')})")
        for name, why in sorted(problems.items()):
            mark = "[private] " if name in private else ""
            print(f"  {mark}{name}: {why}")
        if code not in (0, 1):
            print(f"  pytest ended with status {code}" + (" (timed out)" if code == -1 else ""))
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
