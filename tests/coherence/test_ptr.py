"""``buf.ptr`` hands the memory to work umem_numba does not see: reading it marks the buffer as shared.

Issue #30, item 2: ``ptr`` is "the address kernels see", yet reading it left the toolkit blind
(reading ``__cuda_array_interface__`` marks the buffer as shared, reading ``ptr`` did not), so
``.host`` right after raw work through it could be stale.  Now reading ``ptr`` does what reading
the interface does: device work that may still use the buffer is settled first (the reader may
start its own work at once, on any stream), and the buffer escapes (host access, and toolkit
work on it, then synchronise every device).  ``with buf.lend(stream) as view: view.ptr`` is the
precise way: raw work on the lent stream is recorded when the block ends, nothing escapes.

Each trial uses a non-blocking stream (nothing orders it implicitly) that sleeps on the device
before its raw copy, so a missing wait shows as a stale value.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from support.helpers import ORDERING_TRIALS, random_array, sleeping

import umem_numba as um
from umem_numba import _driver
from umem_numba._driver import _sim

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

N = 2048
SLEEP_MS = 20
KINDS = ("managed", "device", "pinned-mapped", "vmm")


def _trials() -> int:
    return 3 if _sim.active() else ORDERING_TRIALS


def _zeros(kind: str) -> um.ManagedBuffer | um.DeviceBuffer | um.PinnedBuffer | um.VMMBuffer:
    if kind == "managed":
        return um.ManagedBuffer.zeros(N, np.float32)
    if kind == "device":
        return um.DeviceBuffer.zeros(N, np.float32)
    if kind == "pinned-mapped":
        return um.PinnedBuffer.zeros(N, np.float32, um.HostAllocFlags.DEVICEMAP)
    return um.VMMBuffer.zeros(N, np.float32)


def _read(buf) -> np.ndarray:
    """What host code sees now, through the buffer's own host path (it waits per the coherence policy)."""
    if isinstance(buf, (um.ManagedBuffer, um.PinnedBuffer)):
        return np.array(buf.host)
    return buf.copy_to_host()


@pytest.fixture
def consumer():
    """A non-blocking stream (CU_STREAM_NON_BLOCKING), as another library makes them."""
    _driver.ensure_context()  # a raw driver call needs a current context (first test of a worker)
    handle = int(_driver.call("cuStreamCreate", 1))
    yield handle
    _driver.call("cuStreamSynchronize", handle)
    _driver.call("cuStreamDestroy", handle)


@pytest.mark.parametrize("kind", KINDS)
def test_host_access_after_raw_work_through_ptr_sees_it(kind, consumer, rng):
    """The raw work comes after the read of ``ptr``: host access must wait for it (the buffer is shared)."""
    idle = cuda.device_array(1, np.float32)
    for trial in range(_trials()):
        values = random_array(rng, N, np.float32)
        source = um.PinnedBuffer.from_array(values)  # page-locked: the raw copy reads it on the stream
        buf = _zeros(kind)
        buf.synchronize()
        ptr = buf.ptr
        sleeping.fill[1, 1, cuda.external_stream(consumer)](idle, 0.0, SLEEP_MS)
        _driver.call("cuMemcpyAsync", ptr, source.ptr, source.nbytes, consumer)
        got = _read(buf)
        wrong = int((got != values).sum())
        assert not wrong, f"trial {trial}: host access read {wrong} of {N} elements before the raw write through ptr"
        _driver.call("cuStreamSynchronize", consumer)
        buf.close()
        source.close()


@pytest.mark.parametrize("door", ["ptr", "device_ctypes_pointer"])
@pytest.mark.parametrize("kind", KINDS)
def test_raw_work_through_the_address_starts_after_earlier_toolkit_work(kind, door, consumer, rng):
    """A tracked kernel on another stream sleeps, then writes; raw work through the address read
    after it (at once, on its own stream) must see the write: reading the address settles it first."""
    writer = cuda.stream()
    fill = um.coherent(sleeping.fill)
    for trial in range(_trials()):
        value = float(rng.integers(1, 1 << 20))
        buf = _zeros(kind)
        out = um.PinnedBuffer.empty(N, np.float32)
        fill[N // 128, 128, writer](buf, value, SLEEP_MS)
        ptr = buf.ptr if door == "ptr" else buf.device_ctypes_pointer.value
        _driver.call("cuMemcpyAsync", out.ptr, ptr, out.nbytes, consumer)
        _driver.call("cuStreamSynchronize", consumer)
        wrong = int((out.host != value).sum())
        assert not wrong, f"trial {trial}: raw work through {door} read {wrong} of {N} elements before the write"
        buf.close()
        out.close()


def test_ptr_raises_nothing_and_marks_nothing_for_an_empty_buffer():
    buf = um.ManagedBuffer.empty(0, np.float32)
    assert buf.ptr == 0
    assert not buf._coherence_tracker.escaped


@pytest.mark.parametrize("kind", KINDS)
def test_a_lent_views_ptr_is_tracked_precisely(kind, consumer, rng):
    """``with buf.lend(s) as view: view.ptr``: raw work on the lent stream is recorded when the block
    ends (host access waits for exactly that), and the buffer does not escape."""
    idle = cuda.device_array(1, np.float32)
    for trial in range(_trials()):
        values = random_array(rng, N, np.float32)
        source = um.PinnedBuffer.from_array(values)
        address = source.ptr  # read before the block: the source is handed to the raw copy (shared)
        buf = _zeros(kind)
        with buf.lend(consumer) as view:
            sleeping.fill[1, 1, cuda.external_stream(consumer)](idle, 0.0, SLEEP_MS)
            _driver.call("cuMemcpyAsync", view.ptr, address, source.nbytes, consumer)
        assert not buf._coherence_tracker.escaped, "a lent view's ptr made the buffer escape"
        wrong = int((_read(buf) != values).sum())
        assert not wrong, f"trial {trial}: host access read {wrong} of {N} elements before the lent raw work"
        with pytest.raises(um.BufferClosedError, match=r"after its `with buf.lend"):
            view.ptr
        buf.close()
        source.close()


def test_ptr_inside_its_own_lend_block_raises_and_names_the_lent_view():
    buf = um.ManagedBuffer.zeros(N, np.float32)
    with buf.lend(0) as view:
        with pytest.raises(um.CoherenceError, match=r"lent view's ptr"):
            buf.ptr
        assert view.ptr == buf._address
    assert not buf._coherence_tracker.escaped


@pytest.mark.parametrize("kind", KINDS)
def test_the_toolkits_own_address_reads_mark_nothing(kind, rng):
    """Copies, launches, views, repr, element access and pools read the address without marking the buffer."""
    values = random_array(rng, N, np.float32)
    fill = um.coherent(sleeping.fill)
    buf = _zeros(kind)
    other = _zeros(kind)
    buf.copy_from_host(values)
    np.testing.assert_array_equal(buf.copy_to_host(), values)
    um.copy(other, buf)
    fill[N // 128, 128](buf[1:], 3.0, 0)
    repr(buf), repr(buf[::2])
    if isinstance(buf, um.ManagedBuffer):
        buf.prefetch(0)
        buf.hints.set_read_mostly()
    np.testing.assert_array_equal(_read(other), values)
    for b in (buf, other):
        tracker = b._coherence_tracker
        assert not tracker.escaped and not tracker.unknown, f"{kind}: the toolkit's own work marked the buffer"
