"""The layers, held by a test of the whole import graph (read from the source): imports go down the
layers only, bindings never import Spark, the runtime no framework, no module takes a private name
of another, and no modules import each other in a loop."""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
sys.path.insert(0, str(DOCS))

import import_graph as graph  # noqa: E402  (docs/import_graph.py, also used by docs/generate.py)

KNOWN = graph.modules()
IMPORTS = graph.imports(KNOWN)


def test_every_module_has_a_layer():
    """A new top-level package must be placed in the layer table first."""
    assert [m for m in KNOWN if graph.layer_of(m)[1] < 0] == []


def test_imports_go_down_the_layers():
    """runtime <- torch, tensorflow <- keras, lightning <- runner <- spark; torch and tensorflow, and
    keras and lightning, do not import each other (Horovod's path aliases aside)."""
    upward = []
    for imp in IMPORTS:
        if graph.is_alias(imp.source, imp.target):
            continue
        (src, src_layer), (dst, dst_layer) = graph.layer_of(imp.source), graph.layer_of(imp.target)
        if dst_layer > src_layer or (src, dst) in graph.SEPARATE or (dst, src) in graph.SEPARATE:
            upward.append(f"{imp.source}:{imp.line} imports {imp.target}")
    assert upward == []


def test_the_spark_parts_import_down_only():
    """data and the session <- launch <- estimator <- torch, keras <- lightning: the launch part knows no
    estimator, the estimator kit no framework, and the frameworks not each other (Lightning's model
    is a TorchModel)."""
    upward = []
    for imp in IMPORTS:
        if not (imp.source.startswith("spark_hvd.spark.") and imp.target.startswith("spark_hvd.spark")):
            continue
        (src, src_layer), (dst, dst_layer) = (graph.layer_of(imp.source, graph.SPARK_PARTS),
                                              graph.layer_of(imp.target, graph.SPARK_PARTS))
        if dst_layer > src_layer or (dst_layer == src_layer and src != dst):
            upward.append(f"{imp.source}:{imp.line} imports {imp.target}")
    assert upward == []


def test_the_runtime_imports_no_framework_and_bindings_no_spark():
    """The runtime needs numpy and the standard library only (mpi4py in its MPI backend); no binding
    and no launcher module imports pyspark."""
    tops = graph.third_party(KNOWN)
    frameworks = set(graph.FRAMEWORKS)
    runtime = {m: sorted(t & frameworks) for m, t in tops.items()
               if m.startswith("spark_hvd.runtime") and t & frameworks and m != "spark_hvd.runtime.mpi"}
    assert runtime == {}
    assert tops["spark_hvd.runtime.mpi"] & frameworks <= {"mpi4py"}
    spark = [m for m, t in tops.items() if 1 <= graph.layer_of(m)[1] <= 3 and "pyspark" in t]
    assert spark == []


def test_no_module_imports_a_private_name_of_another():
    """``from x import _y`` only where ``x`` lists ``_y`` in its __all__ (Horovod's own ``_``-names)."""
    taken = []
    for imp in IMPORTS:
        private = [n for n in imp.names if n.startswith("_") and not n.startswith("__")]
        if private and imp.target in KNOWN:
            hidden = [n for n in private if n not in graph.declared(KNOWN[imp.target])]
            taken += [f"{imp.source}:{imp.line} takes {imp.target}.{n}" for n in hidden]
    assert taken == []


def test_no_import_loops():
    """No modules import each other in a loop, lazily inside functions or at import time."""
    assert graph.cycles(graph.graph(IMPORTS)) == []


def test_no_import_loops_in_the_runtime_even_for_type_checkers():
    """The runtime's modules form no loop even counting imports made only for type annotations
    (a handle knows its engine through the small Driver protocol, not the Engine class)."""
    runtime = graph.graph([i for i in graph.imports(KNOWN, typing_too=True)
                           if i.source.startswith("spark_hvd.runtime") and i.target.startswith("spark_hvd.runtime")])
    assert graph.cycles(runtime) == []


def test_the_graph_sees_what_it_checks():
    """The reader finds the imports it judges: lazy ones, relative ones and submodule ones."""
    by_pair = {(i.source, i.target): i for i in IMPORTS}
    assert ("spark_hvd.spark.estimator.base", "spark_hvd.spark.launch.barrier") in by_pair
    assert ("spark_hvd.runtime.engine", "spark_hvd.runtime.cycles") in by_pair  # from .cycles import ...
    assert any(i.lazy for i in IMPORTS)


def test_horovods_paths_into_higher_layers_load_only_when_used():
    """The package spark_hvd.tensorflow names the Keras binding's SyncBatchNormalization as Horovod
    does, but imports it only when it is first looked up."""
    aliases = [i for i in IMPORTS if i.source == "spark_hvd.tensorflow" and graph.is_alias(i.source, i.target)]
    assert aliases and all(i.lazy for i in aliases)
