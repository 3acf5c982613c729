"""Checks every estimator and model makes on the driver before any Spark job, whatever the framework.

Each failure is a ValueError that names the parameter or column, the value seen, what was
expected and how to fix it. The framework packages (``spark_hvd.spark.torch``,
``spark_hvd.spark.keras``) add their model checks on top.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import subprocess
import sys
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = [
    "user_frame",
    "require",
    "per_label",
    "check_loss_weights",
    "resolve_shape",
    "schema_row_sizes",
    "feature_shapes",
    "known_shapes",
    "sizes_from_data",
    "ensure_executor_python",
    "check_slots",
]

log = logging.getLogger("spark_hvd.spark")

_PROBE_TIMEOUT_S = 60.0


def user_frame(exc: BaseException, libraries: Sequence[str]) -> Optional[Any]:
    """The frame that raised ``exc`` when it is the user's own code (not in one of the
    ``libraries``' packages nor in spark_hvd), else None: tells a bug in a user's function from
    a library's refusal of the shapes it was given."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return None
    last = frames[-1]
    path = os.path.abspath(last.filename)
    owned = []
    for name in (*libraries, "spark_hvd", "spark_hvd.runtime"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            owned.append(os.path.dirname(os.path.abspath(module.__file__)) + os.sep)
    if last.filename.startswith("<") or any(path.startswith(d) for d in owned):
        return None
    return last


def require(name: str, value: Any, expected: str, example: str) -> None:
    """ValueError when a required Param is unset."""
    if value is None:
        raise ValueError(f"{name}=None is not valid: expected {expected}; pass e.g. {name}={example}")


def per_label(loss: Any, label_cols: Sequence[str]) -> List[Any]:
    """The ``loss`` Param as one loss per label column: a list or tuple as given, a single loss for
    every column; ValueError when a list's length is not the number of label columns."""
    losses = list(loss) if isinstance(loss, (list, tuple)) else [loss] * len(label_cols)
    if len(losses) != len(label_cols):
        raise ValueError(f"loss has {len(losses)} entries for {len(label_cols)} label column(s) {list(label_cols)}: "
                         "expected one loss per label column, or a single loss for all of them")
    return losses


def check_loss_weights(loss_weights: Optional[Sequence[float]], label_cols: Sequence[str]) -> None:
    """ValueError when ``loss_weights`` is set with other than one weight per label column."""
    if loss_weights is not None and len(loss_weights) != len(label_cols):
        raise ValueError(f"loss_weights={list(loss_weights)} has {len(loss_weights)} entries for {len(label_cols)} "
                         f"label column(s) {list(label_cols)}: expected one weight per label column")


def resolve_shape(shape: Sequence[int], numel: int, column: str) -> Tuple[int, ...]:
    """``shape`` with its -1 replaced so that it holds ``numel`` values per row, or a ValueError.

    A leading -1 of a shape with more dimensions stands for the rows, as in Horovod's
    ``input_shapes=[[-1, 1, 28, 28]]``: the per-row shape is the rest."""
    dims = [int(d) for d in shape]
    if len(dims) > 1 and dims[0] == -1:
        dims = dims[1:]
    known = math.prod(d for d in dims if d != -1)
    if -1 in dims:
        if known == 0 or numel % known:
            raise ValueError(f"input shape {list(shape)} of column {column!r} cannot hold its {numel} values per "
                             f"row: expected a shape whose size divides {numel}; fix input_shapes")
        dims[dims.index(-1)] = numel // known
    elif known != numel:
        raise ValueError(f"input shape {list(shape)} of column {column!r} holds {known} values per row but the "
                         f"column has {numel}: expected shapes whose sizes match the data; fix input_shapes")
    return tuple(dims)


def schema_row_sizes(schema: Any, cols: Sequence[str]) -> List[Optional[int]]:
    """Values per row of each column where the schema tells: 1 for scalars, the ``ml_attr``
    size for Vectors made by Spark ML feature transformers; None where only the data knows."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    fields = {f.name: f for f in schema.fields}
    sizes: List[Optional[int]] = []
    for col in cols:
        field = fields.get(col)
        if field is None:
            sizes.append(None)
        elif isinstance(field.dataType, (T.NumericType, T.BooleanType)):
            sizes.append(1)
        elif isinstance(field.dataType, VectorUDT):
            num = (field.metadata or {}).get("ml_attr", {}).get("num_attrs")
            sizes.append(int(num) if isinstance(num, int) and num > 0 else None)
        else:
            sizes.append(None)
    return sizes


def feature_shapes(input_shapes: Optional[Sequence[Sequence[int]]], feature_cols: Sequence[str],
                   sizes: Sequence[Optional[int]]) -> Optional[List[Tuple[int, ...]]]:
    """Concrete per-row shapes of the features, or None while a size is still unknown."""
    if input_shapes is not None and len(input_shapes) != len(feature_cols):
        raise ValueError(f"input_shapes has {len(input_shapes)} shape(s) for {len(feature_cols)} feature column(s) "
                         f"{list(feature_cols)}: expected one shape per feature column, e.g. input_shapes=[[1, 28, 28]]")
    if any(size is None for size in sizes):
        return None
    if input_shapes is None:
        return [(1,) if size == 1 else (int(size),) for size in sizes]  # type: ignore[arg-type]
    return [resolve_shape(shape, int(size), col)  # type: ignore[arg-type]
            for shape, size, col in zip(input_shapes, sizes, feature_cols)]


def known_shapes(input_shapes: Optional[Sequence[Sequence[int]]], feature_cols: Sequence[str],
                 sizes: Sequence[int]) -> List[Tuple[int, ...]]:
    """:func:`feature_shapes` for sizes that are all known."""
    shapes = feature_shapes(input_shapes, feature_cols, sizes)
    assert shapes is not None, "every size is known here"
    return shapes


def sizes_from_data(df: Any, cols: Sequence[str], sizes: Sequence[Optional[int]]) -> List[Optional[int]]:
    """Values per row of array and Vector columns whose size the schema does not record (one row
    without nulls read)."""
    from pyspark.sql import functions as F

    from spark_hvd.spark.data.columns import is_vector, is_vector_struct, quote, vector_as_array

    fields = {f.name: f.dataType for f in df.schema.fields}
    exprs, unknown = [], []
    for i, (col, size) in enumerate(zip(cols, sizes)):
        if size is None:
            column = F.col(quote(col))
            if is_vector(fields[col]) or is_vector_struct(fields[col]):
                column = vector_as_array(column, fields[col])
            exprs.append(F.size(column).alias(f"s{i}"))
            unknown.append(col)
    if not exprs:
        return list(sizes)
    row = df.dropna(subset=unknown).select(*exprs).first()
    if row is None:
        return [1 if s is None else s for s in sizes]  # no complete row: any shape predicts nothing
    found = row.asDict()
    return [int(found[f"s{i}"]) if size is None else size for i, size in enumerate(sizes)]


_BASE_WORKER_MODULES = ("spark_hvd", "numpy", "pyarrow", "pandas", "cloudpickle")
_PROBE = "import importlib.util as u, sys; sys.exit(0 if all(u.find_spec(m) for m in {!r}) else 1)"
_probed: Dict[Tuple[str, Tuple[str, ...]], bool] = {}


def _has_worker_modules(python: str, modules: Tuple[str, ...]) -> bool:
    """Whether ``python`` finds every module in ``modules`` (looked up, not imported: fast)."""
    if os.path.abspath(python) == os.path.abspath(sys.executable):
        return True
    key = (python, modules)
    if key not in _probed:
        try:
            probe = subprocess.run([python, "-c", _PROBE.format(modules)], capture_output=True,
                                   timeout=_PROBE_TIMEOUT_S)
            _probed[key] = probe.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            _probed[key] = False
    return _probed[key]


def ensure_executor_python(session: Any, info: Any, framework_modules: Sequence[str]) -> None:
    """Make Spark's Python workers run an interpreter with spark_hvd and the framework, or say how.

    On a local master the workers run on this machine: when the configured Python
    (``PYSPARK_PYTHON``, else ``python3`` on PATH, which need not be this virtualenv's) lacks
    spark_hvd, ``framework_modules`` (e.g. torch), numpy, pyarrow, pandas or cloudpickle, a
    classic session switches to this process's own interpreter, with a warning; a Spark Connect
    server was started with its Python already, so there the answer is a ValueError naming
    PYSPARK_PYTHON. On a cluster the executors are checked by the job itself, which fails with
    the same advice.
    """
    from spark_hvd.runtime import config
    from spark_hvd.spark.launch.barrier import executor_python

    if not info.local:
        return
    modules = ("spark_hvd", *framework_modules, *_BASE_WORKER_MODULES[1:])
    configured = executor_python(session, info)
    resolved = shutil.which(configured, path=config.environ_snapshot().get("PATH")) or configured
    if _has_worker_modules(resolved, modules):
        return
    if info.connect:
        raise ValueError(f"Spark runs its Python tasks with {resolved}, which lacks some of {', '.join(modules)}; "
                         f"fix: set PYSPARK_PYTHON={sys.executable} before the Spark Connect server starts (or "
                         "use spark_hvd.spark.local_session(connect=True), which does)")
    log.warning("Spark's Python workers would run %s, which lacks some of %s; using this driver's interpreter %s "
                "instead (set PYSPARK_PYTHON=%s before creating the SparkSession to choose it yourself)",
                resolved, ", ".join(modules), sys.executable, sys.executable)
    session.sparkContext.pythonExec = sys.executable


def check_slots(session: Any, num_proc: int) -> Any:
    """ValueError naming both numbers when the cluster cannot run ``num_proc`` barrier tasks at once;
    returns the session's :class:`spark_hvd.spark.session.SessionInfo`."""
    from spark_hvd.spark.launch import barrier as runner

    # The same check run() makes, done before the data is materialized rather than after.
    return runner.wait_for_slots(session, num_proc)
