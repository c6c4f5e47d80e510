"""Coherence with other libraries: numba arrays, CuPy, PyTorch and DLPack consumers.

Each trial: the host writes a sentinel, another library's kernel sleeps
>= 20 ms on the device and then writes fresh random values into the shared
memory, and the host reads right away.  The read must see the new values,
on the first use of the foreign view and on later uses (after a host access
in between), on the legacy default stream and on a non-blocking stream.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from support.helpers import random_array

import umem_numba as um
from umem_numba import _driver

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

N = 4096
TRIALS = 50
SLEEP_MS = 20


@pytest.fixture(scope="module")
def sleep_write():
    @cuda.jit
    def kernel(dst, src, sleeps):
        for _ in range(sleeps):
            cuda.nanosleep(1_000_000)
        i = cuda.grid(1)
        if i < dst.shape[0]:
            dst[i] = src[i]

    return kernel


@pytest.fixture(scope="module")
def sleep_only():
    @cuda.jit
    def kernel(sleeps):
        for _ in range(sleeps):
            cuda.nanosleep(1_000_000)

    return kernel


def _raw_upload(dst_ptr: int, source, stream_handle: int) -> None:
    """Another library's stream work on the memory: ``cuMemcpyHtoDAsync`` from page-locked ``source``.

    Queued on the stream (the simulated driver runs it late, as a GPU may: a plain numba kernel
    runs at the call there).
    """
    _driver.call("cuMemcpyHtoDAsync", dst_ptr, source.ptr, source.nbytes, stream_handle)


def _unwaited(buf) -> np.ndarray:
    """The memory as it is now: no wait for device work (policy "off"), a copy taken at once."""
    with um.coherence_policy("off"):
        return buf.host.copy()


class _NonBlocking:
    """A stream created with CU_STREAM_NON_BLOCKING, as numba, CuPy and PyTorch see it."""

    def __init__(self) -> None:
        _driver.ensure_context()  # a raw driver call needs a current context (first test of a worker)
        self.handle = int(_driver.call("cuStreamCreate", 1))

    def close(self) -> None:
        _driver.call("cuStreamSynchronize", self.handle)
        _driver.call("cuStreamDestroy", self.handle)


@pytest.fixture(params=["default", "non-blocking"])
def stream_handle(request):
    if request.param == "default":
        yield 0
        return
    s = _NonBlocking()
    yield s.handle
    s.close()


def _trials(rng, buf, run_foreign, *, later_use: bool) -> None:
    """``run_foreign(values)`` makes the other library write ``values`` into ``buf`` after a device sleep."""
    for _ in range(TRIALS):
        values = random_array(rng, N, np.float64)
        buf.host[:] = -1.0
        if later_use:
            assert (buf.host == -1.0).all()  # a host access between taking the view and using it
        run_foreign(values)
        np.testing.assert_array_equal(buf.host, values)


@pytest.mark.parametrize("writer", ["kernel", "driver-copy"])
@pytest.mark.parametrize("later_use", [False, True], ids=["first-use", "later-use"])
def test_numba_device_array_view(sleep_write, sleep_only, rng, stream_handle, later_use, writer):
    """The view escapes: host access then synchronises.  ``writer``: a plain numba kernel through the
    view, or a sleeping plain kernel and then a copy queued by the driver into the view's address."""
    buf = um.managed_zeros(N, np.float64)
    view = cuda.as_cuda_array(buf)
    stream = cuda.external_stream(stream_handle) if stream_handle else cuda.default_stream()
    sources = []  # page-locked sources stay until the trials end (their copies may be queued)

    def run(values):
        if writer == "kernel":
            src = cuda.to_device(values, stream=stream)
            sleep_write[N // 128, 128, stream](view, src, SLEEP_MS)
            return
        sources.append(um.PinnedBuffer.from_array(values))
        sleep_only[1, 1, stream](SLEEP_MS)
        _raw_upload(view.__cuda_array_interface__["data"][0], sources[-1], stream_handle)

    _trials(rng, buf, run, later_use=later_use)


def _cupy_sleep_write():
    """CuPy's ``sleep_write(dst, src, n, sleeps)``: sleeps ``sleeps`` ms on the device, then copies."""
    import cupy

    return cupy.RawKernel(
        r"""
    extern "C" __global__ void sleep_write(double* dst, const double* src, int n, int sleeps) {
        for (int s = 0; s < sleeps; ++s) __nanosleep(1000000);
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) dst[i] = src[i];
    }""",
        "sleep_write",
    )


@pytest.mark.parametrize("later_use", [False, True], ids=["first-use", "later-use"])
def test_cupy_array(rng, stream_handle, later_use):
    cupy = pytest.importorskip("cupy")
    kernel = _cupy_sleep_write()
    buf = um.managed_zeros(N, np.float64)
    stream = cupy.cuda.ExternalStream(stream_handle)
    with stream:
        arr = cupy.asarray(buf)

        def run(values):
            src = cupy.asarray(values)
            kernel((N // 128,), (128,), (arr, src, np.int32(N), np.int32(SLEEP_MS)))

        _trials(rng, buf, run, later_use=later_use)


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    return torch


def _torch_sleep_cycles(torch) -> int:
    rate_khz = (
        torch.cuda.get_device_properties(0).clock_rate
        if hasattr(torch.cuda.get_device_properties(0), "clock_rate")
        else 2_000_000
    )
    return int(rate_khz * SLEEP_MS * 1.5)  # kHz x ms = cycles; 1.5x for boost clocks


@pytest.mark.parametrize("later_use", [False, True], ids=["first-use", "later-use"])
@pytest.mark.parametrize("protocol", ["cuda-array-interface", "dlpack"])
def test_pytorch_tensor(rng, stream_handle, later_use, protocol):
    torch = _torch()
    buf = um.managed_zeros(N, np.float64)
    stream = torch.cuda.ExternalStream(stream_handle) if stream_handle else torch.cuda.default_stream()
    cycles = _torch_sleep_cycles(torch)
    with torch.cuda.stream(stream):
        t = torch.as_tensor(buf, device="cuda") if protocol == "cuda-array-interface" else torch.from_dlpack(buf)
        assert t.data_ptr() == buf.ptr

        def run(values):
            src = torch.from_numpy(values).to("cuda", non_blocking=False)
            torch.cuda._sleep(cycles)
            t.copy_(src)

        _trials(rng, buf, run, later_use=later_use)


def test_cupy_from_dlpack(rng):
    cupy = pytest.importorskip("cupy")
    buf = um.managed_zeros(N, np.float64)
    arr = cupy.from_dlpack(buf)
    assert arr.data.ptr == buf.ptr and arr.shape == (N,)
    values = random_array(rng, N, np.float64)
    arr[...] = cupy.asarray(values)
    np.testing.assert_array_equal(buf.host, values)


@pytest.mark.parametrize("consumer", ["cupy", "driver-copy"])
def test_lend_waits_for_exactly_the_lent_work(sleep_write, sleep_only, rng, consumer):
    """Host access after a lend block waits for that stream's work, not for unrelated work elsewhere.

    The lent stream sleeps ~20 ms before the consumer writes (CuPy's kernel, or a copy queued by
    the driver); a tracked ~400 ms kernel writes another buffer on another stream.  The host sees
    the lent work's values, and the other buffer still unwritten (read with no wait).
    """
    cupy = pytest.importorskip("cupy") if consumer == "cupy" else None
    buf = um.managed_zeros(N, np.float64)
    other = um.managed_zeros(N, np.float64)
    buf.host[:] = -1.0
    other.host[:] = -1.0
    busy, lent = _NonBlocking(), _NonBlocking()
    try:
        values = random_array(rng, N, np.float64)
        # Allocations first: a page-locked allocation (cuMemHostAlloc) or a first cudaMalloc waits
        # for the whole device, which would wait for the slow kernel below whatever umem_numba does.
        source = um.PinnedBuffer.from_array(values)
        src = cupy.asarray(values) if cupy is not None else None
        slow = random_array(rng, N, np.float64)
        slow_dev = cuda.to_device(slow)
        # Compiled and loaded first too: a compile inside the block could outlast the slow kernel.
        if cupy is not None:
            _cupy_sleep_write().compile()
        else:
            sleep_only[1, 1](0)
        cuda.synchronize()
        # a ~400 ms tracked kernel on another buffer, another stream: not to be waited for
        um.coherent(sleep_write)[N // 128, 128, cuda.external_stream(busy.handle)](other, slow_dev, 400)
        with buf.lend(lent.handle) as view:
            if cupy is not None:
                with cupy.cuda.ExternalStream(lent.handle):
                    # DLPack: CuPy names its current stream (the lent one), so the block's end stays
                    # precise; a CUDA Array Interface consumer names none (the next host access then
                    # synchronises the device: docs/concepts/coherence.md, "lend")
                    dst = cupy.from_dlpack(view)
                    _cupy_sleep_write()((N // 128,), (128,), (dst, src, np.int32(N), np.int32(SLEEP_MS)))
            else:
                sleep_only[1, 1, cuda.external_stream(lent.handle)](SLEEP_MS)
                _raw_upload(view.ptr, source, lent.handle)  # raw work on the lent stream, as the block promises
        assert not buf._coherence_tracker.escaped
        np.testing.assert_array_equal(buf.host, values, err_msg="host access did not wait for the lent work")
        assert (_unwaited(other) == -1.0).all(), "host access to the lent buffer waited for unrelated work"
        with pytest.raises(um.BufferClosedError, match=r"after its `with buf.lend"):
            view.__cuda_array_interface__
        np.testing.assert_array_equal(other.host, slow)
    finally:
        busy.close()
        lent.close()


def test_lend_orders_the_consumer_after_toolkit_writes(sleep_write, rng):
    """Work lent on a stream starts after a toolkit kernel on another stream wrote the buffer."""
    cupy = pytest.importorskip("cupy")
    buf = um.managed_zeros(N, np.float64)
    writer, lent = cuda.stream(), _NonBlocking()
    kwrite = um.coherent(sleep_write)
    try:
        values = random_array(rng, N, np.float64)
        kwrite[N // 128, 128, writer](buf, cuda.to_device(values, stream=writer), 60)
        with buf.lend(lent.handle, readonly=True) as view, cupy.cuda.ExternalStream(lent.handle):
            doubled = cupy.asarray(view) * 2  # runs after the kernel, on the device
            result = cupy.asnumpy(doubled)
        np.testing.assert_array_equal(result, 2 * values)
    finally:
        lent.close()


def test_escaped_buffer_is_released_after_the_other_library_lets_go(sleep_write):
    torch = _torch()
    buf = um.managed_zeros(N, np.float64)
    t = torch.as_tensor(buf, device="cuda")
    buf.close()
    assert buf.closed
    t += 1  # the memory is still there: torch holds the buffer object
    assert float(t.sum().item()) == N
    stats_before = um.stats()["managed"].live_count
    del t, buf
    import gc

    gc.collect()
    assert um.stats()["managed"].live_count == stats_before - 1
