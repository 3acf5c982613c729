"""In-process checks of spark_hvd.torch that need no second rank: Horovod's names and signatures,
zero-copy staging, compression, the digits loader and module hygiene."""

import importlib
import inspect
import pkgutil
import typing
import warnings

import numpy as np
import pytest
import torch

import spark_hvd.torch as hvd
from spark_hvd.torch import tensor_bridge

_REDUCE = "average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=<global>"
_REDUCE_COMPRESSED = ("average=None, name=None, compression=<none>, op=None, prescale_factor=1.0, "
                      "postscale_factor=1.0, process_set=<global>")
_SCATTER = "name=None, op=Average, process_set=<global>, prescale_factor=1.0, postscale_factor=1.0"
_SCATTER_COMPRESSED = ("name=None, compression=<none>, op=Average, process_set=<global>, prescale_factor=1.0, "
                       "postscale_factor=1.0")

# Horovod 0.28.1's signatures (horovod/torch/mpi_ops.py, functions.py, optimizer.py): parameter
# names in order, with their defaults.
HOROVOD_SIGNATURES = {
    "allreduce": "tensor, " + _REDUCE_COMPRESSED,
    "allreduce_async": "tensor, " + _REDUCE,
    "allreduce_": "tensor, " + _REDUCE,
    "allreduce_async_": "tensor, " + _REDUCE,
    "grouped_allreduce": "tensors, " + _REDUCE_COMPRESSED,
    "grouped_allreduce_async": "tensors, " + _REDUCE,
    "grouped_allreduce_": "tensors, " + _REDUCE,
    "grouped_allreduce_async_": "tensors, " + _REDUCE,
    "sparse_allreduce_async": "tensor, name, op, process_set=<global>",
    "allgather": "tensor, name=None, process_set=<global>",
    "allgather_async": "tensor, name=None, process_set=<global>",
    "grouped_allgather": "tensors, name=None, process_set=<global>",
    "grouped_allgather_async": "tensors, name=None, process_set=<global>",
    "broadcast": "tensor, root_rank, name=None, process_set=<global>",
    "broadcast_async": "tensor, root_rank, name=None, process_set=<global>",
    "broadcast_": "tensor, root_rank, name=None, process_set=<global>",
    "broadcast_async_": "tensor, root_rank, name=None, process_set=<global>",
    "alltoall": "tensor, splits=None, name=None, process_set=<global>",
    "alltoall_async": "tensor, splits=None, name=None, process_set=<global>",
    "reducescatter": "tensor, " + _SCATTER_COMPRESSED,
    "reducescatter_async": "tensor, " + _SCATTER,
    "grouped_reducescatter": "tensors, " + _SCATTER_COMPRESSED,
    "grouped_reducescatter_async": "tensors, " + _SCATTER,
    "poll": "handle",
    "synchronize": "handle",
    "join": "device=-1",
    "barrier": "process_set=<global>",
    "broadcast_object": "obj, root_rank=0, name=None, process_set=<global>",
    "allgather_object": "obj, name=None",
    "broadcast_parameters": "params, root_rank",
    "broadcast_optimizer_state": "optimizer, root_rank, model=None",
    "DistributedOptimizer": "optimizer, named_parameters=None, compression=<none>, backward_passes_per_step=1, "
                            "op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None, "
                            "sparse_as_dense=False, process_set=<global>",
}

# Parameters spark-hvd adds after Horovod's, so every Horovod call still binds the same way.
EXTENSIONS = {
    "allgather_object": "process_set=<global>",
    "broadcast_parameters": "prefix=Parameter., process_set=<global>",
    "broadcast_optimizer_state": "process_set=<global>",
    "DistributedOptimizer": "bucket_cap_mb=None",
}

# The collective grid: each must be a plain, documented def over the one enqueue path.
COLLECTIVES = """allreduce allreduce_async allreduce_ allreduce_async_ grouped_allreduce grouped_allreduce_async
grouped_allreduce_ grouped_allreduce_async_ sparse_allreduce_async allgather allgather_async grouped_allgather
grouped_allgather_async broadcast broadcast_async broadcast_ broadcast_async_ alltoall alltoall_async reducescatter
reducescatter_async grouped_reducescatter grouped_reducescatter_async""".split()


def _render(func):
    parts = []
    for p in inspect.signature(func).parameters.values():
        if p.default is inspect.Parameter.empty:
            parts.append(p.name)
            continue
        default = p.default
        if default is hvd.global_process_set:
            text = "<global>"
        elif default is hvd.Compression.none:
            text = "<none>"
        elif isinstance(default, hvd.ReduceOp):
            text = default.name
        else:
            text = str(default)
        parts.append(f"{p.name}={text}")
    return ", ".join(parts)


@pytest.mark.parametrize("name", sorted(HOROVOD_SIGNATURES))
def test_signature_matches_horovod(name):
    """The public function takes Horovod 0.28.1's parameters in Horovod's order with its defaults,
    followed only by the extensions listed in EXTENSIONS."""
    want = HOROVOD_SIGNATURES[name] + (", " + EXTENSIONS[name] if name in EXTENSIONS else "")
    assert _render(getattr(hvd, name)) == want


@pytest.mark.parametrize("name", COLLECTIVES)
def test_collectives_are_written_out(name):
    """Each collective is a plain def of its own name in a spark_hvd.torch module (so grep and IDEs
    find it), with no signature attached after the fact, and with type hints that resolve."""
    func = getattr(hvd, name)
    assert inspect.isfunction(func)
    assert func.__code__.co_name == name and func.__qualname__ == name
    assert "__signature__" not in vars(func) and not hasattr(func, "__wrapped__")
    module = importlib.import_module(func.__module__)
    assert func.__module__.startswith("spark_hvd.torch.") and getattr(module, name) is func
    assert f"\ndef {name}(" in inspect.getsource(module)
    hints = typing.get_type_hints(func)
    assert "return" in hints and set(inspect.signature(func).parameters) <= set(hints)


@pytest.mark.parametrize("name", COLLECTIVES)
def test_collectives_document_postcondition_and_arguments(name):
    """Each collective's docstring states what holds afterwards and lists every parameter."""
    doc = inspect.getdoc(getattr(hvd, name))
    assert doc and "fterwards" in doc, name
    arguments = doc.split("Arguments:", 1)[1]
    for param in inspect.signature(getattr(hvd, name)).parameters:
        assert f"\n    {param}:" in arguments, (name, param)


def test_every_horovod_name_is_exported():
    """Every name a Horovod PyTorch script commonly uses exists on spark_hvd.torch and in __all__."""
    names = """init shutdown is_initialized rank size local_rank local_size cross_rank cross_size is_homogeneous
    mpi_built mpi_enabled gloo_built gloo_enabled nccl_built cuda_built rocm_built ddl_built ccl_built
    mpi_threads_supported start_timeline stop_timeline Average Sum Min Max Product Adasum Compression
    ProcessSet global_process_set add_process_set remove_process_set HorovodInternalError
    SyncBatchNorm""".split() + list(HOROVOD_SIGNATURES)
    missing = [n for n in names if not hasattr(hvd, n) or n not in hvd.__all__]
    assert not missing


def test_a_handle_is_callable():
    """Calling a handle returns what synchronize() returns, as Horovod's sparse_allreduce_async
    callers expect; poll() and synchronize() still accept it."""
    hvd.init()
    try:
        handle = hvd.sparse_allreduce_async(torch.eye(3).to_sparse(), name="callable", op=hvd.Sum)
        result = handle()
        assert hvd.poll(handle) and hvd.synchronize(handle) is result
        assert result.is_sparse and torch.equal(result.to_dense(), torch.eye(3))
        dense = hvd.allreduce_async(torch.ones(2), op=hvd.Sum)
        assert torch.equal(dense(), torch.ones(2))
    finally:
        hvd.shutdown()


def test_public_modules_have_docstrings_and_all():
    """Every module of spark_hvd.torch has a one-line docstring and __all__."""
    for info in pkgutil.iter_modules(hvd.__path__):
        module = importlib.import_module(f"spark_hvd.torch.{info.name}")
        assert module.__doc__ and module.__doc__.strip(), info.name
        assert isinstance(getattr(module, "__all__", None), list), info.name


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.int8, torch.int16,
                                   torch.int32, torch.int64, torch.uint8, torch.bool, torch.bfloat16])
def test_cpu_tensors_are_staged_without_copies(dtype):
    """A contiguous CPU tensor reaches the runtime as a numpy view of its own memory; bfloat16 as
    its 16-bit storage marked dtype='bfloat16'."""
    t = torch.zeros(3, 5, dtype=dtype, requires_grad=dtype.is_floating_point)
    staged = tensor_bridge.stage(t, reduction=True)
    assert not staged.copied
    assert staged.array.ctypes.data == t.data_ptr()
    assert staged.array.shape == (3, 5)
    assert staged.wire == ("bfloat16" if dtype == torch.bfloat16 else None)


def test_non_contiguous_tensors_are_packed_and_written_back():
    """A transposed tensor is packed into a contiguous copy; write_back() puts results into it."""
    base = torch.arange(6.0).reshape(2, 3)
    view = base.t()
    staged = tensor_bridge.stage(view, reduction=True)
    assert staged.copied and staged.array.flags.c_contiguous
    staged.array[...] = 7.0
    assert staged.write_back() is view
    assert torch.equal(base, torch.full((2, 3), 7.0))


def test_results_wrap_runtime_arrays_without_copies():
    """from_array turns a runtime result into a tensor over the same memory, bfloat16 included."""
    array = np.arange(4, dtype=np.float32)
    tensor = tensor_bridge.from_array(array, torch.float32, torch.device("cpu"))
    assert tensor.data_ptr() == array.ctypes.data
    raw = torch.tensor([1.5, -2.0], dtype=torch.bfloat16).view(torch.uint16).numpy()
    back = tensor_bridge.from_array(raw, torch.bfloat16, torch.device("cpu"))
    assert back.dtype == torch.bfloat16 and back.tolist() == [1.5, -2.0]


def test_unreducible_dtype_and_sparse_layout_are_refused():
    """Reducing uint32 and staging a sparse tensor raise ValueErrors that name the problem and the fix."""
    with pytest.raises(ValueError, match="uint32"):
        tensor_bridge.stage(torch.zeros(2, dtype=torch.uint32), reduction=True)
    assert not tensor_bridge.stage(torch.zeros(2, dtype=torch.uint32), reduction=False).copied
    with pytest.raises(ValueError, match="to_dense"):
        tensor_bridge.stage(torch.zeros(2, 2).to_sparse(), reduction=True)


def test_device_staging_warns_once(monkeypatch):
    """Staging device tensors through host memory warns the first time only."""
    monkeypatch.setattr(tensor_bridge, "_staging_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tensor_bridge._warn_device_staging(torch.device("cuda", 0))
        tensor_bridge._warn_device_staging(torch.device("cuda", 0))
    assert len([w for w in caught if "host memory" in str(w.message)]) == 1


def test_fp16_compression_round_trip():
    """fp16 compression sends floating tensors as float16 and restores their dtype; integers pass through."""
    t = torch.tensor([1.0, 2.5], dtype=torch.float64)
    sent, ctx = hvd.Compression.fp16.compress(t)
    assert sent.dtype == torch.float16
    assert hvd.Compression.fp16.decompress(sent, ctx).dtype == torch.float64
    ints = torch.tensor([1, 2])
    sent, ctx = hvd.Compression.fp16.compress(ints)
    assert sent is ints and hvd.Compression.fp16.decompress(sent, ctx) is ints
    assert hvd.Compression.none.compress(t)[0] is t


def test_init_refuses_a_sub_world():
    """init(comm=[...]) naming a strict subset of the launched ranks explains what to do instead."""
    hvd.init()
    try:
        hvd.init(comm=[0])
        with pytest.raises(ValueError, match="process sets"):
            hvd.init(comm=[0, 1])
        with pytest.raises(ValueError, match="process_sets"):
            hvd.init(process_sets="static")
    finally:
        hvd.shutdown()


def test_digits_loader():
    """load_digits() returns the 1797 x 64 float32 pixel counts in 0..16 and int64 labels 0..9."""
    from spark_hvd.datasets import load_digits

    x, y = load_digits()
    assert x.shape == (1797, 64) and x.dtype == np.float32
    assert y.shape == (1797,) and y.dtype == np.int64
    assert x.min() == 0 and x.max() == 16 and set(np.unique(y)) == set(range(10))
    assert y[:10].tolist() == list(range(10))
