"""VMM: granularity, ranges, physical memory, mappings, access control, VMMBuffer, IPC.

GPU tests read the driver's own state back (cuMemGetAccess, cuPointerGetAttribute,
cuMemGetInfo) and check every element that kernels wrote.  A kernel that
writes through a READ-only mapping poisons its CUDA context, so that test
runs in a child process; so does the second process of the IPC test.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from numba import cuda
from support.helpers import random_array

import umem_numba
from umem_numba import _driver
from umem_numba._errors import BufferClosedError, CudaError, OutOfMemoryError, UnsupportedError
from umem_numba._vmm._access import AccessFlags, allocation_granularity, check_multiple, round_up
from umem_numba._vmm._access import as_access as _as_access
from umem_numba._vmm._buffer import VMMBuffer
from umem_numba._vmm._mapping import AddressRange, Mapping, PhysicalMemory

gpu = pytest.mark.gpu
MiB = 1 << 20


# ---------------------------------------------------------------------------
# kernels


@cuda.jit
def _affine(a, mul, add):
    """a[i] = a[i] * mul + add (1-d, grid-stride)."""
    start, step = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, a.shape[0], step):
        a[i] = a[i] * mul + add


@cuda.jit
def _double_then_fill(a, old_len):
    """Old elements doubled; elements past ``old_len`` get a value from their index."""
    start, step = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, a.shape[0], step):
        if i < old_len:
            a[i] = a[i] * 2
        else:
            a[i] = (i % 1000) + 3


@cuda.jit
def _fill_rows(a, first_row):
    """2-d: rows from ``first_row`` get row*10 + column."""
    start, step = cuda.grid(1), cuda.gridsize(1)
    for r in range(first_row + start, a.shape[0], step):
        for c in range(a.shape[1]):
            a[r, c] = (r % 997) * 10 + c


@cuda.jit
def _copy(dst, src):
    start, step = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, src.shape[0], step):
        dst[i] = src[i]


def _launch(kernel, n, *args):
    kernel[max(1, min(1024, (n + 255) // 256)), 256](*args)


# ---------------------------------------------------------------------------
# driver read-backs


def _drv():
    return _driver.api().drv


def _access(ptr: int, device: int = 0) -> int:
    return int(_driver.call("cuMemGetAccess", umem_numba.Location.device(device).to_cu(), ptr))


def _range_of(ptr: int) -> tuple[int, int]:
    attr = _drv().CUpointer_attribute
    start = _driver.call("cuPointerGetAttribute", attr.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ptr)
    size = _driver.call("cuPointerGetAttribute", attr.CU_POINTER_ATTRIBUTE_RANGE_SIZE, ptr)
    return int(start), int(size)


def _free_bytes() -> int:
    cuda.synchronize()
    return _driver.mem_get_info()[0]


def _as_device_array(ptr: int, shape: tuple, dtype, owner=None):
    dtype = np.dtype(dtype)
    desc = {"shape": shape, "typestr": dtype.str, "data": (ptr, False), "version": 3, "strides": None}
    return cuda.from_cuda_array_interface(desc, owner=owner, sync=False)


def _gran() -> int:
    return allocation_granularity(0)


# ===========================================================================
# CPU-only: no driver needed


def test_access_flags_algebra():
    A = AccessFlags
    assert (int(A.NONE), int(A.READ), int(A.READ_WRITE)) == (0, 1, 3)  # the driver's CUmemAccess_flags
    assert A.READ | A.READ_WRITE == A.READ_WRITE
    assert A.READ | A.NONE == A.READ
    assert A.READ_WRITE & A.READ == A.READ
    assert A.READ in A.READ_WRITE
    assert A.READ_WRITE not in A.READ
    assert A.NONE in A.READ  # the empty set is in every set
    assert not A.NONE and A.READ and A.READ_WRITE
    assert _as_access(3) is A.READ_WRITE and _as_access(A.READ) is A.READ and _as_access(0) is A.NONE


@pytest.mark.parametrize(
    "bad,exc,match",
    [
        (2, ValueError, "no write-only"),
        (4, ValueError, "invalid access flags 4"),
        (-1, ValueError, "invalid access flags -1"),
        (True, TypeError, "AccessFlags"),
        ("rw", TypeError, "AccessFlags"),
        (1.0, TypeError, "AccessFlags"),
    ],
)
def test_access_flags_rejects(bad, exc, match):
    with pytest.raises(exc, match=match):
        _as_access(bad)


def test_granularity_arithmetic_messages():
    g = 2 * MiB
    assert round_up(1, g) == g and round_up(g, g) == g and round_up(g + 1, g) == 2 * g
    check_multiple(3 * g, g, "size")
    with pytest.raises(ValueError) as info:
        check_multiple(3 * MiB, g, "physical allocation size")
    msg = str(info.value)
    assert "3145728" in msg and "2097152" in msg and "nearest valid: 2097152 or 4194304" in msg
    with pytest.raises(ValueError, match=r"nearest valid: 2097152$"):
        check_multiple(4096, g, "size")


@pytest.fixture
def no_driver(monkeypatch):
    """Any driver call fails the test: validation must come first."""

    def boom():
        raise AssertionError("the driver was called before the arguments were validated")

    monkeypatch.setattr(_driver, "api", boom)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: PhysicalMemory.create(0), ValueError, "must be positive, got 0"),
        (lambda: PhysicalMemory.create(-4096), ValueError, "got -4096"),
        (lambda: PhysicalMemory.create(1.5), TypeError, "float 1.5"),
        (lambda: PhysicalMemory.create(True), TypeError, "not a bool"),
        (lambda: PhysicalMemory.from_shareable_handle(-1, 2 * MiB), ValueError, "file descriptor must be >= 0"),
        (lambda: AddressRange.reserve(0), ValueError, "reservation size must be positive"),
        (lambda: AddressRange.reserve(2 * MiB, alignment=3 * MiB), ValueError, "power of two, got 3145728"),
        (lambda: AddressRange.reserve(2 * MiB, alignment=-1), ValueError, "alignment must be >= 0"),
        (lambda: AddressRange.reserve("2MiB"), TypeError, "str"),
        (lambda: Mapping("range", "phys"), TypeError, "AddressRange"),
        (lambda: VMMBuffer.empty(()), ValueError, "at least one dimension"),
        (lambda: VMMBuffer.empty(-3), ValueError, "negative dimension -3"),
        (lambda: VMMBuffer.empty((8, 2), capacity=4), ValueError, "capacity 4 is smaller than the initial length 8"),
        (lambda: VMMBuffer.empty(8, capacity=9.0), TypeError, "capacity must be an int"),
        (lambda: VMMBuffer.empty(8, capacity=-1), ValueError, "capacity must be >= 0"),
        (lambda: VMMBuffer.empty(8, np.dtype(object)), TypeError, "Python objects"),
        (lambda: VMMBuffer.empty(8, chunk_bytes=0), ValueError, "chunk_bytes must be positive, got 0"),
        (lambda: VMMBuffer.empty(8, chunk_bytes=2.0 * MiB), TypeError, "chunk_bytes must be an int"),
        (lambda: VMMBuffer.from_shareable_handle([], 8), ValueError, "empty"),
        (
            lambda: VMMBuffer.from_shareable_handle([(3, 2 * MiB)], 1 << 20, np.float32),
            ValueError,
            "needs 4194304 bytes but the imported chunks hold 2097152",
        ),
        (lambda: VMMBuffer.from_shareable_handle([(3,)], 8), TypeError, "pairs"),
        (lambda: VMMBuffer.from_shareable_handle(5, 0), ValueError, "empty shape"),
        (lambda: VMMBuffer.from_shareable_handle(-2, 8), ValueError, "file descriptor must be >= 0"),
        (lambda: VMMBuffer.from_shareable_handle(5, 8, access=AccessFlags.NONE), ValueError, "access=NONE"),
        (lambda: VMMBuffer.from_shareable_handle(5, 8, access=2), ValueError, "no write-only access"),
    ],
)
def test_validation_before_any_driver_call(no_driver, call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ===========================================================================
# low level (GPU)


@gpu
def test_granularity_from_driver():
    g = allocation_granularity(0)
    rec = allocation_granularity(0, recommended=True)
    ge = allocation_granularity(cuda.gpus[0], exportable=True)
    for v in (g, rec, ge):
        assert v > 0 and v & (v - 1) == 0, v
    assert rec % g == 0
    with pytest.raises(ValueError, match="not the host"):
        allocation_granularity("cpu")


@gpu
def test_map_set_access_and_kernel_on_low_level_mapping(rng, device_memory):
    g = _gran()
    with AddressRange.reserve(4 * g) as ar, PhysicalMemory.create(2 * g, 0) as pm:
        m = Mapping(ar, pm, offset=g)
        assert m.ptr == ar.ptr + g and m.size == 2 * g
        assert _access(m.ptr) == 0, "a fresh mapping grants nothing"
        m.set_access(0, AccessFlags.READ_WRITE)
        assert _access(m.ptr) == 3 and _access(m.ptr + 2 * g - 4096) == 3
        assert m.get_access(0) is AccessFlags.READ_WRITE
        start, size = _range_of(m.ptr + 100)
        assert start <= m.ptr + 100 < start + size and ar.ptr <= start and start + size <= ar.ptr + ar.size

        n = 2 * g // 4
        data = random_array(rng, n, np.int32)
        arr = _as_device_array(m.ptr, (n,), np.int32, owner=m)
        arr.copy_to_device(data)
        _launch(_affine, n, arr, 3, 7)
        np.testing.assert_array_equal(arr.copy_to_host(), data * 3 + 7)
        del arr
        m.close()
        assert m.closed and not ar.released and not pm.released
        # Mapped again elsewhere in the range, the same memory still holds the kernel's values.
        again = Mapping(ar, pm, 2 * g)
        again.set_access(0, AccessFlags.READ_WRITE)
        seen = _as_device_array(again.ptr, (n,), np.int32).copy_to_host()
        np.testing.assert_array_equal(seen, data * 3 + 7)
        again.close()
    assert ar.released and pm.released
    device_memory()


@gpu
@pytest.mark.parametrize("how", ["close", "drop"])
@pytest.mark.parametrize("order", list(itertools.permutations(["range", "physical", "mapping"])))
def test_any_drop_order_unmaps_before_release_and_free(how, order, device_memory, recwarn):
    g = _gran()
    stats0 = umem_numba.stats()["vmm"]
    objs = {"range": AddressRange.reserve(g), "physical": PhysicalMemory.create(g)}
    objs["mapping"] = Mapping(objs["range"], objs["physical"])
    objs["mapping"].set_access(0, AccessFlags.READ_WRITE)
    res = {k: v._res for k, v in objs.items()}
    ptr = objs["mapping"].ptr
    assert umem_numba.stats()["vmm"].live_bytes == stats0.live_bytes + g
    _driver.call("cuMemsetD32", ptr, 0x1234567, g // 4)
    # cuMemsetD32 may still run when it returns (device memory), and the low-level mapping does not
    # wait for work it cannot see: unmapping first (orders 4 and 5) faulted the context on an H200.
    _driver.call("cuCtxSynchronize")
    for name in order:
        if how == "close":
            objs[name].close()
        else:
            del objs[name]
            gc.collect()
        mapped = not res["mapping"].freed
        if mapped:
            # Still mapped: the memory must still be there and readable.
            out = np.empty(4, np.uint32)
            _driver.call("cuMemcpyDtoH", out.ctypes.data, ptr + g - 16, 16)
            assert (out == 0x1234567).all()
        # Nothing under a live mapping is ever freed.
        assert res["range"].freed == (res["range"].closed and not mapped)
        assert res["physical"].freed == (res["physical"].closed and not mapped)
    assert all(r.freed for r in res.values())
    with pytest.raises(CudaError):
        _range_of(ptr)  # the address is no longer known to the driver
    assert umem_numba.stats()["vmm"].live_bytes == stats0.live_bytes
    assert not [w for w in recwarn if "freeing" in str(w.message)]
    device_memory()


@gpu
def test_low_level_bounds_and_sizes_raise_clear_errors(device_memory):
    g = _gran()
    with pytest.raises(ValueError, match=f"multiple of the allocation granularity \\({g} bytes\\)"):
        PhysicalMemory.create(g + 4096)
    with pytest.raises(ValueError, match="reservation size"):
        AddressRange.reserve(g + 4096)
    with AddressRange.reserve(2 * g) as ar, PhysicalMemory.create(2 * g) as big, PhysicalMemory.create(g) as small:
        with pytest.raises(ValueError, match=f"overflows the reserved range of {2 * g} bytes"):
            Mapping(ar, big, g)
        with pytest.raises(ValueError, match="mapping offset"):
            Mapping(ar, small, 4096)
        with Mapping(ar, small, g) as m:
            with pytest.raises(ValueError, match=f"overlaps the mapping at \\[{g}, {2 * g}\\)"):
                Mapping(ar, big, 0)
            assert m.get_access(0) is AccessFlags.NONE
        ar.close()
        with pytest.raises(BufferClosedError, match="closed"):
            Mapping(ar, small, 0)
    device_memory()


# ===========================================================================
# VMMBuffer (GPU)


@gpu
def test_buffer_basics_access_range_stats(rng, device_memory):
    n = 300_007
    data = random_array(rng, n, np.int32)
    gc.collect()  # stats must not move under us: collect earlier tests' garbage now
    s0 = umem_numba.stats()["vmm"]
    buf = VMMBuffer.from_array(data, capacity=n)
    g = buf.granularity
    mapped = round_up(n * 4, g)
    assert (buf.shape, buf.dtype, buf.capacity) == ((n,), np.int32, n)
    assert buf.mapped_nbytes == mapped and buf.reserved_nbytes == mapped and buf.chunk_count == 1
    # capacity == length: the driver's range for the pointer is exactly our mapping.
    assert _range_of(buf._address + 8) == (buf._address, mapped)
    assert _access(buf._address) == 3 and _access(buf._address + mapped - 1) == 3
    assert buf.get_access(0) is AccessFlags.READ_WRITE
    s1 = umem_numba.stats()["vmm"]
    assert (s1.live_count, s1.live_bytes) == (s0.live_count + 1, s0.live_bytes + mapped)

    _launch(_affine, n, buf, 2, 5)
    np.testing.assert_array_equal(buf.copy_to_host(), data * 2 + 5)
    iface = buf.__cuda_array_interface__
    assert iface["shape"] == (n,) and iface["data"][0] == buf._address
    with pytest.raises(UnsupportedError, match="copy_to_host"):
        buf.host
    with pytest.raises(UnsupportedError):
        np.asarray(buf)
    assert "mapped=" in repr(buf) and "capacity=" in repr(buf)
    buf.close()
    assert buf.closed and repr(buf) == "<closed VMMBuffer>"
    # Its interface was read (it escaped): the memory goes when the last object over it does.
    del buf
    gc.collect()
    s2 = umem_numba.stats()["vmm"]
    assert (s2.live_count, s2.live_bytes) == (s0.live_count, s0.live_bytes)
    device_memory()


@gpu
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_grow_keeps_address_contents_and_views(rng, dtype, device_memory):
    n0 = 1_000_003
    data = random_array(rng, n0, dtype)
    buf = VMMBuffer.from_array(data, capacity=4 * n0)
    ptr0, g = buf._address, buf.granularity
    _launch(_affine, n0, buf, 1, 0)  # caches numba's launch view of the old shape
    view = buf[17:4017]
    vptr = view._address
    gc.collect()
    s0 = umem_numba.stats()["vmm"]

    buf.grow(3 * n0)
    assert buf._address == ptr0 and buf.shape == (3 * n0,) and len(buf) == 3 * n0
    assert buf.chunk_count == 2 and buf.mapped_nbytes == round_up(3 * n0 * data.itemsize, g)
    assert umem_numba.stats()["vmm"].live_bytes - s0.live_bytes == buf.mapped_nbytes - round_up(data.nbytes, g)
    assert view._address == vptr
    np.testing.assert_array_equal(view.copy_to_host(), data[17:4017])
    np.testing.assert_array_equal(buf[:n0].copy_to_host(), data)
    # The new chunk is granted like the first; the range stays inside our reservation.
    last = buf._address + 3 * n0 * data.itemsize - 1
    assert _access(last) == 3
    start, size = _range_of(last)
    assert buf._address <= start <= last < start + size <= buf._address + buf.reserved_nbytes

    _launch(_double_then_fill, 3 * n0, buf, n0)  # the launch must see the new length
    out = buf.copy_to_host()
    idx = np.arange(n0, 3 * n0)
    np.testing.assert_array_equal(out[:n0], data * 2)
    np.testing.assert_array_equal(out[n0:], ((idx % 1000) + 3).astype(dtype))
    buf.close()
    device_memory()


@gpu
def test_grow_within_last_chunk_maps_nothing(rng):
    data = random_array(rng, 10, np.int32)
    with VMMBuffer.from_array(data) as buf:
        g = buf.granularity
        free0 = _free_bytes()
        buf.grow(g // 4)  # still inside the first chunk
        assert buf.mapped_nbytes == g and buf.chunk_count == 1 and buf.shape == (g // 4,)
        assert abs(_free_bytes() - free0) < g
        _launch(_double_then_fill, g // 4, buf, 10)
        out = buf.copy_to_host()
        np.testing.assert_array_equal(out[:10], data * 2)
        np.testing.assert_array_equal(out[10:], (np.arange(10, g // 4) % 1000) + 3)


@gpu
def test_two_dimensional_grow_along_first_axis(rng, device_memory):
    data = random_array(rng, (1000, 3), np.float64)
    with VMMBuffer.from_array(data, capacity=200_000) as buf:
        buf.grow(150_000)
        assert buf.shape == (150_000, 3) and buf.strides == (24, 8)
        _launch(_fill_rows, 150_000, buf, 1000)
        out = buf.copy_to_host()
        np.testing.assert_array_equal(out[:1000], data)
        r = np.arange(1000, 150_000)[:, None]
        np.testing.assert_array_equal(out[1000:], (r % 997) * 10 + np.arange(3))
    device_memory()


@gpu
def test_shrink_returns_memory_and_retires_views_beyond(rng, device_memory):
    n0 = 16 * MiB // 4
    data = random_array(rng, n0, np.int32)
    buf = VMMBuffer.from_array(data, capacity=n0 * 32)
    buf.grow(n0 + 256 * MiB // 4)
    _launch(_double_then_fill, len(buf), buf, n0)
    inside, beyond, straddle = buf[:100], buf[-100:], buf[n0 - 10 : n0 + 10]
    gc.collect()
    live0 = umem_numba.stats()["vmm"].live_bytes
    free0 = _free_bytes()

    buf.shrink(n0)
    assert buf.shape == (n0,) and buf.chunk_count == 1 and buf.mapped_nbytes == 16 * MiB
    freed = _free_bytes() - free0
    assert freed >= 256 * MiB - 8 * MiB, f"only {freed / MiB:.1f} MiB came back to the driver"
    assert live0 - umem_numba.stats()["vmm"].live_bytes == 256 * MiB
    np.testing.assert_array_equal(buf.copy_to_host(), data * 2)
    np.testing.assert_array_equal(inside.copy_to_host(), data[:100] * 2)
    for v in (beyond, straddle):
        with pytest.raises(BufferClosedError, match="beyond a shrink"):
            v.ptr
        with pytest.raises(BufferClosedError):
            v.__cuda_array_interface__
        with pytest.raises(BufferClosedError):
            v.copy_to_host()
        with pytest.raises(BufferClosedError):
            _launch(_affine, 100, v, 1, 0)  # numba's launch path must not get the stale pointer
    buf.grow(n0 + 256 * MiB // 4)  # the old views stay retired: their memory is new now
    with pytest.raises(BufferClosedError):
        beyond.copy_to_host()
    after = buf[-100:]
    assert after._address == buf._address + (len(buf) - 100) * 4

    # A shrink inside the first chunk keeps that chunk mapped.
    buf.shrink(10)
    assert buf.chunk_count == 1 and buf.mapped_nbytes == 16 * MiB
    np.testing.assert_array_equal(buf.copy_to_host(), data[:10] * 2)
    buf.close()
    device_memory()


@gpu
def test_failures_leave_the_buffer_exactly_as_it_was(rng, device_memory):
    n = 1 << 20
    data = random_array(rng, n, np.int32)
    buf = VMMBuffer.from_array(data)  # default capacity: the whole device
    free_total = _driver.mem_get_info()
    assert buf.capacity * 4 >= free_total[1] > free_total[0]

    gc.collect()

    def snapshot():
        return (buf.shape, buf._address, buf.mapped_nbytes, buf.chunk_count, umem_numba.stats()["vmm"].live_bytes)

    before, free0 = snapshot(), _free_bytes()
    with pytest.raises(OutOfMemoryError) as info:
        buf.grow(buf.capacity)  # more than the device has free
    assert info.value.call == "cuMemCreate" and info.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
    with pytest.raises(ValueError, match=f"capacity is {buf.capacity}"):
        buf.grow(buf.capacity + 1)
    with pytest.raises(ValueError, match="smaller than the current length"):
        buf.grow(n - 1)
    with pytest.raises(ValueError, match="larger than the current length"):
        buf.shrink(n + 1)
    with pytest.raises(ValueError, match="must be >= 0, got -1"):
        buf.resize(-1)
    with pytest.raises(TypeError, match="float"):
        buf.grow(2.0 * n)
    with pytest.raises(ValueError, match="this is a view"):
        buf[:10].grow(20)
    assert snapshot() == before
    # No leak: free memory must not drop.  It may rise: other libraries' pools in this process
    # (CuPy's, the driver's shared pool of earlier tests) give memory back at synchronisations.
    assert free0 - _free_bytes() < 4 * MiB, "a failed operation kept device memory"
    np.testing.assert_array_equal(buf.copy_to_host(), data)
    buf.grow(2 * n)  # still fully working
    assert buf._address == before[1] and buf.chunk_count == 2
    np.testing.assert_array_equal(buf[:n].copy_to_host(), data)
    buf.close()
    device_memory()


@gpu
def test_set_access_whole_and_ranges_read_back(rng, device_memory):
    g = _gran()
    n = 4 * g // 4
    data = random_array(rng, n, np.int32)
    with VMMBuffer.from_array(data, capacity=2 * n, chunk_bytes=g) as buf:
        assert buf.chunk_count == 4 and buf.chunk_bytes == g
        ptr0 = buf._address
        half = buf[n // 2 :]
        half.set_access(0, AccessFlags.READ)
        assert buf._address == ptr0 and half._address == ptr0 + 2 * g
        assert _access(buf._address) == 3 and _access(buf._address + 2 * g - 1) == 3
        assert _access(half._address) == 1 and _access(buf._address + 4 * g - 1) == 1
        assert half.get_access(0) is AccessFlags.READ and buf.get_access(0) is AccessFlags.READ_WRITE
        # Reading through the READ-only part is allowed.
        dst = cuda.device_array(n, np.int32)
        _launch(_copy, n, dst, buf)
        np.testing.assert_array_equal(dst.copy_to_host(), data)
        # The driver sets access on whole mappings: bounds must be chunk boundaries.
        with pytest.raises(ValueError, match=r"chunk boundaries.*bytes \[40, "):
            buf[10 : n // 2].set_access(0, AccessFlags.READ)
        with pytest.raises(ValueError, match="empty view"):
            buf[5:5].set_access(0, AccessFlags.READ)
        assert _access(buf._address) == 3  # the refused calls changed nothing
        buf[: n // 4].set_access(0, AccessFlags.NONE)
        assert _access(buf._address) == 0 and _access(buf._address + g) == 3 and _access(half._address) == 1

        # A grant on the whole buffer also covers memory mapped by later growth.
        buf.set_access(0, AccessFlags.READ)
        assert _access(buf._address) == 1 and _access(buf._address + 4 * g - 1) == 1
        buf.grow(2 * n)
        assert buf.chunk_count == 8 and buf._address == ptr0
        assert _access(buf._address + 8 * g - 1) == 1 and buf[n:].get_access(0) is AccessFlags.READ
        buf.set_access(0, AccessFlags.READ_WRITE)
        assert _access(buf._address) == 3 and _access(buf._address + 8 * g - 1) == 3
        _launch(_double_then_fill, 2 * n, buf, n)
        out = buf.copy_to_host()
        np.testing.assert_array_equal(out[:n], data * 2)
        np.testing.assert_array_equal(out[n:], (np.arange(n, 2 * n) % 1000) + 3)
        buf.shrink(n // 2)  # chunk_bytes also sets how finely a shrink gives memory back
        assert buf.chunk_count == 2 and buf.mapped_nbytes == 2 * g
        np.testing.assert_array_equal(buf.copy_to_host(), data[: n // 2] * 2)
    with VMMBuffer.from_array(data) as one:  # one chunk: only the whole buffer
        with pytest.raises(ValueError, match="chunk_bytes="):
            one[n // 2 :].set_access(0, AccessFlags.READ)
        assert one.get_access(0) is AccessFlags.READ_WRITE
    device_memory()


@gpu
def test_growth_in_many_chunks_is_all_or_nothing_on_oom(rng, device_memory):
    free = _free_bytes()
    g = _gran()
    chunk = round_up(free // 3, g)  # a few chunks fit before the device runs out
    data = random_array(rng, 1000, np.int32)
    with VMMBuffer.from_array(data, chunk_bytes=chunk) as buf:
        gc.collect()
        before = (buf.shape, buf._address, buf.mapped_nbytes, buf.chunk_count, umem_numba.stats()["vmm"].live_bytes)
        free0 = _free_bytes()
        with pytest.raises(OutOfMemoryError, match="cuMemCreate"):
            buf.grow(buf.capacity)
        after = (buf.shape, buf._address, buf.mapped_nbytes, buf.chunk_count, umem_numba.stats()["vmm"].live_bytes)
        assert after == before
        # one-sided: the driver may hand back unrelated cached memory meanwhile
        assert _free_bytes() >= free0 - 4 * MiB, "chunks mapped before the failure were not given back"
        np.testing.assert_array_equal(buf.copy_to_host(), data)
    device_memory()


_CHILD_READ_ONLY = textwrap.dedent("""
    import json, sys
    import numpy as np
    from numba import cuda
    from umem_numba import _driver, Location
    from umem_numba._errors import CudaError
    from umem_numba._vmm._access import AccessFlags
    from umem_numba._vmm._buffer import VMMBuffer

    @cuda.jit
    def copy(dst, src):
        i = cuda.grid(1)
        if i < src.shape[0]:
            dst[i] = src[i]

    @cuda.jit
    def write(a):
        i = cuda.grid(1)
        if i < a.shape[0]:
            a[i] = -1

    n = 1 << 16
    data = np.random.default_rng(int(sys.argv[1])).integers(1, 1000, n).astype(np.int32)
    buf = VMMBuffer.from_array(data)
    buf.set_access(0, AccessFlags.READ)
    report = {"access": int(_driver.call("cuMemGetAccess", Location.device(0).to_cu(), buf._address))}
    dst = cuda.device_array(n, np.int32)
    copy[n // 256, 256](dst, buf)
    report["read_ok"] = bool((dst.copy_to_host() == data).all())
    write[n // 256, 256](buf)
    try:
        buf.synchronize()
        report["error"] = None
    except CudaError as exc:
        report.update(error=type(exc).__name__, call=exc.call, name=exc.name, message=str(exc))
    err = _driver.api().drv.cuMemAlloc(1 << 20)[0]
    report["later_call"] = _driver.api().drv.CUresult(err).name
    print("REPORT " + json.dumps(report), flush=True)
    import os
    os._exit(0)  # the context is unusable: skip freeing at exit
""")


def _run_child(code: str, *args: str, pass_fds: tuple = ()) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], check=False, capture_output=True, text=True, timeout=300, pass_fds=pass_fds
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1][len("REPORT ") :])


@gpu
def test_read_only_access_is_enforced_in_a_child_process(rng):
    r = _run_child(_CHILD_READ_ONLY, str(int(rng.integers(1 << 30))))
    assert r["access"] == int(AccessFlags.READ)
    assert r["read_ok"], "a kernel may read through a READ-only mapping"
    assert r["error"] == "CudaError", r
    # The plain launch is tracked (it recorded an event): synchronize waits for that event.
    assert r["call"] == "cuEventSynchronize" and r["name"].startswith("CUDA_ERROR_"), r
    assert r["name"] in r["message"]
    # The fault is sticky: the context is unusable afterwards (documented).
    assert r["later_call"] != "CUDA_SUCCESS", r


@gpu
def test_copies_to_and_from_host(rng):
    data = random_array(rng, (4000, 5), np.float32)
    stream = cuda.stream()
    with VMMBuffer.empty((4000, 5), np.float32) as buf:
        buf.copy_from_host(data, stream=stream)
        part = random_array(rng, (100, 5), np.float32)
        buf[200:300].copy_from_host(part)
        expect = data.copy()
        expect[200:300] = part
        out = np.empty((4000, 5), np.float32)
        assert buf.copy_to_host(out, stream=stream) is out
        np.testing.assert_array_equal(out, expect)
        np.testing.assert_array_equal(buf[3990:].copy_to_host(), expect[3990:])
        with pytest.raises(ValueError, match="C-contiguous"):
            buf[:, 1].copy_to_host()
        with pytest.raises(ValueError, match="mismatched"):
            buf.copy_to_host(np.empty((4000, 4), np.float32))
        with pytest.raises(ValueError, match="mismatched"):
            buf.copy_from_host(data.astype(np.float64))


@gpu
def test_zeros_and_zero_length_growth(rng):
    with VMMBuffer.zeros((0, 4), np.int32, capacity=10_000) as buf:
        assert buf._address == 0 and buf.mapped_nbytes == 0 and buf.chunk_count == 0
        buf.grow(10_000)
        assert buf._address != 0 and buf.chunk_count == 1
        data = random_array(rng, (10_000, 4), np.int32)
        buf.copy_from_host(data)
        np.testing.assert_array_equal(buf.copy_to_host(), data)
    with VMMBuffer.zeros(5000, np.int32) as z:
        np.testing.assert_array_equal(z.copy_to_host(), np.zeros(5000, np.int32))


_CHILD_IPC = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    from numba import cuda
    from umem_numba._vmm._buffer import VMMBuffer

    @cuda.jit
    def affine(a, mul, add):
        start, step = cuda.grid(1), cuda.gridsize(1)
        for i in range(start, a.shape[0], step):
            a[i] = a[i] * mul + add

    spec = json.loads(sys.argv[1])
    handle = spec["fd"] if "fd" in spec else [tuple(p) for p in spec["pieces"]]
    buf = VMMBuffer.from_shareable_handle(handle, tuple(spec["shape"]), spec["dtype"])
    for fd in ([spec["fd"]] if "fd" in spec else [p[0] for p in spec["pieces"]]):
        os.close(fd)  # the import holds its own reference
    expected = np.load(spec["expected"])
    seen = buf.copy_to_host()
    report = {"seen_ok": bool((seen == expected).all()), "mismatches": int((seen != expected).sum())}
    affine[256, 256](buf, 3, -11)
    buf.synchronize()
    report["ptr"] = buf._address
    buf.close()
    print("REPORT " + json.dumps(report), flush=True)
""")


@gpu
@pytest.mark.parametrize("chunks", [1, 2])
def test_exported_memory_is_shared_by_two_processes(rng, tmp_path, chunks, device_memory):
    n0 = 1_500_001
    data = random_array(rng, n0, np.int64)
    buf = VMMBuffer.from_array(data, exportable=True, capacity=2 * n0)
    n = n0
    if chunks == 2:
        n = 2 * n0 - 5
        buf.grow(n)
    _launch(_double_then_fill, n, buf, n0)  # a kernel in the parent writes what the child checks
    expected = np.concatenate([data * 2, (np.arange(n0, n) % 1000) + 3]).astype(np.int64)
    buf.synchronize()
    np.save(tmp_path / "expected.npy", expected)
    assert buf.chunk_count == chunks
    if chunks == 1:
        fds = [buf.export_fd()]
        spec = {"fd": fds[0]}
    else:
        with pytest.raises(UnsupportedError, match="export_fds"):
            buf.export_fd()
        pieces = buf.export_fds()
        fds = [fd for fd, _ in pieces]
        assert [s for _, s in pieces] == [
            round_up(n0 * 8, buf.granularity),
            buf.mapped_nbytes - round_up(n0 * 8, buf.granularity),
        ]
        spec = {"pieces": pieces}
    spec.update(shape=[n], dtype="int64", expected=str(tmp_path / "expected.npy"))
    try:
        report = _run_child(_CHILD_IPC, json.dumps(spec), pass_fds=tuple(fds))
    finally:
        for fd in fds:
            os.close(fd)
    assert report["seen_ok"], f"the child saw {report['mismatches']} wrong elements"
    np.testing.assert_array_equal(buf.copy_to_host(), expected * 3 - 11)  # the child's kernel, seen here
    buf.close()
    device_memory()


@gpu
def test_export_needs_exportable_memory():
    with VMMBuffer.empty(10, np.int32) as buf, pytest.raises(UnsupportedError, match="exportable=True"):
        buf.export_fds()
    with PhysicalMemory.create(_gran()) as pm, pytest.raises(UnsupportedError, match="exportable=True"):
        pm.export_fd()


# ===========================================================================
# peers (two GPUs)


@pytest.mark.multigpu
def test_peer_device_gets_access_only_when_granted(rng, device_memory):
    if not int(_driver.call("cuDeviceCanAccessPeer", 1, 0)):
        pytest.skip("device 1 cannot access device 0's memory (no P2P)")
    n = 1 << 20
    data = random_array(rng, n, np.int32)
    with VMMBuffer.from_array(data, device=0, capacity=4 * n) as buf:
        assert _access(buf._address, 1) == 0 and buf.get_access(1) is AccessFlags.NONE
        buf.set_access(1, AccessFlags.READ_WRITE)
        assert _access(buf._address, 1) == 3 and _access(buf._address, 0) == 3
        buf.grow(2 * n)  # the peer grant extends to the new chunk
        assert _access(buf._address + 2 * n * 4 - 1, 1) == 3
        with cuda.gpus[1]:
            _launch(_double_then_fill, 2 * n, buf, n)
            cuda.synchronize()
        out = buf.copy_to_host()
        np.testing.assert_array_equal(out[:n], data * 2)
        np.testing.assert_array_equal(out[n:], (np.arange(n, 2 * n) % 1000) + 3)
        buf.set_access(1, AccessFlags.READ)
        assert _access(buf._address, 1) == 1
    device_memory()


# ===========================================================================
# benchmark plumbing


def test_bench_sizes_fit_free_memory():
    from umem_numba._bench import vmm as bench

    GiB = 1 << 30
    wanted = {"grow": GiB, "step": 64 * MiB, "append_total": 8 * GiB, "stream": GiB}
    assert bench._fit(wanted, 139 * GiB) == (wanted, False)
    sizes, scaled = bench._fit(wanted, 10 * GiB)
    assert scaled and sizes == {"grow": GiB // 2, "step": 64 * MiB, "append_total": 4 * GiB, "stream": GiB // 2}
    with pytest.raises(MemoryError, match=r"0.5 GiB of device memory is free"):
        bench._fit(wanted, GiB // 2)
    with pytest.raises(SystemExit):
        bench._parse(["--repeats", "0"])


@gpu
def test_bench_quick_run_writes_checked_results(tmp_path, capsys):
    from umem_numba._bench import vmm as bench

    path = tmp_path / "vmm.json"
    assert bench.main(["--quick", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "grow" in out and "append" in out and "stream a=b*s" in out
    data = json.loads(path.read_text())
    assert data["quick"] is True and all(data["stream"]["values_ok"].values())
    assert data["grow"]["vmm_grow_s"] > 0 and data["append"]["vmm_peak_bytes"] == data["append"]["total_bytes"]
    assert data["stream"]["chunks"]["VMMBuffer (16 MiB chunks)"] == 4
