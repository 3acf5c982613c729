"""Counters in memory shared between processes, published in an order every CPU keeps.

The shared-memory rings and mailboxes move data the same way: the producer copies bytes into a
slot, then stores a counter; the consumer loads the counter, then reads the slot (and, for a ring,
stores its own counter once it is done with the slot). That is only correct when no process can
see a counter's new value before the memory it publishes, and when a consumer's reads of a slot
finish before the store that hands the slot back. Plain stores do not promise that everywhere:
ARM (AWS Graviton, Azure Cobalt, Ampere) and POWER may make them visible to another core in a
different order than the program wrote them.

So every counter goes through :func:`ordered_counters`, which picks by the CPU:

- ``"plain"`` on x86-64: aligned 8-byte loads and stores of the mapping as they are. The
  architecture keeps stores in program order with other stores and loads with other loads, and an
  aligned quadword access is atomic (Intel SDM vol. 3A, "Memory Ordering in P6 and More Recent
  Processor Families" and "Guaranteed Atomic Operations"; AMD APM vol. 2, "Memory System"): a
  plain store releases and a plain load acquires.
- ``"atomics"`` everywhere else: GCC's runtime library of atomics (``libatomic.so.1``), called for
  each counter as ``__atomic_store_8(address, value, __ATOMIC_RELEASE)`` and
  ``__atomic_load_8(address, __ATOMIC_ACQUIRE)``. By the C11 memory model these are a release
  store and an acquire load: every access the producer made before the store is visible to a
  consumer whose load reads that value, on any architecture the library is built for.
- neither (a CPU other than x86-64 without ``libatomic.so.1``): :func:`ordering_available` is False
  and the runtime moves data between the ranks of a host over sockets instead.

``SPARK_HVD_SHM_ORDERING=atomics`` takes the library's path on x86-64 too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import platform
from typing import Any, Optional

__all__ = ["ORDERINGS", "default_ordering", "ordering_available", "ordered_counters", "AtomicCounters"]

ORDERINGS = ("auto", "plain", "atomics")
"""Values of ``SPARK_HVD_SHM_ORDERING``: ``auto`` picks ``plain`` on x86-64, else ``atomics``."""

_X86_64 = {"x86_64", "amd64"}
_ACQUIRE = 2  # __ATOMIC_ACQUIRE
_RELEASE = 3  # __ATOMIC_RELEASE

_library: Any = None
_library_error: Optional[str] = None


def _atomics() -> Any:
    """``libatomic.so.1`` with the two functions typed, or None when it cannot be loaded."""
    global _library, _library_error
    if _library is None and _library_error is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("atomic") or "libatomic.so.1")
            lib.__atomic_load_8.argtypes = [ctypes.c_void_p, ctypes.c_int]
            lib.__atomic_load_8.restype = ctypes.c_int64
            lib.__atomic_store_8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
            lib.__atomic_store_8.restype = None
            _library = lib
        except (OSError, AttributeError) as exc:
            _library_error = str(exc)
    return _library


def default_ordering() -> str:
    """``plain`` on x86-64, ``atomics`` on every other CPU (32-bit x86 included, where a plain
    8-byte store may be two)."""
    return "plain" if platform.machine().lower() in _X86_64 else "atomics"


def _resolve(ordering: str) -> str:
    if ordering not in ORDERINGS:
        raise ValueError(f"SPARK_HVD_SHM_ORDERING={ordering!r} is invalid: expected one of {', '.join(ORDERINGS)}")
    return default_ordering() if ordering == "auto" else ordering


def ordering_available(ordering: str = "auto") -> bool:
    """Whether counters can be published in order on this CPU with ``ordering`` (``plain`` only
    on x86-64; ``atomics`` where ``libatomic.so.1`` loads)."""
    chosen = _resolve(ordering)
    if chosen == "plain":
        return default_ordering() == "plain"
    return _atomics() is not None


class AtomicCounters:
    """``count`` int64 counters at the start of a shared mapping, each load an acquire and each
    store a release (``libatomic``); indexed like the ``memoryview`` of the plain ordering."""

    __slots__ = ("_base", "_count", "_load", "_store")

    def __init__(self, mm: mmap.mmap, count: int) -> None:
        lib = _atomics()
        if lib is None:
            raise OSError(f"libatomic.so.1 could not be loaded ({_library_error}); shared memory needs it on "
                          f"{platform.machine()}: install libatomic1 (Debian, Ubuntu) or libatomic (RHEL, Amazon "
                          "Linux), or set SPARK_HVD_SHM=0")
        anchor = ctypes.c_char.from_buffer(mm)
        self._base = ctypes.addressof(anchor)  # valid while the mapping is; the anchor is not kept,
        del anchor  # so the mapping can still be closed
        self._count = count
        self._load = getattr(lib, "__atomic_load_8")  # a name a class body would mangle
        self._store = getattr(lib, "__atomic_store_8")

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self._count:
            raise IndexError(index)
        return self._load(self._base + 8 * index, _ACQUIRE)

    def __setitem__(self, index: int, value: int) -> None:
        if not 0 <= index < self._count:
            raise IndexError(index)
        self._store(self._base + 8 * index, value, _RELEASE)

    def release(self) -> None:
        """Nothing to release (the memoryview of the plain ordering has to be)."""


def ordered_counters(mm: mmap.mmap, count: int, ordering: str = "auto") -> Any:
    """The ``count`` int64 counters at the start of ``mm``, read and written in the order this
    module's docstring describes: a ``memoryview`` with ``plain`` ordering, else
    :class:`AtomicCounters`. ``plain`` is refused on a CPU other than x86-64."""
    chosen = _resolve(ordering)
    if chosen == "plain":
        if default_ordering() != "plain":
            raise ValueError(f"SPARK_HVD_SHM_ORDERING=plain is not safe on {platform.machine()} (plain stores may "
                             "become visible out of order there): expected auto or atomics")
        return memoryview(mm)[:8 * count].cast("q")
    return AtomicCounters(mm, count)
