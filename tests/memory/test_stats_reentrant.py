"""Allocation statistics under a garbage collection that releases a buffer (a finalizer counting a release).

``stats()`` builds its snapshot under the counters' lock; building it allocates, so a collection
may start there and run a collected buffer's release on the same thread, which counts the release
under the same lock: that must not deadlock.
"""

from __future__ import annotations

import gc
import threading

import pytest

import umem_numba as um
from umem_numba._memory import _stats


@pytest.mark.gpu
def test_stats_survives_a_collection_inside_it_that_releases_a_buffer(monkeypatch):
    real = _stats.KindStats
    collected: list[int] = []

    def collecting(*args):
        if not collected:  # where the snapshot allocates, under the lock: a collection starts here
            collected.append(gc.collect())
        return real(*args)

    monkeypatch.setattr(_stats, "KindStats", collecting)
    done: list[dict] = []

    def body() -> None:
        buf = um.ManagedBuffer.empty(1024)
        cycle: list = [buf]
        cycle.append(cycle)  # only a collection frees it
        del buf, cycle
        done.append(um.stats())

    worker = threading.Thread(target=body, daemon=True)
    worker.start()
    worker.join(60)
    assert collected and collected[0] > 0, "the collection found nothing to release"
    assert done, "stats() deadlocked: a collection inside it released a buffer on the same thread"
    assert done[0]["managed"].live_count >= 0
