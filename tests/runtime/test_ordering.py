"""Shared-memory counters published in order on every CPU: the plain path on x86-64, libatomic's
release/acquire elsewhere (forced here with SPARK_HVD_SHM_ORDERING=atomics), and sockets where
neither is safe."""

import mmap
import platform

import numpy as np
import pytest

from spark_hvd.runtime import ordering, shm
from spark_hvd.runtime.config import RuntimeConfig
from harness import assert_passed, launch


def test_atomic_counters_share_the_plain_views_memory_and_let_the_mapping_close():
    mm = mmap.mmap(-1, 4096)
    atomic = ordering.ordered_counters(mm, 16, "atomics")
    assert isinstance(atomic, ordering.AtomicCounters)
    plain = memoryview(mm)[:128].cast("q")
    atomic[0] = 7
    atomic[15] = -3
    assert (plain[0], plain[15], atomic[0], atomic[15]) == (7, -3, 7, -3)
    plain[8] = 2 ** 62
    assert atomic[8] == 2 ** 62
    with pytest.raises(IndexError):
        atomic[16]
    with pytest.raises(IndexError):
        atomic[-1] = 1
    plain.release()
    atomic.release()
    mm.close()  # the counters hold no export of the mapping


def test_the_choice_follows_the_cpu(monkeypatch):
    assert ordering.default_ordering() == ("plain" if platform.machine().lower() in ("x86_64", "amd64")
                                           else "atomics")
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert ordering.default_ordering() == "atomics"
    assert isinstance(ordering.ordered_counters(mmap.mmap(-1, 4096), 16), ordering.AtomicCounters)
    with pytest.raises(ValueError, match=r"SPARK_HVD_SHM_ORDERING=plain is not safe on aarch64.*auto or atomics"):
        ordering.ordered_counters(mmap.mmap(-1, 4096), 16, "plain")
    assert not ordering.ordering_available("plain")
    assert ordering.ordering_available("auto")  # libatomic is on this machine
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert isinstance(ordering.ordered_counters(mmap.mmap(-1, 4096), 16), memoryview)


def test_without_libatomic_another_cpu_has_no_shared_memory(monkeypatch):
    """No safe way to publish counters: shm_available() is False, so the ranks of a host use sockets;
    a ring asked for anyway is refused naming the package to install."""
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(ordering, "_library", None)
    monkeypatch.setattr(ordering, "_library_error", "libatomic.so.1: cannot open shared object file")
    assert not ordering.ordering_available()
    assert not shm.shm_available()
    with pytest.raises(OSError, match=r"libatomic.so.1 could not be loaded .*install libatomic1.*SPARK_HVD_SHM=0"):
        shm.ShmRing.create(4, 4096, b"t" * 32)


def test_the_setting_is_checked():
    assert RuntimeConfig(shm_ordering="atomics").shm_ordering == "atomics"
    with pytest.raises(ValueError, match=r"expected one of auto, plain, atomics, got 'relaxed'"):
        RuntimeConfig.from_env({"SPARK_HVD_SHM_ORDERING": "relaxed"})


def rings_and_mailboxes_carry_every_byte(hvd, rank, size):
    """Collectives over the shared-memory rings (allreduce, allgather, broadcast of sizes that fill
    many slots) and a thousand one-host fast-path steps, each result exact; the mailboxes' counters
    are libatomic's."""
    from spark_hvd.runtime import api

    boxes = api._state.session.lockstep.boxes
    assert len(boxes) == size and all(isinstance(box.counters, ordering.AtomicCounters) for box in boxes)
    for n in (1, 1000, 300_000):
        out = hvd.allreduce(np.full(n, rank + 1.0), op=hvd.Sum, name=f"sum.{n}")
        assert np.all(out == size * (size + 1) / 2), n
        gathered = hvd.allgather(np.arange(n, dtype=np.int64) + rank, name=f"gather.{n}")
        assert np.array_equal(gathered, np.concatenate([np.arange(n) + r for r in range(size)])), n
        sent = hvd.broadcast(np.arange(n, dtype=np.float32) * (rank == 1), root_rank=1, name=f"bcast.{n}")
        assert np.array_equal(sent, np.arange(n, dtype=np.float32)), n
    buf = np.empty(6209, np.float32)
    for step in range(1000):
        buf.fill(step + rank)
        assert hvd.allreduce_lockstep(buf, op=hvd.Sum, name="grads") is not None
        assert buf[0] == buf[-1] == size * step + size * (size - 1) / 2, step
    return True


@pytest.mark.parametrize("np_", [2, 3])
def test_collectives_over_shared_memory_with_atomics(np_):
    results = launch([rings_and_mailboxes_carry_every_byte], np=np_, settings={"shm_ordering": "atomics"})
    assert assert_passed(results, rings_and_mailboxes_carry_every_byte) == [True] * np_
