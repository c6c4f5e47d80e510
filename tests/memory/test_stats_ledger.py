"""Allocation statistics counted without a lock: appended to a ledger, summed in bulk.

Every count is one ``array.append`` (a C call under the GIL); folds sum the waiting entries in
the order they were appended.  These tests drive the counters directly (the ``"emm"`` kind,
which only numba's memory-manager plugin counts otherwise) and check exact totals and peaks
across folds, threads and a fold that a collection re-enters.
"""

from __future__ import annotations

import functools

import numpy as np
from support.helpers import while_threads_run

from umem_numba._memory import _stats

KIND = "emm"


def _snap() -> _stats.KindStats:
    return _stats.stats()[KIND]  # type: ignore[return-value]


def test_threads_counting_while_another_folds_lose_nothing(rng, monkeypatch):
    monkeypatch.setattr(_stats, "_FOLD_AT", 97)  # folds all the time, from every thread
    before = _snap()
    sizes = [rng.integers(1, 1 << 40, 5000).tolist() for _ in range(6)]

    def count(mine: list[int]) -> None:
        for n in mine:
            _stats.record_alloc(KIND, n)
        for n in mine:
            _stats.record_free(KIND, n)

    while_threads_run([functools.partial(count, s) for s in sizes], _stats.stats)
    after = _snap()
    assert after.live_count == before.live_count and after.live_bytes == before.live_bytes
    assert after.total_allocations - before.total_allocations == 6 * 5000
    assert after.total_bytes - before.total_bytes == sum(map(sum, sizes))


def test_peak_is_the_highest_live_total_in_the_order_counted_across_folds(rng, monkeypatch):
    for fold_at in (1, 3, 4096):
        monkeypatch.setattr(_stats, "_FOLD_AT", fold_at)
        _stats.reset_peak()
        base = _snap().live_bytes
        live, peak, held = base, base, []
        for _ in range(300):
            if held and rng.random() < 0.45:
                n = held.pop(int(rng.integers(len(held))))
                _stats.record_free(KIND, n)
                live -= n
            else:
                n = int(rng.integers(1, 1 << 33))
                held.append(n)
                _stats.record_alloc(KIND, n)
                live += n
            peak = max(peak, live)
        got = _snap()
        assert (got.live_bytes, got.peak_bytes) == (live, peak), f"fold every {fold_at}"
        for n in held:
            _stats.record_free(KIND, n)
    assert _snap().live_bytes == base


def test_resizes_move_live_bytes_both_ways_and_count_only_growth():
    before = _snap()
    _stats.record_alloc(KIND, 1 << 21)
    _stats.record_resize(KIND, 3 << 21)
    _stats.record_resize(KIND, -(2 << 21))  # a shrink: negative, sign kept through the ledger
    mid = _snap()
    assert mid.live_bytes - before.live_bytes == 2 << 21
    assert mid.total_bytes - before.total_bytes == 4 << 21
    assert mid.peak_bytes >= before.live_bytes + (4 << 21)
    _stats.record_free(KIND, 2 << 21)
    after = _snap()
    assert (after.live_count, after.live_bytes) == (before.live_count, before.live_bytes)


def test_a_count_made_inside_a_fold_waits_for_the_next_one(monkeypatch):
    """A collection inside a fold may count a release on the same thread: appended, folded later."""
    real = np.frombuffer
    inner: list[int] = []

    def reentering(*args, **kwargs):
        if not inner:
            inner.append(1)
            _stats.record_free(KIND, 4096)  # as a finalizer would; its fold finds the lock taken
        return real(*args, **kwargs)

    before = _snap()
    _stats.record_alloc(KIND, 4096)
    monkeypatch.setattr(_stats.np, "frombuffer", reentering)
    monkeypatch.setattr(_stats, "_FOLD_AT", 1)
    first = _snap()  # the fold that the release re-enters
    monkeypatch.setattr(_stats.np, "frombuffer", real)
    assert inner and first.live_count == before.live_count + 1
    after = _snap()
    assert (after.live_count, after.live_bytes) == (before.live_count, before.live_bytes)
