"""numba's array habits on every buffer kind (issue #30, item 1).

Element indexing gives the value (a host read that waits for the device work on the buffer, as
numba's ``DeviceNDArray.__getitem__`` does), ``buf[key] = value`` writes from the host in order
with device work, ``copy_to_device(ary)`` copies *from* ``ary`` into the buffer (numba's
direction), ``copy_to_host(ary=...)`` takes numba's keyword, iteration yields values, and numba's
own helpers that duck-type device arrays (``init_xoroshiro128p_states``, ``cuda.reduce``) take
buffers.  The ordering tests put a kernel that sleeps on the device on another stream first, so
a missing wait shows as a stale or lost value.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from support.helpers import ORDERING_TRIALS, random_array, sleeping

import umem_numba as um
from umem_numba import _driver
from umem_numba._driver import _sim

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    # numba's RNG initialiser on its simulator: object-mode fallbacks and numpy's uint64 wrap-around warnings
    pytest.mark.filterwarnings("ignore::numba.core.errors.NumbaWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered in scalar:RuntimeWarning"),
]

#: Every kind, host-readable or not; "pinned" has no device view, "pinned-mapped" has one.
KINDS = ("managed", "device", "pinned", "pinned-mapped", "vmm")
#: Kinds a kernel can write.
DEVICE_KINDS = ("managed", "device", "pinned-mapped", "vmm")
SLEEP_MS = 20
N = 1024


@pytest.fixture
def non_blocking():
    """Streams created non-blocking (as CuPy and PyTorch make them): nothing orders them with the legacy
    stream, on which umem_numba's own copies of these habits run, so only the coherence tracking does."""
    made = []

    def make():
        _driver.ensure_context()  # a raw driver call needs a current context (first test of a worker)
        handle = int(_driver.call("cuStreamCreate", 1))
        made.append(handle)
        return cuda.external_stream(handle)

    yield make
    for handle in made:
        _driver.call("cuStreamSynchronize", handle)
        _driver.call("cuStreamDestroy", handle)


def _trials() -> int:
    return 3 if _sim.active() else ORDERING_TRIALS


def _from_array(kind: str, data: np.ndarray):
    if kind == "managed":
        return um.ManagedBuffer.from_array(data)
    if kind == "device":
        return um.DeviceBuffer.from_array(data)
    if kind == "pinned":
        return um.PinnedBuffer.from_array(data)
    if kind == "pinned-mapped":
        return um.PinnedBuffer.from_array(data, um.HostAllocFlags.DEVICEMAP)
    return um.VMMBuffer.from_array(data)


def _read(buf) -> np.ndarray:
    return buf.copy_to_host()


@pytest.mark.parametrize("kind", KINDS)
def test_integer_indexing_down_to_an_element_gives_the_value(kind, rng):
    data = random_array(rng, (7, 5), np.float64)
    buf = _from_array(kind, data)
    v = buf[3, 2]
    assert type(v) is np.float64 and v == data[3, 2]
    assert buf[-1, -1] == data[-1, -1]
    row = buf[3]  # not down to an element: a view, as numpy gives
    assert isinstance(row, type(buf)) and row.shape == (5,)
    assert row[4] == data[3, 4]
    assert isinstance(buf[3, ...], type(buf)) and buf[3, ...].shape == (5,)
    zero_d = buf[3, 2, ...]  # an Ellipsis keeps a view, also of no dimensions (numpy's a[i, j, ...])
    assert isinstance(zero_d, type(buf)) and zero_d.shape == ()
    assert zero_d[()] == data[3, 2]
    t = buf.T
    assert t[2, 3] == data[3, 2]
    assert buf[::2, 1::3][1, 1] == data[::2, 1::3][1, 1]
    with pytest.raises(IndexError, match="out of bounds"):
        buf[7, 0]
    with pytest.raises(TypeError, match="unsupported index"):
        buf[1.5, 0]
    ints = _from_array(kind, np.arange(6, dtype=np.int16))
    assert type(ints[5]) is np.int16 and ints[5] == 5
    buf.close()
    ints.close()


@pytest.mark.parametrize("kind", KINDS)
def test_iteration_yields_values_like_numba_and_numpy(kind, rng):
    xs, ys = random_array(rng, 9, np.int64), random_array(rng, 9, np.int64)
    x, y = _from_array(kind, xs), _from_array(kind, ys)
    assert [a + b for a, b in zip(x, y, strict=True)] == list(xs + ys)
    assert list(_from_array(kind, np.arange(6.0).reshape(2, 3))[1]) == [3.0, 4.0, 5.0]
    with pytest.raises(TypeError, match="0-d"):
        iter(x[2, ...])
    with pytest.raises(TypeError, match="0-d"):
        len(x[2, ...])


@pytest.mark.parametrize("kind", KINDS)
def test_item_and_slice_assignment_as_numpy_does_it(kind, rng):
    data = random_array(rng, (6, 8), np.float32)
    expected = data.copy()
    buf = _from_array(kind, data)

    def both(key, value):
        buf[key] = value
        expected[key] = value

    both((2, 3), 7.5)
    both((-1, -1), np.float64(2.25))  # cast to the buffer's dtype
    both((0, slice(1, 5)), np.arange(4))  # a contiguous run, ints cast
    both(slice(None, None, 2), 11.0)  # strided rows: every other row
    both((slice(None), 1), random_array(rng, 6, np.float32))  # a column: strided elements
    both((slice(1, 6, 2), slice(None, None, -3)), random_array(rng, (3, 3), np.float32))  # negative steps
    both(Ellipsis, random_array(rng, 8, np.float32))  # broadcast over the rows
    both(1, random_array(rng, 8, np.float32))
    np.testing.assert_array_equal(_read(buf), expected)
    with pytest.raises(ValueError, match="broadcast"):
        buf[0] = np.zeros(3)
    with pytest.raises(TypeError, match="object"):
        buf[0, 0] = object()
    with pytest.raises(ValueError, match="abc"):
        buf[0, 0] = "abc"
    np.testing.assert_array_equal(_read(buf), expected)  # refused assignments wrote nothing
    buf.close()


@pytest.mark.parametrize("kind", DEVICE_KINDS)
def test_element_read_waits_for_device_work_on_another_stream(kind, non_blocking, rng):
    writer = non_blocking()
    fill = um.coherent(sleeping.fill)
    for trial in range(_trials()):
        value = float(rng.integers(1, 1 << 20))
        buf = _from_array(kind, np.zeros(N, np.float32))
        fill[N // 128, 128, writer](buf, value, SLEEP_MS)
        i = int(rng.integers(N))
        got = buf[i]
        assert got == value, f"trial {trial}: buf[{i}] read {got} before the kernel wrote {value}"
        buf.close()


@pytest.mark.parametrize("key", ["element", "slice", "strided"])
@pytest.mark.parametrize("kind", DEVICE_KINDS)
def test_assignment_comes_after_earlier_device_work_and_before_later(kind, key, non_blocking, rng):
    """A sleeping kernel on another stream fills the buffer; the host then assigns part of it, and a
    tracked kernel on a third stream copies the buffer out: the assigned part must hold the host's
    values (not the earlier fill's, landed late), in the buffer and in the later kernel's copy."""
    writer, reader = non_blocking(), non_blocking()
    fill, copy = um.coherent(sleeping.fill), um.coherent(sleeping.copy)
    index = {"element": 5, "slice": slice(3, 700), "strided": slice(1, None, 3)}[key]
    for trial in range(_trials()):
        before = float(rng.integers(1, 1 << 20))
        buf = _from_array(kind, np.zeros(N, np.float32))
        out = um.ManagedBuffer.zeros(N, np.float32)
        expected = np.full(N, before, np.float32)
        fill[N // 128, 128, writer](buf, before, SLEEP_MS)
        values = random_array(rng, expected[index].shape, np.float32)
        buf[index] = values
        expected[index] = values
        copy[N // 128, 128, reader](buf, out, 0)
        np.testing.assert_array_equal(out.host, expected, err_msg=f"trial {trial}: the later kernel's copy")
        np.testing.assert_array_equal(_read(buf), expected, err_msg=f"trial {trial}: the buffer")
        buf.close()
        out.close()


@pytest.mark.parametrize("source", ["numpy", "list", "buffer", "numba"])
@pytest.mark.parametrize("kind", KINDS)
def test_copy_to_device_copies_from_its_argument_into_the_buffer(kind, source, rng):
    data = random_array(rng, 64, np.float64)
    buf = _from_array(kind, np.zeros(64, np.float64))
    if source == "numpy":
        src = data
    elif source == "list":
        src = data.tolist()
    elif source == "buffer":
        src = um.ManagedBuffer.from_array(data)
    else:
        src = cuda.to_device(data)
    assert buf.copy_to_device(src) is None
    np.testing.assert_array_equal(_read(buf), data)
    buf.copy_to_device(np.zeros(64), stream=cuda.stream())
    np.testing.assert_array_equal(_read(buf), 0.0)
    with pytest.raises(ValueError, match="mismatched"):
        buf.copy_to_device(np.zeros(65))
    with pytest.raises(ValueError, match="mismatched"):
        buf.copy_to_device(np.zeros(64, np.float32))


@pytest.mark.parametrize("kind", DEVICE_KINDS)
def test_copy_to_device_is_ordered_with_device_work_on_other_streams(kind, non_blocking, rng):
    """After a sleeping kernel fills the buffer on another stream, ``copy_to_device`` of fresh values
    must land last; from a buffer a sleeping kernel is still writing, it must copy the written values."""
    writer = non_blocking()
    fill = um.coherent(sleeping.fill)
    for trial in range(_trials()):
        values = random_array(rng, N, np.float32)
        buf = _from_array(kind, np.zeros(N, np.float32))
        fill[N // 128, 128, writer](buf, -1.0, SLEEP_MS)
        buf.copy_to_device(values)
        np.testing.assert_array_equal(_read(buf), values, err_msg=f"trial {trial}: the fill landed after the copy")
        src = _from_array(kind, np.zeros(N, np.float32))
        value = float(rng.integers(1, 1 << 20))
        fill[N // 128, 128, writer](src, value, SLEEP_MS)
        buf.copy_to_device(src)
        np.testing.assert_array_equal(_read(buf), value, err_msg=f"trial {trial}: copied before the fill")
        buf.close()
        src.close()


@pytest.mark.parametrize("kind", KINDS)
def test_copy_to_host_takes_numbas_ary_keyword(kind, rng):
    data = random_array(rng, (4, 6), np.float64)
    buf = _from_array(kind, data)
    for call in (
        lambda out: buf.copy_to_host(ary=out),
        lambda out: buf.copy_to_host(out=out),
        buf.copy_to_host,  # positional, as numba and earlier umem_numba take it
        lambda out: buf.copy_to_host(ary=out, stream=cuda.stream()),
    ):
        out = np.zeros((4, 6))
        assert call(out) is out
        np.testing.assert_array_equal(out, data)
    with pytest.raises(TypeError, match="ary or out"):
        buf.copy_to_host(ary=np.zeros((4, 6)), out=np.zeros((4, 6)))


@pytest.mark.parametrize("kind", DEVICE_KINDS)
def test_copy_to_host_ary_waits_for_device_work(kind, non_blocking, rng):
    writer = non_blocking()
    fill = um.coherent(sleeping.fill)
    for trial in range(_trials()):
        value = float(rng.integers(1, 1 << 20))
        buf = _from_array(kind, np.zeros(N, np.float32))
        fill[N // 128, 128, writer](buf, value, SLEEP_MS)
        out = np.zeros(N, np.float32)
        buf.copy_to_host(ary=out)
        assert (out == value).all(), f"trial {trial}: copy_to_host(ary=) read before the kernel's write"
        buf.close()


def test_pinned_copy_into_goes_from_the_pinned_buffer_to_its_argument(rng):
    """``PinnedBuffer.copy_to_device(dst)`` copied the other way from numba's: it is ``copy_into(dst)`` now."""
    data = random_array(rng, 300, np.float32)
    pinned = um.PinnedBuffer.from_array(data)
    dev = cuda.device_array(300, np.float32)
    stream = cuda.stream()
    pinned.copy_into(dev, stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(dev.copy_to_host(), data)
    fresh = random_array(rng, 300, np.float32)
    pinned.copy_to_device(cuda.to_device(fresh))  # numba's direction: into the pinned buffer
    np.testing.assert_array_equal(pinned.host, fresh)
    with pytest.raises(TypeError, match="must be a numba device array or a umem_numba buffer"):
        pinned.copy_into(np.zeros(300, np.float32))


def test_numbas_rng_initialiser_fills_a_buffer_bitwise_like_its_own_arrays():
    from numba.cuda.random import create_xoroshiro128p_states, init_xoroshiro128p_states, xoroshiro128p_dtype

    n = 64 if _sim.active() else 4096
    theirs = create_xoroshiro128p_states(n, seed=1234).copy_to_host()
    for kind in KINDS:
        buf = _from_array(kind, np.zeros(n, xoroshiro128p_dtype))
        init_xoroshiro128p_states(buf, 1234)
        got = buf.copy_to_host()
        assert got.tobytes() == theirs.tobytes(), kind
        buf.close()


@pytest.mark.parametrize("kind", DEVICE_KINDS)
def test_numbas_reduce_takes_buffers(kind, rng):
    @cuda.reduce
    def sum_reduce(a, b):
        return a + b

    data = random_array(rng, 3000 if not _sim.active() else 300, np.int64)
    buf = _from_array(kind, data)
    expected = sum_reduce(cuda.to_device(data))
    assert sum_reduce(buf) == expected == data.sum()
    res = _from_array(kind, np.zeros(1, np.int64))
    assert sum_reduce(buf, res=res) is None
    assert res[0] == expected
    buf.close()
    res.close()
