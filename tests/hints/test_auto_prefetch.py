"""Automatic prefetch (#28 item 3): migration where the data is needed, by prefetch rather than by fault.

To the device: a tracked launch (``um.jit``) or a plain numba launch of a ``ManagedBuffer`` whose
memory the host touched since the device last had it prefetches the allocation to the launching
device, on the launch stream, before the kernel; a launch whose arguments the host did not touch
moves nothing.  To the host: a host view (``.host``, ``np.asarray``, ``on_host()``) of at least
``HOST_PREFETCH_MIN`` bytes the device wrote is prefetched to the host before the host reads it;
element reads, assignments and small buffers are not.  Each test reads the driver's last prefetch
location back (``cuMemRangeGetAttribute``).
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from support.helpers import random_array

import umem_numba as um
from umem_numba import _driver
from umem_numba._driver import _sim

pytestmark = pytest.mark.gpu

N = 4096
G, B = N // 128, 128
TRIALS = 3 if _sim.active() else 20
SLEEPS = 0 if _sim.active() else 20


@cuda.jit
def _scale(a, k, sleeps):
    for _ in range(sleeps):
        cuda.nanosleep(1_000_000)
    i = cuda.grid(1)
    if i < a.shape[0]:
        a[i] *= k


_tracked_scale = um.jit(_scale.py_func)


def _last_prefetch(buf):
    return buf.hints.last_prefetch_location


@pytest.fixture(autouse=True)
def _auto_prefetch_on():
    before = um.get_auto_prefetch()
    um.set_auto_prefetch(True)
    yield
    um.set_auto_prefetch(before)


@pytest.mark.parametrize("launch", ["um.jit", "plain"])
def test_a_launch_after_host_writes_prefetches_to_the_device(rng, launch):
    """Host writes, then a launch on s: the last prefetch is to the device; the values are the kernel's."""
    kernel = _tracked_scale if launch == "um.jit" else _scale
    s = cuda.stream()
    data = random_array(rng, N, np.float64)
    with um.ManagedBuffer.zeros(N) as buf:
        buf.prefetch("cpu", stream=s)  # a known starting point: the host
        buf.synchronize()
        assert _last_prefetch(buf) == um.HOST
        buf.host[:] = data  # the host touches it
        kernel[G, B, s](buf, 3.0, 0)
        buf_dev = _last_prefetch(buf)
        np.testing.assert_array_equal(buf.host, data * 3.0)
        assert buf_dev == um.Location.device(0), f"the launch did not prefetch: last prefetch {buf_dev}"


@pytest.mark.parametrize("launch", ["um.jit", "plain"])
def test_a_launch_the_host_did_not_touch_moves_nothing(rng, launch):
    """The host did not touch it since: the launch prefetches nothing (the last prefetch stays the host)."""
    kernel = _tracked_scale if launch == "um.jit" else _scale
    s = cuda.stream()
    data = random_array(rng, N, np.float64)
    with um.ManagedBuffer.from_array(data) as buf:
        kernel[G, B, s](buf, 2.0, 0)  # from_array wrote it on the host: this launch prefetches
        buf.prefetch("cpu", stream=s)
        kernel[G, B, s](buf, 2.0, 0)  # untouched since: nothing moves
        buf.synchronize()
        assert _last_prefetch(buf) == um.HOST, "a launch moved memory the host had not touched"
        np.testing.assert_array_equal(buf.host, data * 4.0)


@pytest.mark.filterwarnings("ignore:.*scalar multiply:RuntimeWarning")  # the simulator's discarded half is garbage
@pytest.mark.parametrize("how", ["prefetch_range", "plan", "discard_prefetch_range"])
@pytest.mark.parametrize("launch", ["um.jit", "plain"])
def test_an_explicit_placement_after_host_writes_is_kept(rng, launch, how):
    """Host writes, then the user places part of it on the host: the launch does not move it back.

    The automatic prefetch would move the whole allocation to the device; the user's prefetch
    (or discard-and-prefetch) after the host view says where those pages go, and wins.
    """
    kernel = _tracked_scale if launch == "um.jit" else _scale
    s = cuda.stream()
    data = random_array(rng, N, np.float64)
    half = N // 2
    with um.ManagedBuffer.zeros(N) as buf:
        buf.host[:] = data  # the host touches it: the next launch would prefetch it
        if how == "prefetch_range":
            buf.prefetch_range(0, half, "cpu", stream=s)
        elif how == "plan":
            um.PrefetchPlan().add_range(buf, 0, half, "cpu").execute(s)
        else:
            if _driver.api().discard_missing:
                pytest.skip(_driver.api().discard_missing)
            buf.host[half:] = data[half:]
            buf.discard_prefetch_range(0, half, "cpu", stream=s)
        kernel[G, B, s](buf, 3.0, 0)
        placed = buf.hints.range(0, half).last_prefetch_location
        got = buf.host
        if how != "discard_prefetch_range":
            np.testing.assert_array_equal(got, data * 3.0)
        else:  # the discarded half is indeterminate; the rest is the kernel's
            np.testing.assert_array_equal(got[half:], data[half:] * 3.0)
        assert placed == um.HOST, f"the launch moved the user's placement: last prefetch {placed}"


def test_the_switch_turns_it_off(rng):
    s = cuda.stream()
    um.set_auto_prefetch(False)
    assert um.get_auto_prefetch() is False
    with um.ManagedBuffer.from_array(random_array(rng, N, np.float64)) as buf:
        buf.prefetch("cpu", stream=s)
        buf.synchronize()
        buf.host[0] = 1.0
        _tracked_scale[G, B, s](buf, 2.0, 0)
        buf.synchronize()
        assert _last_prefetch(buf) == um.HOST, "prefetched with launch-time migration off"
    with pytest.raises(TypeError, match="enabled must be a bool, got int"):
        um.set_auto_prefetch(1)


def test_migration_keeps_values_under_a_sleeping_reader_on_another_stream(rng):
    """A slow tracked reader on s1, the host writes the buffer after waiting, then a writer on s2 whose
    launch prefetches: every value is the writer's (fresh random data, 20 trials)."""

    @um.jit
    def slow_copy(dst, src, sleeps):
        for _ in range(sleeps):
            cuda.nanosleep(1_000_000)
        i = cuda.grid(1)
        if i < dst.shape[0]:
            dst[i] = src[i]

    s1, s2 = cuda.stream(), cuda.stream()
    with um.ManagedBuffer.zeros(N) as buf, um.ManagedBuffer.zeros(N) as seen:
        for trial in range(TRIALS):
            data = random_array(rng, N, np.float64)
            buf.host[:] = data  # waits for earlier work, touches every page
            slow_copy[G, B, s1](seen, buf, SLEEPS)  # reads buf slowly (its launch prefetches buf)
            buf.host[:] = data + 1.0  # waits for the reader; touches again
            _tracked_scale[G, B, s2](buf, 2.0, 0)  # prefetches, then scales
            np.testing.assert_array_equal(seen.host, data, err_msg=f"trial {trial}")
            np.testing.assert_array_equal(buf.host, (data + 1.0) * 2.0, err_msg=f"trial {trial}")


BIG = (2 << 20) // 8  # float64 elements: 2 MiB, above HOST_PREFETCH_MIN


@pytest.mark.parametrize("how", ["host", "asarray", "on_host"])
def test_host_access_after_a_device_write_prefetches_to_the_host(rng, how):
    """A slow device write of 2 MiB, then a host view: prefetched to the host, the kernel's values."""
    from umem_numba._arrays._buffer import HOST_PREFETCH_MIN

    assert BIG * 8 >= HOST_PREFETCH_MIN
    s = cuda.stream()
    data = random_array(rng, BIG, np.float64)
    with um.ManagedBuffer.from_array(data) as buf:
        _tracked_scale[(BIG + 127) // 128, 128, s](buf, 3.0, SLEEPS)  # prefetched to the device first
        assert _last_prefetch(buf) == um.Location.device(0)
        if how == "host":
            got = buf.host.copy()
        elif how == "asarray":
            got = np.asarray(buf).copy()
        else:
            with buf.on_host() as h:
                got = h.copy()
        assert _last_prefetch(buf) == um.HOST, f"{how}: the host read faulted the pages in"
        np.testing.assert_array_equal(got, data * 3.0)


@pytest.mark.parametrize("settle", ["buf.synchronize", "cuda.synchronize"])
def test_a_host_read_after_the_wait_still_prefetches_once(rng, settle):
    """The device wrote, the host waited (its events settled and forgotten), then reads: prefetched to the host.

    Before, only a device write still on record triggered the prefetch, so a read after
    ``buf.synchronize()`` faulted every page in.  A second read, with no device write since, moves nothing.
    """
    s = cuda.stream()
    data = random_array(rng, BIG, np.float64)
    with um.ManagedBuffer.from_array(data) as buf:
        _tracked_scale[(BIG + 127) // 128, 128, s](buf, 3.0, SLEEPS)
        if settle == "buf.synchronize":
            buf.synchronize()
        else:
            cuda.synchronize()
        assert _last_prefetch(buf) == um.Location.device(0)
        np.testing.assert_array_equal(buf.host, data * 3.0)
        assert _last_prefetch(buf) == um.HOST, f"after {settle}: the host read faulted the pages in"
        buf.prefetch(0, stream=s)  # placed on the device by hand; the device writes nothing since
        buf.synchronize()
        np.testing.assert_array_equal(buf.host, data * 3.0)
        assert _last_prefetch(buf) == um.Location.device(0), "a read with no device write since was prefetched"


def test_small_buffers_element_reads_and_other_policies_fault_in(rng):
    """Under HOST_PREFETCH_MIN, an element read, an assignment, and the "warn" policy: no prefetch to the host."""
    s = cuda.stream()
    small = random_array(rng, 1024, np.float64)
    with um.ManagedBuffer.from_array(small) as buf:
        _tracked_scale[8, 128, s](buf, 2.0, 0)
        np.testing.assert_array_equal(buf.host, small * 2.0)
        assert _last_prefetch(buf) == um.Location.device(0), "a small buffer was prefetched to the host"
    data = random_array(rng, BIG, np.float64)
    with um.ManagedBuffer.from_array(data) as buf:
        g = (BIG + 127) // 128
        _tracked_scale[g, 128, s](buf, 2.0, 0)
        assert buf[5] == data[5] * 2.0  # an element read: a few bytes, by fault
        assert _last_prefetch(buf) == um.Location.device(0)
        _tracked_scale[g, 128, s](buf, 2.0, 0)
        buf[:] = data  # written on the host, not read: no prefetch to the host first
        assert _last_prefetch(buf) == um.Location.device(0)
        _tracked_scale[g, 128, s](buf, 2.0, 0)
        buf.synchronize()
        with um.coherence_policy("warn"):
            np.testing.assert_array_equal(buf.host, data * 2.0)
        assert _last_prefetch(buf) == um.Location.device(0), "prefetched under the 'warn' policy"


def test_host_prefetch_is_off_with_the_switch(rng):
    um.set_auto_prefetch(False)
    data = random_array(rng, BIG, np.float64)
    s = cuda.stream()
    with um.ManagedBuffer.from_array(data) as buf:
        buf.prefetch(0, stream=s)
        _tracked_scale[(BIG + 127) // 128, 128, s](buf, 2.0, 0)
        np.testing.assert_array_equal(buf.host, data * 2.0)
        assert _last_prefetch(buf) == um.Location.device(0)
