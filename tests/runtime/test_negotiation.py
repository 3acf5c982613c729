"""The coordinator's decisions: readiness, order, fusion, groups, mismatches, cache, join, stalls."""

from spark_hvd.runtime.negotiation import Coordinator, Meta, WorkerSignatures


def meta(kind="allreduce", dtype="float32", shape=(4,), **kw):
    return Meta(kind, dtype, shape, **kw)


def coordinator(size=2, capacity=16, threshold=1 << 20):
    return Coordinator(size, capacity, threshold, stall_check_seconds=0.0, stall_shutdown_seconds=0.0)


def test_ready_only_when_every_rank_submitted_and_order_is_readiness_order():
    """A request is answered once all ranks submitted it; answers follow the order of readiness."""
    c = coordinator(threshold=0)
    c.submit(0, "a", meta())
    c.submit(0, "b", meta())
    assert not c.has_work()
    c.submit(1, "b", meta())
    c.submit(1, "a", meta())
    responses, _, _, _ = c.decide()
    assert [r[1] for r in responses] == [("b",), ("a",)]


def test_fusion_packs_same_dtype_up_to_threshold():
    """Ready allreduces of one dtype share a response until the threshold; other dtypes do not."""
    c = coordinator(threshold=40)
    for name, m in [("a", meta()), ("b", meta()), ("c", meta(shape=(8,))), ("d", meta(dtype="float64"))]:
        c.submit(0, name, m)
        c.submit(1, name, m)
    responses, _, _, _ = c.decide()
    assert [r[1] for r in responses] == [("a", "b"), ("c",), ("d",)]


def test_group_waits_for_all_members_and_is_answered_atomically():
    """Grouped requests are answered together once every member is ready everywhere."""
    c = coordinator(threshold=0)
    group = ("g", 2)
    c.submit(0, "g.0", meta(group=group))
    c.submit(1, "g.0", meta(group=group))
    assert c.decide()[0] == []
    c.submit(0, "g.1", meta(group=group))
    c.submit(1, "g.1", meta(group=group))
    responses, _, _, _ = c.decide()
    assert [r[1] for r in responses] == [("g.0", "g.1")]


def test_mismatch_lists_every_rank():
    """Different shapes produce an error response naming each rank's value."""
    c = coordinator(size=3)
    for r, shape in enumerate([(2,), (2,), (3,)]):
        c.submit(r, "w", meta(shape=shape))
    (response,), _, _, _ = c.decide()
    assert response[0] == "error"
    assert "rank 0: (2,); rank 1: (2,); rank 2: (3,)" in response[3]


def test_cache_lets_workers_announce_ids_and_evicts_least_recent():
    """Workers learn ids from responses and reuse them; beyond capacity old ids are evicted."""
    c = coordinator(capacity=2)
    worker = WorkerSignatures()
    for step in range(2):
        for name in ("x", "y", "z"):
            item = worker.encode(name, meta())
            c.submit(0, name, meta())
            if isinstance(item[1], int):
                c.submit_id(1, name, item[1])
            else:
                c.submit(1, name, item[1])
        responses, defs, evicted, seq = c.decide()
        worker.learn(defs, evicted, seq, c.sigs.persist)
        c.sigs.ack(1, seq)
        assert len(responses) == 1
    # One signature shared by all three names: one id, known to the worker after the first step.
    assert worker.encode("x", meta()) == ("x", 0)
    for i in range(4):
        c.submit(0, f"n{i}", meta(shape=(i + 10,)))
        c.submit(1, f"n{i}", meta(shape=(i + 10,)))
        responses, defs, evicted, seq = c.decide()
        worker.learn(defs, evicted, seq, c.sigs.persist)
        c.sigs.ack(1, seq)
    assert len(c.sigs.by_id) <= 2 + 1  # capacity, plus ids still referenced by the last response
    assert 0 not in worker.metas  # the oldest id was evicted and the worker forgot it


def test_cache_off_never_teaches_ids():
    """With capacity 0 workers always send full metadata and the table does not grow."""
    c = coordinator(capacity=0)
    worker = WorkerSignatures()
    for step in range(5):
        c.submit(0, f"t{step}", meta())
        c.submit(1, f"t{step}", meta())
        responses, defs, evicted, seq = c.decide()
        worker.learn(defs, evicted, seq, c.sigs.persist)
        assert isinstance(worker.encode("t", meta())[1], Meta)
    c.decide()
    assert len(c.sigs.by_id) == 0


def test_joined_rank_counts_as_submitted_and_join_answers_last_rank():
    """After rank 1 joins, rank 0's requests proceed; when all joined the last joiner is reported."""
    c = coordinator()
    c.submit(1, "join.1", meta(kind="join", dtype="", shape=()))
    c.submit(0, "a", meta())
    responses, _, _, _ = c.decide()
    assert [r[0] for r in responses] == ["allreduce"]
    c.submit(0, "join.0", meta(kind="join", dtype="", shape=()))
    responses, _, _, _ = c.decide()
    assert responses == [("join", (), 0, 0)]


def test_stall_report_names_missing_ranks():
    """A request older than the stall time is reported with who submitted and who is missing."""
    c = Coordinator(3, 16, 0, stall_check_seconds=5.0, stall_shutdown_seconds=0.0)
    c.submit(0, "slow", meta())
    c.submit(2, "slow", meta())
    lines, shutdown = c.stalled(c.pending[(0, "slow")].first_seen + 6.0)
    assert lines and "submitted by rank(s) [0, 2], missing rank(s) [1]" in lines[0] and not shutdown
