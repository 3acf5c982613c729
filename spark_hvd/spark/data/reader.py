"""Readers that stream a rank's shard of prepared Parquet as shuffled numpy batches."""

from __future__ import annotations

import math
import os
import posixpath
import queue
import threading
import warnings
from typing import (Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union)

import numpy as np

from spark_hvd.spark.data.batching import (Batch, Batcher, Chunk, ShardCache, ShuffleWindow,
                                           cache_fits_here)
from spark_hvd.spark.data.layout import (ParquetLayout, RowGroup, open_filesystem, arrow_to_numpy, deal_row_groups,
                                         scan_parquet)

__all__ = [
    "READER_KINDS",
    "RowGroup",
    "ParquetLayout",
    "scan_parquet",
    "steps_for",
    "BatchReader",
    "make_reader",
    "reads_ahead",
    "deal_row_groups",
    "arrow_to_numpy",
    "Batcher",
]

READER_KINDS = ("builtin", "petastorm")
"""Values accepted for ``kind`` by :func:`make_reader`."""

_PETASTORM_INSTALL = (
    'pip install "spark-hvd[petastorm]"  (petastorm 0.12.1 needs pyarrow<15, numpy<2 and, for '
    "Spark's Arrow features, pyspark 4.0.x: see constraints/petastorm.txt)"
)


_PIECE_BYTES = 2 << 20
"""About how much of a row group's column data the builtin reader decodes at a time: a whole row
group (Spark writes them up to 128 MiB) decoded at once costs twice the CPU per row of pieces that
stay in the core's cache, and holds the whole group in memory while its batches leave."""
_PIECE_ROWS = 16_384
"""Rows per piece where the footer gives no size."""


_LOCAL_READ = {"pre_buffer": False, "buffer_size": 1 << 20}
"""How the builtin reader opens local files: page by page through a 1 MiB buffer. pyarrow's default
(``pre_buffer``) first reads each row group's column chunks whole, which saves round trips to object
stores (kept for them) but on a local disk only holds a row group's bytes in memory at once: a
rank's peak memory over one epoch of 2M rows of 30 floats (a fit, 4M rows, two ranks) was 768-817
MiB with it and 590-608 MiB without, at the same speed."""


def _is_local(fs: Any) -> bool:
    """Whether an fsspec file system is this machine's own files."""
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return bool({"file", "local"} & set(protocol))


def reads_ahead(url: str, storage_options: Optional[Mapping[str, Any]] = None, ranks: Optional[int] = None,
                cpus: Optional[int] = None) -> bool:
    """What ``read_ahead="auto"`` of :func:`make_reader` decides for files at ``url``: read ahead on
    a background thread, unless the files are this machine's own and the host's ``ranks`` (default:
    the initialized world's ranks on this host, else 1) have a CPU each or fewer of its ``cpus``
    (default: the CPUs this process may run on). Then no CPU is left for a reading thread: it
    would take its CPU from a rank's compute at moments of its own, and in a job that waits for its
    slowest rank at every step, reading on each rank's own thread (all ranks pausing at about the
    same step) costs less; local files leave no latency for a thread to hide."""
    if ranks is None:
        import spark_hvd.runtime as rt

        ranks = rt.local_size() if rt.is_initialized() else 1
    if cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
    if ranks < cpus:
        return True
    fs, _ = open_filesystem(url, storage_options)
    return not _is_local(fs)


def _piece_rows(group: RowGroup) -> int:
    """Rows the builtin reader decodes at a time from ``group``: about :data:`_PIECE_BYTES` of it."""
    if group.byte_size <= 0 or group.num_rows <= 0:
        return _PIECE_ROWS
    return max(1, min(group.num_rows, _PIECE_BYTES * group.num_rows // group.byte_size))


def steps_for(total_rows: int, size: int, batch_size: int) -> int:
    """Steps per epoch that every rank runs: enough batches that, across ``size`` ranks, the
    epoch covers ``total_rows`` (ranks whose shard is smaller wrap around it)."""
    return max(1, math.ceil(total_rows / (size * batch_size)))


def _from_petastorm(value: np.ndarray, shape: Optional[Tuple[int, ...]], row_dtype: Optional[str] = None
                    ) -> np.ndarray:
    if row_dtype is not None:  # raw rows arrive as an array of bytes objects
        dtype = np.dtype(row_dtype).newbyteorder("<")
        flat = np.frombuffer(b"".join(value), dtype=dtype) if len(value) else np.empty(0, dtype=dtype)
        value = flat.reshape(len(value), -1) if len(value) else flat.reshape(0, 0)
    elif value.dtype == object:  # list columns arrive as an array of per-row arrays
        value = np.stack(list(value)) if len(value) else np.empty((0,), dtype=np.float64)
    if shape is not None:
        value = value.reshape((len(value),) + tuple(shape))
    return value


_DONE = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Reading:
    """One epoch read on a background thread: the thread, its stop flag, and the queue of blocks
    of batches it fills for the consumer, at most ``prefetch_blocks`` ahead."""

    def __init__(self, epoch: int, prefetch_blocks: int) -> None:
        self.epoch = epoch
        self.blocks: "queue.Queue[Any]" = queue.Queue(maxsize=prefetch_blocks)
        self.stopped = threading.Event()
        self.thread: Optional[threading.Thread] = None

    def start(self, produce: Callable[["_Reading"], None], name: str) -> None:
        self.thread = threading.Thread(target=produce, args=(self,), name=name, daemon=True)
        self.thread.start()

    def put(self, item: Any) -> bool:
        """Queue ``item``, waiting while the queue is full; False once the reading is stopped."""
        while not self.stopped.is_set():
            try:
                self.blocks.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def next(self, timeout_s: float, kind: str, rank: int) -> Any:
        """The next queued item; an error when the thread ended without one or after ``timeout_s``."""
        waited = 0.0
        while True:
            try:
                return self.blocks.get(timeout=0.2)
            except queue.Empty:
                waited += 0.2
                if self.thread is not None and not self.thread.is_alive() and self.blocks.empty():
                    raise RuntimeError(f"the {kind} reader thread of rank {rank} ended early without an error; "
                                       "this is a bug")
                if waited >= timeout_s:
                    raise TimeoutError(
                        f"rank {rank} waited {timeout_s:.0f} s for a batch from the {kind} reader; the storage "
                        "may be slow or unreachable; raise timeout_s of make_reader if reads are just slow") from None

    def stop(self) -> None:
        """Stop the thread: it sees the flag within 0.2 s, or at once when blocked on a full queue."""
        self.stopped.set()
        while True:  # free a producer blocked on a full queue
            try:
                self.blocks.get_nowait()
            except queue.Empty:
                break
        if self.thread is not None:
            self.thread.join(timeout=30.0)


class BatchReader:
    """Batches of one rank's shard, epoch by epoch.

    Every rank of a job gets the same :attr:`steps_per_epoch`, so collective calls made once per
    step match across ranks. Iterate one epoch with :meth:`iter_epoch`; batches are dicts from
    column name to an ndarray of shape ``(batch_size, *column_shape)``.
    """

    def __init__(self, *, source: Callable[[int, int], Iterator[Chunk]], kind: str, rank: int, size: int,
                 batch_size: int, columns: Sequence[str], total_rows: int, shard_rows: int,
                 steps_per_epoch: int, shuffle: bool, seed: int, shuffle_buffer_rows: int,
                 prefetch_batches: int, timeout_s: float, block_rows: int = 8192, read_ahead: bool = True) -> None:
        self._source = source
        self.kind = kind
        """Which reader produces the rows: 'builtin' or 'petastorm'."""
        self.rank = rank
        self.size = size
        self.batch_size = batch_size
        self.columns = tuple(columns)
        """Columns in every batch."""
        self.total_rows = total_rows
        """Rows in the whole dataset, across all ranks' shards."""
        self.shard_rows = shard_rows
        """Rows in this rank's shard."""
        self.steps_per_epoch = steps_per_epoch
        """Batches :meth:`iter_epoch` yields; equal on every rank."""
        self.shuffle = shuffle
        self.seed = seed
        self.shuffle_buffer_rows = shuffle_buffer_rows
        self.prefetch_batches = prefetch_batches
        self.timeout_s = timeout_s
        self.block_rows = block_rows
        """Rows the reader thread hands over at once (whole batches; at least one batch)."""
        self.read_ahead = read_ahead
        """Whether a background thread reads ahead; else the caller's thread reads each batch."""
        self._readings: List[_Reading] = []
        """Every reading started and not yet stopped."""
        self._prefetched: Optional[_Reading] = None
        """The reading :meth:`prefetch` started, until an epoch's iteration takes it over."""

    def iter_epoch(self, epoch: int) -> Iterator[Batch]:
        """Exactly :attr:`steps_per_epoch` batches of epoch ``epoch``; a background thread reads
        ahead up to ``prefetch_batches`` blocks of batches (a block is up to
        :attr:`block_rows` rows, handed over at once: one thread hand-off per block, not per batch).
        Shuffling is seeded by ``seed`` and ``epoch``."""
        for block in self.iter_epoch_blocks(epoch):
            yield from block

    def iter_epoch_blocks(self, epoch: int) -> Iterator[List[Batch]]:
        """The batches of :meth:`iter_epoch` (the same ones, in the same order) in the blocks the
        reading thread hands over, for a consumer that takes several batches at once (a tf.data
        pipeline cuts a stacked block into batches without a Python call per batch)."""
        reading, self._prefetched = self._prefetched, None
        if reading is not None and reading.epoch != epoch:
            self._stop(reading)
            reading = None
        if reading is None and (not self.read_ahead or self._in_memory(epoch)):
            # Read and cut on this thread: asked for, or rows already decoded in memory (a
            # reading thread would only add hand-offs and contend for the interpreter's lock).
            yield from self._blocks(epoch)
            return
        if reading is None:
            reading = self._start(epoch)
        try:
            left = self.steps_per_epoch
            while left > 0:
                item = reading.next(self.timeout_s, self.kind, self.rank)
                if isinstance(item, _Failure):
                    raise item.error
                block = item[:left]
                left -= len(block)
                yield block
        finally:
            self._stop(reading)

    def prefetch(self, epoch: int) -> None:
        """Start reading epoch ``epoch`` now, in the background, so its first batches are ready when
        :meth:`iter_epoch` asks for them (e.g. while the model is broadcast). Starting another epoch
        instead, or :meth:`close`, stops that reading. Without :attr:`read_ahead`, or for an epoch
        whose rows are all in memory already (the shard cache), it does nothing."""
        if not self.read_ahead or self._in_memory(epoch):
            return
        if self._prefetched is not None:
            if self._prefetched.epoch == epoch:
                return
            self._stop(self._prefetched)
        self._prefetched = self._start(epoch)

    def _start(self, epoch: int) -> "_Reading":
        reading = _Reading(epoch, self.prefetch_batches)
        self._readings.append(reading)
        reading.start(self._produce, name=f"spark-hvd-reader-rank{self.rank}-epoch{epoch}")
        return reading

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_epoch(0)

    def _in_memory(self, epoch: int) -> bool:
        """Whether every row of epoch ``epoch`` comes from memory (the source says so)."""
        in_memory = getattr(self._source, "in_memory", None)
        return bool(in_memory is not None and in_memory(epoch))

    def _batches(self, epoch: int) -> Iterator[Optional[Batch]]:
        """Every batch of epoch ``epoch``, pass after pass over the shard, with a None after the
        batches of each chunk read: :meth:`_blocks` stops it at :attr:`steps_per_epoch`. A rank whose
        shard is shorter than steps * batch_size wraps around it: every rank must run the same
        number of steps, or a collective would wait for it forever."""
        rng = np.random.default_rng([self.seed, epoch, self.rank]) if self.shuffle else None
        buffer = ShuffleWindow(self.shuffle_buffer_rows, rng)
        batcher = Batcher(self.batch_size)
        pass_index = 0
        while True:
            rows_seen = 0
            chunks = self._source(epoch, pass_index)
            try:
                for chunk in chunks:
                    rows_seen += len(next(iter(chunk.values())))
                    yield from batcher.push(*buffer.add(chunk))
                    yield None
            finally:
                close = getattr(chunks, "close", None)
                if close is not None:
                    close()
            yield from batcher.push(*buffer.drain())
            if rows_seen == 0:
                raise ValueError(f"rank {self.rank} of {self.size} has no rows to read: the dataset has "
                                 f"{self.total_rows} rows; prepare it with num_proc={self.size}")
            pass_index += 1

    def _blocks(self, epoch: int) -> Iterator[List[Batch]]:
        """The :attr:`steps_per_epoch` batches of epoch ``epoch`` in lists of up to
        :attr:`block_rows` rows (at least one batch), a list also ending where the rows read so far
        end: a block never waits for the next read."""
        per_block = max(1, self.block_rows // self.batch_size)
        left = self.steps_per_epoch
        block: List[Batch] = []
        batches = self._batches(epoch)
        try:
            for batch in batches:
                if batch is not None:
                    block.append(batch)
                    left -= 1
                if block and (batch is None or len(block) >= per_block or left == 0):
                    yield block
                    block = []
                if left == 0:
                    return
        finally:
            batches.close()

    def _produce(self, reading: "_Reading") -> None:
        blocks = self._blocks(reading.epoch)
        try:
            for block in blocks:
                if not reading.put(block):
                    return  # the consumer stopped
        except BaseException as exc:  # handed to the consumer, which re-raises it
            reading.put(_Failure(exc))
        finally:
            blocks.close()  # the files of the pass, on this thread

    def _stop(self, reading: "_Reading") -> None:
        reading.stop()
        if reading in self._readings:
            self._readings.remove(reading)

    def close(self) -> None:
        """Stop any reading thread still running."""
        self._prefetched = None
        for reading in list(self._readings):
            self._stop(reading)

    def __enter__(self) -> "BatchReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _builtin_source(layout: ParquetLayout, rank: int, size: int, columns: Sequence[str],
                    shapes: Mapping[str, Tuple[int, ...]], shuffle: bool, seed: int,
                    storage_options: Optional[Mapping[str, Any]], url: str, reshuffle: bool = True,
                    cache_all: bool = False) -> Tuple[Callable[[int, int], Iterator[Chunk]], int]:
    groups = layout.row_groups
    fixed = deal_row_groups(groups, size, None, seed)[rank]
    shard_rows = sum(groups[i].num_rows for i in fixed)
    may_read = range(len(groups)) if shuffle and reshuffle else fixed
    cache = ShardCache(sum(groups[i].num_rows for i in may_read)) if cache_all else None

    def shard_of(epoch: int) -> List[int]:
        return deal_row_groups(groups, size, epoch, seed)[rank] if shuffle and reshuffle else fixed

    def in_memory(epoch: int) -> bool:
        return cache is not None and all(i in cache for i in shard_of(epoch))

    def read_pass(epoch: int, pass_index: int) -> Iterator[Chunk]:
        import pyarrow.parquet as pq

        shard = shard_of(epoch)
        order = list(range(len(shard)))
        if shuffle:
            order = list(np.random.default_rng([seed, epoch, rank, pass_index, 1]).permutation(len(shard)))
        fs, _ = open_filesystem(url, storage_options)
        read_options = _LOCAL_READ if _is_local(fs) else {}
        opened: Dict[str, Tuple[Any, Any]] = {}  # file -> (handle, ParquetFile); footers parsed once

        def pieces(rg: RowGroup) -> Iterator[Chunk]:
            # Decoded in pieces on this thread alone (pyarrow's pool threads would compete with
            # the ranks of the host), each handed on before the next is decoded.
            if rg.file not in opened:
                handle = fs.open(rg.file, "rb")
                opened[rg.file] = (handle, pq.ParquetFile(handle, **read_options))
            for table in opened[rg.file][1].iter_batches(batch_size=_piece_rows(rg), row_groups=[rg.index],
                                                         columns=list(columns), use_threads=False):
                yield {c: arrow_to_numpy(table.column(c), shapes.get(c), c, layout.row_bytes.get(c))
                       for c in columns}

        keeping = -1  # the row group being copied into the cache, if any
        try:
            for j in order:
                index = shard[j]
                if cache is None:
                    yield from pieces(groups[index])
                elif index in cache:  # the same pieces as read, from memory
                    yield from cache.pieces(index)
                else:
                    keeping = index if cache.begin(index) else -1
                    for chunk in pieces(groups[index]):
                        # Handed on as the cache's copy, so the shuffle window keeps its positions.
                        yield cache.add(chunk) if keeping >= 0 else chunk
                    if keeping >= 0:
                        cache.commit(groups[index].num_rows)
                    keeping = -1
        finally:
            # The consumer may stop at the epoch's last batch, within a row group: that group is
            # kept if its last piece was read.
            if cache is not None and keeping >= 0:
                cache.commit(groups[keeping].num_rows)
            for handle, _ in opened.values():
                handle.close()

    read_pass.in_memory = in_memory  # type: ignore[attr-defined]
    return read_pass, shard_rows


def _import_petastorm() -> Any:
    try:
        import petastorm  # noqa: F401
        from petastorm import make_batch_reader
    except ImportError as exc:
        raise ImportError(f"the petastorm reader needs petastorm: {_PETASTORM_INSTALL} ({exc})") from exc
    # petastorm calls pyarrow APIs that pyarrow deprecates; those FutureWarnings, raised from
    # petastorm's own modules, are noise for users. Errors and other warnings still show.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"petastorm(\..*)?$")
    return make_batch_reader


def _petastorm_source(urls: Sequence[str], layout: ParquetLayout, rank: int, size: int,
                      columns: Sequence[str], shapes: Mapping[str, Tuple[int, ...]], shuffle: bool,
                      seed: int, storage_options: Optional[Mapping[str, Any]]
                      ) -> Tuple[Callable[[int, int], Iterator[Chunk]], int]:
    make_batch_reader = _import_petastorm()
    if len(layout.row_groups) < size:
        raise ValueError(f"the petastorm reader needs at least one row group per rank: the dataset has "
                         f"{len(layout.row_groups)} row groups for {size} ranks; prepare it with "
                         f"num_proc={size} or use reader='builtin'")
    dataset_urls = [u if "://" in u else "file://" + posixpath.abspath(u) for u in urls]
    shard_rows = sum(rg.num_rows for i, rg in enumerate(layout.row_groups) if i % size == rank)

    def read_pass(epoch: int, pass_index: int) -> Iterator[Chunk]:
        # petastorm also shuffles the sharding with its seed, so the seed is equal on all ranks.
        # Its "dummy" pool reads in this (already background) thread, in the seeded order; a
        # thread pool would hand row groups back in whatever order they finish.
        reader = make_batch_reader(
            dataset_urls if len(dataset_urls) > 1 else dataset_urls[0],
            schema_fields=[f"^{c}$" for c in columns], reader_pool_type="dummy",
            seed=seed * 1_000_003 + epoch * 1_009 + pass_index if shuffle else None,
            shuffle_row_groups=shuffle,
            num_epochs=1, cur_shard=rank, shard_count=size, storage_options=storage_options)
        try:
            for batch in reader:
                row = batch._asdict()
                yield {c: _from_petastorm(np.asarray(row[c]), shapes.get(c), layout.row_bytes.get(c))
                       for c in columns}
        finally:
            reader.stop()
            reader.join()

    return read_pass, shard_rows


def make_reader(kind: str, urls: Union[str, Sequence[str]], *, rank: int, size: int, batch_size: int,
                feature_cols: Sequence[str], label_cols: Sequence[str] = (),
                sample_weight_col: Optional[str] = None, shuffle: bool = True, seed: int = 0,
                shuffle_buffer_rows: int = 10_000, steps_per_epoch: Optional[int] = None, reshuffle: bool = True,
                cache_all: Union[bool, str] = False,
                shapes: Optional[Mapping[str, Sequence[int]]] = None,
                storage_options: Optional[Mapping[str, Any]] = None, prefetch_batches: int = 4,
                timeout_s: float = 600.0, block_rows: int = 8192,
                read_ahead: Union[bool, str] = "auto") -> BatchReader:
    """A reader of rank ``rank``'s shard (of ``size``) of the Parquet at ``urls``.

    ``kind`` is "builtin" (current pyarrow) or "petastorm" (petastorm's ``make_batch_reader``, same
    interface, row group ``i`` to rank ``i % size``). The builtin reader with ``shuffle`` and
    ``reshuffle`` (the default) deals the row groups to the ranks anew every epoch (a seeded
    permutation, balanced by rows; see :func:`deal_row_groups`), so over the epochs every rank
    sees all of the data; ``reshuffle=False`` keeps row group ``i`` on rank ``i % size``.
    ``cache_all`` keeps every row group read in memory, decoded, in one contiguous array per
    column, and hands it out again as views of the pieces it was read in: later epochs read no
    file and decode nothing, and give the same batches as reading the files would (a resumed
    fit's fresh process trains the uninterrupted run's batches);
    ``"auto"`` caches when what the rank may read (its shard, or with ``reshuffle`` every row group)
    fits :data:`CACHE_MEMORY_SHARE` of the host's available memory divided among its ranks. The
    ``"petastorm"`` reader caches nothing. The builtin reader
    decodes each row group in pieces of about 2 MiB of column data, so its memory is the shuffle
    buffer of ``shuffle_buffer_rows`` rows plus a piece, however large the row groups; rows leave
    the buffer in random order (with 0 rows, each row group's rows leave as stored). Batches hold
    ``feature_cols``, ``label_cols`` and ``sample_weight_col``, each reshaped to ``shapes[col]``
    per row when given (e.g. the shapes recorded by ``prepare_data``). ``steps_per_epoch``
    defaults to ``ceil(total_rows / (size * batch_size))`` on every rank. A background thread
    reads ahead and hands batches over in blocks of up to ``block_rows`` rows (at least one
    batch), at most ``prefetch_batches`` blocks ahead; batches are views of the rows read, so
    small batches cost no copy and no thread hand-off each. With ``read_ahead=False`` the
    caller's thread reads and cuts the batches as it asks for them (the same batches, no thread);
    ``"auto"`` (the builtin reader's default) reads ahead unless the files are local and the
    host's ranks leave no CPU for a reading thread (see :func:`reads_ahead`). An epoch whose rows
    are all in the cache has nothing to read: its batches are cut on the caller's thread.
    """
    if kind not in READER_KINDS:
        raise ValueError(f"reader kind={kind!r} is not known: expected one of {READER_KINDS}")
    if not 0 <= rank < size:
        raise ValueError(f"rank={rank} is not valid for size={size}: expected 0 <= rank < size")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} is not valid: expected an integer >= 1")
    if shuffle_buffer_rows < 0:
        raise ValueError(f"shuffle_buffer_rows={shuffle_buffer_rows} is not valid: expected >= 0")
    if prefetch_batches < 1:
        raise ValueError(f"prefetch_batches={prefetch_batches} is not valid: expected >= 1")
    if cache_all not in (True, False, "auto"):
        raise ValueError(f"cache_all={cache_all!r} is not valid: expected True, False or 'auto' (cache when the "
                         "decoded rows fit in memory)")
    if block_rows < 1:
        raise ValueError(f"block_rows={block_rows} is not valid: expected >= 1 (rows handed from the reader "
                         "thread at once; one batch is the least)")
    if read_ahead not in (True, False, "auto"):
        raise ValueError(f"read_ahead={read_ahead!r} is not valid: expected True (a background thread reads "
                         "ahead), False (the caller's thread reads) or 'auto'")
    columns: List[str] = []
    for c in list(feature_cols) + list(label_cols) + ([sample_weight_col] if sample_weight_col else []):
        if c not in columns:
            columns.append(c)
    if not columns:
        raise ValueError("make_reader got no columns: pass feature_cols (and label_cols)")
    url_list = [urls] if isinstance(urls, str) else list(urls)
    if not url_list:
        raise ValueError("make_reader got no urls: pass the prepared dataset's train or val path")
    layout = scan_parquet(url_list, storage_options)
    missing = [c for c in columns if layout.files and c not in layout.column_names]
    if missing:
        raise ValueError(f"columns {missing} are not in the Parquet at {url_list}; available columns: "
                         f"{', '.join(layout.column_names)}")
    shape_map = {c: tuple(int(d) for d in s) for c, s in (shapes or {}).items()}
    if kind == "builtin":
        if cache_all == "auto":
            may_read = range(len(layout.row_groups)) if shuffle and reshuffle else \
                deal_row_groups(layout.row_groups, size, None, seed)[rank]
            cache_all = cache_fits_here(layout, may_read)
        source, shard_rows = _builtin_source(layout, rank, size, columns, shape_map, shuffle, seed,
                                             storage_options, url_list[0], reshuffle, cache_all)
        if read_ahead == "auto":
            read_ahead = reads_ahead(url_list[0], storage_options)
    else:
        source, shard_rows = _petastorm_source(url_list, layout, rank, size, columns, shape_map, shuffle,
                                               seed, storage_options)
    steps = steps_per_epoch if steps_per_epoch is not None else steps_for(layout.num_rows, size, batch_size)
    if steps < 1:
        raise ValueError(f"steps_per_epoch={steps} is not valid: expected an integer >= 1")
    return BatchReader(source=source, kind=kind, rank=rank, size=size, batch_size=batch_size,
                       columns=columns, total_rows=layout.num_rows, shard_rows=shard_rows,
                       steps_per_epoch=steps, shuffle=shuffle, seed=seed,
                       shuffle_buffer_rows=shuffle_buffer_rows if shuffle else 0,
                       prefetch_batches=prefetch_batches, timeout_s=timeout_s, block_rows=block_rows,
                       read_ahead=read_ahead is not False)
