"""The fast paths of default allocations (#28 item 1): an idle close, reused records, no needless capture check.

- A buffer closed with nothing pending, in flight or refusing (the allocate / fill / read /
  close loop) is closed for good under one lock and released with no wait and no driver
  call; one with device work pending takes the full close, which waits (sleeping writers,
  20 trials, in ``test_allocation_cache.py`` and below).
- The next default ``ManagedBuffer`` over cached memory reopens the closed buffer's record
  (a new epoch, as a pool's free list does): a registration that took the closed buffer's
  address is refused; a record that a live graph still counts is not reused.
- A default ``DeviceBuffer`` on the legacy stream whose free-list block needs no ordering makes
  no driver call, the capture check included (the legacy stream never captures itself); a
  block that needs ordering is checked first, and refused inside another stream's capture
  with the capture intact and the block kept for the next allocation.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from support.helpers import ORDERING_TRIALS, random_array, sleeping

import umem_numba as um
from umem_numba import _driver
from umem_numba._driver import _sim
from umem_numba._errors import BufferClosedError
from umem_numba._memory import _cache

N = 1 << 15
TRIALS = 3 if _sim.active() else ORDERING_TRIALS
SLEEP_MS = 1 if _sim.active() else 20
BLOCKS = (N + 127) // 128


#: Every test here runs with the allocation cache on (tests/memory/conftest.py).
pytestmark = pytest.mark.usefixtures("cache_on")


@pytest.fixture
def driver_calls(monkeypatch):
    """Every ``_driver.call`` and capture check made while the test runs, by name."""
    names: list[str] = []
    real_call, real_capturing = _driver.call, _driver.is_capturing

    def call(name, *args, **kw):
        names.append(name)
        return real_call(name, *args, **kw)

    def is_capturing(handle):
        names.append("cuStreamIsCapturing")
        return real_capturing(handle)

    monkeypatch.setattr(_driver, "call", call)
    monkeypatch.setattr(_driver, "is_capturing", is_capturing)
    return names


@pytest.mark.gpu
def test_an_idle_close_makes_no_driver_call_and_the_memory_is_reused(rng, driver_calls):
    um.ManagedBuffer.empty(1, np.float32).close()  # the cache's lists exist (their limit is asked once)
    a = um.ManagedBuffer.empty(N, np.float32)
    ptr = a._alloc.ptr
    um.coherent(sleeping.fill)[BLOCKS, 128, cuda.stream()](a, 2.5, 0)
    np.testing.assert_array_equal(a.host, np.full(N, 2.5, np.float32))  # settled: nothing pending now
    driver_calls.clear()
    a.close()
    assert driver_calls == [], f"an idle close called the driver: {driver_calls}"
    assert a.closed and a._alloc is None
    b = um.ManagedBuffer.empty(N, np.float32)
    assert b._alloc.ptr == ptr, "the idle close did not cache the allocation"
    fresh = random_array(rng, N, np.float32)
    b.host[:] = fresh
    out = um.ManagedBuffer.empty(N, np.float32)
    um.coherent(sleeping.copy)[BLOCKS, 128, cuda.stream()](b, out, 0)
    np.testing.assert_array_equal(out.host, fresh)
    b.close()
    out.close()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["managed", "device"])
def test_a_close_with_a_sleeping_writer_on_another_stream_waits_for_it(rng, kind):
    """The writer sleeps on s1; close; the next default buffer (the same memory) gets fresh values."""
    cls = um.ManagedBuffer if kind == "managed" else um.DeviceBuffer
    s1 = cuda.stream()
    for trial in range(TRIALS):
        a = cls.empty(N, np.float64)
        ptr = a._alloc.ptr
        um.coherent(sleeping.fill)[BLOCKS, 128, s1](a, -1.0, SLEEP_MS)
        a.close()
        b = cls.empty(N, np.float64)
        assert b._alloc.ptr == ptr, f"trial {trial}: not reused"
        fresh = random_array(rng, N, np.float64)
        b.copy_from_host(fresh)
        cuda.synchronize()  # had the sleeping writer outlived the close or the reuse, it would have run by now
        np.testing.assert_array_equal(b.copy_to_host(), fresh, err_msg=f"trial {trial}: the old kernel wrote")
        b.close()


@pytest.mark.gpu
def test_cached_memory_reopens_the_closed_buffers_record_under_a_new_epoch():
    a = um.ManagedBuffer.empty(N, np.float32)
    record = a._alloc.tracker
    epoch = record.epoch
    a.close()
    b = um.ManagedBuffer.empty(N, np.float32)
    assert b._alloc.tracker is record, "the record was not reused"
    assert record.epoch == epoch + 1
    # A launch that took the closed buffer's address (its epoch) and registers only now writes b's memory.
    with pytest.raises(BufferClosedError, match="closed"):
        record.begin_use(_driver.stream_key(0), True, "a late launch", epoch=epoch)
    with pytest.raises(BufferClosedError):
        um.coherent(sleeping.fill)[BLOCKS, 128, 0](a, 1.0, 0)  # the closed buffer itself
    um.coherent(sleeping.fill)[BLOCKS, 128, 0](b, 4.0, 0)
    np.testing.assert_array_equal(b.host, np.full(N, 4.0, np.float32))
    b.close()


@pytest.mark.gpu
def test_a_record_a_live_graph_counts_stays_with_the_closed_buffer():
    s = cuda.stream()
    a = um.ManagedBuffer.zeros(N, np.float32)
    record = a._alloc.tracker
    with um.capture(s) as graph:
        um.coherent(sleeping.fill)[BLOCKS, 128, s](a, 1.0, 0)
    a.close()
    b = um.ManagedBuffer.empty(N, np.float32)
    assert b._alloc.tracker is not record
    with pytest.raises(BufferClosedError):
        graph.launch(s)
    b.close()
    del graph


@pytest.mark.gpu
def test_a_legacy_free_list_block_that_needs_no_ordering_asks_the_driver_nothing(driver_calls):
    for _ in range(3):  # the first reuses order the block on the legacy stream once
        um.DeviceBuffer.empty(N, np.float32).close()
    a = um.DeviceBuffer.empty(N, np.float32)
    ptr = a._alloc.ptr
    a.close()
    driver_calls.clear()
    b = um.DeviceBuffer.empty(N, np.float32)
    assert b._alloc.ptr == ptr
    assert "cuStreamIsCapturing" not in driver_calls and "cuStreamWaitEvent" not in driver_calls, driver_calls
    b.close()


@pytest.mark.gpu
def test_a_legacy_block_that_needs_ordering_is_refused_inside_a_capture_and_kept(rng):
    """Its last use was on s2: reusing it on the legacy stream waits on the stream, which a capture forbids."""
    s, s2 = cuda.stream(), cuda.stream()  # blocking streams: a capture on s forbids legacy-stream work
    c = um.DeviceBuffer.from_array(random_array(rng, N, np.float32))
    um.DeviceBuffer.empty(N, np.float32).close()  # the default pool is made, the legacy stream known
    a = um.DeviceBuffer.empty(N, np.float32)
    ptr = a._alloc.ptr
    um.coherent(sleeping.fill)[BLOCKS, 128, s2](a, 1.0, 0)
    a.close()
    with um.capture(s) as graph:
        with pytest.raises(um.CoherenceError, match="capturing a CUDA graph"):
            um.DeviceBuffer.empty(N, np.float32)
        um.coherent(sleeping.fill)[BLOCKS, 128, s](c, 7.0, 0)  # the capture goes on
    graph.launch(s)
    np.testing.assert_array_equal(c.copy_to_host(), np.full(N, 7.0, np.float32))
    b = um.DeviceBuffer.empty(N, np.float32)
    assert b._alloc.ptr == ptr, "the refused allocation lost its free-list block"
    fresh = random_array(rng, N, np.float32)
    b.copy_from_host(fresh)
    np.testing.assert_array_equal(b.copy_to_host(), fresh)
    for buf in (b, c):
        buf.close()
    del graph


@pytest.mark.gpu
def test_pinned_memory_read_by_a_late_copy_is_reused_only_after_the_copy(rng):
    """A copy out of a default PinnedBuffer waits behind a sleeping kernel on s1; close; the memory is reused."""
    s1 = cuda.stream()
    gate = cuda.device_array(N, np.float32)
    for trial in range(TRIALS):
        old = random_array(rng, N, np.float32)
        p = um.PinnedBuffer.from_array(old)
        ptr = p._alloc.ptr
        d = um.DeviceBuffer.empty(N, np.float32)
        sleeping.fill[BLOCKS, 128, s1](gate, 0.0, SLEEP_MS)  # s1 sleeps before the copy reads p
        d.copy_from_host(p, stream=s1)
        p.close()
        q = um.PinnedBuffer.empty(N, np.float32)
        assert q._alloc.ptr == ptr, f"trial {trial}: the pinned memory was not reused"
        q.host[:] = random_array(rng, N, np.float32)
        np.testing.assert_array_equal(d.copy_to_host(), old, err_msg=f"trial {trial}: the copy read the new buffer")
        q.close()
        d.close()


@pytest.mark.gpu
def test_only_default_flags_pinned_memory_is_cached():
    p = um.PinnedBuffer.empty(N, np.float32, um.HostAllocFlags.DEVICEMAP)
    p.close()
    assert _cache.cached_bytes() == 0, "memory allocated with flags joined the cache"
    q = um.PinnedBuffer.empty(N, np.float32)
    cached = q._alloc.ptr
    q.close()
    assert _cache.cached_bytes() == _cache.rounded(N * 4)
    r = um.PinnedBuffer.empty(N, np.float32, um.HostAllocFlags.DEVICEMAP)
    assert r._alloc.ptr != cached, "a buffer with flags took default-flags memory from the cache"
    r.close()
    s = um.PinnedBuffer.empty(N, np.float32)
    assert s._alloc.ptr == cached
    s.close()
