"""The coordinator's decisions: readiness, order, fusion, groups, mismatches, cache, join, stalls."""

from spark_hvd.runtime.messages import Meta, Response
from spark_hvd.runtime.negotiation import Coordinator, WorkerSignatures


def meta(kind="allreduce", dtype="float32", shape=(4,), **kw):
    return Meta(kind=kind, dtype=dtype, shape=shape, **kw)


def coordinator(size=2, capacity=16, threshold=1 << 20):
    return Coordinator(size, capacity, threshold, stall_check_seconds=0.0, stall_shutdown_seconds=0.0)


def announce(c, worker, rank, name, m):
    """What the engine does with a worker's announcement: by id once the worker holds one."""
    sig = worker.encode(m)
    if isinstance(sig, int):
        c.submit_id(rank, name, sig)
    else:
        c.submit(rank, name, sig)


def test_ready_only_when_every_rank_submitted_and_order_is_readiness_order():
    """A request is answered once all ranks submitted it; answers follow the order of readiness."""
    c = coordinator(threshold=0)
    c.submit(0, "a", meta())
    c.submit(0, "b", meta())
    assert not c.has_work()
    c.submit(1, "b", meta())
    c.submit(1, "a", meta())
    batch, _ = c.decide()
    assert [r.names for r in batch.responses] == [("b",), ("a",)]


def test_fusion_packs_same_dtype_up_to_threshold():
    """Ready allreduces of one dtype share a response until the threshold; other dtypes do not."""
    c = coordinator(threshold=40)
    for name, m in [("a", meta()), ("b", meta()), ("c", meta(shape=(8,))), ("d", meta(dtype="float64"))]:
        c.submit(0, name, m)
        c.submit(1, name, m)
    batch, _ = c.decide()
    assert [r.names for r in batch.responses] == [("a", "b"), ("c",), ("d",)]


def test_group_waits_for_all_members_and_is_answered_atomically():
    """Grouped requests are answered together once every member is ready everywhere."""
    c = coordinator(threshold=0)
    group = ("g", 2)
    c.submit(0, "g.0", meta(group=group))
    c.submit(1, "g.0", meta(group=group))
    assert c.decide()[0].responses == ()
    c.submit(0, "g.1", meta(group=group))
    c.submit(1, "g.1", meta(group=group))
    batch, _ = c.decide()
    assert [r.names for r in batch.responses] == [("g.0", "g.1")]


def test_mismatch_lists_every_rank():
    """Different shapes produce an error response naming each rank's value."""
    c = coordinator(size=3)
    for r, shape in enumerate([(2,), (2,), (3,)]):
        c.submit(r, "w", meta(shape=shape))
    (response,), _ = c.decide()[0].responses, None
    assert response.kind == "error"
    assert "rank 0: (2,); rank 1: (2,); rank 2: (3,)" in response.error


def test_cache_lets_workers_announce_ids_and_evicts_least_recent():
    """Workers learn ids from responses and reuse them; beyond capacity old ids are evicted."""
    c = coordinator(capacity=2)
    worker = WorkerSignatures()
    for step in range(2):
        for name in ("x", "y", "z"):
            c.submit(0, name, meta())
            announce(c, worker, 1, name, meta())
        batch, _ = c.decide()
        worker.learn(batch)
        c.sigs.ack(1, batch.seq)
        assert len(batch.responses) == 1
    # One signature shared by all three names: one id, known to the worker after the first step.
    assert worker.encode(meta()) == 0
    for i in range(4):
        c.submit(0, f"n{i}", meta(shape=(i + 10,)))
        announce(c, worker, 1, f"n{i}", meta(shape=(i + 10,)))
        batch, _ = c.decide()
        worker.learn(batch)
        c.sigs.ack(1, batch.seq)
    assert len(c.sigs) <= 2 + 1  # capacity, plus ids still referenced by the last response
    assert 0 not in worker.metas  # the oldest id was evicted and the worker forgot it


def test_cache_off_never_teaches_ids():
    """With capacity 0 workers always send full metadata and the table does not grow."""
    c = coordinator(capacity=0)
    worker = WorkerSignatures()
    for step in range(5):
        c.submit(0, f"t{step}", meta())
        c.submit(1, f"t{step}", meta())
        batch, _ = c.decide()
        resolver = worker.learn(batch)
        assert batch.teach == () and set(resolver) == {batch.responses[0].sids[0]}
        assert isinstance(worker.encode(meta()), Meta)
    c.decide()
    assert len(c.sigs) == 0


def test_an_evicted_id_announced_before_the_eviction_stays_resolvable():
    """A worker may announce an id it has not yet learned is evicted; the id must resolve until no
    pending request carries it, even after every worker has acknowledged the eviction."""
    c = Coordinator(3, 1, 1 << 20, stall_check_seconds=0.0, stall_shutdown_seconds=0.0)
    w1, w2 = WorkerSignatures(), WorkerSignatures()
    for r, w in ((1, w1), (2, w2)):
        announce(c, w, r, "a", meta())
    c.submit(0, "a", meta())
    batch, _ = c.decide()
    for r, w in ((1, w1), (2, w2)):
        w.learn(batch)
    old = w1.encode(meta())
    assert isinstance(old, int)
    stale = (w1.seq, old)  # worker 1 announces "b" by the old id; the message is still on its way
    # Meanwhile another signature pushes the old id out of the one-entry cache.
    c.submit(0, "c", meta(shape=(9,)))
    c.submit_id(1, "c", c.sigs.intern(meta(shape=(9,))))
    c.submit(2, "c", meta(shape=(9,)))
    batch, _ = c.decide()
    assert old in batch.evicted
    w2.learn(batch)
    c.sigs.ack(2, batch.seq)
    # The stale announcement arrives, then worker 1 catches up and acknowledges the eviction too.
    c.sigs.ack(1, stale[0])
    c.submit_id(1, "b", stale[1])
    w1.learn(batch)
    c.sigs.ack(1, batch.seq)
    c.submit(0, "b", meta())
    announce(c, w2, 2, "b", meta())
    batch, metas = c.decide()
    (response,) = batch.responses
    assert response.kind == "allreduce" and response.names == ("b",)
    for w in (w1, w2):
        resolver = w.learn(batch)
        assert all(resolver[sid] == meta() for sid in response.sids)
    assert all(metas[sid] == meta() for sid in response.sids)
    c.decide()
    assert len(c.sigs) <= 2  # the retired id is gone once nothing can use it


def test_joined_rank_counts_as_submitted_and_join_answers_last_rank():
    """After rank 1 joins, rank 0's requests proceed; when all joined the last joiner is reported."""
    c = coordinator()
    c.submit(1, "join.1", meta(kind="join", dtype="", shape=()))
    c.submit(0, "a", meta())
    batch, _ = c.decide()
    assert [r.kind for r in batch.responses] == ["allreduce"]
    c.submit(0, "join.0", meta(kind="join", dtype="", shape=()))
    batch, _ = c.decide()
    assert batch.responses == (Response(kind="join", names=(), ps=0, value=0),)


def test_collectives_other_than_allreduce_fail_while_a_rank_has_joined():
    """An allgather (or broadcast, alltoall, reducescatter) that needs a joined rank is an error."""
    c = coordinator(size=3)
    c.submit(2, "join.2", meta(kind="join", dtype="", shape=()))
    for kind in ("allgather", "broadcast", "alltoall", "reducescatter"):
        extra = {"root": 0} if kind == "broadcast" else {"splits": (1, 1, 2)} if kind == "alltoall" else {}
        for r in (0, 1):
            c.submit(r, kind, meta(kind=kind, **extra))
    c.submit(0, "ok", meta())
    c.submit(1, "ok", meta())
    batch, _ = c.decide()
    errors = {r.names[0]: r.error for r in batch.responses if r.kind == "error"}
    assert set(errors) == {"allgather", "broadcast", "alltoall", "reducescatter"}
    assert all("rank(s) [2] have joined" in e for e in errors.values())
    assert [r.names for r in batch.responses if r.kind == "allreduce"] == [("ok",)]


def test_stall_report_names_missing_ranks():
    """A request older than the stall time is reported with who submitted and who is missing."""
    c = Coordinator(3, 16, 0, stall_check_seconds=5.0, stall_shutdown_seconds=0.0)
    c.submit(0, "slow", meta())
    c.submit(2, "slow", meta())
    lines, shutdown = c.stalled(c.pending[(0, "slow")].first_seen + 6.0)
    assert lines and "submitted by rank(s) [0, 2], missing rank(s) [1]" in lines[0] and not shutdown
