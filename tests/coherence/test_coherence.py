"""Coherence on the GPU: host access never races device work.

A kernel sleeps ~50 ms on the device, then writes random values; the host
reads right after the launch.  With checks off the host sees stale data (the
race is real); with "sync" it always sees the kernel's values.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from numba import cuda
from support.helpers import random_array

import umem_numba as um
from umem_numba._driver._location import stream_handle

pytestmark = pytest.mark.gpu

N = 256


@pytest.fixture(scope="module")
def k():

    @cuda.jit
    def sleep_then_copy(dst, src, sleeps):
        for _ in range(sleeps):
            cuda.nanosleep(1_000_000)  # ~1 ms per call, on the device clock
        i = cuda.grid(1)
        if i < dst.shape[0]:
            dst[i] = src[i]

    @cuda.jit
    def scale(a, s):
        i = cuda.grid(1)
        if i < a.shape[0]:
            a[i] *= s

    return sleep_then_copy, um.coherent(sleep_then_copy), scale


@pytest.fixture(scope="module")
def copy_twice():
    """``copy_twice(dst, witness, src, sleeps)``: sleeps, then writes ``src`` into both ``dst`` and ``witness``."""

    @cuda.jit
    def sleep_then_copy_twice(dst, witness, src, sleeps):
        for _ in range(sleeps):
            cuda.nanosleep(1_000_000)
        i = cuda.grid(1)
        if i < dst.shape[0]:
            dst[i] = src[i]
            witness[i] = src[i]

    return um.coherent(sleep_then_copy_twice)


def _sentinel(buf):
    buf.host[:] = -1.0


def _unwaited(buf) -> np.ndarray:
    """The memory as it is now: no wait for device work (policy "off"), a copy taken at once."""
    with um.coherence_policy("off"):
        return buf.host.copy()


def test_the_race_is_real_without_checks(k, rng):
    _raw, coh, _ = k

    values = random_array(rng, N, np.float64)
    src = cuda.to_device(values)
    dst = um.managed_empty(N, np.float64)
    _sentinel(dst)
    coh[1, N](dst, src, 50)
    assert (_unwaited(dst) == -1.0).all()  # the kernel had not written yet
    np.testing.assert_array_equal(dst.host, values)  # "sync" waits (compared with host data: no sync here)


def test_sync_policy_200_trials(k, rng):
    _, coh, _ = k

    rows = random_array(rng, (200, N), np.float64)
    srcs = cuda.to_device(rows)
    dst = um.managed_empty(N, np.float64)
    stream = cuda.stream()
    for t in range(200):
        _sentinel(dst)
        coh[1, N, stream](dst, srcs[t], 50)
        # the kernel sleeps ~50 ms before it writes: only a wait shows this trial's row
        np.testing.assert_array_equal(dst.host, rows[t], err_msg=f"trial {t}")


def test_raise_policy_names_the_stream(k, rng):
    _, coh, _ = k

    first, second = random_array(rng, N, np.float64), random_array(rng, N, np.float64)
    # Device copies kept alive: numba frees a dropped device array (cuMemFree synchronises the
    # device) once enough are pending, which would end the kernel before the host checks it.
    src1, src2 = cuda.to_device(first), cuda.to_device(second)
    dst = um.managed_empty(N, np.float64)
    stream = cuda.stream()
    coh[1, N, stream](dst, src1, 50)
    with um.coherence_policy("raise"):
        with pytest.raises(um.CoherenceError, match=f"{int(stream.handle):#x}"):
            dst.host
        assert dst.busy
        dst.synchronize()
        np.testing.assert_array_equal(dst.host, first)  # no error once done (and synchronize waited)
    # per-buffer policy wins over the global default
    coh[1, N, stream](dst, src2, 30)
    dst.coherence_policy = "raise"
    with pytest.raises(um.CoherenceError):
        np.asarray(dst)
    dst.coherence_policy = None
    np.testing.assert_array_equal(np.asarray(dst), second)  # "sync" again: waited for the second kernel


def test_warn_policy(k, rng):
    _, coh, _ = k

    src = cuda.to_device(random_array(rng, N, np.float64))
    dst = um.managed_empty(N, np.float64)
    coh[1, N](dst, src, 30)
    with um.coherence_policy("warn"), pytest.warns(um.CoherenceWarning, match="may still be using"):
        dst.host
    dst.synchronize()


def test_launch_function_and_jit_decorator(rng):
    data = random_array(rng, 1000, np.float32)

    @um.jit
    def double(a):
        i = cuda.grid(1)
        if i < a.shape[0]:
            a[i] *= 2

    assert isinstance(double, um.CoherentKernel)
    buf = um.managed_from(data)
    double[8, 128](buf)
    assert buf._coherence_tracker.pending  # an event was recorded, no unknown mark
    assert not buf._coherence_tracker.unknown
    np.testing.assert_array_equal(buf.host, data * 2)
    um.launch(double.kernel, 8, 128, buf)
    np.testing.assert_array_equal(buf.host, data * 4)


def test_raw_numba_launch_is_recorded_on_its_stream(k, rng):
    """A plain numba launch of a buffer (numba's launch, not the toolkit's) is recorded on its stream."""
    raw, _, _ = k

    values = random_array(rng, N, np.float64)
    src = cuda.to_device(values)
    dst = um.managed_empty(N, np.float64)
    _sentinel(dst)
    s = cuda.stream()
    raw[1, N, s](dst, src, 50)  # numba's own launch
    tracker = dst._coherence_tracker
    assert not tracker.unknown and not tracker.escaped, "the launch's stream is known: no unknown mark"
    assert list(tracker.pending) == [stream_handle(s)], "one event, on the launch's stream"
    with um.coherence_policy("raise"), pytest.raises(um.CoherenceError, match="may still be using"):
        dst.host
    np.testing.assert_array_equal(dst.host, values)  # "sync": waits for the launch's event


def test_host_hold_blocks_launches(k, rng):
    _raw, _coh, scale = k
    data = random_array(rng, N, np.float32)
    buf = um.managed_from(data)
    with buf.on_host() as h:
        with pytest.raises(um.CoherenceError, match="held by the host"):
            um.launch(scale, 1, N, buf, 2.0)
        with pytest.raises(um.CoherenceError, match="host holds this buffer"):
            scale[1, N](buf[10:], 2.0)  # a plain numba launch of a view is caught too
        h[:] += 1
    um.launch(scale, 1, N, buf, 2.0)
    np.testing.assert_array_equal(buf.host, (data + 1) * 2)


@pytest.mark.parametrize("launch", ["coherent", "plain"])
def test_precision_unrelated_work_is_not_waited_for(k, rng, launch):
    """Host access to A waits for A's kernel only, not for B's long kernel on another stream:
    coherent launches, and plain numba launches (each tracked on its own stream, issue #28)."""
    raw, coh, scale = k

    slow_stream, fast_stream = cuda.stream(), cuda.stream()
    b_data = random_array(rng, N, np.float64)
    src = cuda.to_device(b_data)
    b = um.managed_empty(N, np.float64)
    _sentinel(b)
    a_data = random_array(rng, N, np.float32)
    a = um.managed_from(a_data)

    def scale_a(factor):
        if launch == "coherent":
            um.launch(scale, 1, N, a, factor, stream=fast_stream)
        else:
            scale[1, N, fast_stream](a, factor)

    scale_a(1.0)  # compiled now: a compile inside B's sleep could outlast it
    a.synchronize()
    (coh if launch == "coherent" else raw)[1, N, slow_stream](b, src, 400)  # ~400 ms on B
    scale_a(3.0)
    np.testing.assert_array_equal(a.host, a_data * 3)
    # A's host access waited for A's kernel only: B's kernel, still asleep, has not written yet
    assert (_unwaited(b) == -1.0).all(), "host access to A waited for B's kernel"
    assert b.busy, "B's kernel should still be running"
    np.testing.assert_array_equal(b.host, b_data)


def test_close_waits_for_pending_work(k, copy_twice, rng):
    """close() waits for the kernels still using the memory, then frees it.

    A VMMBuffer: its release (cuMemUnmap, cuMemRelease) does not wait for the device by itself,
    unlike cuMemFree of managed memory, so only close()'s own wait keeps the kernel off freed memory.
    """
    _, coh, _ = k

    src = cuda.to_device(random_array(rng, N, np.float64))
    dst = um.VMMBuffer.empty(N, np.float64)
    coh[1, N](dst, src, 50)
    with um.coherence_policy("raise"), pytest.raises(um.CoherenceError):
        dst.close()
    assert not dst.closed  # a refused close leaves the buffer usable
    values = random_array(rng, N, np.float64)
    witness = um.managed_empty(N, np.float64)
    _sentinel(witness)
    copy_twice[1, N](dst, witness, cuda.to_device(values), 50)  # writes dst and witness after ~50 ms
    dst.close()  # "sync": waits for the kernel, then frees
    assert dst.closed
    # the kernel had finished when close() returned: it wrote the witness too
    np.testing.assert_array_equal(_unwaited(witness), values, err_msg="close() freed dst under a running kernel")


def test_device_without_concurrent_access_waits_for_whole_device(k, rng):
    """Simulate concurrentManagedAccess=0: host access must wait for *any* kernel."""
    _, coh, scale = k

    other = um.managed_empty(N, np.float64)
    _sentinel(other)
    values = random_array(rng, N, np.float64)
    mine_data = random_array(rng, N, np.float32)
    mine = um.managed_from(mine_data)
    mine._coherence_tracker.concurrent = False
    coh[1, N, cuda.stream()](other, cuda.to_device(values), 200)
    mine.host
    # waited for the unrelated kernel: it has written `other`
    np.testing.assert_array_equal(_unwaited(other), values, err_msg="host access did not wait for the device")
    # attached to one stream, it waits for that stream only
    s1, s2 = cuda.stream(), cuda.stream()
    mine.attach(s1)
    assert mine.attached_to == int(s1.handle)
    _sentinel(other)
    coh[1, N, s2](other, cuda.to_device(random_array(rng, N, np.float64)), 300)
    um.launch(scale, 1, N, mine, 2.0, stream=s1)
    np.testing.assert_array_equal(mine.host, mine_data * 2)
    # the kernel on s2, still asleep, was not waited for
    assert (_unwaited(other) == -1.0).all(), "host access waited for another stream than the attached one"
    assert other.busy
    mine.attach("global", stream=s1)
    assert mine.attached_to == "global"
    with pytest.raises(ValueError, match="legacy default stream"):
        mine.attach(0)
    with pytest.raises(ValueError, match="attach target"):
        mine.attach("device")


def test_eight_threads(rng):
    @um.jit
    def affine(a, s, t):
        i = cuda.grid(1)
        if i < a.shape[0]:
            a[i] = a[i] * s + t

    errors: list[BaseException] = []
    seeds = rng.integers(0, 2**31, size=8)

    def worker(seed: int) -> None:
        try:
            r = np.random.default_rng(seed)
            stream = cuda.stream()
            buf = um.managed_empty(10_000, np.float64)
            for _ in range(25):
                data = r.random(10_000) + 0.5
                buf.host[:] = data
                affine[40, 256, stream](buf, 3.0, 1.0)
                np.testing.assert_array_equal(buf.host, data * 3.0 + 1.0)
            buf.close()
        except BaseException as exc:  # collected and re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(int(s),)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_coherent_wrapper_validation():
    with pytest.raises(TypeError, match=r"numba @cuda.jit kernel"):
        um.coherent(lambda x: x)

    @cuda.jit
    def noop(a):
        pass

    kk = um.coherent(noop)
    assert um.coherent(kk) is kk
    with pytest.raises(ValueError, match="launch configuration"):
        kk[1]


@pytest.mark.multigpu
def test_launch_on_another_device_is_tracked(rng):
    """A buffer from device 0 used by a kernel on device 1: the event lives in device 1's context."""
    data = random_array(rng, 4096, np.float64)
    buf = um.managed_from(data)
    assert buf.device_id == 0

    @um.jit
    def plus_two(a):
        i = cuda.grid(1)
        if i < a.shape[0]:
            a[i] += 2

    with cuda.gpus[1]:
        other = um.managed_from(data)
        assert other.device_id == 1
        plus_two[32, 128](buf)
        plus_two[32, 128](other)
        ((_stream, event),) = buf._coherence_tracker.pending.items()
        assert event.device_id == 1
    np.testing.assert_array_equal(buf.host, data + 2)
    np.testing.assert_array_equal(other.host, data + 2)
