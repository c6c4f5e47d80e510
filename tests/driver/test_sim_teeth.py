"""Issue #20 item 4: ordering defects of issue #19 whose own tests cannot run over the simulated driver.

The tests of issue #19 items 1 and 7 need what numba's simulator does not have: numba's
memory-manager plugin (item 1), or a plain numba launch that is still running when the
pool memory it reads is released (item 7: numba's simulator runs a plain launch at the call,
so nothing of it is pending by then).  The tests here reach the same faulty mechanisms
through what the simulator has, so that reverting either fix fails them on the CPU
(``NUMBA_ENABLE_CUDASIM=1``) for every seed CI uses, as well as on a GPU:

- item 1: the plugin's own free (``_emm._pool_free``) and its ``pool.allocate(size, 0)``,
  with a tracked reader still queued (on a GPU: sleeping) on one stream and the next
  allocation written on another;
- item 5: a pool block read on one thread's per-thread default stream (handle 2) and taken
  on another thread's (handle 2 too), then written there by work ordered only by that
  stream (an asynchronous memset: numba's simulator would run a plain kernel at the call,
  after settling the buffer, as host code);
- item 7: a pool buffer that escaped to another library, whose copy of it is still queued
  behind a sleeping kernel on a non-blocking stream when the buffer is dropped.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import types
from types import SimpleNamespace

import numpy as np
import pytest
from numba import cuda
from support.helpers import ORDERING_TRIALS, random_array, sleeping, worker_thread

import umem_numba as um
from umem_numba import _driver
from umem_numba._driver import _sim
from umem_numba._memory import _stats

N = 16 * 1024  # elements per buffer: 64 KiB of float32 (numba's simulator runs every CUDA thread)
GRID, BLOCK = 16, 1024
#: Device time of each sleeping kernel on a GPU; over the simulated driver the work runs late
#: anyway, and every CUDA thread's sleep loop would cost Python time.
SLEEP_MS = 1 if _sim.active() else 60


def _raw_array(ptr: int, n: int):
    """A numba array over a raw pool address (no owner: the pool keeps the memory)."""
    cai = {"data": (ptr, False), "shape": (n,), "strides": None, "typestr": "<f4", "version": 3, "stream": None}
    return cuda.as_cuda_array(SimpleNamespace(__cuda_array_interface__=cai))


def _plugin_module():
    """umem_numba's numba plugin module (``_emm``), whose free function the test calls.

    Under numba's simulator the module cannot be imported as it is: its plugin class
    derives from numba's memory-manager classes, which the simulator's driver module
    lacks (``umem_numba._numba_compat.emm_api`` refuses).  It is then loaded, under another
    name, over a stand-in for those classes (empty base classes); the functions used here
    (``_pool_free`` and its context guard) use none of numba's driver.
    """
    if not _sim.active():
        from umem_numba._interop import _emm

        return _emm
    from umem_numba import _numba_compat

    stand_in = types.SimpleNamespace(
        **{name: type(name, (), {}) for name in ("GetIpcHandleMixin", "HostOnlyCUDAMemoryManager", "IpcHandle")},
        CudaAPIError=type("CudaAPIError", (Exception,), {}),
        shutting_down=lambda: False,
    )
    origin = importlib.util.find_spec("umem_numba._interop._emm").origin
    spec = importlib.util.spec_from_file_location("umem_numba._interop._emm_over_simulator", origin)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    real = _numba_compat._emm
    _numba_compat._emm = stand_in
    try:
        spec.loader.exec_module(module)
    finally:
        _numba_compat._emm = real
    return module


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_plugin_free_is_not_reused_under_a_reader_on_another_stream(rng):
    """Issue #20 item 4: issue #19 item 1 (plugin reuse) over the simulated driver.

    numba drops an array while a kernel on stream 1 still reads it: the plugin frees it
    (``_emm._pool_free``, as its finalizer does) and the next array comes from
    ``pool.allocate(size, 0)`` (as the plugin's ``memalloc`` does); a plain kernel on
    stream 2 writes 7s into it.  The reader (a tracked launch, so that the simulated
    driver queues it; on a GPU it sleeps first) must read its own data: the freed
    address must not be handed out again before the reader is done.  With the plugin's
    old free (``pool.free(ptr, 0)``: the legacy stream's raw free list, no ordering)
    the next allocation gets the same address at once and every element is wrong.
    """
    plugin = _plugin_module()
    _driver.ensure_context()
    ctx = _driver.api().drv.cuCtxGetCurrent()[1]
    pool = um.MemoryPool("device")
    read = um.coherent(sleeping.copy)
    nbytes = N * 4
    s1, s2 = cuda.stream(), cuda.stream()
    out = um.DeviceBuffer.empty(N, np.float32)  # a tracked argument: the reader is a tracked launch
    taken: list[int] = []
    try:
        for trial in range(ORDERING_TRIALS):
            data = random_array(rng, N, np.float32)
            ptr = pool.allocate(nbytes, 0)  # as UmemNumbaMemoryManager._allocate
            _stats.record_alloc("emm", nbytes)  # as the plugin's _wrap (its free counts the release)
            _raw_array(ptr, N).copy_to_device(data)
            read[GRID, BLOCK, s1](_raw_array(ptr, N), out, SLEEP_MS)  # reads ptr (queued / sleeping)
            plugin._pool_free(pool, ctx, ptr, nbytes)  # numba frees the array through the plugin
            nxt = pool.allocate(nbytes, 0)  # the next numba array
            _stats.record_alloc("emm", nbytes)
            taken.append(nxt)
            sleeping.fill[GRID, BLOCK, s2](_raw_array(nxt, N), 7.0, 0)  # plain: nothing orders it
            got = out.copy_to_host(stream=s1)  # after the reader
            assert np.array_equal(got, data), (
                f"trial {trial}: {int((got != data).sum())} of {N} elements read after the next allocation "
                f"overwrote them (same address handed out again: {nxt == ptr})"
            )
    finally:
        cuda.synchronize()
        for p in taken:
            plugin._pool_free(pool, ctx, p, nbytes)
        out.close()
        pool.close()


SEVENS = int(np.float32(7.0).view(np.uint32))


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("interface", ["buffer", "raw"])
def test_per_thread_stream_reuse_orders_stream_ordered_work_of_the_other_thread(interface, rng):
    """Issue #20 item 4: issue #19 item 5 (per-thread stream reuse) over the simulated driver.

    Thread A reads a pool block with a tracked kernel on its per-thread default stream
    (handle 2; the simulated driver queues it, a GPU runs it after a sleep) and frees it
    on that stream.  Thread B takes a block of that size on *its* per-thread stream (also
    handle 2) and fills it with 7s by ``cuMemsetD32Async`` on that stream: only B's
    stream order can protect A's reader.  A's reader must read its own data.  With free
    lists keyed by raw handle, B gets A's block with no wait (raw: the same address;
    buffer: a reuse whose events are all "on stream 2").
    """
    pool = um.MemoryPool("device")
    read = um.coherent(sleeping.copy)
    out = um.DeviceBuffer.empty(N, np.float32)  # tracked: every reader is a tracked launch
    try:
        for trial in range(ORDERING_TRIALS):
            data = random_array(rng, N, np.float32)

            def thread_a(data=data):
                pts = cuda.per_thread_default_stream()
                if interface == "buffer":
                    a = um.DeviceBuffer.from_array(data, pool=pool, stream=pts)
                    read[GRID, BLOCK, pts](a, out, SLEEP_MS)  # an event on A's stream
                    ptr = a.ptr
                    a.close()  # onto the free list, with A's event
                else:
                    ptr = pool.allocate(N * 4, pts)
                    _raw_array(ptr, N).copy_to_device(data)
                    read[GRID, BLOCK, pts](_raw_array(ptr, N), out, SLEEP_MS)
                    pool.free(ptr, pts)  # ordered on A's per-thread stream only
                return ptr

            def thread_b():
                pts = cuda.per_thread_default_stream()
                if interface == "buffer":
                    b = um.DeviceBuffer.empty(N, np.float32, pool=pool, stream=pts)
                    ptr = b.ptr
                    with _driver.device_context(pool.device_id):
                        _driver.call("cuMemsetD32Async", ptr, SEVENS, N, 2, detail="B's stream-ordered write")
                    cuda.synchronize()
                    b.close()
                else:
                    ptr = pool.allocate(N * 4, pts)
                    with _driver.device_context(pool.device_id):
                        _driver.call("cuMemsetD32Async", ptr, SEVENS, N, 2, detail="B's stream-ordered write")
                    cuda.synchronize()
                    pool.free(ptr, pts)
                return ptr

            a_ptr = worker_thread("teeth-a").submit(thread_a).result(timeout=60)
            b_ptr = worker_thread("teeth-b").submit(thread_b).result(timeout=60)
            cuda.synchronize()
            got = out.copy_to_host()
            assert np.array_equal(got, data), (
                f"trial {trial}: {int((got != data).sum())} of {N} elements overwritten by thread B "
                f"(same block: {a_ptr == b_ptr})"
            )
    finally:
        cuda.synchronize()
        out.close()
        pool.close()


@contextlib.contextmanager
def _non_blocking_stream():
    drv = _driver.api().drv
    _driver.ensure_context()
    handle = _driver.call("cuStreamCreate", int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING))
    try:
        yield int(handle)
    finally:
        cuda.synchronize()
        _driver.call("cuStreamDestroy", handle)


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_pool_memory_another_library_still_copies_waits_for_a_synchronise(rng):
    """Issue #20 item 4: issue #19 item 7 (pool memory of work umem_numba could not see) over the simulated driver.

    A pool buffer escapes to another library (its CUDA Array Interface is read), which
    copies it on its own non-blocking stream behind a sleeping kernel
    (``cuMemcpyDtoDAsync``, as CuPy would).  The buffer is closed and dropped while that
    copy is still queued, then a same-size buffer is allocated on another stream and
    written by a tracked kernel.  The copy must read the old data: such memory is held
    until a device synchronise.  With the old free (``cuMemFreeAsync`` on the legacy
    stream, which does not wait for non-blocking streams) the next buffer gets the
    memory, or it is gone, before the copy reads it.
    """
    pool = um.MemoryPool("device")
    write = um.coherent(sleeping.fill)
    dummy = cuda.device_array(1, np.float32)
    # The other library's destination: device memory (a copy into pageable memory would return done).
    out = um.DeviceBuffer.empty(N, np.float32)
    out_ptr = out.__cuda_array_interface__["data"][0]
    other = cuda.stream()
    nbytes = N * 4
    try:
        with _non_blocking_stream() as nb:
            for trial in range(ORDERING_TRIALS):
                data = random_array(rng, N, np.float32)
                a = um.DeviceBuffer.from_array(data, pool=pool, stream=other)
                a.synchronize()
                src = a.__cuda_array_interface__["data"][0]  # escapes: the other library's work is unseen
                sleeping.fill[1, 1, cuda.external_stream(nb)](dummy, 0.0, SLEEP_MS)  # its stream is busy
                _driver.call("cuMemcpyDtoDAsync", out_ptr, src, nbytes, nb, detail="another library's copy")
                a.close()
                del a  # released with the last object over it
                gc.collect()
                b = um.DeviceBuffer.empty(N, np.float32, pool=pool, stream=other)
                write[GRID, BLOCK, other](b, 7.0, 0)
                cuda.synchronize()
                got = out.copy_to_host()
                assert np.array_equal(got, data), (
                    f"trial {trial}: {int((got != data).sum())} of {N} elements read after the memory was reused"
                )
                b.close()
    finally:
        cuda.synchronize()
        out.close()
        pool.close()
