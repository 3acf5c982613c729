"""The collective grid of spark_hvd.tensorflow at world sizes 1, 2 and 3, eagerly and inside tf.function,
with gradients; one launched world per size, shared with test_tf_training (conftest.py)."""

import numpy as np
import pytest

from tf_world import assert_passed, close

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"]
LENGTHS = [0, 1, 7]
TOLERANCE = {"float16": 1e-2, "bfloat16": 5e-2, "float32": 1e-5, "float64": 1e-12}


def _tf():
    import tensorflow as tf

    return tf


def _ops(hvd, dtype):
    if dtype == "bool":
        return [hvd.Sum, hvd.Min, hvd.Max]
    return [hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product]


def _contribution(r, length, op, hvd):
    base = np.arange(length, dtype=np.float64)
    if op == hvd.Product:
        return 1.0 + (base + r) % 2
    return (base + 3 * r) % 7


def _expected(hvd, size, length, op, dtype):
    stack = np.stack([_contribution(r, length, op, hvd) for r in range(size)])
    if dtype == "bool":
        stack = stack != 0
        return {hvd.Sum: stack.any(0), hvd.Min: stack.all(0), hvd.Max: stack.any(0)}[op]
    want = {hvd.Sum: lambda: stack.sum(0), hvd.Min: lambda: stack.min(0), hvd.Max: lambda: stack.max(0),
            hvd.Product: lambda: stack.prod(0), hvd.Average: lambda: stack.sum(0) / size}[op]()
    if op == hvd.Average and dtype not in TOLERANCE:
        want = np.trunc(want)
    return want


def _as(tf, values, dtype):
    return tf.cast(tf.constant(values, dtype=tf.float64), getattr(tf, dtype))


def _numpy_as(tf, values, dtype):
    return _as(tf, values, dtype).numpy()


def check_topology(hvd, rank, size):
    """rank/size and the *_op tensors agree; the build probes answer False for what is not built."""
    tf = _tf()
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (rank, size, rank, size)
    assert int(hvd.rank_op()) == rank and int(hvd.size_op()) == size
    assert int(hvd.local_rank_op()) == rank and int(hvd.local_size_op()) == size
    assert int(hvd.process_set_included_op()) == 1
    assert hvd.rank_op().dtype == tf.int32
    for probe in (hvd.gloo_built, hvd.nccl_built, hvd.cuda_built, hvd.rocm_built, hvd.ddl_built, hvd.ccl_built,
                  hvd.mpi_enabled, hvd.gloo_enabled):
        assert probe() is False, probe.__name__


def check_allreduce_every_dtype_and_op_eager_and_graph(hvd, rank, size):
    """allreduce of every dtype and op on empty, one-element and odd-length tensors matches the
    reduction computed locally, eagerly and inside tf.function; the output keeps shape and dtype."""
    tf = _tf()

    @tf.function
    def reduce_in_graph(x, op):
        return hvd.allreduce(x, op=op)

    for dtype in DTYPES:
        for op in _ops(hvd, dtype):
            for length in LENGTHS:
                mine = _as(tf, _contribution(rank, length, op, hvd), dtype)
                want = _numpy_as(tf, _expected(hvd, size, length, op, dtype), dtype)
                what = f"allreduce {dtype} op={op!r} length={length}"
                close(hvd.allreduce(mine, op=op), want, TOLERANCE.get(dtype, 0), what + " eager")
                close(reduce_in_graph(mine, op), want, TOLERANCE.get(dtype, 0), what + " graph")


def check_allreduce_scaling_average_flag_compression(hvd, rank, size):
    """prescale/postscale multiply before and after the sum; average= maps to Average/Sum and clashes
    with op=; Compression.fp16 sends float16 and returns the input dtype."""
    tf = _tf()
    t = tf.fill([3], float(rank + 1))
    total = size * (size + 1) / 2
    close(hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5), np.full(3, total, np.float32))
    close(hvd.allreduce(t, average=False), np.full(3, total, np.float32))
    close(hvd.allreduce(t, average=True), np.full(3, total / size, np.float32), 1e-6)
    with pytest.raises(ValueError, match="op"):
        hvd.allreduce(t, average=True, op=hvd.Sum)
    got = hvd.allreduce(tf.linspace(-1.0, 1.0, 33) * (rank + 1), compression=hvd.Compression.fp16)
    close(got, (np.linspace(-1, 1, 33) * (size + 1) / 2).astype(np.float32), 2e-3, "fp16")
    compressed, ctx = hvd.Compression.fp16.compress(tf.ones([2], tf.float64))
    assert compressed.dtype == tf.float16 and hvd.Compression.fp16.decompress(compressed, ctx).dtype == tf.float64


def check_scalars_variables_and_grouped(hvd, rank, size):
    """0-dim tensors keep their shape; tf.Variable inputs are read; grouped_allreduce reduces each
    tensor of a list (bfloat16 in its own group), eagerly and in a graph."""
    tf = _tf()
    got = hvd.allreduce(tf.constant(float(rank)), op=hvd.Sum)
    assert got.shape == () and float(got) == sum(range(size))
    v = tf.Variable([float(rank)] * 4)
    close(hvd.allreduce(v, op=hvd.Max), np.full(4, size - 1, np.float32))
    inputs = [tf.fill([4], float(rank)), tf.fill([2, 3], 2 * rank)]
    mean = sum(range(size)) / size
    outs = hvd.grouped_allreduce(inputs)
    close(outs[0], np.full(4, mean, np.float32), 1e-6)
    close(outs[1], np.full((2, 3), int(2 * mean), np.int32))
    outs = tf.function(lambda a, b: hvd.grouped_allreduce([a, b], op=hvd.Sum))(*inputs)
    close(outs[1], np.full((2, 3), 2 * sum(range(size)), np.int32), what="grouped in graph")
    with pytest.raises(ValueError, match="bfloat16"):
        hvd.grouped_allreduce([tf.ones([1], tf.bfloat16), tf.ones([1])])


def check_allgather_uneven_every_dtype(hvd, rank, size):
    """allgather concatenates rank r's r+1 rows in rank order for every dtype (uint16..uint64 too),
    eagerly and in a graph (first dimension unknown at trace time); grouped_allgather agrees."""
    tf = _tf()
    gather = tf.function(hvd.allgather)
    for dtype in DTYPES + ["uint16", "uint32", "uint64"]:
        mine = _as(tf, np.arange(2 * (rank + 1)).reshape(rank + 1, 2) + 10 * rank, dtype)
        want = np.concatenate([_numpy_as(tf, np.arange(2 * (r + 1)).reshape(r + 1, 2) + 10 * r, dtype)
                               for r in range(size)])
        close(hvd.allgather(mine), want, what=f"allgather {dtype}")
        close(gather(mine), want, what=f"allgather {dtype} graph")
    outs = hvd.grouped_allgather([tf.fill([rank + 1], rank), tf.fill([1, 2], float(rank))])
    close(outs[0], np.concatenate([np.full(r + 1, r, np.int32) for r in range(size)]))
    close(outs[1], np.concatenate([np.full((1, 2), r, np.float32) for r in range(size)]))


def check_broadcast_and_inplace(hvd, rank, size):
    """broadcast returns the root's values for every dtype and leaves the input alone; broadcast_
    overwrites variables and returns their new values; broadcast_variables works in a graph."""
    tf = _tf()
    root = size - 1
    for dtype in DTYPES:
        mine = _as(tf, np.arange(6).reshape(2, 3) + rank, dtype)
        want = _numpy_as(tf, np.arange(6).reshape(2, 3) + root, dtype)
        close(hvd.broadcast(mine, root), want, what=f"broadcast {dtype}")
        var = tf.Variable(mine)
        (value,) = hvd.broadcast_([var], root)
        close(var, want, what=f"broadcast_ {dtype}")
        close(value, want, what=f"broadcast_ {dtype} value")
    variables = [tf.Variable(float(rank)), tf.Variable([rank, rank])]

    @tf.function
    def in_graph():
        hvd.broadcast_variables(variables, root_rank=0)

    in_graph()
    assert float(variables[0]) == 0.0 and variables[1].numpy().tolist() == [0, 0]


def check_alltoall(hvd, rank, size):
    """alltoall with splits sends j+1 rows to rank j and returns the rows and received splits; without
    splits it splits evenly and returns the tensor alone; uneven rows without splits raise
    InvalidArgumentError (a ValueError)."""
    tf = _tf()
    splits = [j + 1 for j in range(size)]
    rows = sum(splits)
    mine = tf.reshape(tf.range(rows * 2, dtype=tf.float32), [rows, 2]) + 100 * rank
    for run in (hvd.alltoall, tf.function(hvd.alltoall)):
        out, received = run(mine, splits=tf.constant(splits))
        start = sum(range(1, rank + 1))
        want = np.concatenate([(np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) + 100 * r)[start:start + rank + 1]
                               for r in range(size)])
        close(out, want)
        close(received, np.full(size, rank + 1, np.int32))
    even = tf.range(2 * size) + 10 * rank
    got = hvd.alltoall(even)
    close(got, np.array([v for r in range(size) for v in (10 * r + 2 * rank, 10 * r + 2 * rank + 1)], np.int32))
    if size > 1:
        with pytest.raises(tf.errors.InvalidArgumentError):
            hvd.alltoall(tf.ones([size + 1]))


def check_reducescatter(hvd, rank, size):
    """reducescatter gives rank r block r of the reduction (earlier ranks taking extra rows), in a graph
    with a static shape; grouped and scaled forms agree; a scalar raises a ValueError."""
    tf = _tf()
    rows = 2 * size + 1
    base = np.arange(rows * 3, dtype=np.float64).reshape(rows, 3)
    block = np.array_split(base * (size * (size + 1) / 2), size)[rank]
    mine = tf.constant(base * (rank + 1))
    close(hvd.reducescatter(mine, op=hvd.Sum), block, 1e-9)
    graph_out = tf.function(lambda x: hvd.reducescatter(x))(mine)
    close(graph_out, block / size, 1e-9)
    outs = hvd.grouped_reducescatter([mine, mine * 2], op=hvd.Sum, postscale_factor=0.5)
    close(outs[1], block, 1e-9)
    with pytest.raises(ValueError):
        hvd.reducescatter(tf.constant(1.0))


def check_indexed_slices(hvd, rank, size):
    """An IndexedSlices allreduce allgathers values and indices (Average divides by size); Min/Max
    and scale factors raise NotImplementedError."""
    tf = _tf()
    slices = tf.IndexedSlices(tf.fill([1, 3], float(rank + 1)), tf.constant([rank]), tf.constant([4, 3]))
    got = hvd.allreduce(slices)
    assert isinstance(got, tf.IndexedSlices)
    close(got.indices, np.arange(size, dtype=np.int32))
    close(got.values, np.stack([np.full(3, (r + 1) / size, np.float32) for r in range(size)]), 1e-6)
    dense = tf.convert_to_tensor(hvd.allreduce(slices, op=hvd.Sum))
    assert dense.shape == (4, 3)
    for bad in (dict(op=hvd.Min), dict(op=hvd.Max), dict(op=hvd.Sum, prescale_factor=0.5)):
        with pytest.raises(NotImplementedError):
            hvd.allreduce(slices, **bad)


def check_gradients_eager_and_graph(hvd, rank, size):
    """Gradients follow Horovod: allreduce -> allreduce of the gradient, allgather -> this rank's rows
    of the averaged gradient, broadcast -> averaged on the root and zero elsewhere, alltoall -> sent
    back along the received splits, reducescatter(Sum) -> allgather times size; eager and in a graph."""
    tf = _tf()
    v = tf.Variable(tf.range(1.0, 4.0))

    def grads():
        with tf.GradientTape(persistent=True) as tape:
            y = v * (rank + 1)
            reduced = tf.reduce_sum(hvd.allreduce(y, op=hvd.Sum))
            gathered = tf.reduce_sum(hvd.allgather(y) ** 2)
            sent = tf.reduce_sum(hvd.broadcast(y, 0))
            moved = tf.reduce_sum(hvd.alltoall(tf.tile(y, [size]), splits=[3] * size)[0] * 2.0)
            scattered = tf.reduce_sum(hvd.reducescatter(tf.tile(y, [size]), op=hvd.Sum))
        return [tape.gradient(t, v) for t in (reduced, gathered, sent, moved, scattered)]

    base = np.arange(1.0, 4.0, dtype=np.float32)
    want = [np.full(3, size * (rank + 1), np.float32),
            (2 * base * (rank + 1) * (rank + 1)).astype(np.float32),
            np.full(3, 1.0 if rank == 0 else 0.0, np.float32) * (rank + 1),
            np.full(3, 2.0 * size * (rank + 1), np.float32),
            np.full(3, size * size * (rank + 1), np.float32)]
    for what, got in (("eager", grads()), ("graph", tf.function(grads)())):
        for name, g, w in zip(("allreduce", "allgather", "broadcast", "alltoall", "reducescatter"), got, want):
            close(g, w, 1e-5, f"{name} gradient {what}")


def check_graph_runs_many_times_and_orders_agree(hvd, rank, size):
    """A tf.function with several independent collectives, created in rank-dependent Python order
    inside one graph and run 20 times, gives the right result every time (names come from the
    graph, executions are numbered, and collectives run one after another)."""
    tf = _tf()

    @tf.function
    def step(x):
        outs = [hvd.allreduce(x * float(i + 1), op=hvd.Sum) for i in range(4)]
        outs.append(hvd.allgather(x[:1]))
        return outs

    x = tf.fill([3], float(rank))
    total = float(sum(range(size)))
    for _ in range(20):
        outs = step(x)
        for i in range(4):
            close(outs[i], np.full(3, total * (i + 1), np.float32))
        close(outs[4], np.arange(size, dtype=np.float32))


def check_mismatch_errors(hvd, rank, size):
    """Ranks passing different shapes or dtypes get tf.errors.FailedPreconditionError (also a
    spark-hvd RankMismatchError), eagerly, inside tf.function and in a TF1 graph run by a Session,
    naming what differs; the runtime keeps working afterwards."""
    if size == 1:
        return
    tf = _tf()
    from spark_hvd.runtime.errors import RankMismatchError

    with pytest.raises(tf.errors.FailedPreconditionError) as info:
        hvd.allreduce(tf.ones([17 + rank]))
    assert isinstance(info.value, RankMismatchError)
    with pytest.raises(tf.errors.FailedPreconditionError):
        hvd.allreduce(tf.ones([3], dtype=tf.int32 if rank % 2 == 0 else tf.float32))
    with pytest.raises(tf.errors.FailedPreconditionError):
        hvd.broadcast(tf.ones([2]), rank)

    graph_allreduce = tf.function(lambda x: hvd.allreduce(x, name="mismatched") * 2.0)
    with pytest.raises(tf.errors.FailedPreconditionError, match="shape") as info:
        graph_allreduce(tf.ones([17 + rank]))
    assert "mismatched" in str(info.value)
    with pytest.raises(tf.errors.FailedPreconditionError):
        tf.function(lambda x: hvd.allgather(x))(tf.ones([2], dtype=tf.int32 if rank % 2 == 0 else tf.float32))
    close(graph_allreduce(tf.ones([3])), np.full(3, 2.0, np.float32), what="a graph after its error")
    with tf.Graph().as_default():
        reduced = hvd.allreduce(tf.ones([5 + rank]))
        with tf.compat.v1.Session() as session, pytest.raises(tf.errors.FailedPreconditionError):
            session.run(reduced)
    close(hvd.allreduce(tf.ones([2]), op=hvd.Sum), np.full(2, size, np.float32), what="after the errors")


def check_unreducible_dtype_named(hvd, rank, size):
    """Reducing a dtype without a reduction (uint32) raises InvalidArgumentError naming the dtype;
    XLA-compiled functions are refused with a message naming jit_compile=False."""
    tf = _tf()
    with pytest.raises(tf.errors.InvalidArgumentError, match="uint32"):
        hvd.allreduce(tf.ones([2], tf.uint32))
    with pytest.raises(Exception, match="jit_compile=False"):
        tf.function(lambda x: hvd.allreduce(x), jit_compile=True)(tf.ones([2]))


def check_join_and_objects(hvd, rank, size):
    """join returns the same last-joined rank everywhere; broadcast_object and allgather_object move
    Python objects; barrier returns; broadcast_global_variables names its TF2 replacement."""
    tf = _tf()
    last = hvd.join()
    assert last.dtype == tf.int32 and hvd.allgather_object(int(last)) == [int(last)] * size
    assert hvd.broadcast_object({"a": rank}, root_rank=size - 1) == {"a": size - 1}
    assert hvd.allgather_object(rank) == list(range(size))
    hvd.barrier()
    with pytest.raises(RuntimeError, match="broadcast_variables"):
        hvd.broadcast_global_variables(0)


def check_broadcast_gradient_in_a_v1_graph(hvd, rank, size):
    """In a TensorFlow 1 style graph, running only the gradient of a broadcast runs the
    allreduce of the output gradient on every rank (the non-root ranks' zeros depend on it), so
    the root rank gets its averaged gradient instead of waiting for the others forever."""
    tf = _tf()
    for dtype in (tf.float32, tf.float64):
        graph = tf.Graph()
        with graph.as_default():
            x = tf.cast(tf.ones([5]) * rank, dtype)
            grad = tf.gradients(hvd.broadcast(x, size - 1), x, tf.ones([5], dtype) * (rank + 1))[0]
            with tf.compat.v1.Session(graph=graph) as session:
                got = session.run(grad)
        want = np.full(5, (size + 1) / 2.0 if rank == size - 1 else 0.0)
        close(got, want.astype(dtype.as_numpy_dtype), 1e-6, f"{dtype.name} broadcast gradient in a v1 graph")


def check_broadcast_global_variables_in_a_v1_graph(hvd, rank, size):
    """broadcast_global_variables(root) in a TensorFlow 1 style graph returns the op that gives every
    rank the root's global variables; eagerly it raises, naming broadcast_variables."""
    tf = _tf()
    graph = tf.Graph()
    with graph.as_default():
        a = tf.compat.v1.get_variable("a", initializer=tf.fill([3], float(rank)))
        b = tf.compat.v1.get_variable("b", initializer=tf.constant(rank, tf.int64))
        sync = hvd.broadcast_global_variables(size - 1)
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(sync)
            got_a, got_b = session.run([a, b])
    close(got_a, np.full(3, float(size - 1), np.float32), what="float variable after the broadcast")
    assert int(got_b) == size - 1, got_b
    with pytest.raises(RuntimeError, match="broadcast_variables"):
        hvd.broadcast_global_variables(0)


def check_util_helpers(hvd, rank, size):
    """hvd.util, as Horovod users import it: vars_to_refs / refs_to_vars round-trip nested lists of
    variables through hashable references; _executing_eagerly is True eagerly, False in tf.function."""
    tf = _tf()
    a, b = tf.Variable(1.0), tf.Variable([2.0, 3.0])
    refs = hvd.util.vars_to_refs([a, [b]])
    assert len({refs[0], refs[1][0]}) == 2
    back = hvd.util.refs_to_vars(refs)
    assert back[0] is a and back[1][0] is b
    assert hvd.util._executing_eagerly()
    assert not bool(tf.function(lambda: tf.constant(hvd.util._executing_eagerly()))())


CHECKS = [
    check_topology,
    check_util_helpers,
    check_allreduce_every_dtype_and_op_eager_and_graph,
    check_allreduce_scaling_average_flag_compression,
    check_scalars_variables_and_grouped,
    check_allgather_uneven_every_dtype,
    check_broadcast_and_inplace,
    check_alltoall,
    check_reducescatter,
    check_indexed_slices,
    check_gradients_eager_and_graph,
    check_broadcast_gradient_in_a_v1_graph,
    check_broadcast_global_variables_in_a_v1_graph,
    check_graph_runs_many_times_and_orders_agree,
    check_mismatch_errors,
    check_unreducible_dtype_named,
    check_join_and_objects,
]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_collective(world, check):
    """Each check passes on every rank of the world (see the check's docstring)."""
    assert_passed(world, check)
