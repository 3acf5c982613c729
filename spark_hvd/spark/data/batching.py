"""Rows from decoded pieces to batches: the shuffle window, batch cutting, the decoded shard cache.

How much of a rank's data the cache may hold is decided here too (:func:`cache_fits`)."""

from __future__ import annotations

from collections import deque
from typing import Deque, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from spark_hvd.spark.data.layout import ParquetLayout

__all__ = ["Batch", "Chunk", "CachedRows", "Positions", "Picked", "ShuffleWindow", "Batcher", "ShardCache",
           "CACHE_MEMORY_SHARE", "cache_fits", "cache_fits_here"]

Batch = Dict[str, np.ndarray]
"""One batch: column name to an array of ``(batch_size, *shape)``."""
Chunk = Dict[str, np.ndarray]
"""Rows as read: column name to an array of ``(rows, *shape)``, every column the same rows."""

class CachedRows(dict):
    """A :data:`Chunk` whose arrays are views of rows ``start`` to ``start + len`` of a
    :class:`ShardCache`'s arrays (``base``): used as a Chunk it is exactly that; the shuffle window
    keeps such rows as their positions in ``base`` instead of copies."""

    def __init__(self, base: Chunk, start: int, stop: int) -> None:
        super().__init__({k: v[start:stop] for k, v in base.items()})
        self.base = base
        self.start = start
        self.stop = stop


class Positions:
    """Rows of ``base`` (column name to array) picked by ``positions`` (indices into it), not yet
    copied: what the shuffle window holds and hands on for cached rows."""

    def __init__(self, base: Chunk, positions: np.ndarray) -> None:
        self.base = base
        self.positions = positions

    def __len__(self) -> int:
        return len(self.positions)

    def gather(self, order: np.ndarray) -> Chunk:
        """The rows ``positions[order]`` of every column, copied into arrays of their own."""
        picked = self.positions[order]
        return {k: np.take(v, picked, axis=0) for k, v in self.base.items()}


def _length(rows: Union[Chunk, Positions]) -> int:
    """Rows in a Chunk or a :class:`Positions`."""
    return len(rows) if isinstance(rows, Positions) else len(next(iter(rows.values())))


Picked = Tuple[Union[None, Chunk, Positions], Optional[np.ndarray]]
"""Rows on their way to batches: columns (None: no rows; or :class:`Positions` of cached rows), and
the order their rows leave in (None: as stored); ``Batcher.push(*picked)`` takes them."""


class ShuffleWindow:
    """Bounded shuffle across chunks: rows leave in random order once more than ``capacity``
    rows have arrived, so memory stays at ``capacity`` rows plus one chunk. With ``capacity`` 0
    rows leave in their stored order (only the order of the row groups is shuffled).

    What leaves is a chunk with the order of its leaving rows: the rows are gathered batch by
    batch (:class:`Batcher`), each straight into the batch's own array, instead of gathering the
    whole chunk in a new order first. Rows of the shard cache (:class:`CachedRows`) are held as
    their positions in the cache's arrays: adding a piece appends and draws integers, not rows,
    and a batch gathers its rows from the cache once. The random draws are the same either way
    (per piece, a sample of the window's rows in random order, as many as leave), so the same
    rows leave in the same order whether a pass reads its row groups or replays them from the
    cache."""

    def __init__(self, capacity: int, rng: Optional[np.random.Generator]) -> None:
        self.capacity = capacity
        self.rng = rng
        self.rows: Union[None, Chunk, Positions] = None

    def add(self, chunk: Chunk) -> Picked:
        if self.rng is None or self.capacity == 0:
            return chunk, None
        rows = self._joined(chunk)
        count = _length(rows)
        surplus = count - self.capacity
        if surplus <= 0:
            self.rows = rows
            return None, None
        # The rows that leave: a uniform sample of the window in random order (one draw per row
        # that leaves, where a permutation of the whole window costs one per row held, and
        # numpy's choice runs several times faster than its permutation); the rest stay, in
        # their order, for later draws to pick from.
        leaving = self.rng.choice(count, surplus, replace=False)
        stay = np.ones(count, dtype=bool)
        stay[leaving] = False
        kept = np.flatnonzero(stay)
        self.rows = Positions(rows.base, rows.positions[kept]) if isinstance(rows, Positions) else _gather(rows, kept)
        return rows, leaving

    def _joined(self, chunk: Chunk) -> Union[Chunk, Positions]:
        """The window's rows followed by ``chunk``'s: positions when both are rows of one cache."""
        held = self.rows
        if isinstance(chunk, CachedRows) and (held is None or (isinstance(held, Positions) and held.base is chunk.base)):
            fresh = np.arange(chunk.start, chunk.stop)
            return Positions(chunk.base, fresh if held is None else np.concatenate([held.positions, fresh]))
        if isinstance(held, Positions):  # rows of another source follow cached ones: copy the window's rows
            held = held.gather(np.arange(len(held)))
        return chunk if held is None else {k: np.concatenate([held[k], v]) for k, v in chunk.items()}

    def drain(self) -> Picked:
        rows, self.rows = self.rows, None
        if rows is None:
            return None, None
        if self.rng is None:
            return rows, None
        return rows, self.rng.permutation(_length(rows))


def _gather(rows: Chunk, order: np.ndarray) -> Chunk:
    # take() copies whole rows of a matrix; a[order] goes element by element, several times slower.
    return {k: np.take(v, order, axis=0) for k, v in rows.items()}


def _count(picked: Picked) -> int:
    chunk, order = picked
    return len(order) if order is not None else _length(chunk)


class Batcher:
    """Cuts a stream of chunks into batches of exactly ``batch_size`` rows.

    A batch that lies within one chunk kept in its stored order is a view of it (no copy); the
    batches of a chunk with an order of its own (shuffled) are gathered in that order, up to
    ``gather_rows`` rows of whole batches with one call per column, and cut as views of what was
    gathered; only a batch that straddles two chunks is joined. Rows are never copied more
    than once on the way, except the few of a straddling batch.
    """

    def __init__(self, batch_size: int, gather_rows: int = 8192) -> None:
        self.batch_size = batch_size
        self.gather_batches = max(1, gather_rows // batch_size)
        """Most batches of one chunk that are gathered in one call per column."""
        self.pending: Deque[Picked] = deque()
        self.count = 0

    def push(self, chunk: Union[None, Chunk, Positions], order: Optional[np.ndarray] = None) -> Iterator[Batch]:
        """The batches that are complete once ``chunk`` arrived; ``order``, when given, is the
        order in which its rows leave (indices into it; rows not in it are left out)."""
        if chunk is None:
            return
        picked = (chunk, order)
        n = _count(picked)
        if n == 0:
            return
        self.pending.append(picked)
        self.count += n
        size = self.batch_size
        while self.count >= size:
            whole = min(_count(self.pending[0]) // size, self.gather_batches)
            if whole:
                # Several batches gathered at once (one call per column), then cut as views.
                rows = self._take(whole * size)
                self.count -= whole * size
                for start in range(0, whole * size, size):
                    yield {k: v[start:start + size] for k, v in rows.items()}
                continue
            parts = []
            need = size
            while need:
                taken = min(need, _count(self.pending[0]))
                parts.append(self._take(taken))
                need -= taken
            self.count -= size
            yield {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}

    def _take(self, rows: int) -> Chunk:
        """The next ``rows`` rows of the first pending chunk (at most all of it): views of a chunk
        in stored order, the rows gathered for one with an order of its own."""
        chunk, order = self.pending[0]
        if order is None and isinstance(chunk, Positions):  # cached rows kept in their order
            order = np.arange(len(chunk))
        if order is None:
            if len(next(iter(chunk.values()))) <= rows:
                self.pending.popleft()
                return chunk
            self.pending[0] = ({k: v[rows:] for k, v in chunk.items()}, None)
            return {k: v[:rows] for k, v in chunk.items()}
        if len(order) <= rows:
            self.pending.popleft()
        else:
            self.pending[0] = (chunk, order[rows:])
        return chunk.gather(order[:rows]) if isinstance(chunk, Positions) else _gather(chunk, order[:rows])


class ShardCache:
    """The row groups one rank has decoded, held as one contiguous array per column.

    The arrays are allocated once for every row the rank may read (``capacity`` rows; memory is
    only taken as rows arrive) and each piece is copied in as it is read, so the cache never holds
    a row twice. A row group counts once all of its rows are in (:meth:`commit`), and is handed
    out again as views of the same pieces (:meth:`pieces`): what follows (the shuffle window, the
    batches) sees the rows exactly as it saw them read, so a pass gives the same batches whether
    its row groups were cached or read."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        """Rows the arrays are allocated for."""
        self.rows: Chunk = {}
        """Column name to the array of every cached row (allocated with the first piece)."""
        self.ranges: Dict[int, Tuple[int, int]] = {}
        """Row group index to its rows' ``(start, stop)`` in :attr:`rows`."""
        self.filled = 0
        self._open: Optional[Tuple[int, int]] = None
        self._sizes: List[int] = []  # rows of each piece of the row group begun
        self._pieces: Dict[int, List[Tuple[int, int]]] = {}

    def __contains__(self, index: int) -> bool:
        return index in self.ranges

    def begin(self, index: int) -> bool:
        """Start keeping row group ``index``; False (nothing is kept) when it is cached already."""
        if self._open is not None:  # a row group left unfinished (its read failed): dropped
            self.filled = self._open[1]
        if index in self.ranges:
            self._open = None
            return False
        self._open = (index, self.filled)
        self._sizes = []
        return True

    def add(self, piece: Chunk) -> "CachedRows":
        """Copy ``piece``, the next rows of the row group begun, into the arrays; the copy, as views."""
        n = len(next(iter(piece.values())))
        if not self.rows:
            self.rows = {k: np.empty((self.capacity,) + v.shape[1:], dtype=v.dtype) for k, v in piece.items()}
        if self.filled + n > self.capacity:
            raise RuntimeError(f"the shard cache holds {self.capacity} rows and got {self.filled + n}; this is a bug")
        for k, v in piece.items():
            self.rows[k][self.filled:self.filled + n] = v
        self.filled += n
        self._sizes.append(n)
        return CachedRows(self.rows, self.filled - n, self.filled)

    def commit(self, rows: int) -> None:
        """End the row group begun: kept when ``rows`` (its rows) all arrived, else its rows are dropped."""
        if self._open is None:
            return
        index, start = self._open
        self._open = None
        if self.filled - start == rows:
            self.ranges[index] = (start, self.filled)
            bounds = np.cumsum([start] + self._sizes).tolist()
            self._pieces[index] = list(zip(bounds[:-1], bounds[1:]))
        else:
            self.filled = start

    def pieces(self, index: int) -> Iterator["CachedRows"]:
        """Row group ``index`` (cached) as views of the pieces it was read in."""
        for start, stop in self._pieces[index]:
            yield CachedRows(self.rows, start, stop)


CACHE_MEMORY_SHARE = 0.25
"""With ``cache_all="auto"``, the share of the memory available on the host (divided among the ranks
on it) that the decoded rows a rank may read can take up and still be cached."""


def _available_memory() -> Optional[int]:
    """Bytes of memory the host has available now (Linux's MemAvailable; None where it is not known)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _local_ranks() -> int:
    """Ranks on this host when a world is initialized (they share its memory), else 1."""
    import spark_hvd.runtime as rt

    return rt.local_size() if rt.is_initialized() else 1


def cache_fits(layout: ParquetLayout, groups: Sequence[int], available: Optional[int], local_ranks: int) -> bool:
    """Whether the decoded row groups ``groups`` of ``layout`` (their uncompressed size) fit in
    :data:`CACHE_MEMORY_SHARE` of ``available`` bytes shared by ``local_ranks`` ranks."""
    if available is None:
        return False
    needed = sum(layout.row_groups[i].byte_size or 0 for i in groups)
    return needed <= CACHE_MEMORY_SHARE * available / max(1, local_ranks)


def cache_fits_here(layout: ParquetLayout, groups: Sequence[int]) -> bool:
    """:func:`cache_fits` with this host's available memory and the ranks on it."""
    return cache_fits(layout, groups, _available_memory(), _local_ranks())
