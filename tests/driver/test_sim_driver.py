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


def _queued_upload(drv: SimDriver, rng, n: int):
    """Fresh random data in pinned memory, copied to device memory on a new stream (queued, not run)."""
    src = ok(drv.cuMemHostAlloc(4 * n, 0))
    dst = ok(drv.cuMemAlloc(4 * n))
    data = rng.random(n, dtype=np.float32) + 1
    host(src, n)[:] = data
    s = ok(drv.cuStreamCreate(0))
    ok((*drv.cuMemcpyAsync(dst, src, 4 * n, s), None))
    return src, dst, data, s


def test_sim_queued_copy_is_not_visible_before_a_sync(drv, rng):
    n = 1024
    src, dst, data, s = _queued_upload(drv, rng, n)
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


def test_sim_legacy_stream_orders_after_blocking_streams_only(drv):
    drv.reseed(drv.seed, spread=0.0)  # run only what is needed (the default)
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


def test_sim_device_attributes_answer_by_value_so_aliases_agree(drv):
    """``..._VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`` is the binding's alias of ``..._VIRTUAL_ADDRESS_...``.

    The member's name is the latter; looked up by name, the simulated driver answered 0 to the
    former, and ``MultiGPUHeat(halo="vmm")`` fell back to copies under the simulator.
    """
    attrs = drv.CUdevice_attribute
    for name in ("VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", "VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED"):
        assert ok(drv.cuDeviceGetAttribute(getattr(attrs, "CU_DEVICE_ATTRIBUTE_" + name), 0)) == 1
    assert ok(drv.cuDeviceGetAttribute(attrs.CU_DEVICE_ATTRIBUTE_WARP_SIZE, 0)) == 32
    assert drv.cuDeviceGetAttribute(attrs.CU_DEVICE_ATTRIBUTE_WARP_SIZE, 1)[0] != 0


def test_sim_fast_scalar_casts_answer_as_numba_types_do(rng):
    """A simulated kernel's ``uint64(i)`` skips numba's ``Type.__call__`` and still is numba's type."""
    from numba import complex64, float32, uint64
    from numba.core import types
    from numba.np import numpy_support

    namespace = {"uint64": uint64, "float32": float32, "complex64": complex64}
    exec("def casting(i):\n    return uint64(i) + float32(0.5) + complex64(i)\n", namespace)
    fast = _sim_driver._kernels._fast_scalars(namespace["casting"])
    assert fast is not None and set(fast) == {"uint64", "float32", "complex64"}
    i = int(rng.integers(1, 1 << 40))
    for name, numba_type in (("uint64", uint64), ("float32", float32), ("complex64", complex64)):
        t = fast[name]
        assert isinstance(t, type(numba_type)) and isinstance(t, types.Type)
        assert numpy_support.as_dtype(t) == numpy_support.as_dtype(numba_type)
        for value in (i, np.uint32(7), 2.5, True):
            got, want = t(value), numba_type(value)
            assert type(got) is type(want) and got == want
        assert t(types.int32) == numba_type(types.int32)  # a signature, as numba's
    assert _sim_driver._kernels._fast_scalars(ok) is None


def test_sim_simulated_fault_is_an_error(drv):
    mem = ok(drv.cuMemAlloc(64))
    s = ok(drv.cuStreamCreate(0))
    drv.cuMemsetD8Async(mem, 1, 64, s)
    # Out of bounds of the allocation: the memset faults when it runs.
    drv.cuMemsetD8Async(mem + 32, 1, 64, s)
    with pytest.raises(SimulatedFault):
        drv.cuStreamSynchronize(s)


# ---------------------------------------------------------------------------
# Graph capture


def _mode(drv, name: str):
    return getattr(drv.CUstreamCaptureMode, f"CU_STREAM_CAPTURE_MODE_{name}")


def _status(drv, handle) -> str:
    err, status = drv.cuStreamIsCapturing(handle)
    assert err == 0
    return status.name.rsplit("_", 1)[-1]


def test_sim_capture_records_instead_of_running_and_a_replay_is_late_and_ordered(drv, rng):
    n = 256
    a, b = ok(drv.cuMemAlloc(4 * n)), ok(drv.cuMemAlloc(4 * n))
    s, s2 = ok(drv.cuStreamCreate(1)), ok(drv.cuStreamCreate(1))
    ok((*drv.cuStreamBeginCapture(s, _mode(drv, "GLOBAL")), None))
    assert _status(drv, s) == "ACTIVE" and _status(drv, s2) == "NONE"
    drv.cuMemsetD32Async(a, 7, n, s)
    drv.cuMemcpyAsync(b, a, 4 * n, s)  # captured after the memset: b gets a's value at replay
    ev = ok(drv.cuEventCreate(2))
    ok((*drv.cuEventRecord(ev, s), None))  # an event record adds no node
    graph = ok(drv.cuStreamEndCapture(s))
    assert _status(drv, s) == "NONE"
    assert drv.cuGraphGetNodes(graph)[-1] == 2
    drv.cuStreamSynchronize(s)
    drv.cuCtxSynchronize()
    assert not host(a, n, np.uint32).any() and not host(b, n, np.uint32).any(), "captured work ran"
    exe = ok(drv.cuGraphInstantiate(graph, 0))
    ok((*drv.cuGraphDestroy(graph), None))  # the executable graph keeps its own copy
    ok((*drv.cuGraphLaunch(exe, s2), None))
    assert not host(b, n, np.uint32).any(), "a graph launch ran at the call: it is stream work"
    drv.cuStreamSynchronize(s2)
    assert (host(a, n, np.uint32) == 7).all() and (host(b, n, np.uint32) == 7).all()
    # A replay runs the recorded work again, on the memory as it is then, in captured order.
    data = rng.integers(1, 1 << 30, n, dtype=np.uint32)
    host(b, n, np.uint32)[:] = data
    host(a, n, np.uint32)[:] = data
    ok((*drv.cuGraphLaunch(exe, s2), None))
    np.testing.assert_array_equal(host(b, n, np.uint32), data)
    drv.cuStreamSynchronize(s2)
    assert (host(b, n, np.uint32) == 7).all()
    ok((*drv.cuGraphExecDestroy(exe), None))


def test_sim_forked_streams_join_a_capture_and_must_join_back(drv):
    """A stream waiting for a captured event records into that capture; the capture ends once it joined back."""
    n = 4096
    a, b = ok(drv.cuMemAlloc(n)), ok(drv.cuMemAlloc(n))
    s, side = ok(drv.cuStreamCreate(1)), ok(drv.cuStreamCreate(1))
    fork, join = ok(drv.cuEventCreate(2)), ok(drv.cuEventCreate(2))
    ok((*drv.cuMemsetD32Async(b, 0, n // 4, s), None))
    drv.cuStreamSynchronize(s)
    ok((*drv.cuStreamBeginCapture(s, _mode(drv, "THREAD_LOCAL")), None))
    ok((*drv.cuMemsetD32Async(a, 5, n // 4, s), None))
    ok((*drv.cuEventRecord(fork, s), None))
    ok((*drv.cuStreamWaitEvent(side, fork, 0), None))  # the fork: side joins the capture
    assert _status(drv, side) == "ACTIVE"
    ok((*drv.cuMemcpyDtoDAsync(b, a, n, side), None))  # after the memset, on the other branch
    ok((*drv.cuEventRecord(join, side), None))
    assert drv.cuStreamEndCapture(side) == (903, None)  # CUDA_ERROR_STREAM_CAPTURE_UNMATCHED: not its origin
    ok((*drv.cuStreamWaitEvent(s, join, 0), None))  # joined back
    graph = ok(drv.cuStreamEndCapture(s))
    assert _status(drv, side) == "NONE" and _status(drv, s) == "NONE"
    drv.cuCtxSynchronize()
    assert not host(b, n // 4, np.uint32).any(), "captured work ran"
    exe = ok(drv.cuGraphInstantiate(graph, 0))
    ok((*drv.cuGraphLaunch(exe, s), None))
    drv.cuStreamSynchronize(s)
    assert (host(b, n // 4, np.uint32) == 5).all()
    # A fork whose work is not joined back: the capture ends with CUDA_ERROR_STREAM_CAPTURE_UNJOINED.
    ok((*drv.cuStreamBeginCapture(s, _mode(drv, "THREAD_LOCAL")), None))
    ok((*drv.cuEventRecord(fork, s), None))
    ok((*drv.cuStreamWaitEvent(side, fork, 0), None))
    ok((*drv.cuMemsetD32Async(b, 9, n // 4, side), None))
    assert drv.cuStreamEndCapture(s) == (904, None)
    assert _status(drv, side) == "NONE", "the capture ended for the forked stream too"
    drv.cuCtxSynchronize()
    assert (host(b, n // 4, np.uint32) == 5).all(), "work of the failed capture ran"
    ok((*drv.cuGraphExecDestroy(exe), None))
    ok((*drv.cuGraphDestroy(graph), None))


def test_sim_peer_copy_in_a_capture_fails_and_invalidates_it(drv):
    """cuMemcpyPeerAsync on a capturing stream: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, as an H200 (580) answers."""
    a, b = ok(drv.cuMemAlloc(256)), ok(drv.cuMemAlloc(256))
    s = ok(drv.cuStreamCreate(1))
    ctx = ok(drv.cuCtxGetCurrent())
    ok((*drv.cuStreamBeginCapture(s, _mode(drv, "THREAD_LOCAL")), None))
    assert drv.cuMemcpyPeerAsync(b, ctx, a, ctx, 256, s)[0] == 900
    assert _status(drv, s) == "INVALIDATED"
    assert drv.cuStreamEndCapture(s) == (901, None)


def test_sim_synchronising_a_capture_fails_and_invalidates_it(drv):
    mem = ok(drv.cuMemAlloc(64))
    s = ok(drv.cuStreamCreate(0))
    ev = ok(drv.cuEventCreate(2))
    for breach in ("stream", "query", "context", "event", "legacy"):
        ok((*drv.cuStreamBeginCapture(s, _mode(drv, "RELAXED")), None))
        drv.cuMemsetD8Async(mem, 1, 64, s)
        if breach == "stream":
            assert drv.cuStreamSynchronize(s)[0] == 900  # CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        elif breach == "query":
            assert drv.cuStreamQuery(s)[0] == 900
        elif breach == "context":
            assert drv.cuCtxSynchronize()[0] == 900
        elif breach == "event":
            ok((*drv.cuEventRecord(ev, s), None))
            assert drv.cuEventQuery(ev)[0] == 907  # CUDA_ERROR_CAPTURED_EVENT
        else:
            assert drv.cuStreamIsCapturing(0)[0] == 906  # asking is allowed: not invalidating
            assert _status(drv, s) == "ACTIVE"
            assert drv.cuMemsetD8Async(mem, 2, 64, 0)[0] == 906  # CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
        assert _status(drv, s) == "INVALIDATED", breach
        assert drv.cuStreamEndCapture(s) == (901, None), breach  # CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
        assert _status(drv, s) == "NONE"
    drv.cuCtxSynchronize()
    assert not host(mem, 64, np.uint8).any(), "work of an invalidated capture (or refused work) ran"


def test_sim_capture_modes_prohibit_unsafe_calls_as_documented(drv):
    s = ok(drv.cuStreamCreate(1))
    other: list[int] = []

    def alloc_elsewhere() -> None:
        t = threading.Thread(target=lambda: other.append(drv.cuMemAlloc(64)[0]))
        t.start()
        t.join()

    # Relaxed: allocations are allowed in the capturing thread and elsewhere.
    ok((*drv.cuStreamBeginCapture(s, _mode(drv, "RELAXED")), None))
    p = ok(drv.cuMemAlloc(64))
    alloc_elsewhere()
    assert other.pop() == 0
    assert ok(drv.cuStreamEndCapture(s)) is not None
    # Thread-local: prohibited in the capturing thread only.
    ok((*drv.cuStreamBeginCapture(s, _mode(drv, "THREAD_LOCAL")), None))
    alloc_elsewhere()
    assert other.pop() == 0 and _status(drv, s) == "ACTIVE"
    assert drv.cuMemFree(p)[0] == 900
    assert drv.cuStreamEndCapture(s) == (901, None)
    # Global: prohibited in every thread in global interaction mode, and it invalidates the capture.
    ok((*drv.cuStreamBeginCapture(s, _mode(drv, "GLOBAL")), None))
    alloc_elsewhere()
    assert other.pop() == 900
    assert drv.cuStreamEndCapture(s) == (901, None)
    ok((*drv.cuMemFree(p), None))


def test_sim_capture_refuses_by_name_what_it_does_not_simulate(drv):
    n = 4096
    managed = ok(drv.cuMemAllocManaged(n, 1))
    s, s2 = ok(drv.cuStreamCreate(1)), ok(drv.cuStreamCreate(1))
    ev = ok(drv.cuEventCreate(2))
    loc = drv.CUmemLocation()
    loc.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    ok((*drv.cuStreamBeginCapture(s, _mode(drv, "RELAXED")), None))
    with pytest.raises(UnsupportedError, match=r"cuMemPrefetchAsync.*capture.*simulator"):
        drv.cuMemPrefetchAsync(managed, n, loc, 0, s)
    with pytest.raises(UnsupportedError, match=r"pageable"):
        drv.cuMemcpyAsync(managed, np.zeros(n, np.uint8).ctypes.data, n, s)
    ok((*drv.cuEventRecord(ev, s), None))
    ok((*drv.cuStreamBeginCapture(s2, _mode(drv, "RELAXED")), None))
    with pytest.raises(UnsupportedError, match=r"merging two captures"):
        drv.cuStreamWaitEvent(s2, ev, 0)
    assert drv.cuGraphGetNodes(ok(drv.cuStreamEndCapture(s2)))[-1] == 0
    with pytest.raises(UnsupportedError, match=r"cuStreamGetCaptureInfo.*simulator"):
        drv.cuStreamGetCaptureInfo(s)
    assert drv.cuGraphGetNodes(ok(drv.cuStreamEndCapture(s)))[-1] == 0  # nothing refused was recorded


# ---------------------------------------------------------------------------
# Discards and host NUMA locations


def _location(drv, kind: str, ident: int = 0):
    loc = drv.CUmemLocation()
    loc.type = getattr(drv.CUmemLocationType, f"CU_MEM_LOCATION_TYPE_{kind}")
    loc.id = ident
    return loc


def _discarded(seed: int, data: np.ndarray) -> np.ndarray:
    drv = SimDriver(seed_value=seed)
    n = data.nbytes
    p = ok(drv.cuMemAllocManaged(n, 1))
    host(p, n, np.uint8)[:] = data
    s = ok(drv.cuStreamCreate(1))
    drv.cuMemsetD8Async(p, 9, n // 2, s)
    ok((*drv.cuMemDiscardBatchAsync([drv.CUdeviceptr(p)], [n // 2], 1, 0, s), None))
    assert (host(p, n, np.uint8) == data).all(), "the discard ran at the call: it is stream work"
    ok((*drv.cuStreamSynchronize(s), None))
    out = host(p, n, np.uint8).copy()
    np.testing.assert_array_equal(out[n // 2 :], data[n // 2 :])  # outside the range: kept
    assert (out[: n // 2] != 9).any() and (out[: n // 2] != data[: n // 2]).any(), "the discard left the values"
    return out


def test_sim_discards_garble_deterministically_per_seed(rng):
    data = rng.integers(0, 256, 8192, dtype=np.uint8)
    first = _discarded(5, data)
    np.testing.assert_array_equal(first, _discarded(5, data))
    assert not np.array_equal(first, _discarded(6, data))


def test_sim_discard_and_prefetch_and_host_numa_locations_read_back(drv):
    n = 4 * 4096
    p = ok(drv.cuMemAllocManaged(n, 1))
    s = ok(drv.cuStreamCreate(1))
    attr = drv.CUmem_range_attribute
    numa = _location(drv, "HOST_NUMA", 0)
    locs = [_location(drv, "DEVICE", 0), numa]
    ptrs = [drv.CUdeviceptr(p), drv.CUdeviceptr(p + n // 2)]
    ok((*drv.cuMemDiscardAndPrefetchBatchAsync(ptrs, [n // 2, n // 2], 2, locs, [0, 1], 2, 0, s), None))
    second = (p + n // 2, n // 2)
    typed = drv.CUmemLocationType
    kind = ok(drv.cuMemRangeGetAttribute(4, attr.CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_TYPE, *second))
    assert kind == int(typed.CU_MEM_LOCATION_TYPE_HOST_NUMA)
    assert ok(drv.cuMemRangeGetAttribute(4, attr.CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_ID, *second)) == 0
    # The legacy attribute says CU_DEVICE_CPU for a host NUMA node, as the driver's does.
    assert ok(drv.cuMemRangeGetAttribute(4, attr.CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION, *second)) == -1
    assert ok(drv.cuMemRangeGetAttribute(4, attr.CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION, p, n // 2)) == 0
    advice = drv.CUmem_advise.CU_MEM_ADVISE_SET_PREFERRED_LOCATION
    ok((*drv.cuMemAdvise(p, n, advice, numa), None))
    kind = ok(drv.cuMemRangeGetAttribute(4, attr.CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE, p, n))
    assert kind == int(typed.CU_MEM_LOCATION_TYPE_HOST_NUMA)
    # The raw entry point (what umem_numba calls where the binding refuses the typed attributes).
    pfn = ok(drv.cuGetProcAddress(b"cuMemRangeGetAttribute", 12020, 0))[0]
    fn = ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64, ctypes.c_size_t
    )(pfn)
    out = ctypes.c_int32(-5)
    assert fn(ctypes.byref(out), 4, int(attr.CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE), p, n) == 0
    assert out.value == int(typed.CU_MEM_LOCATION_TYPE_HOST_NUMA)
    # A node this host lacks, the legacy stream and unmanaged memory are refused as the driver does.
    missing = _location(drv, "HOST_NUMA", 1 + max(_sim_driver._locations._host_numa_nodes()))
    assert drv.cuMemAdvise(p, n, advice, missing)[0] == 1
    assert drv.cuMemDiscardBatchAsync([drv.CUdeviceptr(p)], [n], 1, 0, 0)[0] == 1
    dev = ok(drv.cuMemAlloc(n))
    assert drv.cuMemDiscardBatchAsync([drv.CUdeviceptr(dev)], [n], 1, 0, s)[0] == 1
    drv.cuCtxSynchronize()


def test_sim_host_pools_give_pinned_memory_at_their_location(drv):
    attrs = drv.CUmemPool_attribute
    for kind, node in (("HOST", 0), ("HOST_NUMA", _sim_driver._locations._host_numa_nodes()[0])):
        props = drv.CUmemPoolProps()
        props.allocType = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.location = _location(drv, kind, node)
        pool = ok(drv.cuMemPoolCreate(props))
        assert ok(drv.cuMemPoolGetAttribute(pool, attrs.CU_MEMPOOL_ATTR_LOCATION_TYPE)) == int(props.location.type)
        assert ok(drv.cuMemPoolGetAttribute(pool, attrs.CU_MEMPOOL_ATTR_LOCATION_ID)) == node
        dev = _location(drv, "DEVICE", 0)
        assert int(ok(drv.cuMemPoolGetAccess(pool, dev))) == 0, "a host pool is mapped for no device until granted"
        desc = drv.CUmemAccessDesc()
        desc.location = dev
        desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        ok((*drv.cuMemPoolSetAccess(pool, [desc], 1), None))
        assert int(ok(drv.cuMemPoolGetAccess(pool, dev))) == 3
        s = ok(drv.cuStreamCreate(1))
        p = ok(drv.cuMemAllocFromPoolAsync(4096, pool, s))
        mtype = ok(drv.cuPointerGetAttribute(drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p))
        assert mtype == drv.CUmemorytype.CU_MEMORYTYPE_HOST
        assert drv.cuMemHostGetFlags(p)[0] == 1  # not cuMemHostAlloc memory
        ok((*drv.cuMemFreeAsync(p, s), None))
        drv.cuStreamSynchronize(s)
        ok((*drv.cuMemPoolDestroy(pool), None))
    props.location = _location(drv, "HOST_NUMA", 1 + max(_sim_driver._locations._host_numa_nodes()))
    assert drv.cuMemPoolCreate(props)[0] == 1  # a node this host lacks


def test_sim_work_a_finalizer_drives_during_a_wait_runs_once(drv, rng):
    """A wait picks the next operation; a finalizer run right then (garbage collection, in the same
    thread: the lock is re-entrant) waits for device work itself and runs that operation first.

    Seen in CI as ``IndexError: pop from empty list`` from eight threads sharing one buffer: the
    outer wait then ran the operation a second time.  Each operation runs once, in stream order.
    """
    n = 256
    _, dst, data, s = _queued_upload(drv, rng, n)
    ok((*drv.cuMemsetD32Async(dst, 0, n // 2, s), None))
    choose = drv._rng.choice
    nested = []

    def choice_with_a_finalizer_first(ready):
        op = choose(ready)
        if not nested:  # the finalizer: it synchronises the stream (the operations it needs run now)
            nested.append(op.what)
            ok((*drv.cuStreamSynchronize(s), None))
        return op

    drv._rng.choice = choice_with_a_finalizer_first
    ok((*drv.cuCtxSynchronize(), None))
    assert nested, "the wait chose no operation"
    expected = data.copy()
    expected[: n // 2] = 0
    np.testing.assert_array_equal(host(dst, n), expected)


def test_sim_waits_run_with_garbage_collection_off(drv):
    """A wait's bookkeeping and the work it runs see no garbage collection, which is back on after.

    A finalizer run by the collector in the waiting thread (the lock is re-entrant) could wait
    for device work itself, between an op leaving its stream and being marked done: CI saw
    "no runnable work (dependency cycle)" from eight threads sharing one buffer.
    """
    import gc

    s = ok(drv.cuStreamCreate(0))
    seen = []
    drv._enqueue(s, lambda: seen.append(("run", gc.isenabled())), "records whether the collector is on")
    choose = drv._rng.choice

    def choice(ready):  # called by the wait's bookkeeping, before the op leaves its stream
        seen.append(("choice", gc.isenabled()))
        return choose(ready)

    drv._rng.choice = choice
    assert gc.isenabled()
    ok((*drv.cuStreamSynchronize(s), None))
    assert seen == [("choice", False), ("run", False)]
    assert gc.isenabled()


def test_sim_pointer_attributes_answer_unknown_memory_as_the_driver_does(drv, rng):
    """cuPointerGetAttributes: memory the driver does not know gets NULL answers with CUDA_SUCCESS (unlike
    cuPointerGetAttribute's CUDA_ERROR_INVALID_VALUE); what the simulator cannot answer it refuses."""
    attr = drv.CUpointer_attribute
    plain = rng.random(64)
    assert drv.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, plain.ctypes.data)[0] == 1
    both = [attr.CU_POINTER_ATTRIBUTE_IS_MANAGED, attr.CU_POINTER_ATTRIBUTE_MEMORY_TYPE]
    assert ok(drv.cuPointerGetAttributes(2, both, plain.ctypes.data)) == [False, 0]
    pinned = ok(drv.cuMemHostAlloc(256, 0))
    values = ok(drv.cuPointerGetAttributes(2, both, pinned + 100))  # inside the allocation
    assert values == [False, drv.CUmemorytype.CU_MEMORYTYPE_HOST]
    assert drv.cuPointerGetAttributes(3, both, pinned)[0] == 1  # the count must match the list
    with pytest.raises(UnsupportedError, match="DEVICE_ORDINAL"):
        drv.cuPointerGetAttributes(1, [attr.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL], plain.ctypes.data)
    ok((*drv.cuMemFreeHost(pinned), None))
