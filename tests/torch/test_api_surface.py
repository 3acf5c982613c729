"""In-process checks of spark_hvd.torch that need no second rank: Horovod's names and signatures,
zero-copy staging, compression, the digits loader and module hygiene."""

import importlib
import inspect
import pkgutil
import warnings

import numpy as np
import pytest
import torch

import spark_hvd.torch as hvd
from spark_hvd.torch import tensor_bridge

# Horovod 0.28's public signatures (parameter names in order, with defaults where they matter).
HOROVOD_SIGNATURES = {
    "allreduce": "tensor, average=None, name=None, compression=<none>, op=None, prescale_factor=1.0, "
                 "postscale_factor=1.0, process_set=<global>",
    "allreduce_async": "tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, "
                       "process_set=<global>",
    "allreduce_": "tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, "
                  "process_set=<global>",
    "allreduce_async_": "tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, "
                        "process_set=<global>",
    "grouped_allreduce": "tensors, average=None, name=None, compression=<none>, op=None, prescale_factor=1.0, "
                         "postscale_factor=1.0, process_set=<global>",
    "grouped_allreduce_async_": "tensors, average=None, name=None, op=None, prescale_factor=1.0, "
                                "postscale_factor=1.0, process_set=<global>",
    "allgather": "tensor, name=None, process_set=<global>",
    "allgather_async": "tensor, name=None, process_set=<global>",
    "grouped_allgather": "tensors, name=None, process_set=<global>",
    "broadcast": "tensor, root_rank, name=None, process_set=<global>",
    "broadcast_async_": "tensor, root_rank, name=None, process_set=<global>",
    "alltoall": "tensor, splits=None, name=None, process_set=<global>",
    "alltoall_async": "tensor, splits=None, name=None, process_set=<global>",
    "reducescatter": "tensor, name=None, compression=<none>, op=Average, process_set=<global>, "
                     "prescale_factor=1.0, postscale_factor=1.0",
    "grouped_reducescatter_async": "tensors, name=None, op=Average, process_set=<global>, prescale_factor=1.0, "
                                   "postscale_factor=1.0",
    "join": "device=-1",
    "barrier": "process_set=<global>",
    "broadcast_object": "obj, root_rank=0, name=None, process_set=<global>",
    "allgather_object": "obj, name=None, process_set=<global>",
    "broadcast_parameters": "params, root_rank, prefix=Parameter., process_set=<global>",
    "broadcast_optimizer_state": "optimizer, root_rank, model=None, process_set=<global>",
    "DistributedOptimizer": "optimizer, named_parameters=None, compression=<none>, backward_passes_per_step=1, "
                            "op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None, "
                            "sparse_as_dense=False, process_set=<global>",
}


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
    """The public function takes Horovod 0.28's parameters in Horovod's order with its defaults."""
    assert _render(getattr(hvd, name)) == HOROVOD_SIGNATURES[name]


def test_every_horovod_name_is_exported():
    """Every name a Horovod PyTorch script commonly uses exists on spark_hvd.torch and in __all__."""
    names = """init shutdown is_initialized rank size local_rank local_size cross_rank cross_size is_homogeneous
    mpi_built mpi_enabled gloo_built gloo_enabled nccl_built cuda_built rocm_built ddl_built ccl_built
    mpi_threads_supported start_timeline stop_timeline Average Sum Min Max Product Adasum Compression
    ProcessSet global_process_set add_process_set remove_process_set HorovodInternalError
    allreduce allreduce_async allreduce_ allreduce_async_ grouped_allreduce grouped_allreduce_async
    grouped_allreduce_ grouped_allreduce_async_ sparse_allreduce_async allgather allgather_async
    grouped_allgather grouped_allgather_async broadcast broadcast_async broadcast_ broadcast_async_ alltoall
    alltoall_async reducescatter reducescatter_async grouped_reducescatter grouped_reducescatter_async barrier
    join poll synchronize broadcast_object allgather_object broadcast_parameters broadcast_optimizer_state
    DistributedOptimizer SyncBatchNorm""".split()
    missing = [n for n in names if not hasattr(hvd, n) or n not in hvd.__all__]
    assert not missing


def test_generated_variants_are_documented():
    """Every generated grid variant carries its Horovod name, a docstring stating the postcondition
    and an argument list naming each parameter."""
    for name in ("allreduce_async", "allreduce_", "grouped_allreduce_async_", "broadcast_async_", "alltoall",
                 "reducescatter"):
        func = getattr(hvd, name)
        assert func.__name__ == name
        doc = func.__doc__
        for param in inspect.signature(func).parameters:
            assert f"    {param}:" in doc, (name, param)


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
