"""Plain launches on one stream share a lazily recorded mark (#28 item 4: plain launches at numba's cost).

A plain launch on the legacy stream or on a stream numba created (once umem_numba has seen the
stream object: numba's launch hands buffers only the handle) files the stream's current
:class:`~umem_numba._memory._plain_launch.StreamMark` instead of recording an event; a launch of a
buffer whose only pending work is that mark files nothing and makes no driver call.  The mark is
recorded when something must wait for it.  Each fast path here meets a kernel that sleeps on the
device, 20 trials on a GPU: the host, a reader on another stream and a later writer must all see
the launches' values.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from numba import cuda
from support.helpers import random_array, sleeping

import umem_numba as um
from umem_numba import _driver
from umem_numba._driver import _sim
from umem_numba._driver._location import stream_handle
from umem_numba._memory import _events, _plain_launch

pytestmark = pytest.mark.gpu

N = 1024
G, B = N // 128, 128
TRIALS = 3 if _sim.active() else 20
SLEEPS = 0 if _sim.active() else 20  # ms on a GPU

# sleeping.copy[grid, block, stream](src, out, ms): sleep, then out[i] = src[i] (tests/support/helpers.py)


@cuda.jit
def _slow_fill_plus_one(a, v, sleeps):
    for _ in range(sleeps):
        cuda.nanosleep(1_000_000)
    i = cuda.grid(1)
    if i < a.shape[0]:
        a[i] = v[i] + 1.0


@pytest.fixture
def counted(monkeypatch):
    """Counts of events recorded and capture checks made."""
    counts = {"record": 0, "is_capturing": 0}
    record, is_capturing = _events.record, _driver.is_capturing

    def counting_record(*args, **kwargs):
        counts["record"] += 1
        return record(*args, **kwargs)

    def counting_is_capturing(handle):
        counts["is_capturing"] += 1
        return is_capturing(handle)

    monkeypatch.setattr(_events, "record", counting_record)
    monkeypatch.setattr(_driver, "is_capturing", counting_is_capturing)
    return counts


def _known_stream():
    """A numba stream umem_numba has seen (numba's launch hands buffers only its handle)."""
    s = cuda.stream()
    um.stream_handle(s)
    return s


@pytest.mark.parametrize("where", ["known numba stream", "legacy stream"])
def test_repeated_launches_on_one_stream_record_nothing(where, rng, counted):
    """After the first launch, launches of the same buffers on the same stream make no driver call of ours."""
    s = _known_stream() if where == "known numba stream" else 0
    values = random_array(rng, N, np.float64)
    with um.ManagedBuffer.from_array(values) as src, um.ManagedBuffer.zeros(N) as dst:
        sleeping.copy[G, B, s](src, dst, 0)
        first = dict(counted)
        for _ in range(10):
            sleeping.copy[G, B, s](src, dst, 0)
        assert counted == first, f"repeated launches recorded or checked: {first} -> {counted}"
        (mark,) = dst._coherence_tracker.pending_work()[0]
        assert isinstance(mark, _plain_launch.StreamMark) and mark.event is None
        np.testing.assert_array_equal(dst.host, values)
        assert counted["record"] == first["record"] + 1, "host access records the mark once"


def test_a_stream_umem_numba_has_not_seen_gets_an_event_per_launch(rng, counted):
    """numba's launch names a stream by its handle only: without a known owner, the handle may be
    destroyed and reused before a mark is recorded, so each launch records its own event."""
    if _sim.active():
        pytest.skip("the simulated driver's launch hands buffers numba's stream object itself")
    s = cuda.stream()
    values = random_array(rng, N, np.float64)
    with um.ManagedBuffer.from_array(values) as src, um.ManagedBuffer.zeros(N) as dst:
        sleeping.copy[G, B, s](src, dst, 0)
        first = counted["record"]
        for _ in range(3):
            sleeping.copy[G, B, s](src, dst, 0)
        assert counted["record"] == first + 3
        (event,) = dst._coherence_tracker.pending_work()[0]
        assert isinstance(event, _events.Event)
        np.testing.assert_array_equal(dst.host, values)


@pytest.mark.parametrize("where", ["known numba stream", "legacy stream"])
def test_host_access_after_many_marked_launches_is_never_stale(where, rng):
    """Several slow writers under one mark, then ``.host``: the last kernel's values (20 trials)."""
    s = _known_stream() if where == "known numba stream" else 0
    with um.ManagedBuffer.zeros(N) as dst:
        for trial in range(TRIALS):
            sources = [um.ManagedBuffer.from_array(random_array(rng, N, np.float64)) for _ in range(3)]
            for src in sources:
                src.synchronize()
            for src in sources:
                sleeping.copy[G, B, s](src, dst, SLEEPS)
            np.testing.assert_array_equal(dst.host, sources[-1].host, err_msg=f"trial {trial}")
            for src in sources:
                src.close()


@pytest.mark.parametrize("reader", ["plain", "um.jit", "copy"])
def test_another_stream_waits_for_marked_launches(reader, rng):
    """Slow marked writers on s1, then a reader on s2 (plain, tracked, a copy): s2 waits on the device."""
    s1, s2 = _known_stream(), cuda.stream()
    tracked = um.coherent(sleeping.copy)
    with um.ManagedBuffer.zeros(N) as mid, um.ManagedBuffer.zeros(N) as out:
        for trial in range(TRIALS):
            values = [random_array(rng, N, np.float64) for _ in range(2)]
            srcs = [um.DeviceBuffer.from_array(v) for v in values]
            for src in srcs:
                src.synchronize()
                sleeping.copy[G, B, s1](src, mid, SLEEPS)
            if reader == "plain":
                sleeping.copy[G, B, s2](mid, out, 0)
            elif reader == "um.jit":
                tracked[G, B, s2](mid, out, 0)
            else:
                um.copy(out, mid, stream=s2)
            np.testing.assert_array_equal(out.host, values[-1], err_msg=f"trial {trial}")
            for src in srcs:
                src.close()


def test_a_later_writer_on_another_stream_waits_for_marked_readers(rng):
    """Write after read: slow marked launches read ``a`` on s1; a plain write of ``a`` on s2 must wait."""
    s1, s2 = _known_stream(), cuda.stream()
    with um.ManagedBuffer.zeros(N) as a, um.ManagedBuffer.zeros(N) as seen:
        for trial in range(TRIALS):
            old, new = random_array(rng, N, np.float64), random_array(rng, N, np.float64)
            a.copy_from_host(old)
            with um.DeviceBuffer.from_array(new) as src:
                src.synchronize()
                sleeping.copy[G, B, s1](a, seen, 0)
                sleeping.copy[G, B, s1](a, seen, SLEEPS)  # the second launch is under the same mark
                sleeping.copy[G, B, s2](src, a, 0)
                np.testing.assert_array_equal(seen.host, old, err_msg=f"trial {trial}: the writer overtook the reader")
                np.testing.assert_array_equal(a.host, new)


def test_a_mark_recorded_while_its_launch_registers_does_not_lose_the_kernel(rng):
    """The launch's mark is recorded before its kernel is queued (settling an escaped argument that holds
    it): the kernel gets an event of its own, so the host waits for it (20 trials)."""
    s = _known_stream()
    with um.ManagedBuffer.zeros(N) as a, um.ManagedBuffer.zeros(N) as v:
        v.__cuda_array_interface__
        for trial in range(TRIALS):
            values = random_array(rng, N, np.float64)
            v.host[:] = values
            sleeping.copy[G, B, s](v, a, 0)  # both now hold the stream's mark
            _slow_fill_plus_one[G, B, s](a, v, SLEEPS)  # a: unchanged; v: settled, which records the mark
            np.testing.assert_array_equal(a.host, values + 1.0, err_msg=f"trial {trial}")


def test_a_mark_of_a_collected_stream_still_waits(rng):
    """numba destroys a stream when its object is collected; marked launches on it may still run."""
    with um.ManagedBuffer.zeros(N) as dst:
        for trial in range(TRIALS):
            values = random_array(rng, N, np.float64)
            with um.DeviceBuffer.from_array(values) as src:
                src.synchronize()
                s = _known_stream()
                sleeping.copy[G, B, s](src, dst, SLEEPS)
                assert isinstance(dst._coherence_tracker.pending_work()[0][0], _plain_launch.StreamMark)
                del s
                gc.collect()
                np.testing.assert_array_equal(dst.host, values, err_msg=f"trial {trial}")


def test_host_access_while_the_marked_stream_captures_is_refused_and_the_capture_kept(rng):
    """The mark cannot be recorded inside the user's capture: a clear refusal, the capture intact."""
    s = _known_stream()
    h = stream_handle(s)
    values = random_array(rng, N, np.float64)
    drv = _driver.api().drv
    with um.ManagedBuffer.from_array(values) as src, um.ManagedBuffer.zeros(N) as dst:
        src.synchronize()
        sleeping.copy[G, B, s](src, dst, 0)
        _driver.call("cuStreamBeginCapture", h, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
        try:
            with pytest.raises(um.CoherenceError, match="capturing a CUDA graph"):
                dst.host
        finally:
            err, graph = drv.cuStreamEndCapture(h)
        assert int(err) == 0, "the refusal broke the capture"
        _driver.call("cuGraphDestroy", graph)
        np.testing.assert_array_equal(dst.host, values)


def test_an_escaped_buffer_settles_before_every_marked_launch(rng):
    """A foreign writer (a numba array over the buffer's escaped view) sleeps on s2 between two plain
    launches on s: the second must come after it, though the buffer already holds s's mark (20 trials)."""
    s, s2 = _known_stream(), cuda.stream()
    with um.ManagedBuffer.zeros(N) as a:
        foreign = cuda.as_cuda_array(a)  # a escapes: another library may use it at any time
        for trial in range(TRIALS):
            first, middle, last = (random_array(rng, N, np.float64) for _ in range(3))
            with (
                um.DeviceBuffer.from_array(first) as f,
                um.DeviceBuffer.from_array(middle) as m,
                um.DeviceBuffer.from_array(last) as z,
            ):
                for b in (f, m, z):
                    b.synchronize()
                sleeping.copy[G, B, s](f, a, 0)  # a now holds s's mark
                sleeping.copy[G, B, s2](cuda.as_cuda_array(m), foreign, SLEEPS)  # unseen by umem_numba
                sleeping.copy[G, B, s](z, a, 0)  # must not be overtaken by the foreign write
                np.testing.assert_array_equal(a.host, last, err_msg=f"trial {trial}: the foreign write landed last")
