"""Issue #27 items 5 and 6: operations that refuse a capturing stream do so before any other call on it.

A discard (item 5) asked the stream's device (``cuStreamGetDevice``, which a capture forbids)
before its capture check, and a pool allocation (item 6: ``DeviceBuffer.empty``,
``ManagedBuffer.empty``, ``PinnedBuffer.empty`` with ``pool=``) made no capture check at all: it
issued ``cuStreamGetId`` / ``cuMemAllocFromPoolAsync`` into the capture.  Each must raise
:class:`~umem_numba.CoherenceError` and leave the user's capture intact and empty.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from numba import cuda
from support.helpers import random_array

import umem_numba as um
from umem_numba import _driver
from umem_numba._driver._location import stream_handle

N = 4096


def _ops():
    """``{name: op(stream, objects)}``: the operations of items 5 and 6."""
    return {
        "discard": lambda s, o: o["managed"].discard(s),
        "discard_range": lambda s, o: o["managed"].discard_range(0, N // 2, s),
        "discard_prefetch": lambda s, o: o["managed"].discard_prefetch(0, s),
        "DeviceBuffer.empty-pool": lambda s, o: um.DeviceBuffer.empty(N, np.float32, pool=o["device_pool"], stream=s),
        "DeviceBuffer.empty-pool-reuse": lambda s, o: um.DeviceBuffer.empty(
            N, np.float32, pool=o["device_pool_used"], stream=s
        ),
        "DeviceBuffer.empty-default-pool": lambda s, o: um.DeviceBuffer.empty(N, np.float32, stream=s),
        "ManagedBuffer.empty-pool": lambda s, o: um.ManagedBuffer.empty(
            N, np.float32, pool=o["managed_pool"], stream=s
        ),
        "PinnedBuffer.empty-pool": lambda s, o: um.PinnedBuffer.empty(N, np.float32, pool=o["pinned_pool"], stream=s),
    }


def _needs(op: str) -> None:
    if op.startswith("discard"):
        api = _driver.api()
        if api.discard_missing:
            pytest.skip(api.discard_missing)
        if not cuda.get_current_device().CONCURRENT_MANAGED_ACCESS:
            pytest.skip("discards need concurrentManagedAccess")


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["GLOBAL", "RELAXED"])
@pytest.mark.parametrize("op", list(_ops()))
def test_refused_operation_leaves_the_capture_intact(op, mode, rng):
    """Begin a capture, call the operation: CoherenceError, then the capture ends with an empty graph.

    Before the fix: the discards raised a raw CudaError from cuStreamGetDevice and the capture
    was invalidated; the pool constructors were not refused (or failed inside the capture).
    """
    _needs(op)
    _driver.ensure_context()
    data = random_array(rng, N, np.float32)
    objects = {
        "managed": um.ManagedBuffer.from_array(data),
        "device_pool": um.MemoryPool("device"),
        "device_pool_used": um.MemoryPool("device"),
        "managed_pool": um.MemoryPool("managed"),
        "pinned_pool": um.MemoryPool("pinned"),
    }
    # A closed buffer's memory on the pool's free list, with its record of device work:
    # the reuse path, which orders the stream after that work.
    used = um.DeviceBuffer.zeros(N, np.float32, pool=objects["device_pool_used"], stream=cuda.stream())
    used.close()
    objects["managed"].synchronize()
    cuda.synchronize()
    drv = _driver.api().drv
    s = cuda.stream()
    h = stream_handle(s)
    gc.collect()
    gc.disable()
    made = None
    try:
        _driver.call("cuStreamBeginCapture", h, getattr(drv.CUstreamCaptureMode, f"CU_STREAM_CAPTURE_MODE_{mode}"))
        try:
            with pytest.raises(um.CoherenceError, match="capturing a CUDA graph"):
                made = _ops()[op](s, objects)
        finally:
            err, graph = drv.cuStreamEndCapture(h)
    finally:
        gc.enable()
    assert int(err) == 0, f"the capture was broken: cuStreamEndCapture returned {drv.CUresult(err).name}"
    try:
        res = drv.cuGraphGetNodes(graph)
        assert int(res[0]) == 0
        assert int(res[-1]) == 0, f"the refused {op} left {int(res[-1])} node(s) in the user's graph"
    finally:
        _driver.call("cuGraphDestroy", graph)
    assert made is None
    # Nothing was left half done: the buffer holds its data, the pools still allocate.
    np.testing.assert_array_equal(objects["managed"].copy_to_host(stream=s), data)
    for kind, name in (("device", "device_pool"), ("managed", "managed_pool")):
        cls = um.DeviceBuffer if kind == "device" else um.ManagedBuffer
        b = cls.empty(N, np.float32, pool=objects[name], stream=s)
        b.copy_from_host(data, stream=s)
        np.testing.assert_array_equal(b.copy_to_host(stream=s), data, err_msg=name)
        b.close()
    objects["managed"].close()
    cuda.synchronize()
    for name in ("device_pool", "device_pool_used", "managed_pool", "pinned_pool"):
        objects[name].close()


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_zero_size_pool_buffer_on_a_capturing_stream_is_refused_too():
    """Item 6: the refusal does not depend on the size (zeros refused a zero-size buffer already)."""
    _driver.ensure_context()
    pool = um.MemoryPool("device")
    drv = _driver.api().drv
    s = cuda.stream()
    h = stream_handle(s)
    gc.collect()
    gc.disable()
    try:
        _driver.call("cuStreamBeginCapture", h, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
        try:
            with pytest.raises(um.CoherenceError, match="capturing a CUDA graph"):
                um.DeviceBuffer.empty(0, np.float32, pool=pool, stream=s)
        finally:
            err, graph = drv.cuStreamEndCapture(h)
    finally:
        gc.enable()
    assert int(err) == 0
    _driver.call("cuGraphDestroy", graph)
    pool.close()


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["managed", "pinned", "mapped-pinned"])
def test_a_buffer_made_and_freed_beside_a_global_capture_leaves_it_intact(kind, rng):
    """While another stream captures in the driver's global mode, a driver allocation and free
    (cuMemAllocManaged / cuMemHostAlloc, cuMemFree / cuMemFreeHost: calls the capture prohibits)
    of umem_numba's own run in the relaxed mode: they work and the capture goes on.

    Before the fix: the allocation raised a raw CudaError (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
    and the user's capture was invalidated (found by the API fuzzer's capture family).
    """
    _driver.ensure_context()
    drv = _driver.api().drv
    data = random_array(rng, N, np.float32)
    s = cuda.stream()
    h = stream_handle(s)
    make = {
        "managed": lambda: um.ManagedBuffer.empty(N, np.float32),
        "pinned": lambda: um.PinnedBuffer.empty(N, np.float32),
        "mapped-pinned": lambda: um.PinnedBuffer.empty(N, np.float32, flags=um.HostAllocFlags.DEVICEMAP),
    }[kind]
    gc.collect()
    gc.disable()
    try:
        _driver.call("cuStreamBeginCapture", h, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
        try:
            made = make()
            freed = make()
            freed.close()
        finally:
            err, graph = drv.cuStreamEndCapture(h)
    finally:
        gc.enable()
    assert int(err) == 0, f"the capture was broken: cuStreamEndCapture returned {drv.CUresult(err).name}"
    try:
        res = drv.cuGraphGetNodes(graph)
        assert int(res[0]) == 0 and int(res[-1]) == 0, "the allocation left nodes in the user's graph"
    finally:
        _driver.call("cuGraphDestroy", graph)
    made.host[...] = data  # the buffer made beside the capture works
    np.testing.assert_array_equal(made.copy_to_host(), data)
    made.close()
