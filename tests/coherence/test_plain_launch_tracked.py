"""A plain numba launch of a buffer (``kernel[g, b, s](buf)`` of a ``@cuda.jit`` kernel) is ordered and
recorded on its stream (#28 item 4).

numba's launch hands every ``ArgHint`` argument its launch stream (``to_device(retr, stream)``) and
calls what it appended to ``retr`` once the kernel is queued.  Buffers are such hints: the stream
waits, on the device, for conflicting work on other streams, and one event recorded after the kernel
is filed as a write.  Before, umem_numba only noticed such a launch from numba's typing (work on an
unknown stream): every later launch or host access synchronised the whole device first.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from support.helpers import random_array

import umem_numba as um
from umem_numba._driver import _sim
from umem_numba._driver._location import stream_handle

pytestmark = pytest.mark.gpu

N = 1024
G, B = N // 128, 128  # the launch configuration: N threads
TRIALS = 3 if _sim.active() else 20
SLEEPS = 0 if _sim.active() else 20  # ~1 ms each on a GPU: a reader not ordered after it sees old values


@cuda.jit
def _slow_fill(a, v, sleeps):
    for _ in range(sleeps):
        cuda.nanosleep(1_000_000)
    i = cuda.grid(1)
    if i < a.shape[0]:
        a[i] = v[i]


@cuda.jit
def _copy(dst, src):
    i = cuda.grid(1)
    if i < dst.shape[0]:
        dst[i] = src[i]


def test_a_plain_launch_is_one_event_on_its_stream(rng):
    """Not unknown, not escaped: one write event, on the launch's stream (the same buffer twice: one)."""
    s = cuda.stream()
    values = random_array(rng, N, np.float64)
    with um.DeviceBuffer.from_array(values) as src, um.ManagedBuffer.zeros(N) as dst:
        src.synchronize()
        _copy[G, B, s](dst, src)
        tracker = dst._coherence_tracker
        assert not tracker.unknown and not tracker.escaped, "the launch was only noticed, not recorded"
        assert list(tracker.pending) == [stream_handle(s)]
        assert list(src._coherence_tracker.pending) == [stream_handle(s)], "a kernel counts as writing every buffer"
        assert src._coherence_tracker.pending_work()[0] == tracker.pending_work()[0], "one event per launch"
        np.testing.assert_array_equal(dst.host, values)
        _copy[G, B, s](dst, dst)  # the same allocation twice in one launch
        assert len(tracker.pending_work()[0]) == 1


def test_host_access_after_a_plain_launch_is_never_stale(rng):
    """A slow plain writer on s, then ``.host``: the kernel's values (fresh random data, 20 trials)."""
    s = cuda.stream()
    with um.ManagedBuffer.zeros(N) as dst:
        for trial in range(TRIALS):
            values = random_array(rng, N, np.float64)
            with um.DeviceBuffer.from_array(values) as src:
                _slow_fill[G, B, s](dst, src, SLEEPS)
                np.testing.assert_array_equal(dst.host, values, err_msg=f"trial {trial}")


@pytest.mark.parametrize("reader", ["plain", "um.jit"])
def test_a_reader_on_another_stream_waits_for_a_plain_writer(rng, reader):
    """A slow plain write on s1, then a read on s2 (plain or tracked): s2 waits on the device (20 trials)."""
    s1, s2 = cuda.stream(), cuda.stream()
    copy = _copy if reader == "plain" else um.jit(_copy.py_func)
    with um.ManagedBuffer.zeros(N) as mid, um.ManagedBuffer.zeros(N) as out:
        for trial in range(TRIALS):
            values = random_array(rng, N, np.float64)
            with um.DeviceBuffer.from_array(values) as src:
                _slow_fill[G, B, s1](mid, src, SLEEPS)
                copy[G, B, s2](out, mid)
                np.testing.assert_array_equal(out.host, values, err_msg=f"trial {trial}")


def test_a_plain_writer_waits_for_a_reader_on_another_stream(rng):
    """Write after read: a slow tracked reader of ``a`` on s1, then a plain write of ``a`` on s2 (20 trials)."""
    slow_copy = um.jit(_slow_fill.py_func)
    s1, s2 = cuda.stream(), cuda.stream()
    with um.ManagedBuffer.zeros(N) as a, um.ManagedBuffer.zeros(N) as seen:
        for trial in range(TRIALS):
            old, new = random_array(rng, N, np.float64), random_array(rng, N, np.float64)
            a.copy_from_host(old)
            with um.DeviceBuffer.from_array(new) as src:
                slow_copy[G, B, s1](seen, a, SLEEPS)  # reads a slowly
                _copy[G, B, s2](a, src)  # must not overwrite a before the reader took it
                np.testing.assert_array_equal(seen.host, old, err_msg=f"trial {trial}: the writer overtook the reader")
                np.testing.assert_array_equal(a.host, new)


def test_a_launch_that_fails_leaves_a_conservative_mark_not_a_hang(rng):
    """A plain launch whose second argument is closed raises; the first buffer stays usable and right."""
    values = random_array(rng, N, np.float64)
    with um.ManagedBuffer.from_array(values) as a:
        closed = um.ManagedBuffer.zeros(N)
        closed.close()
        with pytest.raises(um.BufferClosedError):
            _copy[G, B, cuda.stream()](a, closed)
        np.testing.assert_array_equal(a.host, values)  # settles the mark left by the failed launch
        assert not a._coherence_tracker.unknown


def test_a_plain_launch_inside_the_hosts_hold_is_refused():
    with um.ManagedBuffer.zeros(N) as a, a.on_host(), pytest.raises(um.CoherenceError, match="holds this buffer"):
        _copy[G, B, cuda.stream()](a, a)


@pytest.mark.real_gpu("numba's cuda.InOut over a buffer (the simulator's InOut takes numpy arrays only)")
def test_a_plain_launch_keeps_an_earlier_unknown_mark(rng):
    """Work on an unknown stream (numba's own hint ``cuda.InOut(buf)`` names no stream to umem_numba),
    then, under the "off" policy, a plain launch on another stream: its record must not clear the
    earlier mark, so host access under "sync" still waits for the unknown work (20 trials)."""
    s1, s2 = cuda.stream(), cuda.stream()
    with um.ManagedBuffer.zeros(N) as a, um.ManagedBuffer.zeros(N) as b:
        for trial in range(TRIALS):
            values = random_array(rng, N, np.float64)
            with um.DeviceBuffer.from_array(values) as src:
                src.synchronize()
                _slow_fill[G, B, s1](cuda.InOut(a), src, SLEEPS)  # unknown stream: a conservative mark
                assert a._coherence_tracker.unknown
                with um.coherence_policy("off"):
                    _copy[G, B, s2](b, a)  # the user orders nothing here; b's copy may see old values
                np.testing.assert_array_equal(a.host, values, err_msg=f"trial {trial}: the unknown writer was lost")
                b.synchronize()
