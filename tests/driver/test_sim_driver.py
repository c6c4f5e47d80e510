"""The simulated driver itself (CPU only): stream work runs late, waits pull in dependencies, seeded order.

These build a :class:`umem_numba._driver._simulated.SimDriver` of their own, so they
run in the CPU suite too (no numba simulator needed: no kernels, only copies,
memsets, events and streams).
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

from umem_numba import UnsupportedError
from umem_numba._driver import _simulated as _sim_driver
from umem_numba._driver._simulated import SimDriver, SimulatedFault, tracing


def ok(res):
    assert res[0] == 0, f"simulated driver returned {res[0]}"
    return res[1] if len(res) == 2 else res[1:]


def host(ptr: int, n: int, dtype=np.float32) -> np.ndarray:
    """A numpy view of simulated memory (it is host memory)."""
    buf = (ctypes.c_byte * (n * np.dtype(dtype).itemsize)).from_address(ptr)
    return np.frombuffer(buf, dtype)


@pytest.fixture
def drv() -> SimDriver:
    return SimDriver(seed_value=1234)


def test_sim_queued_copy_is_not_visible_before_a_sync(drv, rng):
    n = 1024
    src = ok(drv.cuMemHostAlloc(4 * n, 0))
    dst = ok(drv.cuMemAlloc(4 * n))
    data = rng.random(n, dtype=np.float32) + 1
    host(src, n)[:] = data
    s = ok(drv.cuStreamCreate(0))
    ok((*drv.cuMemcpyAsync(dst, src, 4 * n, s), None))
    assert not host(dst, n).any(), "the copy ran at the call: device work must wait until it is needed"
    host(src, n)[:] = 0  # a host write lands at once: the late copy sees it
    ok((*drv.cuStreamSynchronize(s), None))
    assert not host(dst, n).any()
    host(src, n)[:] = data
    ok((*drv.cuMemcpyAsync(dst, src, 4 * n, s), None))
    ok((*drv.cuCtxSynchronize(), None))
    np.testing.assert_array_equal(host(dst, n), data)


def test_sim_pageable_copies_complete_as_the_driver_does(drv, rng):
    """A pageable source is read at the call, a pageable destination written before it returns."""
    n = 256
    dev = ok(drv.cuMemAlloc(4 * n))
    s = ok(drv.cuStreamCreate(0))
    data = rng.random(n, dtype=np.float32) + 1
    src = data.copy()
    ok((*drv.cuMemcpyAsync(dev, src.ctypes.data, 4 * n, s), None))
    src[:] = 0  # too late: the driver staged it
    out = np.zeros(n, np.float32)
    ok((*drv.cuMemcpyAsync(out.ctypes.data, dev, 4 * n, s), None))
    np.testing.assert_array_equal(out, data)


def test_sim_stream_wait_pulls_in_the_awaited_work(drv, rng):
    n = 512
    a = ok(drv.cuMemHostAlloc(4 * n, 0))
    b = ok(drv.cuMemAlloc(4 * n))
    c = ok(drv.cuMemAlloc(4 * n))
    data = rng.random(n, dtype=np.float32) + 1
    host(a, n)[:] = data
    s1, s2 = ok(drv.cuStreamCreate(1)), ok(drv.cuStreamCreate(1))  # non-blocking: no implicit order
    ev = ok(drv.cuEventCreate(2))
    ok((*drv.cuMemcpyAsync(b, a, 4 * n, s1), None))
    ok((*drv.cuEventRecord(ev, s1), None))
    ok((*drv.cuStreamWaitEvent(s2, ev, 0), None))
    ok((*drv.cuMemcpyAsync(c, b, 4 * n, s2), None))
    ok((*drv.cuStreamSynchronize(s2), None))
    np.testing.assert_array_equal(host(c, n), data)


def test_sim_missing_wait_gives_a_stale_read(rng):
    """Without the wait, the reader on s2 runs before the writer on s1: a stale read, for every seed.

    A synchronisation runs only the work it needs (as late as possible), so the
    writer that nothing orders before the reader has not run.
    """
    n = 512
    for seed in range(10):
        drv = SimDriver(seed_value=seed)
        a = ok(drv.cuMemHostAlloc(4 * n, 0))
        b, c = ok(drv.cuMemAlloc(4 * n)), ok(drv.cuMemAlloc(4 * n))
        host(a, n)[:] = rng.random(n, dtype=np.float32) + 1
        s1, s2 = ok(drv.cuStreamCreate(1)), ok(drv.cuStreamCreate(1))
        drv.cuMemcpyAsync(b, a, 4 * n, s1)
        drv.cuMemcpyAsync(c, b, 4 * n, s2)  # no wait for s1: the bug
        drv.cuStreamSynchronize(s2)
        assert not host(c, n).any(), f"seed {seed}: the unordered writer ran before the reader"
        drv.cuCtxSynchronize()
        np.testing.assert_array_equal(host(b, n), host(a, n))


def _scenario(drv: SimDriver, streams: int = 6, ops: int = 8) -> list[tuple[int, str]]:
    mem = ok(drv.cuMemAlloc(4096))
    handles = [ok(drv.cuStreamCreate(1)) for _ in range(streams)]
    with tracing(drv) as trace:
        for k in range(ops):
            for i, s in enumerate(handles):
                drv.cuMemsetD8Async(mem + 64 * i, k, 64, s)
        drv.cuCtxSynchronize()
    return [sid for sid, _ in trace]


def test_sim_same_seed_gives_the_same_order():
    assert _scenario(SimDriver(seed_value=99)) == _scenario(SimDriver(seed_value=99))


def test_sim_different_seeds_give_different_orders():
    orders = {tuple(_scenario(SimDriver(seed_value=seed))) for seed in range(5)}
    assert len(orders) > 1
    # Within each stream the order is kept.
    for order in orders:
        ids = sorted(set(order))
        assert all(order.count(i) == 8 for i in ids)


def test_sim_stream_order_is_kept_within_a_stream(drv):
    mem = ok(drv.cuMemAlloc(64))
    s = ok(drv.cuStreamCreate(0))
    for v in range(1, 30):
        drv.cuMemsetD8Async(mem, v, 64, s)
    drv.cuStreamSynchronize(s)
    assert (host(mem, 64, np.uint8) == 29).all()


def test_sim_legacy_stream_orders_after_blocking_streams_only(drv, monkeypatch):
    monkeypatch.setattr(_sim_driver, "SPREAD", 0.0)  # run only what is needed
    n = 64
    a, b = ok(drv.cuMemAlloc(n)), ok(drv.cuMemAlloc(n))
    blocking, nonblocking = ok(drv.cuStreamCreate(0)), ok(drv.cuStreamCreate(1))
    drv.cuMemsetD8Async(a, 5, n, blocking)
    drv.cuMemsetD8Async(b, 6, n, nonblocking)
    drv.cuStreamSynchronize(0)  # an empty legacy stream: nothing is needed
    assert not host(a, n, np.uint8).any() and not host(b, n, np.uint8).any()
    drv.cuMemsetD8Async(a, 7, n, 0)  # legacy work comes after the blocking stream's
    drv.cuStreamSynchronize(0)
    assert (host(a, n, np.uint8) == 7).all()
    assert not host(b, n, np.uint8).any(), "a non-blocking stream was ordered before the legacy stream"


def test_sim_stream_ids_unique_and_per_thread_stream_differs_per_thread(drv):
    s1, s2 = ok(drv.cuStreamCreate(0)), ok(drv.cuStreamCreate(0))
    ids = {ok(drv.cuStreamGetId(h)) for h in (0, s1, s2, 2)}
    assert len(ids) == 4
    assert ok(drv.cuStreamGetId(0)) == ok(drv.cuStreamGetId(1))
    other: list[int] = []
    t = threading.Thread(target=lambda: other.append(ok(drv.cuStreamGetId(2))))
    t.start()
    t.join()
    assert other[0] != ok(drv.cuStreamGetId(2))


def test_sim_query_is_not_ready_first_then_done_at_a_random_poll(drv):
    n = 64
    mem = ok(drv.cuMemAlloc(n))
    s = ok(drv.cuStreamCreate(0))
    polls = []
    for v in range(1, 20):
        drv.cuMemsetD8Async(mem, v, n, s)
        assert drv.cuStreamQuery(s)[0] == 600, "work just queued should still be running"
        for k in range(2, 30):
            if drv.cuStreamQuery(s)[0] == 0:
                assert (host(mem, n, np.uint8) == v).all(), "the query said done before the work ran"
                polls.append(k)
                break
        else:
            raise AssertionError("polling never saw the work finish")
    assert len(set(polls)) > 1, "the poll that sees the work done should vary"


def test_sim_pool_free_poisons_and_reuse_waits_for_the_free(drv):
    props = drv.CUmemPoolProps()
    props.allocType = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    props.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    pool = ok(drv.cuMemPoolCreate(props))
    s = ok(drv.cuStreamCreate(0))
    p = ok(drv.cuMemAllocFromPoolAsync(512, pool, s))
    drv.cuMemsetD8Async(p, 3, 512, s)
    drv.cuMemFreeAsync(p, s)
    q = ok(drv.cuMemAllocFromPoolAsync(512, pool, s))  # same stream: reused at once, in stream order
    assert q == p
    drv.cuStreamSynchronize(s)
    assert (host(q, 512, np.uint8) == 0xFF).all(), "freed pool memory should hold garbage after the free runs"


def test_sim_device_work_on_freed_memory_faults(drv):
    props = drv.CUmemPoolProps()
    props.allocType = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    props.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    pool = ok(drv.cuMemPoolCreate(props))
    s1, s2 = ok(drv.cuStreamCreate(1)), ok(drv.cuStreamCreate(1))
    p = ok(drv.cuMemAllocFromPoolAsync(512, pool, s1))
    drv.cuMemFreeAsync(p, s1)
    drv.cuStreamSynchronize(s1)
    assert drv.cuMemsetD8Async(p, 1, 512, s2)[0] != 0


def test_sim_refuses_what_it_cannot_do(drv):
    with pytest.raises(UnsupportedError, match=r"cuIpcGetEventHandle.*simulator"):
        drv.cuIpcGetEventHandle(0)
    with pytest.raises(UnsupportedError, match=r"cuCtxEnablePeerAccess.*simulator"):
        drv.cuCtxEnablePeerAccess(0, 0)
    assert drv.cuDeviceGetCount() == (0, 1)


def test_sim_simulated_fault_is_an_error(drv):
    mem = ok(drv.cuMemAlloc(64))
    s = ok(drv.cuStreamCreate(0))
    drv.cuMemsetD8Async(mem, 1, 64, s)
    # Out of bounds of the allocation: the memset faults when it runs.
    drv.cuMemsetD8Async(mem + 32, 1, 64, s)
    with pytest.raises(SimulatedFault):
        drv.cuStreamSynchronize(s)
