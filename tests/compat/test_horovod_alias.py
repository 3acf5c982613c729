"""The ``horovod`` alias package that runs Horovod's Spark tests against spark-hvd: Horovod's public
module paths are spark-hvd's modules, its internals are placeholders that fail by name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_horovod_spark_tests import ALIAS_PACKAGE, PRIVATE  # noqa: E402

_PROBE = """
import copy, pickle
import horovod.spark.torch as hvd_spark
import spark_hvd.spark.torch
from horovod.spark.common.store import LocalStore
from horovod.spark.common import util, constants
from horovod.spark.torch import remote
from horovod.common.util import gloo_built, mpi_built
import horovod.spark
assert hvd_spark.TorchEstimator is spark_hvd.spark.torch.TorchEstimator
assert LocalStore.__module__.startswith("spark_hvd.")
assert gloo_built() is True and mpi_built() is False
assert pickle.loads(pickle.dumps(horovod.spark)) is horovod.spark
for use in (lambda: util._get_metadata(None), lambda: remote._calculate_loss_fn(), lambda: constants.X + 1):
    try:
        use()
    except AttributeError as error:
        print(error)
    else:
        raise SystemExit("a placeholder did not fail")
"""


def test_horovods_public_paths_are_spark_hvds_and_its_internals_fail_by_name(tmp_path):
    package = tmp_path / "horovod"
    package.mkdir()
    (package / "__init__.py").write_text(ALIAS_PACKAGE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines == [f"horovod.spark.common.util._get_metadata {PRIVATE}, not part of spark-hvd's surface",
                     f"horovod.spark.torch.remote._calculate_loss_fn {PRIVATE}, not part of spark-hvd's surface",
                     f"horovod.spark.common.constants.X {PRIVATE}, not part of spark-hvd's surface"]
