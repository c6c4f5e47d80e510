"""Issue #22 items 3 and 4: pinned (host-location) pools, the driver's shared pools, peer access.

GPU tests read driver state back: pool attributes and handles (``cuDeviceGetMemPool``,
``cuMemGetDefaultMemPool``), access flags (``cuMemPoolGetAccess``), the memory type of
pinned pool memory (``CU_POINTER_ATTRIBUTE_MEMORY_TYPE``) and the pools' used/reserved
statistics.  CPU tests at the end: bad input is refused before any driver call.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from support.helpers import ORDERING_TRIALS, random_array, sleeping

import umem_numba as um
from umem_numba import _driver
from umem_numba._driver import _sim

MiB = 1 << 20


def _pinned_pool_or_skip(**kw):
    from umem_numba._memory._resources import pinned_pool_support

    missing = pinned_pool_support(_driver.ensure_context(), kw.get("numa"))
    try:
        pool = um.MemoryPool("pinned", **kw)
    except um.UnsupportedError as exc:
        assert "pinned (host) memory pools" in str(exc)
        if missing:
            assert missing in str(exc)
        pytest.skip(f"pinned pools unsupported here (the error says so): {exc}")
    assert not missing, f"a pinned pool was made although the checks said it needs {missing}"
    return pool


def _memory_type(ptr):
    drv = _driver.api().drv
    return int(_driver.call("cuPointerGetAttribute", drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr))


@pytest.fixture(scope="module")
def affine():
    from numba import cuda

    @cuda.jit
    def affine(a, s, c):
        i = cuda.grid(1)
        if i < a.size:
            a[i] = a[i] * s + c

    return um.coherent(affine)


# ---------------------------------------------------------------------------
# Item 3: pinned pools


@pytest.mark.gpu
def test_pinned_pool_memory_is_host_memory_kernels_use_and_is_counted(affine, rng):
    """Issue #22 item 3: MemoryPool("pinned") makes host memory (the driver says so) that the pool's device
    reads and writes in a kernel, that the host reads after the kernel (coherence), counted in
    stats()["pinned"] and the pool's statistics, and that goes on the free list when closed."""
    from numba import cuda

    pool = _pinned_pool_or_skip()
    c = _driver.consts()
    assert pool.kind == "pinned" and pool.location == um.HOST and not pool.shared
    # read back from the driver on the pool's memory below (cuda-bindings 13.3 cannot read the pool's
    # CU_MEMPOOL_ATTR_LOCATION_TYPE or _ALLOCATION_TYPE: "Unsupported attribute")
    assert pool.access(pool.device_id) == "rw"  # granted when the pool was made
    s = cuda.stream()
    data = random_array(rng, 5000, np.float32)
    gc.collect()
    live = um.stats()["pinned"].live_count
    buf = um.PinnedBuffer.from_array(data, pool=pool, stream=s)
    assert _memory_type(buf._address) == c.memorytype_host  # the driver: host memory
    assert um.stats()["pinned"].live_count == live + 1
    assert _memory_type(buf._address) == c.memorytype_host
    assert buf._alloc.ptr == buf._address  # one address for the host and the device (no CAI here: it escapes)
    affine[20, 256, s](buf, 3.0, 1.0)
    np.testing.assert_allclose(buf.host, data * 3 + 1, rtol=1e-6)  # waits for the kernel
    st = pool.statistics()
    assert st.used_current >= data.nbytes and st.reserved_current >= st.used_current
    assert um.stats()["pool"].used_current >= data.nbytes
    assert buf.driver_flags == um.HostAllocFlags.DEFAULT  # not cuMemHostAlloc memory: nothing to ask
    buf.close()
    assert um.stats()["pinned"].live_count == live
    assert pool.cached_bytes == -(-data.nbytes // 512) * 512  # on its free list
    assert "pinned" in repr(pool)
    pool.close()


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_pinned_pool_reuse_on_another_stream_waits_for_the_old_work(rng):
    """Issue #22 item 3: a closed pinned pool buffer's block, taken by a buffer on another stream, is
    written only after the old buffer's sleeping kernel: by the host (coherence) or by a plain numba
    launch on the new stream (ordered by the free list)."""
    from numba import cuda

    pool = _pinned_pool_or_skip()
    fill = um.coherent(sleeping.fill)
    s1, s2 = cuda.stream(), cuda.stream()
    n = 1 << 12 if _sim.active() else 1 << 16  # the simulator runs each CUDA thread in Python
    for trial in range(ORDERING_TRIALS):
        old, new = (float(v) for v in rng.random(2) + 0.5)
        a = um.PinnedBuffer.empty(n, np.float32, pool=pool, stream=s1)
        fill[n // 256, 256, s1](a, old, 40)  # writes a after ~40 ms
        a_ptr = a._address
        a.close()  # no host wait: the block goes on the free list with a's record
        b = um.PinnedBuffer.empty(n, np.float32, pool=pool, stream=s2)
        assert b._address == a_ptr  # the same block, from the free list
        if trial % 2:
            b.host[:] = new  # waits for a's kernel
        else:
            sleeping.fill[n // 256, 256, s2](b, new, 0)  # plain launch: s2 was made to wait for a's kernel
        cuda.synchronize()
        np.testing.assert_array_equal(b.host, np.full(n, new, np.float32), err_msg=f"trial {trial}")
        b.close()
        del b
        pool.release_cached()  # each trial starts with empty lists
    pool.close()


@pytest.mark.gpu
def test_pinned_pool_zeros_clear_a_reused_block_and_numa_pools_say_where(rng):
    """Issue #22 item 3: zeros() on a reused block clears it (stream-ordered); a pool at a host NUMA node
    reports that node, or UnsupportedError names what is missing."""
    from numba import cuda

    pool = _pinned_pool_or_skip()
    s = cuda.stream()
    junk = um.PinnedBuffer.from_array(random_array(rng, 4096, np.float64), pool=pool, stream=s)
    ptr = junk._address
    junk.close()
    z = um.PinnedBuffer.zeros((64, 64), np.float64, pool=pool, stream=s)
    assert z._address == ptr and not z.host.any()
    z.close()
    pool.close()
    nodes = um.info()["numa_nodes"]
    if not nodes:
        pytest.skip("the host reports no NUMA nodes")
    numa_pool = _pinned_pool_or_skip(numa=nodes[0])
    assert numa_pool.location == um.Host(numa=nodes[0])
    data = random_array(rng, 1000, np.int32)
    buf = um.PinnedBuffer.from_array(data, pool=numa_pool, stream=s)
    assert _memory_type(buf._address) == _driver.consts().memorytype_host
    # where the pages are, from the kernel (cuda-bindings 13.3 cannot read CU_MEMPOOL_ATTR_LOCATION_ID)
    assert _numa_node_of(buf._address) == nodes[0]
    np.testing.assert_array_equal(buf.copy_to_host(), data)
    buf.close()
    numa_pool.close()


def _numa_node_of(address: int) -> int:
    """The host NUMA node holding the page at ``address`` (Linux ``get_mempolicy(MPOL_F_NODE | MPOL_F_ADDR)``)."""
    import ctypes
    import platform

    numbers = {"x86_64": 239, "aarch64": 236}  # SYS_get_mempolicy
    assert platform.system() == "Linux" and platform.machine() in numbers, "get_mempolicy: Linux x86-64 or arm64"
    libc = ctypes.CDLL(None, use_errno=True)
    node = ctypes.c_int(-1)
    mpol_f_node, mpol_f_addr = 1, 2
    page = address & ~4095
    rc = libc.syscall(
        numbers[platform.machine()],
        ctypes.byref(node),
        None,
        ctypes.c_ulong(0),
        ctypes.c_void_p(page),
        ctypes.c_ulong(mpol_f_node | mpol_f_addr),
    )
    assert rc == 0, f"get_mempolicy failed: errno {ctypes.get_errno()}"
    return node.value


# ---------------------------------------------------------------------------
# Item 4: the driver's shared pools


@pytest.mark.gpu
def test_default_device_pool_is_the_drivers_current_pool_and_survives_close(rng):
    """Issue #22 item 4: MemoryPool.default("device") is cuDeviceGetMemPool's pool, one wrapper per pool,
    leaves the release threshold alone, keeps no free lists and is never destroyed by close()."""
    dev = _driver.ensure_context()
    raw = _driver.call("cuDeviceGetMemPool", dev)
    handle = int(raw)
    attr = _driver.consts().mempool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
    threshold = int(_driver.call("cuMemPoolGetAttribute", raw, attr))
    pool = um.MemoryPool.default("device")
    assert pool.handle == handle and pool.shared and um.MemoryPool.default(kind="device", device=dev) is pool
    assert int(_driver.call("cuMemPoolGetAttribute", raw, attr)) == threshold  # not changed by wrapping
    data = random_array(rng, (300, 7), np.float64)
    buf = um.DeviceBuffer.from_array(data, pool=pool)
    np.testing.assert_array_equal(buf.copy_to_host(), data)
    buf.close()
    assert pool.cached_bytes == 0  # back to the driver's pool, where other libraries can take it
    pool.close()
    assert "closed" in repr(pool)
    again = um.MemoryPool.default("device")  # the driver's pool is still there
    assert again is not pool and again.handle == handle == int(_driver.call("cuDeviceGetMemPool", dev))
    buf = um.DeviceBuffer.from_array(data, pool=again)
    np.testing.assert_array_equal(buf.copy_to_host(), data)
    buf.close()


@pytest.mark.gpu
def test_default_pool_memory_freed_by_one_library_is_reused_by_the_other(rng):
    """Issue #22 item 4: umem_numba and CuPy's MemoryAsyncPool allocate from one pool: memory one frees
    is what the other allocates next (the pool's reserved bytes do not grow; used bytes count both)."""
    cupy = pytest.importorskip("cupy")
    from numba import cuda

    nbytes = 4 * MiB
    n = nbytes // 4
    cuda.synchronize()
    pool = um.MemoryPool.default("device")
    old_threshold = pool.release_threshold
    pool.release_threshold = 1 << 30  # freed memory stays reserved across the synchronisations below
    try:
        data = random_array(rng, n, np.float32)
        a = um.DeviceBuffer.from_array(data, pool=pool)
        np.testing.assert_array_equal(a.copy_to_host(), data)
        a_ptr = a._address
        a.close()
        cuda.synchronize()
        st1 = pool.statistics()
        assert st1.reserved_current >= st1.used_current + nbytes  # a's memory: reserved, unused
        cupy_pool = cupy.cuda.MemoryAsyncPool()
        data2 = random_array(rng, n, np.float32)
        with cupy.cuda.using_allocator(cupy_pool.malloc):
            x = cupy.asarray(data2)
            cupy.cuda.runtime.deviceSynchronize()
            st2 = pool.statistics()
            assert st2.used_current >= st1.used_current + nbytes, (st1, st2)
            assert st2.reserved_current == st1.reserved_current, (st1, st2)  # reused, nothing new
            np.testing.assert_array_equal(cupy.asnumpy(x), data2)
            print("CuPy took umem_numba's block:", x.data.ptr == a_ptr)
            del x
            cupy.cuda.runtime.deviceSynchronize()
        st3 = pool.statistics()
        assert st3.used_current == st1.used_current, (st1, st3)
        data3 = random_array(rng, n, np.float32)
        b = um.DeviceBuffer.from_array(data3, pool=pool)
        cuda.synchronize()
        st4 = pool.statistics()
        assert st4.reserved_current == st1.reserved_current, (st1, st4)  # CuPy's freed memory, reused
        assert st4.used_current >= st1.used_current + nbytes
        np.testing.assert_array_equal(b.copy_to_host(), data3)
        b.close()
    finally:
        pool.release_threshold = old_threshold


@pytest.mark.gpu
def test_default_managed_pool_is_the_drivers_default_managed_pool(rng):
    """Issue #22 item 4: MemoryPool.default("managed") is cuMemGetDefaultMemPool's managed pool of the device
    (RMM's CudaAsyncManagedMemoryResource), or UnsupportedError names what is missing."""
    from umem_numba._memory._resources import MANAGED

    dev = _driver.ensure_context()
    try:
        expected = int(MANAGED.shared_pool(dev))
    except um.UnsupportedError as exc:
        with pytest.raises(um.UnsupportedError, match="cuMemGetDefaultMemPool"):
            um.MemoryPool.default("managed")
        pytest.skip(f"no default managed pool here (the error says so): {exc}")
    c = _driver.consts()
    direct = _driver.call("cuMemGetDefaultMemPool", um.Location.device(dev).to_cu(), c.pool_managed)
    assert int(direct) == expected
    pool = um.MemoryPool.default("managed", dev)
    assert pool.handle == expected and pool.shared and pool.kind == "managed"
    data = random_array(rng, 2048, np.float32)
    buf = um.ManagedBuffer.from_array(data, pool=pool)
    np.testing.assert_array_equal(buf.host, data)
    assert pool.statistics().used_current >= data.nbytes
    buf.close()
    assert pool.cached_bytes == 0
    with pytest.raises(um.UnsupportedError, match="managed pool cannot change"):
        pool.set_access(dev, "rw")


@pytest.mark.gpu
def test_set_access_on_one_device_reads_back_and_refuses_bad_input():
    """Issue #22 item 4: the owning device reads back rw; granting it rw again does nothing, taking it
    away, an unknown device, a bad mode and a managed pool are clear errors."""
    dev = _driver.ensure_context()
    pool = um.MemoryPool("device")
    assert pool.access(dev) == "rw"
    pool.set_access(dev, "rw")  # documented no-op
    assert pool.access(dev) == "rw"
    with pytest.raises(ValueError, match="own device, which always has read-write access"):
        pool.set_access(dev, None)
    with pytest.raises(ValueError, match="own device"):
        pool.set_access(dev, "r")
    count = _driver.device_count()
    with pytest.raises(ValueError, match=f"device {count} does not exist"):
        pool.set_access(count, "rw")
    with pytest.raises(ValueError, match=f"device {count} does not exist"):
        pool.access(count)
    with pytest.raises(ValueError, match="mode must be 'rw'"):
        pool.set_access(dev, "write")
    assert pool.access(dev) == "rw"  # nothing changed
    pool.close()
    with pytest.raises(ValueError, match="closed"):
        pool.access(dev)
    shared = um.MemoryPool.default("device")
    assert shared.access(dev) == "rw"
    shared.set_access(dev, "rw")


@pytest.mark.multigpu
def test_peer_access_to_device_and_pinned_pools_reads_back_and_works(rng):
    """Issue #22 item 4 (two GPUs): set_access grants device 1 access to a device-0 pool (a kernel on
    device 1 reads its memory) and to a pinned pool, reads it back, and revokes it."""
    from numba import cuda

    pool = um.MemoryPool("device", device=0)
    data = random_array(rng, 4096, np.float32)
    buf = um.DeviceBuffer.from_array(data, pool=pool)
    cuda.synchronize()
    pool.set_access(1, "rw")
    assert pool.access(1) == "rw" and pool.access(0) == "rw"

    @cuda.jit
    def double_into(src, out):
        i = cuda.grid(1)
        if i < src.size:
            out[i] = src[i] * 2

    with cuda.gpus[1]:
        src = cuda.from_cuda_array_interface(buf.__cuda_array_interface__, owner=buf, sync=False)
        out = cuda.device_array(data.size, np.float32)
        double_into[16, 256](src, out)
        cuda.synchronize()
        np.testing.assert_array_equal(out.copy_to_host(), data * 2)
    pool.set_access(1, None)
    assert pool.access(1) is None
    buf.close()
    pool.close()
    pinned = _pinned_pool_or_skip(device=0)
    pinned.set_access(1, "rw")
    assert pinned.access(1) == "rw"
    pinned.set_access(1, None)
    assert pinned.access(1) is None
    pinned.close()


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["device", "cpu", "host numa"])
def test_managed_pool_preferred_location_is_read_back_on_its_allocations(affine, rng, target):
    """Issue #22 item 2: a managed pool prefers a device, the host or a host NUMA node for its pages.

    As cuda.core's ``ManagedMemoryResourceOptions(preferred_location=...)``: the driver records the
    pool's location as the preferred location of every allocation, read back through the range
    attributes on fresh and on reused blocks, and kernels and the host use the memory as usual.
    """
    from umem_numba._driver._location import as_location, numa_nodes

    if target == "host numa":
        nodes = numa_nodes()
        if not nodes:
            pytest.skip("the host reports no NUMA nodes (/sys/devices/system/node)")
        where = um.Host(numa=nodes[0])
    else:
        where = _driver.ensure_context() if target == "device" else target
    expected = as_location(where)
    try:
        pool = um.MemoryPool("managed", preferred_location=where)
    except um.UnsupportedError as exc:
        assert "managed memory pools need" in str(exc)
        pytest.skip(f"no managed pools here (the error says why): {exc}")
    with pool:
        assert pool.location == expected
        assert ("location=" in repr(pool)) == (target != "device"), repr(pool)
        for trial in range(3):  # the first block is fresh, the next ones come back from the free lists
            data = random_array(rng, 1 << 18, np.float32)
            with um.ManagedBuffer.empty(data.shape, np.float32, pool=pool) as buf:
                assert buf.hints.preferred_location == expected, f"trial {trial}"
                buf.copy_from_host(data)
                affine[256, 1024](buf, 2.0, 1.0)
                np.testing.assert_array_equal(buf.host, data * np.float32(2.0) + np.float32(1.0))


# ---------------------------------------------------------------------------
# CPU: validation before any driver call (on a machine without a GPU a driver call would raise
# CudaUnavailableError instead)


def _fake_pool(kind):
    """A MemoryPool object with no driver pool behind it: enough for the checks that come first."""
    pool = object.__new__(um.MemoryPool)
    pool.kind = kind
    pool.device_id = 0
    pool._closed = False
    return pool


def test_pool_kinds_numa_and_default_arguments_are_checked_before_the_driver():
    """Issue #22 items 3 and 4: bad kinds, NUMA nodes and exportable pinned pools are refused first."""
    with pytest.raises(ValueError, match="'managed', 'device' or 'pinned', got 'host'"):
        um.MemoryPool("host")
    with pytest.raises(um.UnsupportedError, match="pinned memory pool cannot be exported"):
        um.MemoryPool("pinned", exportable=True)
    with pytest.raises(ValueError, match="numa= places a pinned"):
        um.MemoryPool("device", numa=0)
    for kind in ("device", "pinned"):
        with pytest.raises(ValueError, match=f"preferred_location= .* a {kind} pool's memory stays where it is made"):
            um.MemoryPool(kind, preferred_location="cpu")
    with pytest.raises(TypeError, match="MemoryPool preferred_location: unknown target 'gpu'"):
        um.MemoryPool("managed", preferred_location="gpu")
    with pytest.raises(ValueError, match="NUMA node number must be >= 0"):
        um.MemoryPool("pinned", numa=-1)
    with pytest.raises(TypeError, match="numa must be an int"):
        um.MemoryPool("pinned", numa="0")
    from umem_numba._driver._location import numa_nodes

    if numa_nodes() is not None:
        with pytest.raises(ValueError, match="host NUMA node 4096 does not exist"):
            um.MemoryPool("pinned", numa=4096)
        with pytest.raises(ValueError, match="host NUMA node 4096 does not exist"):
            um.MemoryPool("managed", preferred_location="cpu:4096")
    with pytest.raises(ValueError, match=r"MemoryPool.default kind must be 'device' or 'managed', got 'pinned'"):
        um.MemoryPool.default("pinned")
    with pytest.raises(ValueError, match="got 3"):
        um.MemoryPool.default(3)


def test_set_access_and_pinned_pool_buffers_refuse_bad_input_before_the_driver():
    """Issue #22 items 3 and 4: a bad access mode, access changes on a managed pool, and bad pool, flags
    and stream arguments of PinnedBuffer are clear errors before any driver call."""
    with pytest.raises(ValueError, match=r"mode must be 'rw' .*, 'r' .* or None, got 'RW'"):
        _fake_pool("device").set_access(0, "RW")
    with pytest.raises(ValueError, match="got True"):
        _fake_pool("pinned").set_access(0, True)
    with pytest.raises(um.UnsupportedError, match="managed pool cannot change which devices reach it"):
        _fake_pool("managed").set_access(0, "rw")
    with pytest.raises(TypeError, match="MemoryPool"):
        um.PinnedBuffer.empty(4, pool="pool")
    with pytest.raises(ValueError, match="'device' pool; it makes DeviceBuffers, not PinnedBuffers"):
        um.PinnedBuffer.empty(4, pool=_fake_pool("device"))
    with pytest.raises(ValueError, match="'pinned' pool; it makes PinnedBuffers, not ManagedBuffers"):
        um.ManagedBuffer.empty(4, pool=_fake_pool("pinned"))
    with pytest.raises(ValueError, match=r"flags .* are cuMemHostAlloc's; pool memory takes none"):
        um.PinnedBuffer.empty(4, flags=um.HostAllocFlags.DEVICEMAP, pool=_fake_pool("pinned"))
    with pytest.raises(ValueError, match="stream= is the allocation stream of pool memory; pass pool= too"):
        um.PinnedBuffer.empty(4, stream=7)  # a stream handle other than the default (0) needs a pool
