"""``kernel.forall(n)(args)`` on a ``um.jit`` kernel: tracked like ``kernel[grid, block, stream](args)`` (#28 item 4).

numba's ``forall`` picks a block size and launches through numba, so on a ``um.jit`` kernel it was a
plain numba launch: noticed (the buffers marked as escaped, every later host access synchronising
the devices), not tracked.  It is now the kernel's own tracked launch, with numba's block size.
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


@um.jit
def _add(a, b, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a[i] + b[i]


@um.jit
def _slow_scale(a, out, k, sleeps):
    i = cuda.grid(1)
    for _ in range(sleeps):  # ~1 ms each: a reader not ordered after it sees the old values
        cuda.nanosleep(1_000_000)
    if i < out.size:
        out[i] = a[i] * k


def _stream_id(s) -> int:
    from umem_numba import _driver

    return int(_driver.stream_key(stream_handle(s)))


@pytest.mark.parametrize("n", [1, 1000, 4099])
def test_forall_values_as_numba(rng, n):
    """vecadd as numba documents it (``forall(len(a))``), on fresh random data: numpy's values."""
    a, b = random_array(rng, n, np.float32), random_array(rng, n, np.float32)
    with um.ManagedBuffer.from_array(a) as da, um.DeviceBuffer.from_array(b) as db, um.ManagedBuffer.empty(n) as out:
        _add.forall(n)(da, db, out)
        np.testing.assert_array_equal(out.host, a + b)


def test_forall_is_recorded_on_its_stream_not_noticed(rng):
    """The launch is tracked: one write event on its stream, nothing unknown, the buffer not escaped."""
    n = 2048
    s = cuda.stream()
    a = random_array(rng, n, np.float64)
    with um.ManagedBuffer.from_array(a) as src, um.ManagedBuffer.zeros(n) as out:
        src.synchronize()
        _slow_scale.forall(n, stream=s)(src, out, 3.0, 0)
        events, unknown, _gen, escaped = out._coherence_tracker.pending_work()
        assert not escaped and not unknown, "forall was a plain numba launch: noticed, not tracked"
        assert [e.key for e in events] == [_stream_id(s)], "the write is recorded on the forall's stream"
        np.testing.assert_array_equal(out.host, a * 3.0)


def test_forall_is_ordered_against_other_streams(rng):
    """A slow forall write on s1, then a tracked read on s2: s2 waits on the device (20 trials)."""

    @um.jit
    def copy(dst, src):
        i = cuda.grid(1)
        if i < dst.size:
            dst[i] = src[i]

    n = 1024
    s1, s2 = cuda.stream(), cuda.stream()
    trials = 3 if _sim.active() else 20
    with um.ManagedBuffer.zeros(n) as mid, um.ManagedBuffer.zeros(n) as out:
        for trial in range(trials):
            a = random_array(rng, n, np.float64)
            with um.DeviceBuffer.from_array(a) as src:
                _slow_scale.forall(n, stream=s1)(src, mid, 2.0, 0 if _sim.active() else 20)
                copy.forall(n, stream=s2)(out, mid)
                np.testing.assert_array_equal(out.host, a * 2.0, err_msg=f"trial {trial}")


def test_forall_block_size_is_numbas(rng):
    """tpb 0: numba's occupancy choice (its own forall on the same kernel and types); tpb given: used."""
    if _sim.active():
        pytest.skip("numba's simulator configures forall as ntasks blocks of one thread")
    from umem_numba import _numba_compat

    n = 5000
    a = random_array(rng, n, np.float32)
    with um.DeviceBuffer.from_array(a) as da, um.DeviceBuffer.empty(n, np.float32) as out:
        _add.forall(n)(da, da, out)
        types = tuple(b._launch_arg()[1] for b in (da, da, out))
        tpb = _numba_compat.forall_block_size(_add.kernel, types, 0)
        assert 32 <= tpb <= 1024
        assert [entry[1] for entry in _add._forall_blocks.values()].count(tpb) >= 1
        _add.forall(n, tpb=64)(da, da, out)
        np.testing.assert_array_equal(out.copy_to_host(), a + a)


def test_forall_zero_tasks_launches_nothing_but_refuses_a_closed_buffer():
    with um.ManagedBuffer.zeros(4) as out:
        before = out._coherence_tracker.pending_work()[0]
        _add.forall(0)(out, out, out)
        assert out._coherence_tracker.pending_work()[0] == before, "nothing was launched"
    with pytest.raises(um.BufferClosedError):
        _add.forall(0)(out, out, out)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"ntasks": -1}, ValueError, "ntasks must not be negative, got -1"),
        ({"ntasks": 4, "tpb": -2}, ValueError, "tpb must not be negative"),
        ({"ntasks": 4.0}, TypeError, "ntasks must be an integer, got float"),
        ({"ntasks": True}, TypeError, "ntasks must be an integer, got bool"),
        ({"ntasks": 4, "sharedmem": "x"}, TypeError, "sharedmem must be an integer, got str"),
        ({"ntasks": 4, "stream": "s"}, TypeError, "forall"),
    ],
)
def test_forall_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        _add.forall(**kwargs)


def test_a_forall_launch_object_is_kept_and_serves_other_types(rng):
    """``k.forall(n)`` in a loop builds one launch object; called with other argument types it still
    picks their block size and gives numpy's values (fresh random data)."""
    n = 3000
    s = cuda.stream()
    assert _add.forall(n, stream=s) is _add.forall(n, stream=s)
    assert _add.forall(n, stream=s) is not _add.forall(n, stream=cuda.stream())
    with pytest.raises(TypeError, match="ntasks must be an integer"):
        _add.forall(True)
    launch = _add.forall(n, stream=s)
    for dtype in (np.float32, np.float64, np.float32):
        a, b = random_array(rng, n, dtype), random_array(rng, n, dtype)
        with (
            um.ManagedBuffer.from_array(a) as da,
            um.DeviceBuffer.from_array(b) as db,
            um.ManagedBuffer.empty(n, dtype) as out,
        ):
            launch(da, db, out)
            np.testing.assert_array_equal(out.host, a + b, err_msg=str(dtype))
    if not _sim.active():  # one configured launch per argument types (the float32 one served twice)
        assert len(launch._launches) == 2
