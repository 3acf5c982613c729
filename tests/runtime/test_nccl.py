"""NCCL up to the communicator: finding and loading the library, errors, and, with a stand-in for
NCCL and for device tensors (tests/runtime/fake_nccl.py), the whole device data plane in real
worlds of 1-3 ranks: id exchange, communicators per process set, every collective, lifecycle."""

import ctypes.util
import os
import sys

import numpy as np
import pytest

from harness import SIZES, assert_passed, launch
from spark_hvd.runtime.nccl import NcclLibrary, NcclUnavailable, library_candidates, load_nccl, nccl_dtype, nccl_op
from spark_hvd.runtime.ops import ReduceOp


def test_candidates_come_explicit_first_then_the_wheel(tmp_path, monkeypatch):
    """An explicit path is tried first, then libnccl.so* of the nvidia-nccl-cu12 wheel's folder."""
    lib = tmp_path / "nvidia" / "nccl" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnccl.so.2").write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = library_candidates("/opt/explicit/libnccl.so.2")
    assert found[0] == "/opt/explicit/libnccl.so.2"
    assert str(lib / "libnccl.so.2") in found[1:]


def test_a_library_that_is_not_nccl_is_refused():
    """Loading a shared library without ncclGetVersion (the C library) says it is not NCCL."""
    libc = ctypes.util.find_library("c")
    with pytest.raises(NcclUnavailable, match="is not NCCL"):
        NcclLibrary(libc)


def test_no_library_says_how_to_install_one(tmp_path):
    """When nothing loads, the error lists what was tried and the pip line that fixes it."""
    missing = str(tmp_path / "libnccl.so.2")
    with pytest.raises(NcclUnavailable) as info:
        load_nccl([missing])
    assert missing in str(info.value) and 'pip install "spark-hvd[nccl]"' in str(info.value)


def test_types_and_reductions_map_to_nccl_or_say_why_not():
    """NCCL's numbering for dtypes and ops; int16 and Adasum have none, and say so."""
    assert nccl_dtype("float32") == 7 and nccl_dtype("bfloat16") == 9 and nccl_op(ReduceOp.Max) == 2
    with pytest.raises(ValueError, match="'int16'"):
        nccl_dtype("int16")
    with pytest.raises(NotImplementedError, match="Adasum"):
        nccl_op(ReduceOp.Adasum)


def test_cpu_torch_reports_why_nccl_cannot_be_used():
    """On this CPU build of torch, nccl_built() is False and nccl_problem() says why."""
    import spark_hvd.torch as hvd

    assert hvd.nccl_built() is False and hvd.cuda_built() is False
    assert "CUDA" in hvd.nccl_problem() or "NCCL" in hvd.nccl_problem()


# -- the device data plane in launched worlds, with the stand-ins ---------------------------------
def _install_fakes(rt):
    """Register the numpy "device" and point the runtime at the fake NCCL, whose folder the test
    module made (communicators get folders of their own in it, named by their unique ids)."""
    import fake_nccl

    from spark_hvd.runtime import device

    root = os.environ["FAKE_NCCL_DIR"]
    lib = fake_nccl.FakeNccl(root)
    device.register_device_ops("cuda", fake_nccl.NumpyDeviceOps())
    device._nccl, device._nccl_problem = lib, None
    return lib, root


def check_device_collectives(rt, rank, size):
    """Every collective on "device" tensors gives what the host path gives: allreduce single and
    fused, with pre/postscale and Average; broadcast; allgather with uneven rows; alltoall with
    uneven splits; reducescatter with uneven blocks; and all through one communicator."""
    lib, root = _install_fakes(rt)
    x = np.arange(7, dtype=np.float32) + rank
    out = np.empty_like(x)
    got = rt.device_async("allreduce", [x], [out], wire="float32", op=rt.Sum, name="d.single").wait()
    assert got is out and out.tolist() == (np.arange(7) * size + sum(range(size))).tolist()
    parts = [np.full(3, rank + i, np.float64) for i in range(4)]
    outs = [np.empty_like(p) for p in parts]
    fused = [rt.device_async("allreduce", [p], [o], wire="float64", op=rt.Average, name=f"d.fused.{i}",
                             prescale_factor=2.0, postscale_factor=0.5) for i, (p, o) in enumerate(zip(parts, outs))]
    for i, handle in enumerate(fused):
        assert handle.wait().tolist() == [sum(r + i for r in range(size)) / size] * 3
    b = np.full(5, float(rank), np.float32)
    rt.device_async("broadcast", [b], [b], wire="float32", root_rank=size - 1, name="d.bcast").wait()
    assert b.tolist() == [float(size - 1)] * 5
    g = rt.device_async("allgather", [np.full((rank + 1, 2), rank, np.int64)], [None], wire="int64",
                        name="d.gather").wait()
    assert g.tolist() == [[r, r] for r in range(size) for _ in range(r + 1)]
    splits = [(rank + j) % 3 for j in range(size)]
    send = np.concatenate([np.full(n, 100 * rank + j, np.int32) for j, n in enumerate(splits)])
    received, got_splits = rt.device_async("alltoall", [send], [None], wire="int32", splits=splits,
                                           name="d.a2a").wait()
    assert got_splits.tolist() == [(r + rank) % 3 for r in range(size)]
    assert received.tolist() == [100 * r + rank for r in range(size) for _ in range((r + rank) % 3)]
    rows = 2 * size + 1
    mine = rt.device_async("reducescatter", [np.ones((rows, 2), np.float32) * (rank + 1)], [None], wire="float32",
                           op=rt.Sum, name="d.rs").wait()
    counts = [rows // size + (1 if i < rows % size else 0) for i in range(size)]
    assert mine.shape == (counts[rank], 2) and float(mine.max()) == sum(range(1, size + 1))
    inits = [entry for entry in lib.log if entry[0] == "init"]
    assert len(inits) == 1 and inits[0][2:] == (size, rank)
    everyone = rt.allgather_object(inits[0][1])
    assert len(set(everyone)) == 1, everyone  # one unique id, sent from rank 0


def check_communicators_follow_process_sets_and_worlds(rt, rank, size):
    """A process set gets a communicator of its own on first use (members only); shutdown destroys
    every communicator and the next world makes new ones."""
    rt.shutdown()  # a fresh world: no communicator from the checks before
    rt.init()
    lib, root = _install_fakes(rt)
    evens = rt.add_process_set([r for r in range(size) if r % 2 == 0]) if size > 1 else None
    x = np.ones(4, np.float32)
    rt.device_async("allreduce", [x], [x], wire="float32", op=rt.Sum, name="d.world").wait()
    assert x.tolist() == [float(size)] * 4
    if evens is not None and evens.included():
        y = np.ones(4, np.float32)
        rt.device_async("allreduce", [y], [y], wire="float32", op=rt.Sum, name="d.evens", process_set=evens).wait()
        assert y.tolist() == [float(evens.size())] * 4
    made = [entry for entry in lib.log if entry[0] == "init"]
    assert len(made) == (2 if evens is not None and evens.included() else 1), made
    rt.shutdown()
    assert len([entry for entry in lib.log if entry[0] == "destroy"]) == len(made)
    rt.init()
    lib, root = _install_fakes(rt)
    z = np.ones(2, np.float32)
    rt.device_async("allreduce", [z], [z], wire="float32", op=rt.Sum, name="d.again").wait()
    assert z.tolist() == [float(size)] * 2 and len(lib.log) == 1


def check_mixing_host_and_device_tensors_is_a_mismatch(rt, rank, size):
    """A rank passing a host array where the others pass device tensors fails on every rank with
    the devices named, instead of hanging."""
    if size == 1:
        return
    _install_fakes(rt)
    x = np.ones(3, np.float32)
    try:
        if rank == 0:
            rt.allreduce(x, name="d.mixed")
        else:
            rt.device_async("allreduce", [x], [x], wire="float32", name="d.mixed").wait()
    except rt.RankMismatchError as exc:
        assert "devices" in str(exc), exc
    else:
        raise AssertionError("a host/device mix was not refused")


ALL = [check_device_collectives, check_communicators_follow_process_sets_and_worlds,
       check_mixing_host_and_device_tensors_is_a_mismatch]


@pytest.fixture(scope="module", params=SIZES, ids=lambda n: f"np{n}")
def world(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"fake-nccl-np{request.param}")
    return launch(ALL, np=request.param, env={"PYTHONPATH": os.pathsep.join(sys.path), "FAKE_NCCL_DIR": str(folder)})


@pytest.mark.parametrize("check", ALL, ids=lambda c: c.__name__)
def test_device_data_plane(world, check):
    """The device check (its docstring says what it asserts) passed on every rank."""
    assert_passed(world, check)
