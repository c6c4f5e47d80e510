"""Allocation statistics per kind of memory.

Counters move on every allocation *and* every release, so ``live_*`` show what
is held right now (one reference design only ever counted up).  Pinned memory
is locked out of the OS's paging and is scarce: watch ``stats()["pinned"]``.
"""

from __future__ import annotations

import threading
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


#: Guards every counter.  The counters are updated in place under it, and
#: nothing in those updates allocates a container or drops an object, so no
#: garbage collection (no finalizer) can interrupt one halfway.  :func:`stats`
#: allocates its snapshot under it, where a collection may release a collected
#: buffer on this thread, which counts the release under the same lock: hence
#: re-entrant.  (An earlier design appended to a lock-free log folded later: the
#: fold cost twice a locked update per entry, about 0.5 µs, so it saved nothing.)
_lock = threading.RLock()
_counters = {kind: _Counters() for kind in KINDS}


def record_alloc(kind: str, nbytes: int) -> None:
    """Count an allocation of ``nbytes`` bytes of ``kind``."""
    c = _counters[kind]
    with _lock:
        c.live_count += 1
        c.total_allocations += 1
        c.total_bytes += nbytes
        live = c.live_bytes = c.live_bytes + nbytes
        if live > c.peak_bytes:  # noqa: PLR1730 (every allocation: a comparison costs less than max())
            c.peak_bytes = live


def record_resize(kind: str, delta: int) -> None:
    """An allocation changed size in place by ``delta`` bytes (VMM grow: > 0, shrink: < 0)."""
    c = _counters[kind]
    with _lock:
        live = c.live_bytes = c.live_bytes + delta
        if delta > 0:
            c.total_bytes += delta
            c.peak_bytes = max(c.peak_bytes, live)


def record_free(kind: str, nbytes: int) -> None:
    """Count the release of an allocation of ``nbytes`` bytes of ``kind``."""
    c = _counters[kind]
    with _lock:
        c.live_count -= 1
        c.live_bytes -= nbytes


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
        for c in _counters.values():
            c.peak_bytes = c.live_bytes
