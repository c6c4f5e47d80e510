"""Allocation statistics per kind of memory.

Counters move on every allocation *and* every release, so ``live_*`` show what
is held right now (one reference design only ever counted up).  Pinned memory
is locked out of the OS's paging and is scarce: watch ``stats()["pinned"]``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

#: Buffer kinds; "device" is pool device memory (DeviceBuffer), "emm" what
#: numba allocated through umem_numba's memory-manager plugin.
KINDS = ("managed", "pinned", "vmm", "device", "emm")


@dataclass(frozen=True)
class KindStats:
    """A snapshot of one kind's counters.

    Attributes
    ----------
    live_count : int
        Allocations not yet released.
    live_bytes : int
        Bytes held by those allocations.
    peak_bytes : int
        Highest ``live_bytes`` seen since start (or :func:`reset_peak`).
    total_allocations : int
        Allocations ever made.
    total_bytes : int
        Bytes ever allocated.
    """

    live_count: int = 0
    live_bytes: int = 0
    peak_bytes: int = 0
    total_allocations: int = 0
    total_bytes: int = 0


@dataclass(frozen=True)
class PoolStats:
    """Memory-pool counters read from the driver (summed over the live pools).

    Attributes
    ----------
    pools : int
        Live :class:`~umem_numba.MemoryPool` objects counted.
    reserved_current : int
        Bytes the pools hold from the driver (``CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT``).
    reserved_high : int
        High-water mark of reserved bytes since creation or the last reset.
    used_current : int
        Bytes handed out to allocations not yet freed (``USED_MEM_CURRENT``).
    used_high : int
        High-water mark of used bytes.
    cached : int
        Of ``used_current``, the bytes on the buffers' free lists: memory of
        closed buffers kept for the next buffer of its size (umem_numba's
        count, not the driver's).
    """

    pools: int = 0
    reserved_current: int = 0
    reserved_high: int = 0
    used_current: int = 0
    used_high: int = 0
    cached: int = 0


class _Counters:
    __slots__ = ("live_bytes", "live_count", "peak_bytes", "total_allocations", "total_bytes")

    def __init__(self) -> None:
        self.live_count = self.live_bytes = self.peak_bytes = 0
        self.total_allocations = self.total_bytes = 0


_lock = threading.Lock()
_counters = {kind: _Counters() for kind in KINDS}

#: Allocations, releases and resizes not yet folded into the counters, in the
#: order they happened: ``(counters, count delta, byte delta)``.  Appending to a
#: deque is atomic, so the allocation paths take no lock (a pool buffer's whole
#: allocate + free cycle costs about as much as two locked counter updates);
#: the log is folded, in order, when it grows long and whenever it is read, so
#: the counters (peak included) are exact.
_log: deque[tuple[_Counters, int, int]] = deque()
_FOLD_AT = 4096


def _fold() -> None:
    """Apply the logged changes to the counters, oldest first (call with ``_lock`` held)."""
    pop = _log.popleft
    for _ in range(len(_log)):
        c, count, delta = pop()
        c.live_count += count
        live = c.live_bytes = c.live_bytes + delta
        if delta > 0:
            c.total_bytes += delta
            c.peak_bytes = max(c.peak_bytes, live)
        if count > 0:
            c.total_allocations += 1


def _fold_if_long() -> None:
    if len(_log) > _FOLD_AT:
        with _lock:
            _fold()


def record_alloc(kind: str, nbytes: int) -> None:
    """Count an allocation of ``nbytes`` bytes of ``kind``."""
    _log.append((_counters[kind], 1, nbytes))
    if len(_log) > _FOLD_AT:
        _fold_if_long()


def record_resize(kind: str, delta: int) -> None:
    """An allocation changed size in place by ``delta`` bytes (VMM grow: > 0, shrink: < 0)."""
    _log.append((_counters[kind], 0, delta))
    _fold_if_long()


def record_free(kind: str, nbytes: int) -> None:
    """Count the release of an allocation of ``nbytes`` bytes of ``kind``."""
    _log.append((_counters[kind], -1, -nbytes))
    if len(_log) > _FOLD_AT:
        _fold_if_long()


def stats() -> dict[str, KindStats | PoolStats]:
    """Snapshot of the allocation counters, per kind, and of the memory pools.

    Returns
    -------
    dict
        ``{"managed", "pinned", "vmm", "device", "emm"}`` -> :class:`KindStats`
        (``"device"``: pool device memory; ``"emm"``: numba's allocations
        through the memory-manager plugin), and ``"pool"`` ->
        :class:`PoolStats`, read from the driver for every live
        :class:`~umem_numba.MemoryPool` (zeros, without touching the driver,
        when there is none).

    Examples
    --------
    >>> umem_numba.stats()["managed"].live_bytes  # doctest: +SKIP
    4194304
    """
    with _lock:
        _fold()
        out: dict[str, KindStats | PoolStats] = {
            k: KindStats(c.live_count, c.live_bytes, c.peak_bytes, c.total_allocations, c.total_bytes)
            for k, c in _counters.items()
        }
    for name, source in list(_sources.items()):
        out[name] = source()
    out.setdefault("pool", PoolStats())
    return out


#: Counters that other modules read from the driver (the memory pools register
#: theirs when they are imported): name -> function returning a snapshot.
_sources: dict[str, Callable[[], PoolStats]] = {}


def add_source(name: str, source: Callable[[], PoolStats]) -> None:
    """Report ``source()`` as ``stats()[name]`` (a module above this one registers itself)."""
    _sources[name] = source


def reset_peak() -> None:
    """Set every kind's ``peak_bytes`` to its current ``live_bytes``."""
    with _lock:
        _fold()
        for c in _counters.values():
            c.peak_bytes = c.live_bytes
