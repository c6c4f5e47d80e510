"""Advice, migration policies and prefetch: every hint is read back from the driver.

CPU-only tests (policies, argument checks that need no driver) run everywhere;
the rest are marked ``gpu`` (and ``multigpu``).
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from support.helpers import random_array

import umem_numba as um
from umem_numba import HOST, Location, ManagedMemoryHints, MemAdvice, MigrationPolicy, PrefetchPlan, _driver
from umem_numba._errors import CudaError, UnsupportedError

#: These tests read back the driver state of fresh ranges: no memory from the allocation cache.
pytestmark = pytest.mark.usefixtures("fresh_allocations")

#: 64 KiB of float32: a whole number of CPU pages on x86-64 (4 KiB) and arm64 (up to 64 KiB),
#: so ranges built from it never share a page with their neighbours.
PAGE = (64 << 10) // 4
DEV0 = Location.device(0)


class _FakeManaged:
    """A CUDA-array-interface object whose pointer is never dereferenced (CPU-only tests)."""

    def __init__(self, n: int = 100, strides: tuple | None = None) -> None:
        self.__cuda_array_interface__ = {
            "shape": (n,),
            "typestr": "<f4",
            "data": (0x10000, False),
            "strides": strides,
            "version": 3,
        }


# ---------------------------------------------------------------------------
# CPU only: policies and argument validation.


def test_policy_constants_equality_hash_repr():
    P = MigrationPolicy
    assert P.PREFER_DEVICE(1) == P("prefer_device", 1) == P("prefer_device", device=1)
    assert P.PREFER_DEVICE(1) != P.PREFER_DEVICE(0)
    assert P("host_mapped", device=0) != P.HOST_MAPPED
    assert (
        len(
            {
                P.DEFAULT,
                P.READ_MOSTLY,
                P.PREFER_HOST,
                P.HOST_MAPPED,
                P.PREFER_DEVICE(0),
                P.PREFER_DEVICE(0),
                P.PREFER_DEVICE(1),
            }
        )
        == 6
    )
    assert repr(P.DEFAULT) == "MigrationPolicy.DEFAULT"
    assert repr(P.READ_MOSTLY) == "MigrationPolicy.READ_MOSTLY"
    assert repr(P.PREFER_HOST) == "MigrationPolicy.PREFER_HOST"
    assert repr(P.HOST_MAPPED) == "MigrationPolicy.HOST_MAPPED"
    assert repr(P.PREFER_DEVICE(3)) == "MigrationPolicy.PREFER_DEVICE(3)"
    assert repr(P("host_mapped", device=2)) == "MigrationPolicy('host_mapped', device=2)"
    with pytest.raises(AttributeError):
        P.READ_MOSTLY.kind = "default"  # frozen: a shared constant cannot be changed


def test_policy_advice_honours_its_device_and_the_host():
    P = MigrationPolicy
    assert P.DEFAULT.advice_for(0) == ()
    assert P.READ_MOSTLY.advice_for(0) == ((MemAdvice.SET_READ_MOSTLY, None),)
    # PREFER_DEVICE(n) targets n, whatever the buffer's device is.
    assert P.PREFER_DEVICE(3).advice_for(0) == ((MemAdvice.SET_PREFERRED_LOCATION, Location.device(3)),)
    # PREFER_HOST targets the host location, not a device.
    ((advice, loc),) = P.PREFER_HOST.advice_for(2)
    assert advice is MemAdvice.SET_PREFERRED_LOCATION and loc == HOST and loc.is_host
    assert P.HOST_MAPPED.advice_for(2) == (
        (MemAdvice.SET_PREFERRED_LOCATION, HOST),
        (MemAdvice.SET_ACCESSED_BY, Location.device(2)),
    )
    assert P("host_mapped", device=1).advice_for(2)[1] == (MemAdvice.SET_ACCESSED_BY, Location.device(1))


class _Dev:
    id = 4  # quacks like a numba device


def test_policy_accepts_a_numba_like_device():
    assert MigrationPolicy.PREFER_DEVICE(_Dev()) == MigrationPolicy.PREFER_DEVICE(4)


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: MigrationPolicy.PREFER_DEVICE("cpu"), ValueError, "not the host"),
        (lambda: MigrationPolicy.PREFER_DEVICE(-1), ValueError, "-1"),
        (lambda: MigrationPolicy.PREFER_DEVICE(True), TypeError, "bool"),
        (lambda: MigrationPolicy.PREFER_DEVICE(1.0), TypeError, "float"),
        (lambda: MigrationPolicy("prefer_device"), ValueError, "needs a device"),
        (lambda: MigrationPolicy("read_mostly", device=1), ValueError, "takes no device"),
        (lambda: MigrationPolicy("prefer_gpu"), ValueError, "prefer_gpu"),
    ],
)
def test_policy_rejects_bad_arguments(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_mem_advice_values_are_the_drivers():
    from cuda.bindings import driver as drv

    for advice in MemAdvice:
        assert int(getattr(drv.CUmem_advise, "CU_MEM_ADVISE_" + advice.name)) == advice
    assert {a for a in MemAdvice if a.takes_location} == {
        MemAdvice.SET_PREFERRED_LOCATION,
        MemAdvice.SET_ACCESSED_BY,
        MemAdvice.UNSET_ACCESSED_BY,
    }


@pytest.mark.parametrize(
    "start, stop, exc, match",
    [
        (5, 2, ValueError, "start > stop"),
        (3, 3, ValueError, "empty"),
        (0, 101, IndexError, "out of bounds"),
        (-1, 5, IndexError, "negative"),
        (0, -1, IndexError, "negative"),
        (1.5, 3, TypeError, "float"),
        (True, 3, TypeError, "bool"),
        (0, "9", TypeError, "str"),
    ],
)
def test_range_validation_without_gpu(start, stop, exc, match):
    fake = _FakeManaged(100)
    with pytest.raises(exc, match=match):
        ManagedMemoryHints(fake, start, stop)
    plan = PrefetchPlan()
    with pytest.raises(exc, match=match):
        plan.add_range(fake, start, stop, 0)
    assert len(plan) == 0


def test_range_of_a_range_counts_from_its_start():
    h = ManagedMemoryHints(_FakeManaged(100), 10, 40)
    sub = h.range(5, 15)
    assert (sub.start, sub.stop) == (15, 25)
    assert (h.start, h.stop) == (10, 40)
    with pytest.raises(IndexError):
        h.range(0, 31)
    assert "[10, 40)" in repr(h)


def test_argument_types_checked_before_the_driver():
    fake = _FakeManaged(100)
    h = ManagedMemoryHints(fake)
    with pytest.raises(TypeError, match="MigrationPolicy"):
        h.apply_policy("read_mostly")
    with pytest.raises(TypeError, match="MemAdvice"):
        h.advise("SET_READ_MOSTLY")
    with pytest.raises(ValueError, match="takes no target"):
        h.advise(MemAdvice.SET_READ_MOSTLY, 0)
    with pytest.raises(ValueError, match="needs a target"):
        h.advise(MemAdvice.SET_ACCESSED_BY)
    with pytest.raises(TypeError, match="unknown target 'gpu'"):
        h.set_preferred_location("gpu")
    with pytest.raises(TypeError, match="ManagedBuffer"):
        ManagedMemoryHints(np.ones(4, np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        ManagedMemoryHints(_FakeManaged(10, strides=(8,)))
    plan = PrefetchPlan()
    with pytest.raises(TypeError, match="entry 0"):
        plan.add(object(), 0)
    with pytest.raises(TypeError, match="gpu"):
        plan.add(fake, "gpu")
    with pytest.raises(TypeError):
        plan.add(fake, 2.0)
    # Issue #30 item 7: None is not "the current device" for a migration; refused, naming None.
    with pytest.raises(TypeError, match="the target is None; say where the memory should go"):
        plan.add(fake, None)
    with pytest.raises(TypeError, match="the target is None"):
        plan.add_range(fake, 0, 10, None, discard=True)
    assert len(plan) == 0 and repr(plan) == "PrefetchPlan(0 entries)"


# ---------------------------------------------------------------------------
# GPU: hints read back from the driver.


@pytest.fixture(scope="module")
def affine():
    """``a[i] = a[i] * s + t`` over any 1-d array, grid-stride."""

    @cuda.jit
    def kernel(a, s, t):
        start = cuda.grid(1)
        for i in range(start, a.shape[0], cuda.gridsize(1)):
            a[i] = a[i] * s + t

    return kernel


def _buffer(rng, pages: int = 16) -> tuple[um.ManagedBuffer, np.ndarray]:
    """A buffer never prefetched, its pages written on the host (``from_array`` of 1 MiB or more would
    place them on the device by DMA, a prefetch these tests must not see)."""
    data = random_array(rng, pages * PAGE, np.float32)
    buf = um.ManagedBuffer.empty(data.shape, data.dtype)
    buf.host[:] = data
    return buf, data


def _state(hints: ManagedMemoryHints) -> tuple:
    s = hints.state()
    return s.read_mostly, s.preferred_location, s.accessed_by


@pytest.mark.gpu
def test_read_mostly_set_and_unset_read_back(rng):
    buf, _ = _buffer(rng)
    with buf:
        h = buf.hints
        assert h.read_mostly is False
        h.set_read_mostly()
        assert h.read_mostly is True and buf.hints.read_mostly is True
        h.unset_read_mostly()
        assert h.read_mostly is False


@pytest.mark.gpu
def test_preferred_location_set_and_unset_read_back(rng):

    buf, _ = _buffer(rng)
    with buf:
        h = buf.hints
        assert h.preferred_location is None
        h.set_preferred_location(0)
        assert h.preferred_location == DEV0
        h.set_preferred_location("cpu")
        assert h.preferred_location == HOST
        h.set_preferred_location(cuda.gpus[0])
        assert h.preferred_location == DEV0
        h.unset_preferred_location()
        assert h.preferred_location is None


@pytest.mark.gpu
def test_accessed_by_set_and_unset_read_back(rng):
    buf, _ = _buffer(rng)
    with buf:
        h = buf.hints
        assert h.accessed_by == frozenset()
        h.set_accessed_by(0)
        assert h.accessed_by == {DEV0}
        h.set_accessed_by("cpu")
        assert h.accessed_by == {DEV0, HOST}
        h.unset_accessed_by(0)
        assert h.accessed_by == {HOST}
        h.advise(MemAdvice.UNSET_ACCESSED_BY, "host")
        assert h.accessed_by == frozenset()


@pytest.mark.gpu
def test_range_advice_reads_back_on_its_pages_only(rng):
    buf, _ = _buffer(rng)
    with buf:
        inside = buf.hints.range(4 * PAGE, 8 * PAGE)
        outside = buf.hints.range(0, 2 * PAGE)
        inside.set_read_mostly()
        inside.set_preferred_location("cpu")
        assert inside.read_mostly is True and inside.preferred_location == HOST
        assert buf[4 * PAGE : 8 * PAGE].hints.read_mostly is True  # a view's hints are its own elements
        assert outside.read_mostly is False and outside.preferred_location is None
        # Attributes hold for a range only when every page agrees.
        assert buf.hints.read_mostly is False and buf.hints.preferred_location is None
        inside.unset_read_mostly()
        inside.unset_preferred_location()
        assert _state(inside) == (False, None, frozenset())


@pytest.mark.gpu
def test_state_reads_all_four(rng):
    from umem_numba import HintState

    buf, _ = _buffer(rng)
    with buf:
        buf.hints.advise(MemAdvice.SET_PREFERRED_LOCATION, 0)
        buf.hints.advise(MemAdvice.SET_ACCESSED_BY, "cpu")
        buf.prefetch("cpu")
        buf.synchronize()
        assert buf.hints.state() == HintState(False, DEV0, frozenset({HOST}), HOST)


# ---------------------------------------------------------------------------
# GPU: prefetch.


@pytest.mark.gpu
def test_last_prefetch_location_device_then_host(rng):

    buf, data = _buffer(rng)
    stream = cuda.stream()
    with buf:
        assert buf.hints.last_prefetch_location is None
        buf.prefetch(0, stream)
        # The prefetch is tracked like a kernel: host access waits for this event.
        assert int(stream.handle) in buf._coherence_tracker.pending
        buf.synchronize()
        assert buf.hints.last_prefetch_location == DEV0
        buf.prefetch("cpu", stream)
        np.testing.assert_array_equal(buf.host, data)
        assert not buf._coherence_tracker.pending
        assert buf.hints.last_prefetch_location == HOST


@pytest.mark.gpu
def test_prefetch_range_moves_only_its_elements(rng):
    buf, data = _buffer(rng)
    with buf:
        buf.prefetch("cpu")
        view = buf[2 * PAGE : 6 * PAGE]
        view.prefetch_range(PAGE, 3 * PAGE, 0)  # elements [3P, 5P) of buf
        buf.synchronize()
        assert buf.hints.range(3 * PAGE, 5 * PAGE).last_prefetch_location == DEV0
        assert buf.hints.range(0, 3 * PAGE).last_prefetch_location == HOST
        assert buf.hints.range(5 * PAGE, 16 * PAGE).last_prefetch_location == HOST
        assert buf.hints.last_prefetch_location is None  # pages disagree
        buf.hints.range(3 * PAGE, 5 * PAGE).prefetch("cpu")
        buf.synchronize()
        assert buf.hints.last_prefetch_location == HOST
        np.testing.assert_array_equal(buf.host, data)


@pytest.mark.gpu
def test_kernel_after_prefetch_both_ways(rng, affine):

    buf, data = _buffer(rng)
    stream = cuda.stream()
    with buf:
        buf.prefetch(0, stream)
        um.launch(affine, 64, 256, buf, np.float32(2), np.float32(1), stream=stream)
        buf.prefetch("cpu", stream)
        np.testing.assert_array_equal(buf.host, data * np.float32(2) + np.float32(1))
        assert buf.hints.last_prefetch_location == HOST


@pytest.mark.sim
@pytest.mark.gpu
def test_prefetch_errors_name_the_bad_value(rng):
    buf, _ = _buffer(rng, pages=1)
    n = buf.size
    with buf:
        with pytest.raises(IndexError, match=str(n + 1)):
            buf.prefetch_range(0, n + 1, 0)
        with pytest.raises(IndexError, match="negative"):
            buf.prefetch_range(-1, 5, 0)
        with pytest.raises(ValueError, match="start > stop"):
            buf.prefetch_range(5, 2, 0)
        with pytest.raises(ValueError, match="empty"):
            buf.prefetch_range(2, 2, 0)
        with pytest.raises(TypeError, match="float"):
            buf.prefetch_range(0.0, 4, 0)
        with pytest.raises(ValueError, match="device 99"):
            buf.prefetch(99)
        with pytest.raises(ValueError, match="device 99"):
            buf.hints.set_preferred_location(99)
        with pytest.raises(ValueError, match="device 99"):
            buf.apply_policy(MigrationPolicy.PREFER_DEVICE(99))
        with pytest.raises(TypeError, match="'gpu'"):
            buf.prefetch("gpu")
        with pytest.raises(TypeError, match="bool"):
            buf.prefetch(True)
        with pytest.raises(TypeError, match="stream"):
            buf.prefetch(0, stream="s")
        with pytest.raises(ValueError, match="C-contiguous"):
            buf[::2].prefetch(0)
        # Issue #30 item 7: None meant the current device, silently; now refused, naming None.
        for call in (
            lambda: buf.prefetch(None),
            lambda: buf.prefetch_range(0, 4, None),
            lambda: buf.discard_prefetch(None),
            lambda: buf.discard_prefetch_range(0, 4, None),
            lambda: PrefetchPlan().add(buf, None),
        ):
            with pytest.raises(TypeError, match=r"the target is None; say where the memory should go: a device"):
                call()
        # None of the refused calls reached the driver.
        assert buf.hints.state() == (False, None, frozenset(), None)
        buf.prefetch(0)  # and the buffer goes on as usual
        assert buf.hints.last_prefetch_location == DEV0


@pytest.mark.sim
@pytest.mark.gpu
def test_empty_and_closed_buffers():
    from umem_numba import BufferClosedError

    with um.ManagedBuffer.empty(0) as empty:
        empty.prefetch(0)  # a whole zero-size buffer: nothing to move (tests/hints/test_zero_size_hints.py)
        with pytest.raises(ValueError, match="empty"):
            empty.hints
    buf = um.ManagedBuffer.from_array(np.arange(1, PAGE + 1, dtype=np.float32))
    hints = buf.hints
    buf.close()
    with pytest.raises(BufferClosedError):
        buf.prefetch(0)
    with pytest.raises(BufferClosedError):
        hints.read_mostly
    with pytest.raises(BufferClosedError):
        PrefetchPlan().add(buf, 0)


@pytest.mark.gpu
def test_memory_that_is_not_managed_is_refused(rng):

    from umem_numba import UnsupportedError

    data = random_array(rng, PAGE, np.float32)
    with um.PinnedBuffer.from_array(data) as pinned:
        with pytest.raises(UnsupportedError, match="pinned memory"):
            ManagedMemoryHints(pinned)
        with pytest.raises(UnsupportedError, match="not managed"):
            PrefetchPlan().add(pinned, 0)
    dev_array = cuda.to_device(data)
    hints = ManagedMemoryHints(dev_array)  # no driver call yet
    with pytest.raises(UnsupportedError, match="IS_MANAGED"):
        hints.read_mostly
    with pytest.raises(UnsupportedError, match="IS_MANAGED"):
        hints.prefetch(0)
    with pytest.raises(UnsupportedError, match="IS_MANAGED"):
        PrefetchPlan().add(dev_array, "cpu")


@pytest.mark.gpu
def test_numba_managed_array_is_accepted(rng, affine):

    data = random_array(rng, 4 * PAGE, np.float32)
    arr = cuda.managed_array(data.shape, np.float32)
    arr[:] = data
    hints = ManagedMemoryHints(arr)
    hints.set_read_mostly()
    assert hints.read_mostly is True
    hints.unset_read_mostly()
    hints.prefetch(0)
    cuda.synchronize()
    assert hints.last_prefetch_location == DEV0
    affine[64, 256](arr, np.float32(2), np.float32(1))
    cuda.synchronize()
    np.testing.assert_array_equal(np.asarray(arr), data * np.float32(2) + np.float32(1))


@pytest.mark.gpu
def test_without_concurrent_managed_access_each_call_works_or_raises(rng, monkeypatch):
    from umem_numba import UnsupportedError

    buf, data = _buffer(rng)
    real = _driver.device_attribute

    def no_concurrent(name: str, device_id: int) -> int:
        return 0 if name == "CONCURRENT_MANAGED_ACCESS" else real(name, device_id)

    monkeypatch.setattr(_driver, "device_attribute", no_concurrent)
    with buf:
        for call in (
            lambda: buf.prefetch(0),
            lambda: buf.prefetch("cpu"),
            lambda: buf.prefetch_range(0, PAGE, 0),
            lambda: buf.hints.set_preferred_location(0),
            lambda: buf.hints.set_accessed_by(0),
            lambda: buf.apply_policy(MigrationPolicy.PREFER_DEVICE(0)),
            lambda: buf.apply_policy(MigrationPolicy.HOST_MAPPED),
            lambda: PrefetchPlan().add(buf, 0),
        ):
            with pytest.raises(UnsupportedError, match="concurrentManagedAccess"):
                call()
        assert buf.hints.state() == (False, None, frozenset(), None)  # nothing was half-done
        # Host and read-mostly advice need no concurrent access: they work.
        buf.apply_policy(MigrationPolicy.PREFER_HOST)
        assert _state(buf.hints) == (False, HOST, frozenset())
        buf.apply_policy(MigrationPolicy.READ_MOSTLY)
        assert _state(buf.hints) == (True, None, frozenset())
        np.testing.assert_array_equal(buf.host, data)


# ---------------------------------------------------------------------------
# GPU: policies.


def _expected(policy: MigrationPolicy) -> tuple:
    return {
        MigrationPolicy.DEFAULT: (False, None, frozenset()),
        MigrationPolicy.READ_MOSTLY: (True, None, frozenset()),
        MigrationPolicy.PREFER_DEVICE(0): (False, DEV0, frozenset()),
        MigrationPolicy.PREFER_HOST: (False, HOST, frozenset()),
        MigrationPolicy.HOST_MAPPED: (False, HOST, frozenset({DEV0})),
    }[policy]


POLICIES = [
    MigrationPolicy.DEFAULT,
    MigrationPolicy.READ_MOSTLY,
    MigrationPolicy.PREFER_DEVICE(0),
    MigrationPolicy.PREFER_HOST,
    MigrationPolicy.HOST_MAPPED,
]


@pytest.mark.gpu
def test_every_policy_switch_leaves_only_the_new_advice(rng):
    buf, _ = _buffer(rng, pages=2)
    with buf:
        for first in POLICIES:
            for second in POLICIES:
                buf.apply_policy(first)
                assert _state(buf.hints) == _expected(first), first
                buf.apply_policy(second)
                assert _state(buf.hints) == _expected(second), (first, second)


@pytest.mark.gpu
def test_policy_removes_hand_given_advice_too(rng):
    buf, _ = _buffer(rng)
    with buf:
        buf.hints.set_accessed_by("cpu")
        buf.hints.set_accessed_by(0)
        buf.hints.range(0, 4 * PAGE).set_read_mostly()  # part of the buffer only
        buf.hints.range(4 * PAGE, 8 * PAGE).set_preferred_location(0)
        buf.apply_policy(MigrationPolicy.PREFER_HOST)
        assert _state(buf.hints) == (False, HOST, frozenset())
        assert buf.hints.range(0, 4 * PAGE).read_mostly is False
        buf.hints.clear()
        assert _state(buf.hints) == (False, None, frozenset())


@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_kernels_and_host_see_right_values_under_each_policy(rng, affine, policy):

    buf, data = _buffer(rng)
    stream = cuda.stream()
    with buf:
        buf.apply_policy(policy)
        if policy == MigrationPolicy.HOST_MAPPED:
            buf.prefetch("cpu", stream)  # the device then reads host memory over the bus
        elif policy.kind == "prefer_device":
            buf.prefetch(0, stream)
        um.launch(affine, 64, 256, buf, np.float32(2), np.float32(1), stream=stream)
        expect = data * np.float32(2) + np.float32(1)
        np.testing.assert_array_equal(buf.host, expect)
        fresh = random_array(rng, buf.size, np.float32)
        buf.host[:] = fresh  # host writes under the policy, then the device reads them
        um.launch(affine, 64, 256, buf, np.float32(3), np.float32(0.5), stream=stream)
        np.testing.assert_allclose(buf.host, fresh * np.float32(3) + np.float32(0.5), rtol=1e-6)
        assert _state(buf.hints) == _expected(policy)


# ---------------------------------------------------------------------------
# GPU: plans.


@pytest.mark.gpu
@pytest.mark.parametrize("own_stream", [False, True], ids=["default-stream", "own-stream"])
def test_plan_prefetches_every_entry_where_it_says(rng, own_stream):

    from umem_numba._hints import _prefetch

    (a, da), (b, db), (c, dc) = (_buffer(rng, pages=4) for _ in range(3))
    stream = cuda.stream() if own_stream else None
    handle = int(stream.handle) if own_stream else 0
    with a, b, c:
        plan = PrefetchPlan()
        assert plan.add(a, 0) is plan
        plan.add_range(b, 0, PAGE, "cpu").add_range(b, PAGE, 3 * PAGE, 0).add(c, "cpu")
        assert len(plan) == 4
        assert "4 entries" in repr(plan) and "ManagedBuffer[0:16384] -> host" in repr(plan)
        assert [e[3] for e in plan.entries] == [DEV0, HOST, DEV0, HOST]
        batched = own_stream and _driver.api().mem_prefetch_batch is not None
        assert _prefetch._batch_possible(handle, len(plan)) == batched
        plan.execute(stream)
        for buf in (a, b, c):
            assert handle in buf._coherence_tracker.pending
        for buf in (a, b, c):
            buf.synchronize()
        assert a.hints.last_prefetch_location == DEV0
        assert b.hints.range(0, PAGE).last_prefetch_location == HOST
        assert b.hints.range(PAGE, 3 * PAGE).last_prefetch_location == DEV0
        assert b.hints.range(3 * PAGE, 4 * PAGE).last_prefetch_location is None  # not in the plan
        assert c.hints.last_prefetch_location == HOST
        for buf, data in ((a, da), (b, db), (c, dc)):
            np.testing.assert_array_equal(buf.host, data)
        plan.clear()
        assert len(plan) == 0


@pytest.mark.gpu
def test_plan_with_one_bad_entry_issues_nothing(rng):

    from umem_numba import BufferClosedError

    (a, _), (b, _), (c, _) = (_buffer(rng, pages=2) for _ in range(3))
    stream = cuda.stream()
    with a, b:
        plan = PrefetchPlan().add(a, 0).add_range(b, 0, PAGE, "cpu").add(c, 0)
        with pytest.raises(ValueError, match="device 99"):
            plan.add(a, 99)
        with pytest.raises(IndexError):
            plan.add_range(a, 0, a.size + 1, 0)
        assert len(plan) == 3  # refused entries were not added
        c.close()
        with pytest.raises(BufferClosedError, match="entry 2"):
            plan.execute(stream)
        stream.synchronize()
        assert a.hints.last_prefetch_location is None
        assert b.hints.range(0, PAGE).last_prefetch_location is None
        assert not a._coherence_tracker.pending and not b._coherence_tracker.pending


# ---------------------------------------------------------------------------
# Several GPUs.


@pytest.mark.multigpu
def test_targets_reach_device_n(rng, affine):

    last = _driver.device_count() - 1
    dev_n = Location.device(last)
    buf, data = _buffer(rng, pages=4)
    with buf:
        buf.prefetch(last)
        buf.synchronize()
        assert buf.hints.last_prefetch_location == dev_n
        buf.apply_policy(MigrationPolicy.PREFER_DEVICE(last))
        assert _state(buf.hints) == (False, dev_n, frozenset())
        buf.apply_policy(MigrationPolicy("host_mapped", device=cuda.gpus[last]))
        assert _state(buf.hints) == (False, HOST, frozenset({dev_n}))
        buf.apply_policy(MigrationPolicy.DEFAULT)
        with cuda.gpus[last]:
            stream = cuda.stream()
            PrefetchPlan().add_range(buf, 0, PAGE, 0).add_range(buf, PAGE, 4 * PAGE, last).execute(stream)
            um.launch(affine, 64, 256, buf, np.float32(2), np.float32(1), stream=stream)
        np.testing.assert_array_equal(buf.host, data * np.float32(2) + np.float32(1))
        assert buf.hints.range(0, PAGE).last_prefetch_location == DEV0
        assert buf.hints.range(PAGE, 4 * PAGE).last_prefetch_location == dev_n


def test_a_sticky_driver_error_is_not_reported_as_not_managed(monkeypatch):
    """Only an unknown address means 'not managed'; a sticky launch failure is reported as itself."""
    from types import SimpleNamespace

    from umem_numba import _driver
    from umem_numba._hints import _managed_span

    drv = pytest.importorskip("cuda.bindings.driver")
    results = {"answer": (drv.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, None)}
    fake = SimpleNamespace(
        drv=SimpleNamespace(cuPointerGetAttributes=lambda count, attrs, ptr: results["answer"], CUresult=drv.CUresult),
        c=_driver._constants(drv),
    )
    monkeypatch.setattr(_driver, "api", lambda: fake)
    with pytest.raises(CudaError, match="CUDA_ERROR_ILLEGAL_ADDRESS") as info:
        _managed_span._require_managed(0x1000, "prefetch")
    assert not isinstance(info.value, UnsupportedError)
    # An address the driver does not know: NULL values with success (no error for memcheck to report).
    results["answer"] = (drv.CUresult.CUDA_SUCCESS, [False])
    with pytest.raises(UnsupportedError, match="not managed memory"):
        _managed_span._require_managed(0x1000, "prefetch")
    results["answer"] = (drv.CUresult.CUDA_SUCCESS, [True])
    _managed_span._require_managed(0x1000, "prefetch")


def test_an_unsupported_error_is_not_its_own_cause():
    from umem_numba._hints._managed_span import unsupported_from

    other = CudaError("cuMemAdvise", 1, "CUDA_ERROR_INVALID_VALUE")
    assert unsupported_from(other, "advise") is None
    converted = unsupported_from(CudaError("cuMemAdvise", 801, "CUDA_ERROR_NOT_SUPPORTED"), "advise")
    assert isinstance(converted, UnsupportedError) and "does not support" in str(converted)
