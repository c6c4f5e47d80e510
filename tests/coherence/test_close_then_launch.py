"""No device use registers on a buffer once ``close()`` has returned.

A launch checks that its buffers are open when it takes their addresses, then registers its use
(``Tracker.begin_use``) and issues the kernel.  ``close()`` blocked new registrations only while
it ran: a launch that took the addresses before a ``close()`` on another thread and registered
after it returned wrote memory that host views still held, and nothing waited for it
(``test_coherence_threads.py::test_close_racing_launches_and_host_views`` failed at times on
2 x H100: a view read before the kernel's write).  The registration itself must refuse.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from numba import cuda

import umem_numba as um
from umem_numba import _driver
from umem_numba._memory._tracker import Tracker


@pytest.mark.gpu
@pytest.mark.parametrize("make", ["managed_zeros"])
def test_no_device_use_registers_after_close(make):
    pool = None
    buf = um.managed_zeros(64, np.float64) if make == "managed_zeros" else um.DeviceBuffer.zeros(64, np.float64)
    view = buf.host if make == "managed_zeros" else None  # a host view keeps the memory mapped after close
    tracker = buf._coherence_tracker
    try:
        buf.close()
        key = _driver.stream_key(0)
        try:
            tracker.begin_use(key, True, "a launch that took the address before close()")
        except um.BufferClosedError as exc:
            assert "closed" in str(exc), exc
        else:
            tracker.end_use(key, None, True, issued=False)  # undo it, or the pool's close waits for it
            pytest.fail("a device use registered on a closed buffer")
        assert not tracker.inflight, "a refused registration left a use in flight"
    finally:
        del view
        if pool is not None:
            pool.close()


@cuda.jit
def _fill(a, v):
    i = cuda.grid(1)
    if i < a.size:
        a[i] = v


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["launch", "copy"])
def test_work_that_took_a_pool_buffer_before_close_never_writes_the_next_buffer(op, rng, monkeypatch):
    """Thread T takes a pool buffer's address (a launch, a copy into it) and stops just before
    registering; the main thread closes the buffer and the pool hands its block, with its record,
    to a new buffer, which it fills.  T's work must be refused, and the new buffer keep its values."""
    pool = um.MemoryPool("device")
    a = um.DeviceBuffer.zeros(64, np.float64, pool=pool)
    kernel = um.jit(_fill)
    kernel[1, 64](a, 1.0)  # compiled, and its direct call cached: the launch T makes is the fast one
    a.synchronize()
    tracker = a._coherence_tracker
    at_registration, go = threading.Event(), threading.Event()
    begin_use = Tracker.begin_use

    def paused(self, *args, **kwargs):
        if threading.current_thread().name == "late-work" and not at_registration.is_set():
            at_registration.set()
            assert go.wait(60), "the main thread never let the late work go on"
        return begin_use(self, *args, **kwargs)

    monkeypatch.setattr(Tracker, "begin_use", paused)
    outcome: list[BaseException | None] = []

    def late_work() -> None:
        try:
            if op == "launch":
                kernel[1, 64](a, 7.0)
            else:
                a.copy_from_host(np.full(64, 7.0), staging=False)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=late_work, name="late-work")
    t.start()
    try:
        assert at_registration.wait(60), "the late work never reached its registration"
        a.close()
        b = um.DeviceBuffer.empty(64, np.float64, pool=pool)
        assert b._coherence_tracker is tracker, "the pool did not hand the closed buffer's block on (no race made)"
        values = rng.random(64)
        b.copy_from_host(values)
    finally:
        go.set()
        t.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], um.BufferClosedError), outcome
    np.testing.assert_array_equal(b.copy_to_host(), values)
    b.synchronize()
    np.testing.assert_array_equal(b.copy_to_host(), values)
    b.close()
    pool.close()
