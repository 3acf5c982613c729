"""Readers: sharding, equal steps per rank, shuffling, shapes, prefetch threads, both kinds."""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from typing import Dict, List

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_hvd.spark.data.reader import make_reader, scan_parquet, steps_for

KINDS = ["builtin", pytest.param("petastorm", marks=pytest.mark.petastorm)]


def write_dataset(root, files: int, groups_per_file: int, rows_per_group: int, width: int = 3) -> int:
    """Parquet files like Spark's: ids 0..n-1, x = [id, 2 id, 3 id, ...] (width), w = id / 10."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "_SUCCESS").write_bytes(b"")
    next_id = 0
    for f in range(files):
        n = groups_per_file * rows_per_group
        ids = np.arange(next_id, next_id + n, dtype=np.int64)
        x = [list(i * np.arange(1, width + 1, dtype=np.float64)) for i in ids]
        table = pa.table({"id": ids, "x": pa.array(x, type=pa.list_(pa.float64())), "w": ids / 10.0})
        pq.write_table(table, str(root / f"part-{f:05d}.snappy.parquet"), row_group_size=rows_per_group)
        next_id += n
    return next_id


def read_epoch(root, kind: str, size: int, epoch: int = 0, **kwargs) -> List[List[Dict[str, np.ndarray]]]:
    """Every rank's batches of one epoch."""
    out = []
    for rank in range(size):
        options = dict(batch_size=5, feature_cols=["x"], label_cols=["id"], seed=7)
        options.update(kwargs)
        with make_reader(kind, str(root), rank=rank, size=size, **options) as reader:
            out.append(list(reader.iter_epoch(epoch)))
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", [1, 2, 3])
def test_every_row_once_per_epoch_when_sizes_divide(tmp_path, kind, size):
    """With 12 row groups of 5 rows and batch 5, ranks 1..3 together read each id exactly once."""
    total = write_dataset(tmp_path / "d", files=4, groups_per_file=3, rows_per_group=5)
    for epoch in (0, 1):
        per_rank = read_epoch(tmp_path / "d", kind, size, epoch=epoch, shuffle=True)
        assert {len(batches) for batches in per_rank} == {total // (size * 5)}
        ids = np.concatenate([b["id"] for batches in per_rank for b in batches])
        assert sorted(ids.tolist()) == list(range(total))


@pytest.mark.parametrize("kind", KINDS)
def test_equal_steps_when_shards_are_uneven(tmp_path, kind):
    """7 row groups over 2 ranks: both run ceil(35 / (2*4)) = 5 full steps; the smaller shard wraps."""
    total = write_dataset(tmp_path / "d", files=7, groups_per_file=1, rows_per_group=5)
    per_rank = read_epoch(tmp_path / "d", kind, 2, batch_size=4)
    assert [len(b) for b in per_rank] == [steps_for(total, 2, 4)] * 2 == [5, 5]
    for batches in per_rank:
        assert all(b["id"].shape == (4,) and b["x"].shape == (4, 3) for b in batches)
        ids = np.concatenate([b["id"] for b in batches])
        assert set(ids.tolist()) <= set(range(total))
    wrapped = Counter(np.concatenate([b["id"] for b in per_rank[1]]).tolist())
    assert max(wrapped.values()) == 2  # 15 rows stretched over 20 slots: some rows twice


def test_fewer_row_groups_than_ranks_still_gives_every_rank_steps(tmp_path):
    """One row group, three ranks: each rank borrows it and runs the common number of steps."""
    write_dataset(tmp_path / "d", files=1, groups_per_file=1, rows_per_group=4)
    per_rank = read_epoch(tmp_path / "d", "builtin", 3, batch_size=2)
    assert [len(b) for b in per_rank] == [1, 1, 1]


@pytest.mark.parametrize("kind", KINDS)
def test_shuffle_differs_by_epoch_and_repeats_by_seed(tmp_path, kind):
    """Shuffled order changes between epochs, is identical for the same seed and epoch, and
    differs for another seed; without shuffle the order is the file order."""
    write_dataset(tmp_path / "d", files=4, groups_per_file=3, rows_per_group=5)

    def order(epoch: int, seed: int, shuffle: bool = True) -> List[int]:
        (batches,) = read_epoch(tmp_path / "d", kind, 1, epoch=epoch, seed=seed, shuffle=shuffle,
                                shuffle_buffer_rows=20)
        return np.concatenate([b["id"] for b in batches]).tolist()

    first = order(0, seed=1)
    assert order(0, seed=1) == first
    assert order(1, seed=1) != first
    assert order(0, seed=2) != first
    assert sorted(first) == list(range(60))
    assert order(0, seed=1, shuffle=False) == list(range(60))


@pytest.mark.parametrize("kind", KINDS)
def test_shapes_values_and_sample_weights(tmp_path, kind):
    """Columns come back with the requested per-row shape, matching values, and the weight column."""
    write_dataset(tmp_path / "d", files=2, groups_per_file=2, rows_per_group=6, width=4)
    (batches,) = read_epoch(tmp_path / "d", kind, 1, batch_size=8, shapes={"x": (2, 2)},
                            sample_weight_col="w", shuffle=True)
    assert len(batches) == 3
    for b in batches:
        assert set(b) == {"x", "id", "w"}
        assert b["x"].shape == (8, 2, 2) and b["x"].dtype == np.float64
        assert b["w"].shape == (8,)
        expected = b["id"][:, None] * np.arange(1, 5, dtype=np.float64)
        np.testing.assert_array_equal(b["x"].reshape(8, 4), expected)
        np.testing.assert_allclose(b["w"], b["id"] / 10.0)


def test_steps_per_epoch_override_and_layout(tmp_path):
    """An explicit steps_per_epoch is honoured; scan_parquet skips _SUCCESS and counts row groups."""
    write_dataset(tmp_path / "d", files=2, groups_per_file=3, rows_per_group=4)
    layout = scan_parquet(str(tmp_path / "d"))
    assert len(layout.files) == 2 and len(layout.row_groups) == 6 and layout.num_rows == 24
    assert layout.column_names == ("id", "x", "w")
    (batches,) = read_epoch(tmp_path / "d", "builtin", 1, batch_size=4, steps_per_epoch=9)
    assert len(batches) == 9


def _reader_threads() -> List[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("spark-hvd-reader")]


def test_abandoned_epoch_stops_its_prefetch_thread(tmp_path):
    """Leaving an epoch after one batch stops and joins the background reader thread."""
    write_dataset(tmp_path / "d", files=2, groups_per_file=5, rows_per_group=10)
    reader = make_reader("builtin", str(tmp_path / "d"), rank=0, size=1, batch_size=2, feature_cols=["x"],
                         prefetch_batches=2, block_rows=2, read_ahead=True)  # a block a batch: 50, 2 queued ahead
    epoch = reader.iter_epoch(0)
    next(epoch)
    assert len(_reader_threads()) == 1  # the producer is blocked on the full queue
    epoch.close()
    assert _reader_threads() == []
    reader.close()


def test_read_errors_reach_the_consumer(tmp_path):
    """A file that breaks mid-read raises in the training loop instead of hanging it."""
    write_dataset(tmp_path / "d", files=2, groups_per_file=1, rows_per_group=10)
    reader = make_reader("builtin", str(tmp_path / "d"), rank=0, size=1, batch_size=5, feature_cols=["x"],
                         shuffle=False)
    (tmp_path / "d" / "part-00001.snappy.parquet").write_bytes(b"not parquet")
    with pytest.raises(Exception, match="(?i)parquet"):
        list(reader.iter_epoch(0))
    assert _reader_threads() == []


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(kind="fast"), "reader kind='fast' is not known"),
    (dict(rank=2, size=2), "rank=2 is not valid for size=2"),
    (dict(batch_size=0), "batch_size=0 is not valid"),
    (dict(feature_cols=["nope"]), r"columns \['nope'\] are not in the Parquet.*available columns: id, x, w"),
])
def test_invalid_arguments(tmp_path, kwargs, fragment):
    """Bad arguments raise ValueError naming the value and what is expected."""
    write_dataset(tmp_path / "d", files=1, groups_per_file=1, rows_per_group=4)
    args = dict(kind="builtin", rank=0, size=1, batch_size=2, feature_cols=["x"])
    args.update(kwargs)
    kind = args.pop("kind")
    with pytest.raises(ValueError, match=fragment):
        make_reader(kind, str(tmp_path / "d"), **args)


def test_missing_data_path_names_prepare_data(tmp_path):
    """Reading a path that does not exist points at prepare_data."""
    with pytest.raises(ValueError, match="prepare_data"):
        make_reader("builtin", str(tmp_path / "absent"), rank=0, size=1, batch_size=2, feature_cols=["x"])


def test_petastorm_missing_says_how_to_install(tmp_path, monkeypatch):
    """Without petastorm, kind='petastorm' raises ImportError with the pip line and version limits."""
    write_dataset(tmp_path / "d", files=1, groups_per_file=1, rows_per_group=4)
    monkeypatch.setitem(sys.modules, "petastorm", None)
    with pytest.raises(ImportError, match=r'pip install "spark-hvd\[petastorm\]".*pyarrow<15.*numpy<2'):
        make_reader("petastorm", str(tmp_path / "d"), rank=0, size=1, batch_size=2, feature_cols=["x"])


def test_batches_within_a_chunk_are_views_and_straddling_ones_join_chunks():
    """The batcher copies no row twice: a batch inside one chunk views it, one across chunks
    gathers exactly its rows, and the order of rows is kept."""
    from spark_hvd.spark.data.reader import Batcher

    batcher = Batcher(4)
    chunks = [{"x": np.arange(a, b, dtype=np.float64)} for a, b in ((0, 6), (6, 9), (9, 16), (16, 20))]
    batches = [batch for chunk in chunks for batch in batcher.push(chunk)]
    assert [list(b["x"]) for b in batches] == [list(range(i, i + 4)) for i in range(0, 20, 4)]
    assert np.shares_memory(batches[0]["x"], chunks[0]["x"])  # rows 0-3: inside the first chunk
    assert not np.shares_memory(batches[1]["x"], chunks[0]["x"])  # rows 4-7: across two chunks
    assert np.shares_memory(batches[3]["x"], chunks[2]["x"])  # rows 12-15: inside the third chunk
    assert batcher.count == 0 and not batcher.pending


@pytest.mark.parametrize("shuffle", [True, False])
def test_handing_batches_over_in_blocks_changes_no_batch(tmp_path, shuffle):
    """One batch a block or many: the same batches in the same order, epoch after epoch."""
    write_dataset(tmp_path / "d", files=2, groups_per_file=3, rows_per_group=17)
    got = {}
    for block_rows in (1, 40, 10_000):
        reader = make_reader("builtin", str(tmp_path / "d"), rank=0, size=1, batch_size=4, feature_cols=["x"],
                             label_cols=["id"], shuffle=shuffle, seed=3, shuffle_buffer_rows=20,
                             block_rows=block_rows)
        got[block_rows] = [[b["id"].tolist() for b in reader.iter_epoch(e)] for e in (0, 1)]
        reader.close()
    assert got[1] == got[40] == got[10_000]
    assert len(got[1][0]) == steps_for(102, 1, 4)


def test_a_chunk_with_an_order_leaves_in_that_order_gathered_into_batches_of_their_own():
    """A shuffled chunk's rows leave in its order, each batch gathered into new, writable arrays
    (nothing to copy again on the way to a tensor); a batch across two chunks joins both orders."""
    from spark_hvd.spark.data.reader import Batcher

    batcher = Batcher(4)
    first = {"x": np.arange(0, 10, dtype=np.float64)}
    second = {"x": np.arange(10, 16, dtype=np.float64)}
    order_a = np.array([9, 3, 5, 1, 0, 2, 8])  # rows 4, 6 and 7 are kept back: not in the order
    order_b = np.array([5, 4, 3, 2, 1])
    batches = list(batcher.push(first, order_a)) + list(batcher.push(second, order_b))
    assert [b["x"].tolist() for b in batches] == [[9, 3, 5, 1], [0, 2, 8, 15], [14, 13, 12, 11]]
    for batch in batches:
        assert batch["x"].flags.writeable and batch["x"].flags.c_contiguous
        assert not np.shares_memory(batch["x"], first["x"]) and not np.shares_memory(batch["x"], second["x"])
    assert batcher.count == 0 and not batcher.pending


def _epoch_threads(epoch: int) -> List[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"spark-hvd-reader-rank0-epoch{epoch}" and t.is_alive()]


@pytest.mark.parametrize("kind", KINDS)
def test_prefetch_reads_an_epoch_ahead_and_changes_no_batch(tmp_path, kind):
    """prefetch(e) starts reading epoch e before iter_epoch(e) asks; the batches are those of a
    reader that did not prefetch; prefetching another epoch, or closing, stops that reading."""
    write_dataset(tmp_path / "d", files=2, groups_per_file=3, rows_per_group=17)
    options = dict(rank=0, size=1, batch_size=4, feature_cols=["x"], label_cols=["id"], shuffle=True, seed=3,
                   shuffle_buffer_rows=20, block_rows=4, prefetch_batches=2, read_ahead=True)
    with make_reader(kind, str(tmp_path / "d"), **options) as plain:
        expected = [[b["id"].tolist() for b in plain.iter_epoch(e)] for e in (0, 1)]
    with make_reader(kind, str(tmp_path / "d"), **options) as reader:
        reader.prefetch(1)
        assert _epoch_threads(1), "prefetch(1) started no reading thread"
        reader.prefetch(0)  # another epoch: the first reading stops
        deadline = time.monotonic() + 30
        while _epoch_threads(1) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _epoch_threads(1)
        got0 = [b["id"].tolist() for b in reader.iter_epoch(0)]
        reader.prefetch(1)
        got1 = [b["id"].tolist() for b in reader.iter_epoch(1)]
        assert [got0, got1] == expected
        deadline = time.monotonic() + 30
        while _epoch_threads(1) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _epoch_threads(1), "iter_epoch(1) read with a thread of its own, not the prefetching one"
        reader.prefetch(0)
    deadline = time.monotonic() + 30
    while _epoch_threads(0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _epoch_threads(0), "close() left the prefetching thread running"


def test_a_large_row_group_is_decoded_in_pieces_and_read_whole(tmp_path, monkeypatch):
    """One row group of 1,000 rows of ~32 bytes, pieces of about 2 KiB: the source hands it on in
    pieces of about 64 rows (never the whole group at once), every row once, in stored order; with
    cache_all the second epoch yields the same pieces from memory."""
    from spark_hvd.spark.data import reader as reader_module

    write_dataset(tmp_path / "d", files=1, groups_per_file=1, rows_per_group=1000)
    layout = scan_parquet(str(tmp_path / "d"))
    (group,) = layout.row_groups
    assert group.num_rows == 1000 and group.byte_size > 0
    monkeypatch.setattr(reader_module, "_PIECE_BYTES", 2048)
    rows = reader_module._piece_rows(group)
    assert 16 <= rows <= 256, rows
    for cache_all in (False, True):
        source, shard_rows = reader_module._builtin_source(
            layout, 0, 1, ["id", "x"], {}, shuffle=False, seed=0, storage_options=None,
            url=str(tmp_path / "d"), cache_all=cache_all)
        assert shard_rows == 1000
        for epoch in (0, 1):
            if cache_all and epoch == 1:  # from memory: the files are gone
                _remove_data_files(tmp_path / "d")
            pieces = list(source(epoch, 0))
            assert len(pieces) == -(-1000 // rows) and max(len(p["id"]) for p in pieces) == rows
            if cache_all and epoch == 1:  # the same pieces, as views of the cache's one array
                assert all(p["id"].base is pieces[0]["id"].base is not None for p in pieces)
            ids = np.concatenate([p["id"] for p in pieces])
            assert ids.tolist() == list(range(1000))
            assert np.array_equal(np.concatenate([p["x"] for p in pieces])[:, 1], 2.0 * ids)


def test_a_shuffle_buffer_of_zero_rows_shuffles_row_groups_only(tmp_path):
    """shuffle_buffer_rows=0: the row groups come in a shuffled order, each one's rows as stored."""
    write_dataset(tmp_path / "d", files=2, groups_per_file=4, rows_per_group=10)
    (batches,) = read_epoch(tmp_path / "d", "builtin", 1, batch_size=10, shuffle=True, shuffle_buffer_rows=0)
    groups = [b["id"].tolist() for b in batches]
    assert all(g == list(range(g[0], g[0] + 10)) and g[0] % 10 == 0 for g in groups)
    assert sorted(g[0] for g in groups) == list(range(0, 80, 10))
    assert [g[0] for g in groups] != list(range(0, 80, 10))


def _remove_data_files(root) -> None:
    for path in root.glob("*.parquet"):
        path.unlink()


@pytest.mark.parametrize("size, reshuffle", [(1, True), (2, True), (2, False)])
def test_cached_epochs_read_no_file_and_give_every_row_once(tmp_path, size, reshuffle):
    """With cache_all, once every row group a rank reads is in memory, epochs draw from the cache: every
    row once per epoch across the ranks, each row's values intact, in a new order each epoch; ranks that
    deal row groups anew (reshuffle) read the groups new to them from the files until they have all."""
    n = write_dataset(tmp_path / "d", files=2, groups_per_file=3, rows_per_group=8)
    readers = [make_reader("builtin", str(tmp_path / "d"), rank=r, size=size, batch_size=4, feature_cols=["x"],
                           label_cols=["id"], seed=3, cache_all=True, reshuffle=reshuffle) for r in range(size)]
    try:
        orders = []
        for epoch in range(6 if reshuffle and size > 1 else 2):
            ids = []
            for reader in readers:
                for batch in reader.iter_epoch(epoch):
                    np.testing.assert_array_equal(batch["x"], batch["id"][:, None] * np.arange(1.0, 4.0))
                    ids.extend(batch["id"].tolist())
            assert sorted(ids) == list(range(n)), epoch
            orders.append(ids)
        _remove_data_files(tmp_path / "d")
        epoch_after = len(orders)
        ids = [int(i) for reader in readers for batch in reader.iter_epoch(epoch_after) for i in batch["id"]]
        assert sorted(ids) == list(range(n))
        assert ids != orders[-1] and orders[0] != orders[1]
    finally:
        for reader in readers:
            reader.close()


def test_cached_epochs_without_a_shuffle_window_keep_each_group_as_stored(tmp_path):
    """shuffle_buffer_rows=0 from the cache as from the files: row groups in a new order, each one's rows as
    stored."""
    write_dataset(tmp_path / "d", files=2, groups_per_file=2, rows_per_group=10)
    with make_reader("builtin", str(tmp_path / "d"), rank=0, size=1, batch_size=10, feature_cols=["id"], seed=2,
                     cache_all=True, shuffle_buffer_rows=0) as reader:
        list(reader.iter_epoch(0))
        _remove_data_files(tmp_path / "d")
        groups = [b["id"].tolist() for b in reader.iter_epoch(1)]
    assert all(g == list(range(g[0], g[0] + 10)) for g in groups)
    assert sorted(g[0] for g in groups) == [0, 10, 20, 30]


@pytest.mark.parametrize("available, cached", [(1 << 40, True), (1000, False), (None, False)])
def test_cache_auto_caches_what_fits_the_memory_share(tmp_path, monkeypatch, available, cached):
    """cache_all='auto' caches when the row groups a rank may read fit a quarter of the available memory
    (here: plenty, too little, unknown), which shows as a second epoch that does or does not need the files."""
    from spark_hvd.spark.data import batching

    monkeypatch.setattr(batching, "_available_memory", lambda: available)
    write_dataset(tmp_path / "d", files=1, groups_per_file=2, rows_per_group=50)
    layout = scan_parquet(str(tmp_path / "d"))
    assert batching.cache_fits(layout, [0, 1], available, 1) is cached
    both = sum(g.byte_size for g in layout.row_groups)
    assert batching.cache_fits(layout, [0, 1], 4 * both, 1)
    assert not batching.cache_fits(layout, [0, 1], 4 * both, 2)
    assert batching.cache_fits(layout, [0], 4 * both, 2)
    with make_reader("builtin", str(tmp_path / "d"), rank=0, size=1, batch_size=10, feature_cols=["id"],
                     cache_all="auto") as reader:
        list(reader.iter_epoch(0))
        _remove_data_files(tmp_path / "d")
        if cached:
            assert sorted(int(i) for b in reader.iter_epoch(1) for i in b["id"]) == list(range(100))
        else:
            with pytest.raises(FileNotFoundError):
                list(reader.iter_epoch(1))


def test_the_shard_cache_copies_each_row_once_and_keeps_only_whole_row_groups():
    """Pieces are copied into arrays allocated once; a row group read only in part is dropped (its place
    reused), one cached already is not kept twice, and a cached group comes back as views of the pieces it
    was read in."""
    from spark_hvd.spark.data.batching import ShardCache

    cache = ShardCache(30)
    assert cache.begin(3)
    for start in (0, 6):
        ids = np.arange(start, start + 6)
        cache.add({"id": ids, "x": np.stack([ids, -ids], axis=1)})
    cache.commit(12)
    arrays = cache.rows["x"]
    assert 3 in cache and cache.ranges[3] == (0, 12) and arrays.shape == (30, 2)
    assert cache.begin(5)
    cache.add({"id": np.arange(100, 104), "x": np.zeros((4, 2), dtype=np.int64)})
    cache.commit(10)  # 4 of its 10 rows: dropped
    assert 5 not in cache and cache.filled == 12
    assert not cache.begin(3)
    assert cache.begin(7)
    cache.add({"id": np.arange(50, 55), "x": np.ones((5, 2), dtype=np.int64)})
    cache.commit(5)
    assert cache.ranges[7] == (12, 17) and cache.rows["x"] is arrays
    replayed = list(cache.pieces(3))
    assert [len(p["id"]) for p in replayed] == [6, 6]
    assert np.concatenate([p["id"] for p in replayed]).tolist() == list(range(12))
    np.testing.assert_array_equal(replayed[1]["x"], np.stack([np.arange(6, 12), -np.arange(6, 12)], axis=1))
    assert [p["id"].tolist() for p in cache.pieces(7)] == [[50, 51, 52, 53, 54]]


def test_the_window_keeps_cached_rows_as_positions_and_gives_the_batches_of_copies():
    """Pieces of the shard cache enter the shuffle window as their positions in the cache's arrays (no row
    is copied until a batch gathers it); the batches are those of the same rows handed over as copies, with
    the same seed, also when a piece that is not the cache's follows."""
    from spark_hvd.spark.data.batching import Batcher, Positions, ShardCache, ShuffleWindow

    cache = ShardCache(40)
    cache.begin(0)
    pieces = [cache.add({"id": np.arange(a, a + 8), "x": np.arange(a, a + 8, dtype=np.float32).reshape(-1, 1) * 2})
              for a in range(0, 40, 8)]
    cache.commit(40)
    extra = {"id": np.arange(100, 107), "x": np.arange(100, 107, dtype=np.float32).reshape(-1, 1) * 2}

    def batches(chunks, copied):
        window, batcher, out = ShuffleWindow(12, np.random.default_rng(5)), Batcher(6), []
        for i, chunk in enumerate(chunks):
            out += batcher.push(*window.add({k: np.array(v) for k, v in chunk.items()} if copied else chunk))
            if not copied and not any(c is extra for c in chunks[:i + 1]):
                assert isinstance(window.rows, Positions) and window.rows.base is cache.rows
        out += batcher.push(*window.drain())
        return [(b["id"].tolist(), b["x"][:, 0].tolist()) for b in out]

    for chunks in (pieces, pieces[:3] + [extra] + pieces[3:]):
        expected = batches(chunks, copied=True)
        assert batches(chunks, copied=False) == expected
        ids = [i for b, _ in expected for i in b]
        rows = sum(len(c["id"]) for c in chunks)
        assert len(set(ids)) == len(ids) == rows - rows % 6  # each row once; a part batch stays behind
        assert all(x == [2.0 * i for i in b] for b, x in expected)


def test_batches_gathered_together_are_the_batches_gathered_one_by_one():
    """The batcher gathers several whole batches of a chunk in one call per column and cuts them as views:
    the same batches, in the same order, as gathering each batch alone, for shuffled copies, cached
    positions and chunks kept in their order, with batches straddling chunks."""
    from spark_hvd.spark.data.batching import Batcher, ShardCache, ShuffleWindow

    cache = ShardCache(200)
    cache.begin(0)
    pieces = [cache.add({"id": np.arange(a, a + 50), "x": np.arange(a, a + 50, dtype=np.float32).reshape(-1, 1)})
              for a in range(0, 200, 50)]
    cache.commit(200)
    copies = [{k: np.array(v) for k, v in p.items()} for p in pieces]

    def batches(chunks, capacity, gather_rows):
        rng = np.random.default_rng(3)
        window, batcher, out = ShuffleWindow(capacity, rng), Batcher(7, gather_rows=gather_rows), []
        for chunk in chunks:
            out += batcher.push(*window.add(chunk))
        out += batcher.push(*window.drain())
        return [(b["id"].tolist(), b["x"][:, 0].tolist()) for b in out]

    for chunks in (pieces, copies):
        for capacity in (0, 30):
            one_by_one = batches(chunks, capacity, gather_rows=1)
            assert len(one_by_one) == 200 // 7
            assert batches(chunks, capacity, gather_rows=8192) == one_by_one
            assert batches(chunks, capacity, gather_rows=21) == one_by_one


def test_the_window_draws_every_order_of_its_rows_alike():
    """Rows leave the shuffle window as a uniform shuffle would have them: over many seeds, each row of two
    pieces (a window of 4 rows) is about as often first out, and every row leaves exactly once."""
    from spark_hvd.spark.data.batching import ShuffleWindow

    first = np.zeros(8, dtype=np.int64)
    for seed in range(4000):
        window, out = ShuffleWindow(4, np.random.default_rng(seed)), []
        for a in (0, 4):
            rows, order = window.add({"id": np.arange(a, a + 4)})
            if rows is not None:
                out += rows["id"][order].tolist()
        rows, order = window.drain()
        out += rows["id"][order].tolist()
        assert sorted(out) == list(range(8))
        first[out[0]] += 1
    # The first row out is drawn from all 8 once the second piece arrives: 500 each, give or take ~4 sigma.
    assert first.min() > 410 and first.max() < 590, first.tolist()


def test_a_cold_cache_gives_the_batches_of_a_warm_one(tmp_path):
    """With cache_all, an epoch's batches do not depend on what was cached before: a fresh reader (a resumed
    fit's new process) starting at epoch 2 yields what a reader that read epochs 0 and 1 yields, on each of
    two ranks dealing row groups anew every epoch, and what a reader without the cache yields."""
    write_dataset(tmp_path / "d", files=2, groups_per_file=3, rows_per_group=8)
    options = dict(size=2, batch_size=4, feature_cols=["x"], label_cols=["id"], seed=9, cache_all=True)
    for rank in range(2):
        with make_reader("builtin", str(tmp_path / "d"), rank=rank, **options) as warm:
            for epoch in (0, 1):
                list(warm.iter_epoch(epoch))
            expected = [b["id"].tolist() for b in warm.iter_epoch(2)]
        with make_reader("builtin", str(tmp_path / "d"), rank=rank, **options) as cold:
            assert [b["id"].tolist() for b in cold.iter_epoch(2)] == expected
        with make_reader("builtin", str(tmp_path / "d"), rank=rank, **{**options, "cache_all": False}) as plain:
            assert [b["id"].tolist() for b in plain.iter_epoch(2)] == expected


def test_an_epoch_from_memory_is_cut_without_a_reading_thread(tmp_path):
    """Once every row of an epoch is in the shard cache, its batches are cut on the consumer's thread
    (no reading thread, no hand-off), and they are the batches a reader without the cache yields; an
    epoch that still reads files reads on a thread of its own."""
    write_dataset(tmp_path / "d", files=2, groups_per_file=2, rows_per_group=10)
    options = dict(rank=0, size=1, batch_size=4, feature_cols=["x"], label_cols=["id"], seed=3, read_ahead=True)

    def epoch(reader, e):
        batches, threads = [], []
        for b in reader.iter_epoch(e):
            batches.append(b["id"].tolist())
            threads.append(len(reader._readings))
        return batches, set(threads)

    with make_reader("builtin", str(tmp_path / "d"), cache_all=True, **options) as cached, \
            make_reader("builtin", str(tmp_path / "d"), cache_all=False, **options) as plain:
        first, threads = epoch(cached, 0)
        assert threads == {1} and first == epoch(plain, 0)[0]
        for e in (1, 2):
            batches, threads = epoch(cached, e)
            assert threads == {0}
            assert batches == epoch(plain, e)[0] and batches != first
        assert epoch(plain, 1)[1] == {1}


def test_reading_on_the_callers_thread_gives_the_batches_of_reading_ahead(tmp_path):
    """read_ahead=False reads and cuts every batch on the caller's thread (no reading thread, prefetch does
    nothing): the batches of a reader that reads ahead, epoch after epoch, with and without the cache, on
    each of two ranks, also when an epoch wraps around a short shard."""
    write_dataset(tmp_path / "d", files=2, groups_per_file=3, rows_per_group=7)
    for cache_all in (False, True):
        for rank in range(2):
            options = dict(rank=rank, size=2, batch_size=4, feature_cols=["x"], label_cols=["id"], seed=5,
                           cache_all=cache_all, steps_per_epoch=7)
            with make_reader("builtin", str(tmp_path / "d"), read_ahead=True, **options) as ahead, \
                    make_reader("builtin", str(tmp_path / "d"), read_ahead=False, **options) as inline:
                assert ahead.read_ahead and not inline.read_ahead
                for e in range(3):
                    inline.prefetch(e)
                    assert inline._readings == []
                    got = []
                    for b in inline.iter_epoch(e):
                        got.append(b["id"].tolist())
                        assert inline._readings == []
                    assert got == [b["id"].tolist() for b in ahead.iter_epoch(e)]
                    assert len(got) == 7


def test_read_ahead_auto_reads_on_the_ranks_thread_only_where_no_cpu_is_left(tmp_path):
    """read_ahead='auto' reads ahead unless the files are local and the host's ranks have a CPU each or
    fewer; files of another file system (an object store's latency) are always read ahead."""
    from spark_hvd.spark.data.reader import reads_ahead

    local = str(tmp_path)
    assert reads_ahead(local, ranks=1, cpus=2)
    assert not reads_ahead(local, ranks=2, cpus=2)
    assert not reads_ahead(local, ranks=4, cpus=2)
    assert reads_ahead("memory://bucket/data", ranks=2, cpus=2)
    assert reads_ahead(local, cpus=10**6)  # one rank (no world) and CPUs to spare
    write_dataset(tmp_path / "d", files=1, groups_per_file=2, rows_per_group=8)
    with pytest.raises(ValueError, match=r"read_ahead='sometimes' is not valid: expected True"):
        make_reader("builtin", str(tmp_path / "d"), rank=0, size=1, batch_size=4, feature_cols=["x"],
                    read_ahead="sometimes")


def test_local_and_object_store_files_give_the_same_batches(tmp_path):
    """Local files are read page by page, files of other file systems with pyarrow's pre-buffering:
    the same rows either way (an fsspec in-memory file system stands in for an object store)."""
    import fsspec

    from spark_hvd.spark.data.reader import _is_local

    write_dataset(tmp_path / "d", files=2, groups_per_file=2, rows_per_group=7)
    memory = fsspec.filesystem("memory")
    assert _is_local(fsspec.filesystem("file")) and not _is_local(memory)
    for path in sorted((tmp_path / "d").iterdir()):
        memory.pipe(f"/reader-test/d/{path.name}", path.read_bytes())
    try:
        for cache_all in (False, True):
            local = read_epoch(tmp_path / "d", "builtin", 2, shuffle=True, cache_all=cache_all)
            remote = read_epoch("memory://reader-test/d", "builtin", 2, shuffle=True, cache_all=cache_all)
            assert [[b["id"].tolist() for b in rank] for rank in local] == \
                [[b["id"].tolist() for b in rank] for rank in remote]
            assert {int(i) for rank in local for b in rank for i in b["id"]} == set(range(28))
    finally:
        memory.rm("/reader-test", recursive=True)
