"""Issue #27 items 2 and 11: what a GPU showed and the simulated driver missed now fails on the CPU too.

Each test states what a GPU does; it runs on a GPU as well (``gpu`` marker) and, over the
simulated driver (``NUMBA_ENABLE_CUDASIM=1``), failed on the simulated driver before it was
made harsher:

- a plain numba launch (``kernel[g, b, s](...)``) is queued on its stream, after the work
  already queued there, like the toolkit's launches (it ran at the call);
- a kernel fault is reported at the synchronisation of the work that raised it, naming the
  kernel, and every later synchronisation fails too, as a GPU's context does after a fault
  (the simulated driver raised numba's IndexError once, wherever the kernel happened to run,
  and the buffer then read back what the kernel had written so far, with no error);
- managed-pool memory takes no advice (``cuMemAdvise`` answers ``CUDA_ERROR_NOT_SUPPORTED``, as
  driver 580 does), and nothing of a freed pool block's advice reaches the next buffer there
  (the simulated driver took the advice and handed it on);
- a discard issued while other streams' work on its pages is unfinished lands after that work
  (an H100 lost the write queued after such a discard; the simulated driver ran the discard as
  ordinary stream work and did not);
- ``cuda.stream()`` owns its handle, as numba's streams do, so the pool keeps its id and its
  capture check comes before asking it (the simulated driver's numba streams were not owned,
  and reverting that check, 164cdbf, passed on the CPU);
- the identity umem_numba keeps for a numba stream follows a handle the driver hands out
  again (the simulated driver never reused one);
- work queued on a range ``cuMemUnmap`` takes away faults, naming the kernel (a GPU's unmap does
  not wait for it; the simulated driver ran the kernel over whatever was mapped there next);
- the branches of a captured graph that nothing orders run in either order (the simulated
  driver ran a graph's nodes in the order the host issued them).

The last test checks a rule that held already: tracked work is ordered between the legacy
stream and a non-blocking stream, both ways (the legacy stream orders neither).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from numba import cuda
from support.helpers import ORDERING_TRIALS, random_array, sleeping

import umem_numba as um
from umem_numba import _driver
from umem_numba._driver import _sim

N = 4 * 1024  # elements per buffer (numba's simulator runs every CUDA thread)
GRID, BLOCK = 4, 1024
#: Device time of each sleeping kernel on a GPU; over the simulated driver the work runs late anyway.
SLEEP_MS = 1 if _sim.active() else 60
TRIALS = 4 if _sim.active() else ORDERING_TRIALS


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("argument", ["cuda_array_interface", "buffer"])
def test_plain_launch_runs_after_earlier_work_on_its_stream(rng, argument):
    """A tracked writer sleeps on ``s``; a plain ``copy[g, b, s](buf, dst)`` on the same stream reads what it wrote.

    Stream order alone orders the two on a GPU.  The simulated driver ran a plain launch at
    the call: with numba's array over the buffer (``cuda.as_cuda_array``) it read the buffer
    before the queued writer had run.
    """
    fill = um.coherent(sleeping.fill)
    s = cuda.stream()
    buf = um.DeviceBuffer.empty(N, np.float32)
    dst = cuda.device_array(N, np.float32)
    try:
        for trial in range(TRIALS):
            value = float(random_array(rng, 1, np.float32)[0]) + 1.0
            fill[GRID, BLOCK, s](buf, value, SLEEP_MS)  # tracked, queued (on a GPU: sleeping)
            arg = cuda.as_cuda_array(buf) if argument == "cuda_array_interface" else buf
            sleeping.copy[GRID, BLOCK, s](arg, dst, 0)  # plain: ordered by the stream only
            s.synchronize()
            got = dst.copy_to_host()
            assert np.all(got == np.float32(value)), (
                f"trial {trial}: {int((got != np.float32(value)).sum())} of {N} elements read before the earlier "
                f"writer on the same stream had run (first: {got[0]!r}, want {value!r})"
            )
    finally:
        cuda.synchronize()
        buf.close()


def _simulator_only() -> None:
    if not _sim.active():
        pytest.skip(
            "an out-of-bounds write faults at once only in numba's simulator (it checks bounds); on a GPU it may "
            "land in mapped memory, and a real fault would end the test session's context"
        )


@pytest.mark.gpu
def test_kernel_fault_is_reported_at_its_synchronisation_and_after(rng):
    """A kernel that writes past the end of its buffer: its synchronisation fails naming it, and so do later ones."""
    _simulator_only()
    from umem_numba._driver._simulated import SimulatedFault

    @um.jit
    def write_past_end(a, value):
        i = cuda.grid(1)
        if i < a.size:
            a[i + 1] = value  # the last thread writes one element past the end

    data = random_array(rng, N, np.float32)
    buf = um.ManagedBuffer.from_array(data)
    s = cuda.stream()
    write_past_end[GRID, BLOCK, s](buf, 7.0)  # queued: faults when it runs
    with pytest.raises(SimulatedFault, match="write_past_end"):
        s.synchronize()
    # The context is unusable after a fault, as on a GPU: what the kernel wrote cannot be read back.
    with pytest.raises(SimulatedFault, match="write_past_end"):
        buf.host
    with pytest.raises(SimulatedFault, match="write_past_end"):
        cuda.synchronize()
    assert _driver.api().drv.drain_quietly() == [], "the fault was reported already: the reset reports nothing more"


def _managed_pool_or_skip() -> um.MemoryPool:
    from umem_numba._memory._resources import managed_pool_support

    missing = managed_pool_support()
    if missing:
        pytest.skip(f"managed pools unsupported here: {missing}")
    return um.MemoryPool("managed")


@pytest.mark.gpu
@pytest.mark.parametrize("advice", ["preferred_location", "read_mostly", "accessed_by"])
def test_managed_pool_memory_takes_no_advice(rng, advice):
    """Advice on managed-pool memory is refused clearly; the next buffer at that address has the pool's hints only."""
    pool = _managed_pool_or_skip()
    s = cuda.stream()
    dev = um.Location.device(0)
    try:
        buf = um.ManagedBuffer.from_array(random_array(rng, N, np.float32), pool=pool, stream=s)
        address = buf.ptr
        give = {
            "preferred_location": lambda: buf.hints.set_preferred_location("cpu"),
            "read_mostly": buf.hints.set_read_mostly,
            "accessed_by": lambda: buf.hints.set_accessed_by("cpu"),
        }[advice]
        with pytest.raises(um.UnsupportedError, match="does not support"):
            give()
        buf.close()
        nxt = um.ManagedBuffer.empty(N, np.float32, pool=pool, stream=s)
        h = nxt.hints
        assert h.preferred_location in (None, dev), f"advice handed on at {address:#x}: {h.preferred_location}"
        assert not h.read_mostly and um.HOST not in h.accessed_by
        nxt.close()
    finally:
        cuda.synchronize()
        pool.close()


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_discard_after_a_pending_writer_on_another_stream_keeps_the_later_write(rng):
    """Issue #27 (GPU finding): a writer sleeps on ``s1``; ``buf.discard(stream=s2)``; a writer on ``s2``; ``buf.host``.

    The later write must be what the host reads.  On an H100 it was lost in 5 of 5 trials:
    the discard did not order itself after the pending writer on ``s1`` (the stream wait the
    toolkit queued on ``s2`` does not hold the driver's discard back), and its effect landed
    after the later write.  The simulated driver ran the discard as ordinary stream work, after
    that wait, and passed; it now lets a discard issued while other streams' work on its pages is
    unfinished land after that work and the work ordered after it, as the GPU showed.
    """
    fill = um.coherent(sleeping.fill)
    s1, s2 = cuda.stream(), cuda.stream()
    buf = um.ManagedBuffer.from_array(random_array(rng, N, np.float32))
    try:
        for trial in range(TRIALS):
            first, later = 1.0 + trial, -1.0 - trial
            fill[GRID, BLOCK, s1](buf, first, SLEEP_MS)  # pending (on a GPU: sleeping)
            try:
                buf.discard(stream=s2)
            except um.UnsupportedError as exc:
                pytest.skip(f"no discards here: {exc}")
            fill[GRID, BLOCK, s2](buf, later, 0)
            got = buf.host
            assert np.all(got == np.float32(later)), (
                f"trial {trial}: {int((got != np.float32(later)).sum())} of {N} elements lost the later write "
                f"(first: {got[0]!r}, want {later!r})"
            )
    finally:
        cuda.synchronize()
        buf.close()


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_numba_stream_is_owned_and_a_pool_allocation_in_its_capture_refuses_cleanly():
    """``cuda.stream()`` owns its handle (numba destroys it only when collected), here as on a GPU.

    The pool then keeps the stream's ``cuStreamGetId``, asked once: a pool allocation on it
    while it captures must refuse before asking (an H100 refuses ``cuStreamGetId`` inside a
    capture and invalidates the capture; commit 164cdbf).  The simulated driver's numba streams
    were not recognised as owned, so the pool never took that path on the CPU.
    """
    from umem_numba._driver._location import owns_stream, stream_handle

    _driver.ensure_context()
    s = cuda.stream()
    assert owns_stream(s), f"{s!r}: a stream numba created owns its handle"
    assert not owns_stream(cuda.external_stream(stream_handle(s))), "an external stream owns nothing"
    pool = um.MemoryPool("device")
    drv = _driver.api().drv
    h = stream_handle(s)
    assert _driver.owned_stream(h) is not None, "the pool would ask the driver for the stream's id at every use"
    mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    try:
        _driver.call("cuStreamBeginCapture", h, mode)
        try:
            with pytest.raises(um.CoherenceError, match="capturing a CUDA graph"):
                um.DeviceBuffer.empty((4,), np.float32, pool=pool, stream=s)
        finally:
            err, graph = drv.cuStreamEndCapture(h)
        assert int(err) == 0, f"the capture was broken: cuStreamEndCapture returned {drv.CUresult(err).name}"
        res = drv.cuGraphGetNodes(graph)
        assert int(res[0]) == 0 and int(res[-1]) == 0, "the refused allocation left nodes in the graph"
        _driver.call("cuGraphDestroy", graph)
        # Outside the capture the pool takes the owned stream's id, asked once and kept.
        buf = um.DeviceBuffer.zeros((4,), np.float32, pool=pool, stream=s)
        np.testing.assert_array_equal(buf.copy_to_host(stream=s), np.zeros(4, np.float32))
        assert _driver.owned_stream(h)[1] == _driver.check(drv.cuStreamGetId(h), "cuStreamGetId")
        buf.close()
    finally:
        cuda.synchronize()
        pool.close()


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_a_reused_stream_handle_gets_the_new_streams_identity(rng):
    """A numba stream is collected once its work has run; the next ``cuda.stream()`` may get its handle.

    The simulated driver hands it out again (last freed first, as a GPU driver may), so the
    identity umem_numba keeps for a live numba stream (its ``cuStreamGetId``) must follow the new
    stream, and the block freed on the dead stream is the new stream's to take.
    """
    import gc

    from umem_numba._driver._location import stream_handle

    gc.collect()  # streams earlier tests left to the collector: their handles are freed now, not mid-test
    cuda.synchronize()
    pool = um.MemoryPool("device")
    data = random_array(rng, N, np.float32)
    reused = 0
    try:
        for trial in range(TRIALS):
            s1 = cuda.stream()
            h1 = stream_handle(s1)
            key1 = _driver.stream_key(h1)
            buf = um.DeviceBuffer.from_array(data, pool=pool, stream=s1)
            buf.close()  # its block goes back to the pool on s1
            s1.synchronize()  # the driver releases a destroyed stream's handle once its work has run
            del s1
            gc.collect()
            if not _sim.active():
                cuda.current_context().deallocations.clear()  # numba defers cuStreamDestroy on a GPU
            s2 = cuda.stream()
            h2 = stream_handle(s2)
            reused += h2 == h1
            key2 = _driver.stream_key(h2)
            assert key2 != key1, f"trial {trial}: the new stream kept the destroyed stream's id"
            assert key2 == int(_driver.call("cuStreamGetId", h2))
            nxt = um.DeviceBuffer.from_array(-data, pool=pool, stream=s2)
            np.testing.assert_array_equal(nxt.copy_to_host(stream=s2), -data, err_msg=f"trial {trial}")
            nxt.close()
            s2.synchronize()  # its handle is free at once: the next trial's is the one it checks
            del s2
            gc.collect()
        if _sim.active():
            assert reused == TRIALS, f"the simulated driver handed the freed handle out in {reused} of {TRIALS}"
        print(f"handles reused in {reused} of {TRIALS} trials")
    finally:
        cuda.synchronize()
        pool.close()


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_work_queued_on_a_range_cuMemUnmap_takes_away_faults_naming_the_kernel():
    """``cuMemUnmap`` does not wait for the device work queued on the range (``cuMemFree`` does).

    A kernel queued on a VMM mapping, then the range unmapped and mapped again to new memory:
    on a GPU the kernel faults or writes the new memory.  The simulated driver remapped the
    range and ran the kernel over the new mapping (or, unmapped, over no memory at all); it now
    makes the kernel a fault reported at the synchronisation, naming it, that touches nothing.
    """
    _simulator_only()
    from umem_numba._driver._simulated import GRANULARITY, SimulatedFault

    @cuda.jit
    def fill_mapping(a, value):
        i = cuda.grid(1)
        if i < a.size:
            a[i] = value

    drv = _driver.api().drv
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    access = drv.CUmemAccessDesc()
    access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = 0
    access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    size = GRANULARITY
    base = _driver.call("cuMemAddressReserve", size, 0, 0, 0)
    first, second = (_driver.call("cuMemCreate", size, prop, 0) for _ in range(2))
    s = cuda.stream()
    try:
        _driver.call("cuMemMap", base, size, 0, first, 0)
        _driver.call("cuMemSetAccess", base, size, [access], 1)
        n = size // 4
        mapped = np.ndarray((n,), np.float32, buffer=(ctypes.c_byte * size).from_address(base))
        mapped[:] = 1.0
        drv.queue_kernel(s.handle, fill_mapping[n // 256, 256], (mapped, 7.0))
        _driver.call("cuMemUnmap", base, size)  # does not wait for the kernel
        _driver.call("cuMemMap", base, size, 0, second, 0)  # other memory at the same addresses
        _driver.call("cuMemSetAccess", base, size, [access], 1)
        mapped[:] = 2.0
        with pytest.raises(SimulatedFault, match=rf"fill_mapping used memory unmapped by cuMemUnmap at {base:#x}"):
            s.synchronize()
        with pytest.raises(SimulatedFault, match="fill_mapping"):
            cuda.synchronize()  # the context is unusable after a fault, as on a GPU
        assert _driver.api().drv.drain_quietly() == []
        assert (mapped == 2.0).all(), "the faulted kernel wrote the memory mapped there after the unmap"
        _driver.call("cuMemUnmap", base, size)
    finally:
        _driver.api().drv.drain_quietly()
        for handle in (first, second):
            _driver.call("cuMemRelease", handle)
        _driver.call("cuMemAddressFree", base, size)


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_tracked_reader_on_a_non_blocking_stream_waits_for_a_legacy_stream_writer(rng):
    """The legacy stream does not order a non-blocking stream: umem_numba's tracking must.

    A tracked writer sleeps on the legacy stream; a tracked reader of the same buffer on a
    non-blocking stream (``cuStreamCreate(CU_STREAM_NON_BLOCKING)``, as ``cuda.external_stream``)
    must read what it wrote, and a tracked writer on the legacy stream after a reader there
    must not overtake it.
    """
    fill, copy = um.coherent(sleeping.fill), um.coherent(sleeping.copy)
    _driver.ensure_context()
    handle = int(_driver.call("cuStreamCreate", 1))  # numba takes the handle as an int
    ns = cuda.external_stream(handle)
    buf = um.DeviceBuffer.empty(N, np.float32)
    out = um.DeviceBuffer.empty(N, np.float32)
    try:
        for trial in range(TRIALS):
            value = float(random_array(rng, 1, np.float32)[0]) + 1.0
            fill[GRID, BLOCK, 0](buf, value, SLEEP_MS)  # legacy stream (on a GPU: sleeping)
            copy[GRID, BLOCK, ns](buf, out, 0)  # non-blocking: ordered by umem_numba only
            got = out.copy_to_host(stream=ns)
            assert np.all(got == np.float32(value)), (
                f"trial {trial}: {int((got != np.float32(value)).sum())} of {N} elements read before the legacy "
                f"stream's writer (first: {got[0]!r}, want {value!r})"
            )
            copy[GRID, BLOCK, ns](buf, out, SLEEP_MS)  # a reader on the non-blocking stream (sleeping)
            fill[GRID, BLOCK, 0](buf, -value, 0)  # a writer on the legacy stream: must wait for it
            got = out.copy_to_host(stream=ns)
            assert np.all(got == np.float32(value)), f"trial {trial}: the legacy writer overtook the reader"
    finally:
        cuda.synchronize()
        buf.close()
        out.close()
        _driver.call("cuStreamDestroy", handle)


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_htod_copy_into_pinned_pool_memory_is_refused_and_a_plain_copy_taken():
    """``cuMemcpyHtoDAsync`` into a pinned pool's memory: an H100 (driver 580) answers INVALID_VALUE,
    as the API fuzzer found there; ``cuMemcpyAsync`` (unified addressing) copies it.  The simulated
    driver took both."""
    pool = um.MemoryPool("pinned")
    try:
        with um.PinnedBuffer.empty(16, np.int32, pool=pool) as buf:
            src = np.arange(16, dtype=np.int32)
            err = _driver.api().drv.cuMemcpyHtoDAsync(buf.ptr, src.ctypes.data, src.nbytes, 0)[0]
            assert int(err) == 1, f"cuMemcpyHtoDAsync into pinned pool memory answered {err}, not INVALID_VALUE (1)"
            _driver.call("cuMemcpyAsync", buf.ptr, src.ctypes.data, src.nbytes, 0)
            _driver.call("cuStreamSynchronize", 0)
            np.testing.assert_array_equal(np.array(buf.host), src)
    finally:
        pool.close()


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_unordered_branches_of_a_graph_run_in_either_order(rng):
    """Two branches of a captured graph that nothing orders do not run in the order they were issued.

    The capture forks a side stream that fills ``a`` after sleeping on the device, while the
    capturing stream copies ``a`` without waiting for it; the side stream is joined back at the
    end.  On a GPU the copy runs beside the sleeping fill and reads the old values.  The
    simulated driver ran a graph's nodes one after another in the order the host issued them,
    so the copy always came after the fill: a graph branch that missed its dependency (an MPI
    band kernel not waiting for its input copies, #29) passed on the CPU.  Its graph launches
    now run the nodes in any order their captured dependencies allow, drawn from the seed.
    """
    n = 4096
    old = random_array(rng, n, np.float32)
    value = np.float32(old.max() + 1)
    s, side = cuda.stream(), cuda.stream()
    fork, join = cuda.event(timing=False), cuda.event(timing=False)
    a, out = cuda.to_device(old), cuda.device_array(n, np.float32)
    grid, block = n // 128, 128
    sleeping.fill[grid, block, s](a, value, 0)  # compiled and loaded outside the capture
    sleeping.copy[grid, block, s](a, out, 0)
    cuda.synchronize()
    with um.capture(s) as graph:
        fork.record(s)
        fork.wait(side)
        sleeping.fill[grid, block, side](a, value, 2)
        sleeping.copy[grid, block, s](a, out, 0)  # not ordered after the fill: the bug under test
        join.record(side)
        join.wait(s)
    seen = []
    try:
        for _ in range(ORDERING_TRIALS):
            a.copy_to_device(old)
            cuda.synchronize()
            graph.launch()
            s.synchronize()
            got = out.copy_to_host()
            seen.append("copy first" if (got == old).all() else "fill first" if (got == value).all() else "mixed")
    finally:
        graph.close()
    assert "copy first" in seen, f"the copy never ran before the fill it does not wait for: {seen}"
