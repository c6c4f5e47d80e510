"""No device use registers on a buffer once ``close()`` has returned.

A launch checks that its buffers are open when it takes their addresses, then registers its use
(``Tracker.begin_use``) and issues the kernel.  ``close()`` blocked new registrations only while
it ran: a launch that took the addresses before a ``close()`` on another thread and registered
after it returned wrote memory that host views still held, and nothing waited for it
(``test_coherence_threads.py::test_close_racing_launches_and_host_views`` failed at times on
2 x H100: a view read before the kernel's write).  The registration itself must refuse.
"""

from __future__ import annotations

import numpy as np
import pytest

import umem_numba as um
from umem_numba import _driver


@pytest.mark.gpu
@pytest.mark.parametrize(
    "make",
    [
        "managed_zeros",
        pytest.param(
            "pool",
            marks=pytest.mark.xfail(
                strict=True,
                reason="open: a pool buffer's record goes to the free list at close (recycled, open for "
                "the next buffer); a launch registering late files its event there, and the next buffer "
                "waits for it, but it may still write that buffer's memory after its initialisation",
            ),
        ),
    ],
)
def test_no_device_use_registers_after_close(make):
    pool = um.MemoryPool("device") if make == "pool" else None
    buf = um.managed_zeros(64, np.float64) if make == "managed_zeros" else um.DeviceBuffer.zeros(64, pool=pool)
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
