"""Allocation statistics per kind of memory.

Counters move on every allocation *and* every release, so ``live_*`` show what
is held right now (one reference design only ever counted up).  Pinned memory
is locked out of the OS's paging and is scarce: watch ``stats()["pinned"]``.
"""

from __future__ import annotations

import array
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

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


#: Counts not yet summed into the counters, in the order they happened: one int64 per
#: allocation, release or resize, ``bytes << 5 | op << 3 | kind``.  ``array.append`` is one
#: C call under the GIL, so counting takes no lock and allocates nothing (a locked update
#: cost two thirds of a microsecond per allocate / release cycle, a fifth of a default
#: buffer's); :func:`_fold` sums the entries in bulk, with numpy.  Entries are only ever
#: removed from the front, by the fold that copied them, so an append racing a fold lands
#: after them and is kept.
_ledger = array.array("q")
_append = _ledger.append
_ALLOC, _FREE, _RESIZE = 0, 1, 2
_KIND_BITS = 3
_OP_BITS = 2
_SHIFT = _KIND_BITS + _OP_BITS
_ALLOC_CODE = {k: _ALLOC << _KIND_BITS | i for i, k in enumerate(KINDS)}
_FREE_CODE = {k: _FREE << _KIND_BITS | i for i, k in enumerate(KINDS)}
_RESIZE_CODE = {k: _RESIZE << _KIND_BITS | i for i, k in enumerate(KINDS)}
#: The appending thread folds once this many entries wait (about 0.1 ms of numpy, some 30 ns an entry).
_FOLD_AT = 4096

#: Guards the counters and each fold.  Appenders fold only if they get it at once: a
#: collection inside a fold or a snapshot may release a collected buffer on the same
#: thread, whose count is then appended and folded by the next one.
_lock = threading.Lock()
_counters = {kind: _Counters() for kind in KINDS}


def record_alloc(kind: str, nbytes: int, _codes: dict[str, int] = _ALLOC_CODE) -> None:
    """Count an allocation of ``nbytes`` bytes of ``kind``."""
    # (The code tables are bound as defaults: every buffer's open and close counts, and a
    # global lookup is a tenth of this function.)
    _append(nbytes << _SHIFT | _codes[kind])
    if len(_ledger) >= _FOLD_AT:
        _fold_if_free()


def record_resize(kind: str, delta: int) -> None:
    """An allocation changed size in place by ``delta`` bytes (VMM grow: > 0, shrink: < 0)."""
    _append(delta << _SHIFT | _RESIZE_CODE[kind])
    if len(_ledger) >= _FOLD_AT:
        _fold_if_free()


def record_free(kind: str, nbytes: int, _codes: dict[str, int] = _FREE_CODE) -> None:
    """Count the release of an allocation of ``nbytes`` bytes of ``kind``."""
    _append(nbytes << _SHIFT | _codes[kind])
    if len(_ledger) >= _FOLD_AT:
        _fold_if_free()


def _fold_if_free() -> None:
    if _lock.acquire(blocking=False):
        try:
            _fold()
        finally:
            _lock.release()


def _fold() -> None:
    """Sum the waiting entries into the counters, in order (the caller holds :data:`_lock`)."""
    n = len(_ledger)
    if not n:
        return
    entries = _ledger[:n]  # a copy: appends from here on go after the first n
    del _ledger[:n]
    v = np.frombuffer(entries, dtype=np.int64)
    kinds = v & ((1 << _KIND_BITS) - 1)
    ops = (v >> _KIND_BITS) & ((1 << _OP_BITS) - 1)
    sizes = v >> _SHIFT  # arithmetic: a shrink's negative delta comes back whole
    for i in np.unique(kinds).tolist():
        c = _counters[KINDS[i]]
        mine = kinds == i
        op, size = ops[mine], sizes[mine]
        allocs = op == _ALLOC
        frees = op == _FREE
        live = np.cumsum(np.where(frees, -size, size)) + c.live_bytes
        c.peak_bytes = max(c.peak_bytes, int(live.max()))
        c.live_bytes = int(live[-1])
        made, gone = int(allocs.sum()), int(frees.sum())
        c.live_count += made - gone
        c.total_allocations += made
        c.total_bytes += int(size[allocs].sum()) + int(np.maximum(size[op == _RESIZE], 0).sum())


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


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)
