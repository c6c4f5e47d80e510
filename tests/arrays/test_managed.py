"""ManagedBuffer on the GPU: kernels on buffers and every kind of view, host visibility,
driver-reported memory type, lifetimes, bad input and leaks."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
from numba import cuda
from support.helpers import random_array

import umem_numba as um
from umem_numba import _driver

pytestmark = pytest.mark.gpu

DTYPES = [np.float32, np.float64, np.int32, np.int64, np.uint16, np.complex64]


@pytest.fixture(scope="module")
def kernels():

    @cuda.jit
    def scale1d(a, s):
        i = cuda.grid(1)
        if i < a.shape[0]:
            a[i] = a[i] * s

    @cuda.jit
    def scale2d(a, s):
        i, j = cuda.grid(2)
        if i < a.shape[0] and j < a.shape[1]:
            a[i, j] = a[i, j] * s

    @cuda.jit
    def axpy(out, x, y, s):
        i = cuda.grid(1)
        if i < out.shape[0]:
            out[i] = s * x[i] + y[i]

    return scale1d, scale2d, axpy


def _ptr_attr(name: str, ptr: int) -> int:
    drv = _driver.api().drv
    attr = getattr(drv.CUpointer_attribute, "CU_POINTER_ATTRIBUTE_" + name)
    return int(_driver.call("cuPointerGetAttribute", attr, ptr))


@pytest.mark.sim
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_on_buffer_every_dtype(kernels, rng, dtype):
    scale1d = kernels[0]
    data = random_array(rng, 1000, dtype)
    with um.ManagedBuffer.from_array(data) as buf:
        assert buf.shape == (1000,) and buf.dtype == np.dtype(dtype) and len(buf) == 1000
        assert buf.nbytes == data.nbytes and buf.size == 1000 and buf.ndim == 1
        scale1d[8, 128](buf, 3)
        np.testing.assert_array_equal(buf.host, data * dtype(3))
        np.testing.assert_array_equal(np.asarray(buf), data * dtype(3))


def test_driver_reports_managed_range(rng):
    buf = um.ManagedBuffer.empty((256, 33), np.float64)
    drv = _driver.api().drv
    assert _ptr_attr("IS_MANAGED", buf.ptr) == 1
    # the driver reports managed memory as device memory with IS_MANAGED set
    assert _ptr_attr("MEMORY_TYPE", buf.ptr) == int(drv.CUmemorytype.CU_MEMORYTYPE_DEVICE)
    assert _ptr_attr("RANGE_START_ADDR", buf.ptr) == buf.ptr
    assert _ptr_attr("RANGE_SIZE", buf.ptr) >= 256 * 33 * 8
    view = buf[10:20, 3:]
    assert view.ptr == buf.ptr + 10 * 33 * 8 + 3 * 8
    assert _ptr_attr("RANGE_START_ADDR", view.ptr) == buf.ptr
    buf.close()


@pytest.mark.sim
def test_host_write_then_kernel_then_host_read(kernels, rng):
    scale1d = kernels[0]
    buf = um.managed_empty(4096, np.float32)
    data = random_array(rng, 4096, np.float32)
    buf.host[:] = data  # host write through the view
    scale1d[32, 128](buf, 2.0)
    np.testing.assert_array_equal(buf.host, data * 2)
    buf.close()


VIEWS = [np.s_[5:300], np.s_[::3], np.s_[::-1], np.s_[17], np.s_[100:40:-2]]


@pytest.mark.sim
@pytest.mark.parametrize("key", VIEWS, ids=str)
def test_kernel_on_1d_views(kernels, rng, key):
    scale1d = kernels[0]
    data = random_array(rng, 1000, np.float64)
    buf = um.managed_from(data)
    expected = data.copy()
    view = buf[key]
    if view.ndim == 0:
        with pytest.raises(TypeError):
            len(view)
        return
    scale1d[8, 128](view, 5.0)
    expected[key] *= 5.0
    np.testing.assert_array_equal(buf.host, expected)  # untouched elements untouched too
    np.testing.assert_array_equal(view.host, expected[key])


VIEWS2D = [
    np.s_[:, 1:-1],
    np.s_[1:-1, 1:-1],
    np.s_[::2, ::3],
    np.s_[3],
    np.s_[..., 4:9],
    np.s_[::-1, ::-2],
    np.s_[:],
    np.s_[2:5],
]


@pytest.mark.sim
@pytest.mark.parametrize("key", VIEWS2D, ids=str)
def test_kernel_on_2d_views(kernels, rng, key):
    scale1d, scale2d, _ = kernels
    data = random_array(rng, (64, 48), np.float32)
    buf = um.managed_from(data)
    view = buf[key]
    expected = data.copy()
    if view.ndim == 1:
        scale1d[1, 64](view, 7.0)
    else:
        scale2d[(8, 8), (16, 16)](view, 7.0)
    expected[key] *= np.float32(7.0)
    np.testing.assert_array_equal(buf.host, expected)
    np.testing.assert_array_equal(np.asarray(view), expected[key])


def test_numba_managed_array_slice_fails_but_ours_works(kernels, rng):
    """The motivating bug: numba's managed_array view fails at launch; ours runs."""

    scale2d = kernels[1]
    data = random_array(rng, (32, 32), np.float32)
    ours = um.managed_from(data)
    scale2d[(4, 4), (16, 16)](ours[:, 1:-1], 2.0)
    expected = data.copy()
    expected[:, 1:-1] *= 2
    np.testing.assert_array_equal(ours.host, expected)
    theirs = cuda.managed_array((32, 32), np.float32)
    with pytest.raises(Exception):  # noqa: B017  (numba's own refusal: its type is numba's to choose)
        scale2d[(4, 4), (16, 16)](theirs[:, 1:-1], 2.0)
        cuda.synchronize()


@pytest.mark.sim
def test_several_buffers_in_one_kernel(kernels, rng):
    axpy = kernels[2]
    x, y = random_array(rng, 5000, np.float32), random_array(rng, 5000, np.float32)
    bx, by, out = um.managed_from(x), um.managed_from(y), um.managed_empty(5000, np.float32)
    axpy[40, 128](out, bx, by, 1.5)
    np.testing.assert_allclose(out.host, np.float32(1.5) * x + y, rtol=1e-6)


@pytest.mark.sim
def test_views_share_memory_and_keep_allocation_alive(kernels, rng):
    scale1d = kernels[0]
    data = random_array(rng, 512, np.float32)
    buf = um.managed_from(data)
    view = buf[100:200]
    alloc_ref = weakref.ref(buf._alloc)
    del buf
    gc.collect()
    assert alloc_ref() is not None  # the view keeps it
    scale1d[1, 128](view, 2.0)
    np.testing.assert_array_equal(view.host, data[100:200] * 2)
    live = um.stats()["managed"].live_count
    del view
    gc.collect()
    assert alloc_ref() is None
    assert um.stats()["managed"].live_count == live - 1


@pytest.mark.sim
def test_close_semantics(rng):
    data = random_array(rng, 64, np.float32)
    buf = um.managed_from(data)
    view = buf[8:16]
    view.close()
    assert view.closed and not buf.closed
    np.testing.assert_array_equal(buf.host[8:16], data[8:16])
    other = buf[::2]
    buf.close()
    buf.close()  # harmless
    assert buf.closed and other.closed
    for action in (
        lambda: buf.host,
        lambda: other.host,
        lambda: buf[1:],
        lambda: buf.ptr,
        lambda: buf.__cuda_array_interface__,
        lambda: np.asarray(other),
    ):
        with pytest.raises(um.BufferClosedError, match="closed"):
            action()
    assert "closed" in repr(buf)


@pytest.mark.sim
def test_host_view_defers_release(rng):
    data = random_array(rng, 1 << 16, np.float64)
    buf = um.managed_from(data)
    before = um.stats()["managed"].live_count
    arr = buf.host
    buf.close()
    assert buf.closed
    assert um.stats()["managed"].live_count == before  # still mapped: arr uses it
    np.testing.assert_array_equal(arr, data)  # reading it is safe
    del arr
    gc.collect()
    assert um.stats()["managed"].live_count == before - 1


@pytest.mark.sim
def test_kernel_after_close_is_refused(kernels):
    scale1d = kernels[0]
    buf = um.managed_zeros(16)
    buf.close()
    with pytest.raises(Exception, match="closed"):
        scale1d[1, 16](buf, 2.0)


def test_zero_size_buffers(kernels):
    scale1d = kernels[0]
    live = um.stats()["managed"].live_count
    buf = um.ManagedBuffer.empty(0, np.float32)
    assert buf.ptr == 0 and buf.nbytes == 0 and buf.host.shape == (0,)
    assert buf.__cuda_array_interface__["data"] == (0, False)
    scale1d[1, 32](buf, 2.0)  # kernels get an empty array and do nothing
    e2 = um.managed_zeros((4, 0))
    assert e2.host.shape == (4, 0)
    assert um.stats()["managed"].live_count == live  # nothing was allocated
    buf.close()
    e2.close()


def test_cuda_array_interface_contents(rng):
    buf = um.managed_from(random_array(rng, (10, 12), np.float32))
    cai = buf.__cuda_array_interface__
    assert cai["version"] == 3 and cai["shape"] == (10, 12) and cai["typestr"] == "<f4"
    assert cai["data"] == (buf.ptr, False) and cai["strides"] is None and cai["stream"] is None
    v = buf[:, ::2].__cuda_array_interface__
    assert v["strides"] == (48, 8) and v["shape"] == (10, 6)

    dv = cuda.as_cuda_array(buf[2:4])
    np.testing.assert_array_equal(dv.copy_to_host(), buf.host[2:4])


@pytest.mark.sim
def test_zeros_really_zeroes_after_garbage(rng):
    a = um.managed_from(random_array(rng, 1 << 16, np.float32))
    a.close()
    z = um.managed_zeros(1 << 16, np.float32)
    assert not z.host.any()
    z.close()


def test_attach_host(kernels, rng):
    scale1d = kernels[0]
    data = random_array(rng, 300, np.float32)
    buf = um.ManagedBuffer.from_array(data, attach="host")
    assert buf.attached_to == "host"
    scale1d[3, 128](buf, 2.0)
    np.testing.assert_array_equal(buf.host, data * 2)
    assert _ptr_attr("IS_MANAGED", buf.ptr) == 1


@pytest.mark.sim
def test_managed_like_and_reshape_and_view(kernels, rng):
    scale1d = kernels[0]
    data = random_array(rng, (6, 8), np.float32)
    like = um.managed_like(data)
    assert like.shape == (6, 8) and like.dtype == np.float32
    buf = um.managed_from(data)
    flat = buf.reshape(-1)
    scale1d[1, 64](flat, 3.0)
    np.testing.assert_array_equal(buf.host, data * 3)
    as_int = buf.view(np.int32)
    np.testing.assert_array_equal(as_int.host, (data * 3).view(np.int32))
    with pytest.raises(ValueError, match="C-contiguous"):
        buf[:, ::2].reshape(24)
    with pytest.raises(ValueError, match="itemsize"):
        buf.view(np.float64)


@pytest.mark.sim
@pytest.mark.parametrize(
    "args,exc,match",
    [
        ((-5,), ValueError, "negative dimension -5"),
        (((3, -1),), ValueError, "negative"),
        ((3.0,), TypeError, "float"),
        (("x",), TypeError, "str"),
        ((1 << 62,), ValueError, "more than any device"),
        ((4, object), TypeError, "Python objects"),
    ],
)
def test_bad_constructor_input(args, exc, match):
    live = um.stats()["managed"].live_count
    with pytest.raises(exc, match=match):
        um.ManagedBuffer.empty(*args)
    with pytest.raises(ValueError, match="attach must be 'global' or 'host'"):
        um.ManagedBuffer.empty(4, attach="device")
    assert um.stats()["managed"].live_count == live


def test_out_of_memory_is_clear_and_survivable(device_memory):
    # Managed memory is never oversubscribed in tests (it can hang the GPU), so
    # the driver's OOM path is exercised with pinned memory: 256 TiB to lock.
    pinned_live = um.stats()["pinned"].live_count
    with pytest.raises(um.OutOfMemoryError, match="cuMemHostAlloc failed with CUDA_ERROR_OUT_OF_MEMORY"):
        um.PinnedBuffer.empty(1 << 48, np.uint8)
    assert um.stats()["pinned"].live_count == pinned_live  # a failed allocation is not counted
    ok = um.managed_zeros(1024)  # the process and context still work
    assert not ok.host.any()
    ok.close()
    device_memory()


@pytest.mark.sim
def test_stats_go_up_and_down():
    um.reset_peak()
    s0 = um.stats()["managed"]
    a = um.managed_empty(1 << 20, np.uint8)
    b = um.managed_empty(1 << 21, np.uint8)
    s1 = um.stats()["managed"]
    assert s1.live_count == s0.live_count + 2
    assert s1.live_bytes == s0.live_bytes + 3 * (1 << 20)
    assert s1.total_allocations == s0.total_allocations + 2
    assert s1.peak_bytes >= s1.live_bytes
    a.close()
    b.close()
    s2 = um.stats()["managed"]
    assert s2.live_count == s0.live_count and s2.live_bytes == s0.live_bytes
    assert s2.peak_bytes == s1.peak_bytes


def test_ten_thousand_buffers_do_not_leak(device_memory, rng):
    live = um.stats()["managed"].live_count
    for i in range(10_000):
        b = um.ManagedBuffer.empty(1024 + (i % 7) * 512, np.float32)
        if i % 1000 == 0:
            b.host[:] = 1.0
        if i % 2:  # half closed explicitly, half left to the finalizer
            b.close()
        del b
    gc.collect()
    assert um.stats()["managed"].live_count == live
    device_memory()


@pytest.mark.sim
def test_index_errors_on_buffer():
    buf = um.managed_zeros((4, 5))
    with pytest.raises(IndexError, match="out of bounds for axis 1 with size 5"):
        buf[0, 5]
    with pytest.raises(TypeError, match="advanced indexing"):
        buf[[0, 1]]
    buf.close()
