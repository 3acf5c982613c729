"""The import graph of spark_hvd, read from the source (nothing is imported), and its layers.

``docs/generate.py`` writes the layer and folder tables of ``docs/architecture.md`` from it, and
``tests/test_import_graph.py`` holds the code to the rules below, so neither can drift.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
SOURCES = (("spark_hvd", ROOT / "spark_hvd"), ("spark_hvd.runtime", ROOT / "runtime"))
"""Import name and folder of each source tree (``runtime/`` is installed as ``spark_hvd.runtime``)."""

LAYERS: Tuple[Tuple[str, int, str], ...] = (
    ("spark_hvd.runtime", 0, "the collective engine on numpy arrays: transports, algorithms, negotiation, backends"),
    ("spark_hvd.datasets", 0, "small bundled data sets"),
    ("spark_hvd.torch", 1, "Horovod's PyTorch API over the runtime"),
    ("spark_hvd.tensorflow", 1, "Horovod's TensorFlow 2 API over the runtime"),
    ("spark_hvd.keras", 2, "Horovod's Keras API for Keras 3, on the TensorFlow or the PyTorch binding"),
    ("spark_hvd.lightning", 2, "the PyTorch Lightning strategy, on the PyTorch binding"),
    ("spark_hvd.runner", 3, "spark-hvd-run and local launching of ranks"),
    ("spark_hvd.spark", 4, "Spark: run() on barrier stages, data, stores, estimators and models"),
    ("spark_hvd", 5, "the package itself"),
)
"""Each package's layer: a module imports only from its own layer or lower ones."""

SEPARATE = (("spark_hvd.torch", "spark_hvd.tensorflow"), ("spark_hvd.keras", "spark_hvd.lightning"))
"""Packages of one layer that must not import each other."""

SPARK_PARTS: Tuple[Tuple[str, int, str], ...] = (
    ("spark_hvd.spark.exports", 0, "a package's public names, imported when first used (PEP 562)"),
    ("spark_hvd.spark.session", 1, "what spark-hvd knows of a SparkSession; the local session"),
    ("spark_hvd.spark.data", 1, "stores, the columns' storage, the data's identity, preparation, readers"),
    ("spark_hvd.spark.launch", 2, "barrier stages, elastic stages, retries, the tasks' output streams"),
    ("spark_hvd.spark.estimator", 3, "the estimator kit every framework shares"),
    ("spark_hvd.spark.torch", 4, "TorchEstimator and TorchModel: the torch hooks"),
    ("spark_hvd.spark.keras", 4, "KerasEstimator and KerasModel: the Keras hooks"),
    ("spark_hvd.spark.lightning", 5, "LightningEstimator and LightningModel: the Lightning hooks (on torch's)"),
    ("spark_hvd.spark.common", 6, "Horovod's horovod.spark.common paths: the same stores and backends"),
    ("spark_hvd.spark", 6, "the public names of spark_hvd.spark"),
)
"""The parts of the Spark layer, in the same order rule."""

FRAMEWORKS = ("torch", "tensorflow", "keras", "pyspark", "pytorch_lightning", "lightning", "mpi4py")
"""Third-party frameworks, which the runtime never imports (mpi4py only in its MPI backend)."""

ALIASES: Tuple[Tuple[str, str], ...] = (
    ("spark_hvd.tensorflow", "spark_hvd.keras.layers"),
    ("spark_hvd.tensorflow", "spark_hvd.keras.keras2"),
    ("spark_hvd.tensorflow.keras", "spark_hvd.keras"),
)
"""(module, package) imports of a higher layer made only for Horovod's module paths
(``hvd.SyncBatchNormalization`` of ``horovod.tensorflow``, resolved when first used (PEP 562): the
Keras 3 layer, or Keras 2's when ``tf.keras`` is ``tf_keras``; and
the ``horovod.tensorflow.keras`` path): outside the layer and cycle rules."""


def is_alias(source: str, target: str) -> bool:
    """Whether an import of ``target`` by ``source`` is one of :data:`ALIASES`."""
    return any(source == s and (target == t or target.startswith(t + ".")) for s, t in ALIASES)


@dataclass(frozen=True)
class Import:
    """One import statement's target inside spark_hvd."""

    source: str
    target: str
    names: Tuple[str, ...]
    """Names taken with ``from target import ...`` (empty for ``import target``)."""
    lazy: bool
    """Inside a function (made when the function runs), not at import time."""
    line: int


def modules() -> Dict[str, Path]:
    """Every module by import name."""
    found: Dict[str, Path] = {}
    for base, folder in SOURCES:
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([base] + parts)] = path
    return found


def _package(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rsplit(".", 1)[0]


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _walk(node: ast.AST, lazy: bool = False, typing_too: bool = False) -> Iterator[Tuple[ast.AST, bool]]:
    for child in ast.iter_child_nodes(node):
        if _type_checking(child) and not typing_too:
            continue
        inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield child, inner
        yield from _walk(child, inner, typing_too)


def imports(known: Optional[Dict[str, Path]] = None, typing_too: bool = False) -> List[Import]:
    """Every import of a spark_hvd module by a spark_hvd module, resolved to the module it loads;
    with ``typing_too``, also those made only for type checkers (``if TYPE_CHECKING:``)."""
    known = known if known is not None else modules()
    found: List[Import] = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        package = _package(name, path)
        for node, lazy in _walk(tree, typing_too=typing_too):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("spark_hvd"):
                        found.append(Import(name, alias.name, (), lazy, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1])
                    target = base + ("." + node.module if node.module else "")
                else:
                    target = node.module or ""
                if not target.startswith("spark_hvd"):
                    continue
                names = tuple(alias.name for alias in node.names)
                submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
                rest = tuple(n for n in names if f"{target}.{n}" not in known)
                if rest or not submodules:
                    found.append(Import(name, target, rest, lazy, node.lineno))
                found.extend(Import(name, sub, (), lazy, node.lineno) for sub in submodules)
    return found


def declared(path: Path) -> Set[str]:
    """The names a module lists in ``__all__`` (its public API, Horovod's ``_``-names included)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
                try:
                    return set(ast.literal_eval(node.value))
                except ValueError:
                    return set()
    return set()


def third_party(known: Optional[Dict[str, Path]] = None) -> Dict[str, Set[str]]:
    """The top-level third-party packages each module imports (at any depth of its code)."""
    known = known if known is not None else modules()
    found: Dict[str, Set[str]] = {}
    for name, path in known.items():
        tops: Set[str] = set()
        for node, _ in _walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                tops.add(node.module.split(".")[0])
        found[name] = {t for t in tops if t != "spark_hvd"}
    return found


def layer_of(module: str, table: Tuple[Tuple[str, int, str], ...] = LAYERS) -> Tuple[str, int]:
    """(package, layer) of ``module``: the longest package prefix in ``table``."""
    best = ("", -1)
    for package, layer, _ in table:
        if (module == package or module.startswith(package + ".")) and len(package) > len(best[0]):
            best = (package, layer)
    return best


def graph(found: Optional[List[Import]] = None) -> Dict[str, Set[str]]:
    """Module -> the modules it imports by name, aliases left out. (The packages above a target run
    too, but a package ``__init__`` that gathers its modules' names is the usual Python shape, not a
    loop; the layer rules keep packages from importing upward.)"""
    edges: Dict[str, Set[str]] = {}
    for imp in found if found is not None else imports():
        if is_alias(imp.source, imp.target) or imp.target == imp.source:
            continue
        edges.setdefault(imp.source, set()).add(imp.target)
    return edges


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for node in sorted(edges):
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return found
