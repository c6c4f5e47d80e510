"""Memory pools: buffers from managed and device pools used by kernels, memory back to
the pool then to the driver on trim, no leak over 100k cycles, stream-ordered free
and reuse across streams, out of memory, hints and prefetch on pool memory.
CPU tests at the end: argument validation before any driver call."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from numba import cuda
from support.helpers import ORDERING_TRIALS, random_array

import umem_numba as um
from umem_numba import _driver
from umem_numba._driver import _sim

MiB = 1 << 20


def _managed_pool_or_skip(**kw):
    from umem_numba._memory._resources import managed_pool_support

    missing = managed_pool_support()
    if missing:
        with pytest.raises(um.UnsupportedError, match="managed memory pools need"):
            um.MemoryPool("managed", **kw)
        pytest.skip(f"managed pools unsupported here (the error says so): {missing}")
    return um.MemoryPool("managed", **kw)


def _pool(kind, **kw):
    return _managed_pool_or_skip(**kw) if kind == "managed" else um.MemoryPool("device", **kw)


def _buffer(kind, pool, shape, dtype, stream):
    cls = um.ManagedBuffer if kind == "managed" else um.DeviceBuffer
    return cls.empty(shape, dtype, pool=pool, stream=stream)


@pytest.fixture(scope="module")
def kernels():

    @cuda.jit
    def affine(a, s, c):
        i = cuda.grid(1)
        if i < a.size:
            a[i] = a[i] * s + c

    @cuda.jit
    def sleep_then_fill(a, value, ms):
        for _ in range(ms):
            cuda.nanosleep(1_000_000)
        i = cuda.grid(1)
        if i < a.size:
            a[i] = value

    return um.coherent(affine), um.coherent(sleep_then_fill)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["managed", "device"])
def test_pool_buffers_work_in_kernels_and_show_in_stats(kind, kernels, rng):

    affine, _ = kernels
    pool = _pool(kind)
    s = cuda.stream()
    data = random_array(rng, (1000, 33), np.float32)
    cls = um.ManagedBuffer if kind == "managed" else um.DeviceBuffer
    gc.collect()  # earlier tests' garbage must not be collected while we count
    live = um.stats()[kind].live_count
    buf = cls.from_array(data, pool=pool, stream=s)
    assert um.stats()[kind].live_count == live + 1
    flat = buf.reshape(-1)
    affine[64, 1024, s](flat, 3.0, 1.0)
    np.testing.assert_allclose(buf.copy_to_host(stream=s), data * 3 + 1, rtol=1e-6)
    if kind == "managed":
        np.testing.assert_allclose(buf.host, data * 3 + 1, rtol=1e-6)
    else:
        with pytest.raises(um.UnsupportedError, match="copy_to_host"):
            buf.host
    st = pool.statistics()
    assert st.used_current >= data.nbytes and st.reserved_current >= st.used_current
    total = um.stats()["pool"]
    assert total.pools >= 1 and total.used_current >= data.nbytes
    buf.close()
    s.synchronize()
    st = pool.statistics()
    assert st.cached == pool.cached_bytes == -(-data.nbytes // 512) * 512  # on its free list
    assert st.used_current == st.cached  # nothing else is in use
    assert um.stats()[kind].live_count == live
    assert um.stats()["pool"].cached >= st.cached
    pool.close()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["managed", "device"])
def test_memory_returns_to_the_pool_then_to_the_driver_on_trim(kind, device_memory):

    pool = _pool(kind)
    assert pool.release_threshold == (1 << 64) - 1  # keep everything until trim()
    pool.release_threshold = 64 * MiB
    assert pool.release_threshold == 64 * MiB
    pool.release_threshold = (1 << 64) - 1
    free0, _ = _driver.mem_get_info()
    s = cuda.stream()
    bufs = [_buffer(kind, pool, 64 * MiB, np.uint8, s) for _ in range(4)]
    for b in bufs:  # touch them on the device: physical memory backs them now
        b.copy_from_host(np.ones(64 * MiB, np.uint8), stream=s)
    s.synchronize()
    st = pool.statistics()
    assert st.used_current == 256 * MiB and st.reserved_current >= 256 * MiB
    if kind == "device":
        assert free0 - _driver.mem_get_info()[0] >= 256 * MiB
    for b in bufs:
        b.close()
    s.synchronize()
    st = pool.statistics()
    assert st.cached == st.used_current == 256 * MiB  # on the free lists: still the pool's, not the driver's
    assert st.reserved_current >= 256 * MiB and st.used_high >= 256 * MiB
    pool.release_cached()  # back in the driver's pool
    s.synchronize()
    cuda.synchronize()  # the frees are queued on the legacy stream
    st = pool.statistics()
    assert st.used_current == 0 and st.cached == 0 and st.reserved_current >= 256 * MiB
    pool.trim(0)
    st = pool.statistics()
    assert st.reserved_current == 0, st
    if kind == "device":  # managed pages stay counted in cuMemGetInfo after a trim (driver)
        assert _driver.mem_get_info()[0] >= free0 - 8 * MiB  # and back to the driver
    pool.reset_high()
    assert pool.statistics().used_high == 0
    pool.close()
    device_memory()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["managed", "device"])
def test_no_leak_after_100k_cycles(kind, device_memory):

    pool = _pool(kind)
    s = cuda.stream()
    for _ in range(1_000):  # warm up: the pool reserves what the loop needs
        pool.free(pool.allocate(MiB, s), s)
    s.synchronize()
    free_warm, _ = _driver.mem_get_info()
    for _ in range(50_000):  # raw pool interface
        pool.free(pool.allocate(MiB, s), s)
    for _ in range(50_000):  # buffers: stream-ordered close
        _buffer(kind, pool, MiB, np.uint8, s).close()
    gc.collect()
    s.synchronize()
    st = pool.statistics()
    assert st.used_current == st.cached == 2 * MiB  # one raw block and one buffer's went round and round
    assert st.reserved_high <= 64 * MiB, f"the pool kept growing: {st}"  # memory was reused
    assert _driver.mem_get_info()[0] >= free_warm - 8 * MiB  # the loop itself leaked nothing
    pool.trim(0)
    assert pool.statistics().reserved_current == 0
    pool.close()
    if kind == "device":
        # Managed pool pages the driver placed on the device stay counted in
        # cuMemGetInfo after a trim (the pool's own counters above are 0).
        device_memory()


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_stream_ordered_free_then_reuse_on_another_stream(kernels, rng):
    """A closed buffer's block goes at once (no host wait) to a buffer on another stream, whose
    kernel runs after the old buffer's sleeping kernel (fresh values, ORDERING_TRIALS trials)."""
    _, sleep_then_fill = kernels
    pool = um.MemoryPool("device")
    s1, s2 = cuda.stream(), cuda.stream()
    n = 1 << 12 if _sim.active() else 1 << 18  # the simulator runs each CUDA thread in Python
    for trial in range(ORDERING_TRIALS):
        old, new = (float(v) for v in rng.random(2) + 0.5)
        a = um.DeviceBuffer.empty(n, np.float32, pool=pool, stream=s1)
        sleep_then_fill[n // 256, 256, s1](a, old, 40)  # writes a after ~40 ms
        done = cuda.event()
        done.record(s1)
        a_ptr = a._address
        a.close()  # queued on s1 after the kernel: no host wait
        assert not done.query(), f"trial {trial}: close() waited for the kernel on the host"
        b = um.DeviceBuffer.empty(n, np.float32, pool=pool, stream=s2)
        assert b._address == a_ptr, f"trial {trial}: the closed block was not reused"
        sleep_then_fill[n // 256, 256, s2](b, new, 0)
        cuda.synchronize()  # both kernels are over: an unordered reuse would show `old` in b
        np.testing.assert_array_equal(b.copy_to_host(), np.full(n, new, np.float32), err_msg=f"trial {trial}")
        b.close()
    pool.close()


@pytest.fixture(scope="module")
def plain_fill():
    """A kernel launched the plain numba way: umem_numba cannot order it, only its stream can."""

    @cuda.jit
    def fill(a, value):
        i = cuda.grid(1)
        if i < a.size:
            a[i] = value

    return fill


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["managed", "device"])
def test_a_closed_buffers_memory_goes_to_the_next_buffer_after_its_work(kind, kernels, plain_fill):
    """The free lists hand a block to the next buffer on another stream only after the old work, even for
    a plain numba launch (the stream is made to wait) and for host access (managed)."""
    _, sleep_then_fill = kernels
    pool = _pool(kind)
    s1, s2 = cuda.stream(), cuda.stream()
    n = 1 << 18
    for trial in range(3):
        a = _buffer(kind, pool, n, np.float32, s1)
        sleep_then_fill[n // 256, 256, s1](a, 1.0, 60)  # writes a after ~60 ms
        a_ptr = a._address
        a.close()  # no host wait: the block goes on its free list with a's record
        assert pool.cached_bytes == n * 4
        b = _buffer(kind, pool, n, np.float32, s2)
        assert b._address == a_ptr and pool.cached_bytes == 0  # the same block, from the free list
        if kind == "managed" and trial == 2:
            b.host[:] = 3.0  # host access waits for a's kernel
            expect = 3.0
        else:
            plain_fill[n // 256, 256, s2](b, 2.0)  # not tracked: ordered by s2 waiting for a's work
            expect = 2.0
        cuda.synchronize()
        np.testing.assert_array_equal(b.copy_to_host(), np.full(n, expect, np.float32))
        b.close()  # after the plain launch: held until a device synchronise, not on the free list
        pool.release_cached()  # so that the next trial starts with empty lists
    pool.close()


@pytest.mark.gpu
def test_free_lists_keep_out_advised_escaped_and_over_threshold_memory():
    pool = _managed_pool_or_skip(release_threshold=3 * MiB)
    try:
        s = cuda.stream()
        advised = um.ManagedBuffer.empty(MiB, np.uint8, pool=pool, stream=s)
        try:
            advised.hints.set_preferred_location("cpu")
            took_advice = True
        except um.UnsupportedError:  # this driver takes no advice on pool memory: nothing to keep out
            took_advice = False
        advised.close()
        assert pool.cached_bytes == (0 if took_advice else MiB), "memory with advice must not reach another buffer"
        pool.release_cached()
        escaped = um.ManagedBuffer.empty(MiB, np.uint8, pool=pool, stream=s)
        view = cuda.as_cuda_array(escaped)  # another library holds it: its work cannot be seen
        escaped.close()
        del view, escaped
        gc.collect()
        # Another library may use it on any stream: held until a device synchronise, never on a free list.
        assert not pool._lists.buffers.get(MiB) and [e.size for e in pool._lists.held] == [MiB]
        pool.release_cached()
        assert pool.cached_bytes == 0
        bufs = [um.ManagedBuffer.empty(MiB, np.uint8, pool=pool, stream=s) for _ in range(5)]
        for b in bufs:
            b.close()
        assert pool.cached_bytes == 3 * MiB  # the release threshold bounds the lists
        pool.release_threshold = MiB
        assert pool.cached_bytes <= MiB
    finally:
        pool.close()


@pytest.mark.gpu
def test_reuse_orders_the_stream_again_after_new_work(kernels, plain_fill):
    """A block reused twice on one stream is ordered once, and again after a later owner recorded work."""
    _, sleep_then_fill = kernels
    pool = um.MemoryPool("device")
    s1, s2 = cuda.stream(), cuda.stream()
    n = 1 << 18
    x = um.DeviceBuffer.empty(n, np.float32, pool=pool, stream=s1)
    sleep_then_fill[n // 256, 256, s1](x, 1.0, 40)
    x.close()
    y = um.DeviceBuffer.empty(n, np.float32, pool=pool, stream=s2)  # s2 waits for x's work
    ptr = y._address
    y.close()  # no work: s2 stays ordered after everything the block carries
    z = um.DeviceBuffer.empty(n, np.float32, pool=pool, stream=s1)
    assert z._address == ptr
    sleep_then_fill[n // 256, 256, s1](z, 1.0, 60)  # new work on s1, recorded on the block
    z.close()
    w = um.DeviceBuffer.empty(n, np.float32, pool=pool, stream=s2)
    assert w._address == ptr
    plain_fill[n // 256, 256, s2](w, 2.0)  # untracked: only s2 waiting for z's kernel orders it
    cuda.synchronize()
    np.testing.assert_array_equal(w.copy_to_host(), np.full(n, 2.0, np.float32))
    w.close()
    pool.close()


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_out_of_memory_empties_the_free_lists_and_retries(device_memory):
    """Device memory parked on the free lists in one size is given back when another size needs it."""
    pool = um.MemoryPool("device")
    free, _ = _driver.mem_get_info()
    chunk = 1 << 30
    count = int(free * 0.8) // chunk
    parked = [um.DeviceBuffer.empty(chunk, np.uint8, pool=pool) for _ in range(count)]
    for b in parked:
        b.close()
    assert pool.cached_bytes == count * chunk
    big = um.DeviceBuffer.empty(int(free * 0.6), np.uint8, pool=pool)  # fits only once the lists are emptied
    assert pool.cached_bytes == 0
    big.close()
    pool.close()
    cuda.synchronize()
    device_memory()


@pytest.mark.gpu
def test_a_pool_collected_with_memory_on_its_lists_gives_it_back(device_memory):
    free0, _ = _driver.mem_get_info()
    pool = um.MemoryPool("device")
    for b in [um.DeviceBuffer.empty(256 * MiB, np.uint8, pool=pool) for _ in range(2)]:
        b.close()
    assert pool.cached_bytes == 512 * MiB
    del pool, b
    gc.collect()
    cuda.synchronize()
    assert _driver.mem_get_info()[0] >= free0 - 8 * MiB
    device_memory()


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_threads_share_one_pool_and_its_free_lists(kernels, rng):
    """Eight threads allocate, fill and close buffers of three sizes from one pool, each on its stream."""
    import threading

    affine, _ = kernels
    pool = um.MemoryPool("device")
    sizes = (1000, 4096, 70_001)
    errors: list[BaseException] = []

    def worker(seed):
        try:
            r = np.random.default_rng(seed)
            s = cuda.stream()
            for i in range(60):
                data = r.random(sizes[i % 3]).astype(np.float32)
                b = um.DeviceBuffer.from_array(data, pool=pool, stream=s)
                affine[(b.size + 255) // 256, 256, s](b, 2.0, 1.0)
                np.testing.assert_array_equal(b.copy_to_host(stream=s), data * np.float32(2) + np.float32(1))
                b.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(int(rng.integers(1 << 30)),)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[0]
    cuda.synchronize()
    st = pool.statistics()
    assert st.used_current == st.cached  # every buffer came back
    assert st.cached <= 8 * sum(-(-4 * n // 512) * 512 for n in sizes)  # at most one block per thread and size
    pool.close()


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_free_waits_for_work_on_every_stream(kernels, rng):
    """A buffer allocated on s1 and last written on s2: its block, taken again on s1, is written
    only after the s2 kernel (fresh values, ORDERING_TRIALS trials)."""
    _, sleep_then_fill = kernels
    pool = um.MemoryPool("device")
    s1, s2 = cuda.stream(), cuda.stream()
    n = 1 << 12 if _sim.active() else 1 << 16  # the simulator runs each CUDA thread in Python
    for trial in range(ORDERING_TRIALS):
        old, new = (float(v) for v in rng.random(2) + 0.5)
        a = um.DeviceBuffer.zeros(n, np.float32, pool=pool, stream=s1)
        s1.synchronize()  # the allocation is complete: another stream may use it
        sleep_then_fill[n // 256, 256, s2](a, old, 40)  # recorded on s2
        a_ptr = a._address
        a.close()  # with no host wait
        b = um.DeviceBuffer.empty(n, np.float32, pool=pool, stream=s1)
        assert b._address == a_ptr, f"trial {trial}: the closed block was not reused"
        sleep_then_fill[n // 256, 256, s1](b, new, 0)
        cuda.synchronize()
        np.testing.assert_array_equal(b.copy_to_host(), np.full(n, new, np.float32), err_msg=f"trial {trial}")
        b.close()
    pool.close()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["managed", "device"])
def test_out_of_memory_is_clear_and_the_pool_stays_usable(kind, rng):

    pool = _pool(kind)
    _, total = _driver.mem_get_info()
    with pytest.raises(um.OutOfMemoryError, match=f"{kind} pool"):
        _buffer(kind, pool, 1 << 52, np.uint8, 0)
    if kind == "device":  # a real driver OOM: fill the device from the pool
        chunk = 4 << 30
        held = []
        with pytest.raises(um.OutOfMemoryError, match="memory pool"):
            for _ in range(total // chunk + 2):
                held.append(pool.allocate(chunk))
        for p in held:
            pool.free(p)
        cuda.synchronize()
        pool.trim(0)
    data = random_array(rng, 4096, np.float64)
    cls = um.ManagedBuffer if kind == "managed" else um.DeviceBuffer
    buf = cls.from_array(data, pool=pool)
    np.testing.assert_array_equal(buf.copy_to_host(), data)
    buf.close()
    pool.close()


@pytest.mark.gpu
def test_hints_and_prefetch_on_managed_pool_memory(kernels, rng):

    affine, _ = kernels
    pool = _managed_pool_or_skip()
    s = cuda.stream()
    data = random_array(rng, 1 << 20, np.float32)
    buf = um.ManagedBuffer.from_array(data, pool=pool, stream=s)
    dev = um.Location.device(buf.device_id)
    h = buf.hints
    # Which advice the driver takes on pool memory is its choice (this driver refuses read-mostly
    # and accessed-by): each piece either reads back from the driver or is refused clearly.
    for give, read_back in (
        (h.set_read_mostly, lambda: h.read_mostly),
        (lambda: h.set_accessed_by(dev), lambda: dev in h.accessed_by),
        (lambda: h.set_preferred_location("cpu"), lambda: h.preferred_location == um.HOST),
    ):
        try:
            give()
        except um.UnsupportedError as exc:
            assert "does not support" in str(exc)
        else:
            assert read_back()
    buf.prefetch(dev, stream=s)
    buf.synchronize()
    assert h.last_prefetch_location == dev
    affine[1024, 1024, s](buf, 2.0, 0.5)
    buf.prefetch("cpu", stream=s)
    buf.synchronize()
    assert h.last_prefetch_location == um.HOST
    np.testing.assert_allclose(buf.host, data * 2 + 0.5, rtol=1e-6)
    buf.apply_policy(um.MigrationPolicy.DEFAULT)
    # Pool memory keeps the pool's device as its preferred location (the driver refuses to unset it).
    assert not h.read_mostly and h.preferred_location in (None, dev)
    buf.close()
    pool.close()


@pytest.mark.gpu
def test_pool_argument_checks_on_the_gpu():
    dpool = um.MemoryPool("device")
    with pytest.raises(ValueError, match="'device' pool; it makes DeviceBuffers"):
        um.ManagedBuffer.empty(4, pool=dpool)
    with pytest.raises(TypeError, match="MemoryPool"):
        um.DeviceBuffer.empty(4, pool="pool")
    z = um.DeviceBuffer.empty((0, 3), pool=dpool)
    assert z.copy_to_host().shape == (0, 3)
    with pytest.raises(ValueError, match="nbytes must be positive"):
        dpool.allocate(0)
    ptr = dpool.allocate(1000)
    dpool.free(ptr)
    with pytest.raises(ValueError, match=r"free: 0x[0-9a-f]+ is not memory of this pool's allocate\(\) in use"):
        dpool.free(ptr + 8)
    with pytest.raises(ValueError, match="freed twice"):
        dpool.free(ptr)
    assert dpool.allocate(900) == ptr  # the same 1024-byte block, from the free list of stream 0
    dpool.free(ptr)
    dpool.close()
    with pytest.raises(ValueError, match="closed"):
        um.DeviceBuffer.empty(4, pool=dpool)
    dpool.close()  # twice is fine
    assert "closed" in repr(dpool)


# ---------------------------------------------------------------------------
# CPU: validation before any driver call


def test_pool_arguments_are_checked_before_the_driver():
    with pytest.raises(ValueError, match="'managed', 'device' or 'pinned'"):
        um.MemoryPool("host")
    with pytest.raises(ValueError, match="release_threshold must be >= 0"):
        um.MemoryPool("device", release_threshold=-1)
    with pytest.raises(TypeError, match="release_threshold must be an int"):
        um.MemoryPool("device", release_threshold=1.5)
    with pytest.raises(TypeError, match="not a bool"):
        um.MemoryPool("device", release_threshold=True)
    with pytest.raises(um.UnsupportedError, match="managed memory pool cannot be exported"):
        um.MemoryPool("managed", exportable=True)
    with pytest.raises(ValueError, match=r"MemoryPool: this needs a device .* not the host"):
        um.MemoryPool("device", device="cpu")


def test_pool_stats_without_pools_need_no_gpu():
    st = um.stats()
    assert set(st) >= {"managed", "pinned", "vmm", "device", "emm", "pool"}
    assert isinstance(st["pool"], um.PoolStats)


def test_a_reused_block_orders_its_stream_once_and_again_after_new_events(monkeypatch):
    """CPU: the free-list path decides when the new stream must wait (no driver: the ordering is counted)."""
    from types import SimpleNamespace

    from umem_numba._memory import _free_lists, _pool
    from umem_numba._memory._tracker import Tracker

    pool = object.__new__(um.MemoryPool)

    pool._driver_pool = _pool.DriverPool(1, 0, owned=False)  # a façade: a driver pool it never destroys
    pool.kind, pool.device_id, pool.exportable = "device", 0, False
    pool._handle, pool._closed, pool._lists = 1, False, _free_lists.FreeLists(0, _free_lists.KEEP_ALL)
    pool._raw_sizes, pool._limit, pool._legacy_key = {}, 1 << 40, None
    pool._last = _pool._NO_STREAM
    ordered: list[int] = []
    monkeypatch.setattr(um.MemoryPool, "_order_reuse", lambda self, tracker, stream, key: ordered.append(key))
    monkeypatch.setattr(um.MemoryPool, "_stream_key", lambda self, handle: handle + 100)  # ids differ from handles
    monkeypatch.setattr(um.MemoryPool, "_refuse_capture", lambda self, handle, what: None)  # no driver: no capture
    tracker = Tracker(0)
    tracker.add(7, SimpleNamespace(stream=7, key=107, device_id=0, handle=None))  # the block's last work, on 7
    memory = _pool._PoolMemory(pool, "device", 0x10000, MiB, MiB)
    assert pool._keep(memory, tracker)

    def cycle(stream):
        alloc = pool.allocation(MiB, stream, "device")
        assert alloc.ptr == 0x10000  # always the listed block: no driver call
        alloc.close()
        return alloc

    cycle(5)
    cycle(5)
    assert ordered == [105]  # ordered once on stream 5 (by its stream id)
    cycle(9)
    assert ordered == [105, 109]  # another stream is ordered too
    alloc = pool.allocation(MiB, 9, "device")
    alloc.tracker.add(3, SimpleNamespace(stream=3, key=103, device_id=0, handle=None))  # new work recorded
    alloc.close()
    cycle(9)
    assert ordered == [105, 109, 109]  # the new event makes stream 9 wait again
