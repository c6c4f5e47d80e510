"""Device-side ordering between streams: read after write, write after read, write after write.

The first piece of work sleeps on the device before it touches the buffer,
the second is issued at once on another stream: without ordering the second
overtakes the first (shown with the ordering bypassed), with it the result is
as if they ran in issue order.  Readers on different streams still overlap.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from numba import cuda
from support.helpers import random_array

import umem_numba as um
from umem_numba import _driver

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

N = 4096
TRIALS = 20


@pytest.fixture(scope="module")
def kernels():
    @um.jit
    def sleep_then_copy(dst, src, sleeps):
        for _ in range(sleeps):
            cuda.nanosleep(1_000_000)
        i = cuda.grid(1)
        if i < dst.shape[0]:
            dst[i] = src[i]

    @um.jit
    def copy_then_sleep(dst, src, sleeps):
        i = cuda.grid(1)
        if i < dst.shape[0]:
            dst[i] = src[i]
        for _ in range(sleeps):
            cuda.nanosleep(1_000_000)

    @um.jit
    def fill(dst, value):
        i = cuda.grid(1)
        if i < dst.shape[0]:
            dst[i] = value

    return sleep_then_copy, copy_then_sleep, fill


def test_read_only_arguments_are_inferred(kernels):
    sleep_then_copy, _, fill = kernels
    assert sleep_then_copy.writes == {"dst": True, "src": False, "sleeps": False}
    assert fill.writes == {"dst": True, "value": False}
    from umem_numba.kernels import heat2d_kernel, heat3d_kernel

    assert um.coherent(heat2d_kernel(16)).writes == {"src": False, "dst": True, "w_center": False, "w_neighbour": False}
    assert um.coherent(heat3d_kernel(8)).writes["src"] is False
    assert um.coherent(heat3d_kernel(8)).writes["dst"] is True
    explicit = um.coherent(sleep_then_copy.kernel, readonly=("dst", "src", "sleeps"))
    assert not any(explicit.writes.values())
    with pytest.raises(ValueError, match="not parameters"):
        um.coherent(sleep_then_copy.kernel, readonly=("nope",))


def test_read_after_write_across_streams(kernels, rng):
    sleep_then_copy, _, _ = kernels
    a, b = um.managed_zeros(N, np.float64), um.managed_zeros(N, np.float64)
    s1, s2 = cuda.stream(), cuda.stream()
    for _ in range(TRIALS):
        values = random_array(rng, N, np.float64)
        src = cuda.to_device(values, stream=s1)
        sleep_then_copy[N // 128, 128, s1](a, src, 30)  # writes a after 30 ms
        sleep_then_copy[N // 128, 128, s2](b, a, 0)  # reads a: must wait for the write
        np.testing.assert_array_equal(b.host, values)


def test_write_after_read_across_streams(kernels, rng):
    _, _copy_then_sleep, fill = kernels
    sleep_then_copy = kernels[0]
    a, b = um.managed_zeros(N, np.float64), um.managed_zeros(N, np.float64)
    s1, s2 = cuda.stream(), cuda.stream()
    for trial in range(TRIALS):
        old = random_array(rng, N, np.float64)
        new = float(rng.random() + 2.0)  # unlike any of `old`
        a.host[:] = old
        sleep_then_copy[N // 128, 128, s1](b, a, 30)  # reads a after 30 ms
        fill[N // 128, 128, s2](a, new)  # writes a: must wait for the read
        # a first: its wait runs the writer, and the reader only where the writer waits for it
        assert (a.host == new).all(), f"trial {trial}"
        np.testing.assert_array_equal(b.host, old, err_msg=f"trial {trial}: the writer overtook the reader")


def test_write_after_write_across_streams(kernels, rng):
    sleep_then_copy, _, fill = kernels
    a = um.managed_zeros(N, np.float64)
    s1, s2 = cuda.stream(), cuda.stream()
    for _ in range(TRIALS):
        first = cuda.to_device(random_array(rng, N, np.float64), stream=s1)
        sleep_then_copy[N // 128, 128, s1](a, first, 30)
        fill[N // 128, 128, s2](a, 5.0)
        cuda.synchronize()
        assert (a.host == 5.0).all()  # the later write is the one that stays


def test_copies_and_prefetches_are_ordered_too(kernels, rng):
    sleep_then_copy, _, _ = kernels
    a = um.managed_zeros(N, np.float64)
    dst = um.ManagedBuffer.empty(N, np.float64)
    s1, s2, s3 = cuda.stream(), cuda.stream(), cuda.stream()
    for _ in range(5):
        values = random_array(rng, N, np.float64)
        sleep_then_copy[N // 128, 128, s1](a, cuda.to_device(values, stream=s1), 30)
        a.prefetch("cpu", stream=s2)  # a read: after the write
        um.copy(dst, a, stream=s3)  # a read of a, a write of dst: after the write
        np.testing.assert_array_equal(dst.host, values)
        vmm = um.VMMBuffer.empty(N, np.float64)
        sleep_then_copy[N // 128, 128, s1](a, cuda.to_device(values[::-1].copy(), stream=s1), 30)
        vmm.copy_from_host(a, stream=s2)  # a managed source is tracked (it is read on the device)
        np.testing.assert_array_equal(vmm.copy_to_host(), values[::-1])
        vmm.close()


def test_readers_on_two_streams_are_not_ordered(kernels, rng):
    """A reader on another stream does not wait for a sleeping reader of the same buffer.

    The first reader sleeps ~200 ms, then copies ``a`` into ``outs[0]``; the second copies ``a`` into
    ``outs[1]`` at once.  When the host has the second's result, the first has not written yet (read
    with no wait), so the second was not made to wait for it.  (The other half, a writer after a
    reader waits, is test_write_after_read_across_streams.)
    """
    sleep_then_copy, _, _ = kernels
    a, outs = um.managed_zeros(N, np.float64), [um.managed_zeros(N, np.float64) for _ in range(2)]
    s1, s2 = cuda.stream(), cuda.stream()
    for trial in range(TRIALS):
        values = random_array(rng, N, np.float64)
        a.host[:] = values
        for out in outs:
            out.host[:] = -1.0
        sleep_then_copy[N // 128, 128, s1](outs[0], a, 200)  # reads a after ~200 ms
        sleep_then_copy[N // 128, 128, s2](outs[1], a, 0)  # reads a at once
        np.testing.assert_array_equal(outs[1].host, values, err_msg=f"trial {trial}")
        with um.coherence_policy("off"):
            first = outs[0].host.copy()
        assert (first == -1.0).all(), f"trial {trial}: the second reader waited for the first"
        np.testing.assert_array_equal(outs[0].host, values, err_msg=f"trial {trial}")


def test_per_thread_default_streams_are_told_apart(kernels, rng):
    """Handle 2 names a different stream in each thread: events filed under it must not replace each other."""
    sleep_then_copy, _, fill = kernels
    a = um.managed_zeros(N, np.float64)
    for trial in range(TRIALS):
        values = random_array(rng, N, np.float64)
        last = float(rng.random() + 2.0)  # unlike any of `values`
        started = threading.Event()

        # bound now: this round's values and event
        def slow_writer(values: np.ndarray = values, started: threading.Event = started) -> None:
            s = cuda.per_thread_default_stream()
            sleep_then_copy[N // 128, 128, s](a, cuda.to_device(values, stream=s), 60)
            started.set()

        t = threading.Thread(target=slow_writer)
        t.start()
        assert started.wait(30)
        t.join(30)
        fill[N // 128, 128, cuda.per_thread_default_stream()](a, last)  # another thread's stream 2
        assert (a.host == last).all(), f"trial {trial}"
        cuda.synchronize()
        assert (a.host == last).all(), f"trial {trial}: the slow write landed after the later one"


@pytest.mark.real_gpu(
    "a new stream given a destroyed stream's handle: the simulated driver never hands a handle out twice, "
    "so this test could not reach its case there (the ordering itself is test_write_after_write_across_streams)"
)
def test_a_reused_stream_handle_is_not_the_old_stream(kernels, rng):
    """A slow write on a destroyed stream, then a write on a new stream, often with the old handle."""
    sleep_then_copy, _, fill = kernels
    a = um.managed_zeros(N, np.float64)
    reused = 0
    for trial in range(TRIALS):
        values = random_array(rng, N, np.float64)
        last = float(rng.random() + 2.0)  # unlike any of `values`
        _driver.ensure_context()  # a raw driver call needs a current context (first test of a worker)
        h1 = int(_driver.call("cuStreamCreate", 0))
        s1 = cuda.external_stream(h1)
        sleep_then_copy[N // 128, 128, s1](a, cuda.to_device(values, stream=s1), 60)
        _driver.call("cuStreamDestroy", h1)  # returns at once; the kernel still runs
        h2 = int(_driver.call("cuStreamCreate", 0))
        reused += h2 == h1
        fill[N // 128, 128, cuda.external_stream(h2)](a, last)
        assert (a.host == last).all(), f"trial {trial}"
        cuda.synchronize()
        assert (a.host == last).all(), f"trial {trial}: the slow write landed after the later one"
        _driver.call("cuStreamDestroy", h2)
    # Only a reused handle tells a stream keyed by its handle from one keyed by its id.
    assert reused, f"no new stream got the destroyed stream's handle in {TRIALS} trials: the case was not reached"


def test_graph_capture_is_refused_clearly(kernels, rng):
    _, _, fill = kernels
    a = um.managed_zeros(N, np.float64)
    _driver.ensure_context()  # a raw driver call needs a current context (first test of a worker)
    h = int(_driver.call("cuStreamCreate", 1))
    drv = _driver.api().drv
    relaxed = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    _driver.call("cuStreamBeginCapture", h, relaxed)
    try:
        with pytest.raises(um.CoherenceError, match="graph capture"):
            fill[N // 128, 128, cuda.external_stream(h)](a, 1.0)
    finally:
        graph = _driver.call("cuStreamEndCapture", h)
        _driver.call("cuGraphDestroy", graph)
        _driver.call("cuStreamDestroy", h)
    fill[N // 128, 128](a, 2.0)  # the buffer is still usable, its tracker is clean
    assert (a.host == 2.0).all()


def test_a_view_taken_during_another_launch_is_tracked(kernels, rng):
    """A buffer whose view leaves the toolkit while a toolkit launch of another buffer is under way."""
    sleep_then_copy, _, _ = kernels
    a, b = um.managed_zeros(N, np.float64), um.managed_zeros(N, np.float64)

    class Wrapper:  # a foreign array type that reads b's interface lazily
        @property
        def __cuda_array_interface__(self):
            return b.__cuda_array_interface__

    values = random_array(rng, N, np.float64)
    a.host[:] = values
    um.launch(sleep_then_copy, N // 128, 128, Wrapper(), a, 40)  # b is written through the wrapper
    np.testing.assert_array_equal(b.host, values)
    assert b._coherence_tracker.escaped and not a._coherence_tracker.escaped
