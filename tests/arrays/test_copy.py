"""The copy layer: every direction and every pair of kinds on random data, views,
streams, coherence on both sides of an asynchronous copy.  The CPU tests at the
end check argument validation, which happens before any driver call."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from support.helpers import random_array

import umem_numba as um

KINDS = ("managed", "pinned", "vmm", "device", "numba")
BUFFER_KINDS = ("managed", "pinned", "vmm", "device")


def _make(kind, data):

    if kind == "managed":
        return um.ManagedBuffer.from_array(data)
    if kind == "pinned":
        return um.PinnedBuffer.from_array(data)
    if kind == "vmm":
        return um.VMMBuffer.from_array(data)
    if kind == "device":
        return um.DeviceBuffer.from_array(data)
    return cuda.to_device(data)


def _empty(kind, shape, dtype):

    if kind == "managed":
        return um.ManagedBuffer.empty(shape, dtype)
    if kind == "pinned":
        return um.PinnedBuffer.empty(shape, dtype)
    if kind == "vmm":
        return um.VMMBuffer.empty(shape, dtype)
    if kind == "device":
        return um.DeviceBuffer.empty(shape, dtype)
    return cuda.device_array(shape, dtype)


def _read(obj):

    if isinstance(obj, um.PinnedBuffer):
        return obj.host.copy()  # waits for the copy (coherence)
    if not hasattr(obj, "_coherence_tracker"):
        cuda.synchronize()  # numba arrays carry no coherence record
    return obj.copy_to_host()


@pytest.fixture(scope="module")
def kernels():

    @cuda.jit
    def sleep(ms):
        for _ in range(ms):
            cuda.nanosleep(1_000_000)

    @cuda.jit
    def sleep_then_fill(a, value, ms):
        for _ in range(ms):
            cuda.nanosleep(1_000_000)
        i = cuda.grid(1)
        if i < a.size:
            a[i] = value

    @cuda.jit
    def add(a, b):
        i = cuda.grid(1)
        if i < a.size:
            a[i] += b[i]

    return sleep, um.coherent(sleep_then_fill), um.coherent(add)


@pytest.mark.sim
@pytest.mark.gpu
@pytest.mark.parametrize("kind", BUFFER_KINDS)
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.complex128])
@pytest.mark.parametrize("staging", [None, False, True])
def test_to_host_and_from_host_every_kind(kind, dtype, staging, rng):
    data = random_array(rng, (301, 17), dtype)
    buf = _make(kind, data)
    np.testing.assert_array_equal(buf.copy_to_host(staging=staging), data)
    out = np.empty_like(data)
    assert buf.copy_to_host(out, staging=staging) is out
    np.testing.assert_array_equal(out, data)
    pinned = um.PinnedBuffer.empty(data.shape, dtype)
    assert buf.copy_to_host(pinned) is pinned
    np.testing.assert_array_equal(pinned.host, data)  # host access waits for the async copy
    new = random_array(rng, (301, 17), dtype)
    buf.copy_from_host(new, staging=staging)
    np.testing.assert_array_equal(buf.copy_to_host(), new)
    buf.close()
    pinned.close()


@pytest.mark.sim
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ("managed", "device"))
def test_staging_in_many_chunks_and_a_user_staging_buffer(kind, rng, monkeypatch):
    from umem_numba._arrays import _copy

    monkeypatch.setattr(_copy, "CHUNK_BYTES", 1 << 16)  # odd sizes: many chunks and a short last one
    _copy._Staging._by_device.clear()
    data = random_array(rng, 1_000_003, np.float32)
    buf = _make(kind, data)
    np.testing.assert_array_equal(buf.copy_to_host(staging=True), data)
    stage = um.PinnedBuffer.empty(3 * 4096 + 8, np.uint8)  # a user buffer: chunks are half of it
    np.testing.assert_array_equal(buf.copy_to_host(staging=stage), data)
    new = random_array(rng, 1_000_003, np.float32)
    buf.copy_from_host(new, staging=stage)
    np.testing.assert_array_equal(buf.copy_to_host(staging=False), new)
    buf.copy_from_host(data, staging=True)
    np.testing.assert_array_equal(buf.copy_to_host(), data)
    _copy._Staging._by_device.clear()


@pytest.fixture
def copier_threads(monkeypatch):
    """Run the staged path with a given number of copier threads (fresh pool and staging slots)."""
    from umem_numba._arrays import _copy

    def use(n):
        monkeypatch.setenv("UMEM_NUMBA_COPY_THREADS", str(n))
        monkeypatch.setattr(_copy, "_copiers", None)
        _copy._Staging._by_device.clear()

    yield use
    _copy._Staging._by_device.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [1, 3])
def test_staged_copies_back_to_back_reuse_the_slots_safely(kernels, threads, copier_threads, rng, monkeypatch):
    """Host to device returns with its DMA still pending: the next staged copy must not refill a slot early.

    A kernel sleeps ~50 ms on the stream first, so every DMA of the four copies is still queued
    when the next copy wants the slots.
    """
    from umem_numba._arrays import _copy

    sleep, _, _ = kernels
    copier_threads(threads)
    monkeypatch.setattr(_copy, "CHUNK_BYTES", (1 << 16) + 4)  # many chunks, slots not page multiples
    n = 3 * (1 << 18) + 5
    sources = [random_array(rng, n, np.float32) for _ in range(4)]
    bufs = [um.DeviceBuffer.empty(n, np.float32) for _ in sources]
    s = cuda.stream()
    sleep[1, 1, s](50)  # the DMAs queue behind it
    for buf, src in zip(bufs, sources, strict=True):
        buf.copy_from_host(src, stream=s, staging=True)  # each reuses the slots the previous one still reads
    for buf, src in zip(bufs, sources, strict=True):
        np.testing.assert_array_equal(buf.copy_to_host(staging=True), src)
        buf.close()


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_staged_copies_from_threads_share_the_slots(kernels, copier_threads, rng):
    """Eight threads, each on its own stream, copy through the one staging area at once.

    Each upload queues behind a kernel sleeping ~20 ms on the thread's stream, and each round
    copies fresh data: a slot refilled before its DMA ran shows as another thread's or round's data.
    """
    import threading

    sleep, _, _ = kernels
    copier_threads(4)
    n = (1 << 21) + 17
    seeds = rng.integers(1 << 31, size=8)
    bufs = [um.ManagedBuffer.empty(n, np.float32) for _ in seeds]
    errors: list[BaseException] = []

    def worker(i):
        try:
            r = np.random.default_rng(int(seeds[i]))
            s = cuda.stream()
            for k in range(3):
                data = random_array(r, n, np.float32)
                sleep[1, 1, s](20)  # the upload's DMA queues behind it
                bufs[i].copy_from_host(data, stream=s, staging=True)
                back = bufs[i].copy_to_host(stream=s, staging=True)
                np.testing.assert_array_equal(back, data, err_msg=f"thread {i}, round {k}")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not any(t.is_alive() for t in threads), "a staged copy hung"
    assert not errors, errors[0]
    for b in bufs:
        b.close()


@pytest.mark.gpu
def test_staged_upload_has_read_the_source_when_it_returns(kernels, rng):
    """A pageable source may be changed as soon as copy_from_host returns (staged like the driver's path)."""
    sleep, _, _ = kernels
    data = random_array(rng, (1 << 22) + 3, np.float32)
    buf = um.DeviceBuffer.empty(data.shape, np.float32)
    s = cuda.stream()
    sleep[1, 1, s](50)  # the DMA queues behind 50 ms of work: only the host side is done at return
    src = data.copy()
    buf.copy_from_host(src, stream=s, staging=True)
    src[:] = -1.0
    np.testing.assert_array_equal(buf.copy_to_host(stream=s), data)
    buf.close()


def test_copier_threads_setting_is_checked(monkeypatch):
    from umem_numba._arrays import _copy

    monkeypatch.setenv("UMEM_NUMBA_COPY_THREADS", "many")
    with pytest.raises(ValueError, match=r"UMEM_NUMBA_COPY_THREADS must be an integer from 1 to 64 .*, got 'many'"):
        _copy.copier_threads()
    monkeypatch.setenv("UMEM_NUMBA_COPY_THREADS", "0")
    with pytest.raises(ValueError, match="UMEM_NUMBA_COPY_THREADS"):
        _copy.copier_threads()
    monkeypatch.setenv("UMEM_NUMBA_COPY_THREADS", "5")
    assert _copy.copier_threads() == 5
    monkeypatch.delenv("UMEM_NUMBA_COPY_THREADS")
    assert 1 <= _copy.copier_threads() <= 8


@pytest.mark.sim
@pytest.mark.gpu
@pytest.mark.parametrize("src_kind", KINDS)
@pytest.mark.parametrize("dst_kind", KINDS)
def test_copy_every_pair_of_kinds(src_kind, dst_kind, rng):

    data = random_array(rng, (123, 45), np.float64)
    src = _make(src_kind, data)
    dst = _empty(dst_kind, data.shape, data.dtype)
    stream = cuda.stream()
    um.copy(dst, src, stream=stream)
    np.testing.assert_array_equal(_read(dst), data)
    # and the default stream
    dst2 = _empty(dst_kind, data.shape, data.dtype)
    um.copy(dst2, src)
    np.testing.assert_array_equal(_read(dst2), data)


@pytest.mark.gpu
def test_contiguous_views_and_strided_sources(rng):
    data = random_array(rng, (64, 40), np.float32)
    m = um.ManagedBuffer.from_array(data)
    v = um.VMMBuffer.from_array(data)
    d = um.DeviceBuffer.from_array(data)
    # contiguous row slices copy by DMA, from and into the right offsets
    for buf in (m, v, d):
        np.testing.assert_array_equal(buf[10:20].copy_to_host(), data[10:20])
        part = random_array(rng, (5, 40), np.float32)
        buf[30:35].copy_from_host(part)
        expect = data.copy()
        expect[30:35] = part
        np.testing.assert_array_equal(buf.copy_to_host(), expect)
        buf.copy_from_host(data)
    # a strided managed view is read on the host (it is host-accessible)
    np.testing.assert_array_equal(m[:, ::3].copy_to_host(), data[:, ::3])
    # strided views of device memory are refused with a clear error
    for buf in (v, d):
        with pytest.raises(ValueError, match="C-contiguous"):
            buf[:, ::3].copy_to_host()
    with pytest.raises(ValueError, match="C-contiguous"):
        um.copy(um.ManagedBuffer.empty((64, 14), np.float32), d[:, ::3])
    # a strided numpy source is made contiguous on the host
    src = random_array(rng, (64, 80), np.float32)[:, ::2]
    d.copy_from_host(src)
    np.testing.assert_array_equal(d.copy_to_host(), src)
    # a strided numpy destination for device data is refused
    with pytest.raises(ValueError, match="C-contiguous"):
        d.copy_to_host(np.empty((64, 80), np.float32)[:, ::2])


@pytest.mark.gpu
def test_copy_waits_for_a_kernel_on_another_stream(kernels, rng):

    _, sleep_then_fill, _ = kernels
    src = um.ManagedBuffer.from_array(random_array(rng, 4096, np.float32))
    value = float(rng.integers(2, 1000))
    t, s = cuda.stream(), cuda.stream()
    sleep_then_fill[16, 256, t](src, value, 50)  # writes src after ~50 ms on stream t
    dst = um.PinnedBuffer.empty(4096, np.float32)
    um.copy(dst, src, stream=s)  # on s: must wait (on the device) for t's kernel
    np.testing.assert_array_equal(dst.host, np.full(4096, value, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dst_kind", ("device", "pinned", "vmm"))
def test_host_write_to_the_source_waits_for_the_async_copy(kernels, dst_kind, rng):

    sleep, _, _ = kernels
    data = random_array(rng, 1 << 16, np.float32)
    s = cuda.stream()

    def run(policy):
        # Written on the host, so that the copy below is the only device work on it (a from_array by
        # DMA would be in flight too, and the "off" run's host write would race it as well).
        src = um.ManagedBuffer.empty(data.shape, data.dtype)
        src.host[:] = data
        dst = _empty(dst_kind, data.shape, data.dtype)
        sleep[1, 1, s](50)  # the copy below starts ~50 ms from now
        um.copy(dst, src, stream=s)
        with um.coherence_policy(policy):
            src.host[:] = 0  # "sync": waits for the copy; "off": races it
        return _read(dst)

    raced = run("off")
    assert (raced == 0).any(), "the race was not real: the copy finished before the host write"
    np.testing.assert_array_equal(run("sync"), data)


@pytest.mark.gpu
def test_host_write_to_a_pinned_source_waits_for_the_upload(kernels, rng):

    sleep, _, add = kernels
    data = random_array(rng, 1 << 16, np.float32)
    s = cuda.stream()
    src = um.PinnedBuffer.from_array(data)
    dst = um.DeviceBuffer.zeros(data.shape, np.float32)
    sleep[1, 1, s](50)
    dst.copy_from_host(src, stream=s)  # async DMA from the pinned buffer
    src.host[:] = -1  # waits for the upload
    ones = um.DeviceBuffer.from_array(np.ones_like(data))
    add[64, 1024, s](dst, ones)
    np.testing.assert_array_equal(dst.copy_to_host(), data + 1)


@pytest.mark.gpu
def test_numpy_to_managed_then_kernel_and_device_resident_read_back(kernels, rng):

    _, _, add = kernels
    a = random_array(rng, 1 << 20, np.float32)
    b = random_array(rng, 1 << 20, np.float32)
    ma = um.ManagedBuffer.empty(a.shape, np.float32)
    mb = um.ManagedBuffer.empty(b.shape, np.float32)
    s = cuda.stream()
    ma.copy_from_host(a, stream=s)
    mb.copy_from_host(b, stream=s)
    add[1024, 1024, s](ma, mb)
    np.testing.assert_allclose(ma.copy_to_host(stream=s), a + b, rtol=1e-6)
    # the copy engine wrote the pages on the device (prefetch before the DMA)
    if cuda.get_current_device().CONCURRENT_MANAGED_ACCESS:
        mb.synchronize()
        assert mb.hints.last_prefetch_location == um.Location.device(mb.device_id)


@pytest.mark.sim
@pytest.mark.gpu
def test_copy_refuses_overlap_closed_and_mismatch(rng):
    data = random_array(rng, 100, np.float32)
    m = um.ManagedBuffer.from_array(data)
    with pytest.raises(ValueError, match="overlap"):
        um.copy(m[10:60], m[20:70])
    um.copy(m[50:100], m[0:50])  # disjoint halves of one allocation are fine
    np.testing.assert_array_equal(m.host[50:], data[:50])
    with pytest.raises(ValueError, match="mismatched"):
        um.copy(um.DeviceBuffer.empty(99, np.float32), m)
    with pytest.raises(ValueError, match="mismatched"):
        m.copy_to_host(np.empty(100, np.float64))
    with pytest.raises(TypeError, match="PinnedBuffer"):
        m.copy_to_host(staging="yes")
    closed = um.DeviceBuffer.empty(100, np.float32)
    closed.close()
    with pytest.raises(um.BufferClosedError):
        um.copy(closed, m)


# ---------------------------------------------------------------------------
# CPU: validation before any driver call (fake device arrays)


class _FakeDeviceArray:
    def __init__(self, shape, dtype="<f4", strides=None, ptr=1 << 40, readonly=False):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": dtype,
            "data": (ptr, readonly),
            "strides": strides,
            "version": 3,
        }


def test_copy_refuses_numpy_operands_with_a_hint():
    with pytest.raises(TypeError, match="copy_to_host / copy_from_host"):
        um.copy(np.zeros(3), np.zeros(3))
    with pytest.raises(TypeError, match="numba device array or a umem_numba buffer, got list"):
        um.copy(_FakeDeviceArray((3,)), [1, 2, 3])


def test_copy_validates_shape_dtype_layout_before_the_driver():
    a = _FakeDeviceArray((4, 5))
    with pytest.raises(ValueError, match=r"\(4, 6\) float32 vs \(4, 5\) float32"):
        um.copy(a, _FakeDeviceArray((4, 6), ptr=1 << 41))
    with pytest.raises(ValueError, match="float64"):
        um.copy(a, _FakeDeviceArray((4, 5), "<f8", ptr=1 << 41))
    with pytest.raises(ValueError, match="source must be C-contiguous"):
        um.copy(a, _FakeDeviceArray((4, 5), strides=(40, 8), ptr=1 << 41))
    with pytest.raises(ValueError, match="read-only"):
        um.copy(_FakeDeviceArray((4, 5), readonly=True), _FakeDeviceArray((4, 5), ptr=1 << 41))
    with pytest.raises(ValueError, match="overlap"):
        um.copy(a, _FakeDeviceArray((4, 5), ptr=(1 << 40) + 8))
    # explicit C strides count as contiguous: the error is the stream's, not the layout's
    with pytest.raises(TypeError, match="stream"):
        um.copy(a, _FakeDeviceArray((4, 5), strides=(20, 4), ptr=1 << 41), stream=1.5)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["copy", "--size-gib", "0"], "--size-gib must be positive"),
        (["copy", "--reps", "0"], "--reps must be >= 1"),
        (["pool", "--iterations", "0"], "--iterations must be >= 1"),
    ],
)
def test_benchmark_arguments_are_checked(argv, message):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "umem_numba", "bench", *argv], check=False, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and message in proc.stderr
