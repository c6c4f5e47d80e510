"""Issue #22: discard, host NUMA locations, prefetch on allocation and Fortran order.

Every hint and location is read back from the driver; values are checked on fresh random data.
CPU-only tests (argument checks that need no driver, pure helpers) run everywhere.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from support.helpers import ORDERING_TRIALS, random_array, sleeping

import umem_numba as um
from umem_numba import HOST, Host, Location, MemAdvice, PrefetchPlan, _driver
from umem_numba._driver import _location
from umem_numba._errors import UnsupportedError
from umem_numba._hints import _prefetch

#: These tests read back the driver state of fresh ranges: no memory from the allocation cache.
pytestmark = pytest.mark.usefixtures("fresh_allocations")

#: 64 KiB of float32: whole pages on x86-64 and arm64, so ranges never share a page.
PAGE = (64 << 10) // 4
DEV0 = Location.device(0)


class _FakeManaged:
    """A CUDA-array-interface object whose pointer is never dereferenced (CPU-only tests)."""

    def __init__(self, n: int = 100) -> None:
        self.__cuda_array_interface__ = {
            "shape": (n,),
            "typestr": "<f4",
            "data": (0x10000, False),
            "strides": None,
            "version": 3,
        }


@pytest.fixture
def two_numa_nodes(monkeypatch):
    """Pretend the host has NUMA nodes 0 and 1 (no driver involved)."""
    monkeypatch.setattr(_location, "_numa_nodes", (0, 1))


# ---------------------------------------------------------------------------
# Item 2, CPU: host NUMA locations and their parser.


def test_host_numa_locations_parse_compare_and_print(two_numa_nodes):
    """Issue #22 item 2: Host(numa=N), "cpu:N" and "host:N" are one location, distinct from the host."""
    assert Host() is HOST and Host(None) is HOST
    node1 = Host(numa=1)
    assert node1 == Location("host_numa", 1) == um.as_location("cpu:1") == um.as_location("HOST:1")
    assert node1 == um.as_location(Host(numa=np.int64(1)))
    assert node1 != HOST and node1 != Host(numa=0) and node1 != DEV0
    assert node1.is_host and node1.numa == 1 and node1.legacy_id == -1
    assert HOST.numa is None and DEV0.numa is None
    assert str(node1) == "host NUMA node 1" and str(HOST) == "host"
    assert len({node1, Host(numa=1), HOST, Host(numa=0)}) == 3


@pytest.mark.parametrize(
    ("target", "exc", "words"),
    [
        ("cpu:", ValueError, "bad host NUMA node"),
        ("cpu:x", ValueError, "bad host NUMA node"),
        ("cpu:-1", ValueError, "bad host NUMA node"),
        ("gpu:0", TypeError, "cpu:N"),
        ("cpu:7", ValueError, "host NUMA node 7 does not exist"),
    ],
)
def test_bad_host_numa_targets_are_refused_without_the_driver(two_numa_nodes, target, exc, words):
    """Issue #22 item 2: a malformed or missing NUMA node is a clear error before any driver call."""
    with pytest.raises(exc, match=words):
        um.as_location(target, what="prefetch")


def test_host_numa_constructor_refuses_bad_numbers():
    """Issue #22 item 2: Host(numa=) takes a node number >= 0 (bools and floats refused)."""
    with pytest.raises(ValueError, match=">= 0"):
        Host(numa=-1)
    with pytest.raises(TypeError, match="bool"):
        Host(numa=True)
    with pytest.raises(TypeError, match="numa must be an int"):
        Host(numa=0.0)
    with pytest.raises(ValueError, match="not the host"):
        um.as_location("cpu:0", allow_host=False)


def test_missing_numa_node_is_refused_by_as_location(two_numa_nodes):
    """Issue #22 item 2: a Location for a node the machine lacks fails where it is used, naming the nodes."""
    with pytest.raises(ValueError, match=r"node 2 does not exist: .*0, 1"):
        um.as_location(Location("host_numa", 2), check=False)


def test_numa_nodes_read_from_sysfs(tmp_path):
    """Issue #22 item 2: the kernel's node list ("0-3,5"), its directory fallback, and no list at all."""
    (tmp_path / "online").write_text("0-2,5\n")
    assert _location._read_numa_nodes(str(tmp_path)) == (0, 1, 2, 5)
    other = tmp_path / "nodes"
    other.mkdir()
    for name in ("node3", "node1", "cpu0", "nodeX"):
        (other / name).mkdir()
    assert _location._read_numa_nodes(str(other)) == (1, 3)
    assert _location._read_numa_nodes(str(tmp_path / "missing")) == ()


def test_info_lists_the_hosts_numa_nodes():
    """Issue #22 item 2: info() lists the NUMA nodes (also without a GPU)."""
    assert um.info()["numa_nodes"] == list(_location._read_numa_nodes(_location._NODE_DIR))


def test_accessed_by_a_numa_node_is_refused_before_the_driver(two_numa_nodes):
    """Issue #22 item 2: accessed-by advice is per processor; a NUMA node is a clear ValueError."""
    hints = um.ManagedMemoryHints(_FakeManaged())
    for advice in (MemAdvice.SET_ACCESSED_BY, MemAdvice.UNSET_ACCESSED_BY):
        with pytest.raises(ValueError, match="not host NUMA node 1"):
            hints.advise(advice, "cpu:1")


def test_typed_locations_decode_and_the_legacy_fallback(monkeypatch):
    """Issue #22 item 2: the typed range attributes decode to devices, the host and NUMA nodes."""
    from cuda.bindings import driver as drv

    from umem_numba._hints import _advice
    from umem_numba._hints._managed_span import ManagedSpan

    consts = _driver._constants(drv)
    monkeypatch.setattr(_driver, "consts", lambda: consts)
    t = drv.CUmemLocationType
    assert Location.from_typed(int(t.CU_MEM_LOCATION_TYPE_DEVICE), 2) == Location.device(2)
    assert Location.from_typed(int(t.CU_MEM_LOCATION_TYPE_HOST), 0) is HOST
    assert Location.from_typed(int(t.CU_MEM_LOCATION_TYPE_HOST_NUMA), 1) == Location("host_numa", 1)
    assert Location.from_typed(int(t.CU_MEM_LOCATION_TYPE_INVALID), 7) is None

    class _Api:
        driver_version = 13000

    asked: list = []
    answers = {consts.range_preferred_type: int(t.CU_MEM_LOCATION_TYPE_HOST_NUMA), consts.range_preferred_id: 1}
    monkeypatch.setattr(_driver, "api", _Api)
    monkeypatch.setattr(_driver, "device_context", lambda d: __import__("contextlib").nullcontext(d))
    monkeypatch.setattr(_driver, "range_attribute_int", lambda a, p, n, d="": asked.append(a) or answers[a])
    monkeypatch.setattr(_advice, "_range_attr", lambda span, attr, size=4: [-1])  # legacy: "CPU"
    span = ManagedSpan(0x1000, 4096, 0, None, "test range")
    assert _advice._preferred(span) == Location("host_numa", 1)
    assert asked == [consts.range_preferred_type, consts.range_preferred_id]
    _Api.driver_version = 12010  # before CUDA 12.2: only the legacy id, which says "host"
    assert _advice._preferred(span) is HOST


def test_range_attribute_falls_back_to_the_driver_entry_point(monkeypatch):
    """Issue #22 item 2: where the binding refuses a typed attribute (13.3), the entry point answers."""
    import ctypes

    from cuda.bindings import driver as drv

    def refuse(name, *args, detail=""):
        raise TypeError("Unsupported attribute: CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE")

    calls: list = []

    def entry_point(out, size, attr, ptr, nbytes):
        calls.append((size, attr, ptr, nbytes))
        out._obj.value = 3
        return 0

    class _Api:
        drv = None

    _Api.drv = drv
    monkeypatch.setattr(_driver, "call", refuse)
    monkeypatch.setattr(_driver, "_raw_range_get_attribute", lambda: (entry_point, ctypes))
    monkeypatch.setattr(_driver, "api", _Api)
    attr = drv.CUmem_range_attribute.CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE
    assert _driver.range_attribute_int(attr, 0x2000, 64) == 3
    assert calls == [(4, int(attr), 0x2000, 64)]

    def failing(out, size, attr, ptr, nbytes):
        return int(drv.CUresult.CUDA_ERROR_INVALID_VALUE)

    monkeypatch.setattr(_driver, "_raw_range_get_attribute", lambda: (failing, ctypes))
    with pytest.raises(um.CudaError, match=r"cuMemRangeGetAttribute.*CUDA_ERROR_INVALID_VALUE"):
        _driver.range_attribute_int(attr, 0x2000, 64, "reading hints")


# ---------------------------------------------------------------------------
# Item 1, CPU: discard plumbing that needs no GPU.


def test_discard_range_and_target_checked_before_the_driver(two_numa_nodes):
    """Issue #22 item 1: a bad range or target of a discard is an error before any driver call."""
    fake = _FakeManaged(100)
    with pytest.raises(ValueError, match="start > stop"):
        _prefetch.discard(fake, None, 5, 2)
    with pytest.raises(IndexError, match="out of bounds"):
        _prefetch.discard(fake, None, 0, 101)
    with pytest.raises(ValueError, match="node 9 does not exist"):
        _prefetch.discard_prefetch(fake, "cpu:9")
    with pytest.raises(TypeError, match="discard must be True or False"):
        PrefetchPlan().add(fake, "cpu", discard=1)


class _BindingWithout:
    """The real binding, but with some calls missing and another driver version."""

    def __init__(self, drv, version: int, missing: tuple[str, ...] = ()) -> None:
        self._drv = drv
        self._version = version
        self._missing = missing

    def cuDriverGetVersion(self):
        return (self._drv.CUresult.CUDA_SUCCESS, self._version)

    def __getattr__(self, name):
        if name in self._missing:
            raise AttributeError(name)
        return getattr(self._drv, name)


@pytest.mark.parametrize(
    ("version", "missing", "words"),
    [
        (12080, (), "needs a CUDA 13.0 driver"),
        (13000, ("cuMemDiscardBatchAsync",), "has no cuMemDiscardBatchAsync"),
        (13000, ("cuMemDiscardAndPrefetchBatchAsync",), "has no cuMemDiscardBatchAsync"),
    ],
)
def test_discard_support_names_what_is_missing(version, missing, words):
    """Issue #22 item 1: without the binding's calls or a CUDA 13 driver, discards say which is missing."""
    from cuda.bindings import driver as drv

    api = _driver._Api(_BindingWithout(drv, version, missing), "12.9.0")
    assert api.mem_discard_batch is None and api.mem_discard_prefetch_batch is None
    assert words in api.discard_missing
    full = _driver._Api(_BindingWithout(drv, 13000), "13.3.1")
    assert full.discard_missing == "" and full.mem_discard_batch is drv.cuMemDiscardBatchAsync


def test_discard_unsupported_is_raised_before_any_discard(monkeypatch):
    """Issue #22 item 1: UnsupportedError names the reason (the binding/driver, or a device without CMA)."""

    class _Api:
        discard_missing = "the CUDA driver is version 12.8; cuMemDiscardBatchAsync needs a CUDA 13.0 driver"

    monkeypatch.setattr(_driver, "api", _Api)
    with pytest.raises(UnsupportedError, match=r"discard: the CUDA driver is version 12\.8"):
        _prefetch._require_discard("discard")
    _Api.discard_missing = ""
    monkeypatch.setattr(_driver, "device_count", lambda: 2)
    monkeypatch.setattr(_driver, "concurrent_managed_access", lambda d: d == 0)
    with pytest.raises(UnsupportedError, match=r"device\(s\) 1 lack it"):
        _prefetch._require_discard("discard")


def test_discard_on_the_legacy_stream_goes_through_an_ordered_side_stream(monkeypatch):
    """Issue #22 item 1: the batch calls refuse the legacy stream; the side stream is ordered both ways."""
    calls: list[tuple] = []

    class _Event:
        def __init__(self, stream: int) -> None:
            self.handle = f"event on {stream}"

    class _Consts:
        stream_legacy = 1

    monkeypatch.setattr(_driver, "consts", _Consts)
    monkeypatch.setattr(_prefetch._events, "record", lambda stream, device: _Event(stream))
    monkeypatch.setattr(_driver, "side_stream", lambda device: 77)
    monkeypatch.setattr(_driver, "call", lambda name, *args, detail="": calls.append((name, *args)))
    for legacy in (0, 1):
        calls.clear()
        with _prefetch._batch_stream(legacy, 0) as h:
            assert h == 77
            assert calls == [("cuStreamWaitEvent", 77, f"event on {legacy}", 0)]  # side waits for legacy
            calls.append(("work on", h))
        assert calls[-1] == ("cuStreamWaitEvent", legacy, "event on 77", 0)  # legacy waits for side
    calls.clear()
    with _prefetch._batch_stream(0x1234, 0) as h:
        assert h == 0x1234
    assert calls == []


def test_plan_runs_keep_plan_order():
    """Issue #22 item 1: a plan goes out as runs of one kind each, in plan order."""
    ops = ["prefetch", "prefetch", "discard", "discard_prefetch", "discard_prefetch", "prefetch"]
    prepared = [(i, None, op) for i, op in enumerate(ops)]
    runs = [(op, [s for s, _ in run]) for op, run in _prefetch._runs(prepared)]  # type: ignore[arg-type]
    assert runs == [("prefetch", [0, 1]), ("discard", [2]), ("discard_prefetch", [3, 4]), ("prefetch", [5])]


# ---------------------------------------------------------------------------
# Item 5, CPU: the prefetch target of a constructor is checked before allocating.


@pytest.mark.parametrize("ctor", ["empty", "zeros", "from_array"])
def test_bad_prefetch_target_refused_before_allocating(two_numa_nodes, ctor):
    """Issue #22 item 5: ManagedBuffer.*(prefetch=bad) raises before any driver call (no GPU needed)."""
    make = getattr(um.ManagedBuffer, ctor)
    arg = np.zeros(4, np.float32) if ctor == "from_array" else 4
    with pytest.raises(ValueError, match="node 3 does not exist"):
        make(arg, prefetch="cpu:3")
    with pytest.raises(TypeError, match="memory location"):
        make(arg, prefetch=1.5)


# ---------------------------------------------------------------------------
# GPU helpers.


def _buffer(rng, pages: int = 4) -> tuple[um.ManagedBuffer, np.ndarray]:
    data = random_array(rng, pages * PAGE, np.float32)
    return um.ManagedBuffer.from_array(data), data


@um.jit
def _affine(a, s, t):
    i = cuda.grid(1)
    if i < a.size:
        a[i] = a[i] * s + t


def _check_kernel_values(buf: um.ManagedBuffer, rng, stream=None) -> None:
    """Host writes fresh data, a tracked kernel transforms it, the host reads the right values."""
    fresh = random_array(rng, buf.size, np.float32)
    buf.host[:] = fresh
    _affine[(buf.size + 255) // 256, 256, 0 if stream is None else stream](buf, np.float32(3), np.float32(0.5))
    np.testing.assert_allclose(buf.host, fresh * np.float32(3) + np.float32(0.5), rtol=1e-6)


def _writes_on(buf: um.ManagedBuffer, handle: int) -> bool:
    return any(e.stream == handle for e in buf._coherence_tracker.writes.values())


def _query(handle: int) -> bool:
    """Whether everything queued on ``handle`` has finished (cuStreamQuery)."""
    return _driver.is_finished(_driver.api().drv.cuStreamQuery(handle), "cuStreamQuery")


def _numa_node() -> int:
    """A host NUMA node of this machine (the device's nearest where the driver says)."""
    nodes = _location.numa_nodes()
    if not nodes:
        pytest.skip("the host reports no NUMA nodes (/sys/devices/system/node)")
    try:
        near = _driver.device_attribute("HOST_NUMA_ID", 0)
    except AttributeError:
        near = -1
    return near if near in nodes else nodes[0]


def _needs_discard() -> None:
    missing = _driver.api().discard_missing
    if missing:
        buf = um.ManagedBuffer.empty(PAGE)
        with buf, pytest.raises(UnsupportedError, match="cuMemDiscard"):
            buf.discard(cuda.stream())
        pytest.skip(f"checked the UnsupportedError: {missing}")


# ---------------------------------------------------------------------------
# Item 1, GPU: discard.


@pytest.mark.gpu
@pytest.mark.parametrize("own_stream", [False, True], ids=["legacy-stream", "own-stream"])
def test_discard_prefetch_lands_at_the_target_and_is_tracked_as_a_write(rng, own_stream):
    """Issue #22 item 1: discard_prefetch moves the pages to the target (read back), recorded as a write."""
    _needs_discard()
    stream = cuda.stream() if own_stream else None
    handle = int(stream.handle) if own_stream else 0
    buf, _ = _buffer(rng)
    with buf:
        buf.discard_prefetch("cpu", stream)
        assert _writes_on(buf, handle)
        buf.synchronize()
        assert buf.hints.last_prefetch_location == HOST
        _check_kernel_values(buf, rng, stream)
        buf.discard_prefetch(0, stream)
        assert _writes_on(buf, handle)
        buf.synchronize()
        assert buf.hints.last_prefetch_location == DEV0
        _check_kernel_values(buf, rng, stream)
        buf.discard(stream)
        assert _writes_on(buf, handle)
        _check_kernel_values(buf, rng, stream)  # written again after the discard: defined values


@pytest.mark.gpu
def test_discard_ranges_follow_the_prefetch_range_convention(rng):
    """Issue #22 item 1: element ranges [start, stop), each read back where it was sent."""
    _needs_discard()
    stream = cuda.stream()
    buf, _ = _buffer(rng, pages=4)
    with buf:
        buf.prefetch(0, stream)
        buf.discard_prefetch_range(PAGE, 3 * PAGE, "cpu", stream)
        buf.discard_range(3 * PAGE, 4 * PAGE, stream)
        buf.hints.range(0, PAGE).discard_prefetch(0, stream)
        buf.synchronize()
        assert buf.hints.range(PAGE, 3 * PAGE).last_prefetch_location == HOST
        assert buf.hints.range(0, PAGE).last_prefetch_location == DEV0
        for bad in ((-1, 4), (0, 4 * PAGE + 1), (5, 5)):
            with pytest.raises((IndexError, ValueError)):
                buf.discard_range(*bad, stream)
        _check_kernel_values(buf, rng, stream)


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_discard_waits_for_a_sleeping_writer_on_another_stream(rng):
    """Issue #22 item 1: a discard is ordered after earlier device work (it is a write).

    A kernel sleeps ~30 ms on stream 1 and then writes the buffer; the discard on
    stream 2 must wait for it on the device: while the kernel runs, stream 2 is busy
    (the driver may also hold the calling thread until then; then both are done).
    Without the ordering the discard would finish while the kernel still runs.
    """
    _needs_discard()
    fill = um.coherent(sleeping.fill)
    s1, s2 = cuda.stream(), cuda.stream()
    h2 = int(s2.handle)
    buf, _ = _buffer(rng, pages=2)
    with buf:
        for trial in range(ORDERING_TRIALS):
            fill[(buf.size + 255) // 256, 256, s1](buf, np.float32(trial), 30)
            buf.discard(s2)
            done2 = _query(h2)
            done1 = _query(int(s1.handle))
            assert done1 or not done2, f"trial {trial}: the discard finished before the kernel it follows"
            assert _writes_on(buf, h2)
            _ = buf.host  # host access waits for the discard too
            assert _query(h2) and _query(int(s1.handle))
        _check_kernel_values(buf, rng, s2)


@pytest.mark.gpu
def test_plan_with_discards_batches_them_in_order(rng):
    """Issue #22 item 1: PrefetchPlan discard entries (alone and with a prefetch), each read back."""
    _needs_discard()
    stream = cuda.stream()
    (a, _), (b, _), (c, dc) = (_buffer(rng, pages=2) for _ in range(3))
    with a, b, c:
        plan = PrefetchPlan().add(a, 0, discard=True).add_discard(b).add_range(c, 0, PAGE, "cpu")
        plan.add_discard_range(b, 0, PAGE).add_range(a, PAGE, 2 * PAGE, "cpu", discard=True)
        assert plan.operations == ("discard_prefetch", "discard", "prefetch", "discard", "discard_prefetch")
        assert [e[3] for e in plan.entries] == [DEV0, None, HOST, None, HOST]
        assert "discarded" in repr(plan)
        plan.execute(stream)
        assert _writes_on(a, int(stream.handle)) and _writes_on(b, int(stream.handle))
        assert not _writes_on(c, int(stream.handle))  # a prefetch only reads
        for buf in (a, b, c):
            buf.synchronize()
        assert a.hints.range(0, PAGE).last_prefetch_location == DEV0
        assert a.hints.range(PAGE, 2 * PAGE).last_prefetch_location == HOST
        assert c.hints.range(0, PAGE).last_prefetch_location == HOST
        np.testing.assert_array_equal(c.host, dc)  # prefetched, not discarded: values kept
        pinned = um.PinnedBuffer.empty(16)
        with pinned, pytest.raises(UnsupportedError, match="not managed"):
            plan.add_discard(pinned)
        assert len(plan) == 5
        for buf in (a, b):
            _check_kernel_values(buf, rng, stream)


# ---------------------------------------------------------------------------
# Item 2, GPU: host NUMA locations read back from the driver.


@pytest.mark.gpu
def test_host_numa_preferred_location_reads_back_or_is_refused(rng):
    """Issue #22 item 2: a host NUMA preference reads back through the typed attributes, or is refused.

    A driver that accepts the advice but keeps the old preference (seen on an H100 virtual
    machine, CUDA 13.0) gets UnsupportedError from umem_numba's read-back, never a silent no-op.
    """
    node = _numa_node()
    numa = Host(numa=node)
    buf, _ = _buffer(rng)
    with buf:
        buf.hints.set_preferred_location(0)
        try:
            buf.hints.set_preferred_location(numa)
        except UnsupportedError as exc:
            assert "host NUMA" in str(exc) or "not supported" in str(exc).lower()
            pytest.skip(f"this system's driver does not apply host NUMA preferences: {exc}")
        assert buf.hints.preferred_location == numa
        buf.hints.set_preferred_location("cpu")
        assert buf.hints.preferred_location == HOST  # the typed read tells the host from a node
        buf.hints.range(0, PAGE).set_preferred_location(f"cpu:{node}")
        assert buf.hints.range(0, PAGE).preferred_location == numa
        assert buf.hints.preferred_location is None  # pages disagree
        assert buf.hints.range(0, PAGE).state().preferred_location == numa
        buf.apply_policy(um.MigrationPolicy.DEFAULT)
        assert buf.hints.preferred_location is None


@pytest.mark.gpu
def test_host_numa_prefetch_locations_read_back(rng):
    """Issue #22 item 2: prefetches to a host NUMA node, alone and in a plan, read back as the node."""
    node = _numa_node()
    numa = Host(numa=node)
    buf, data = _buffer(rng)
    stream = cuda.stream()
    with buf:
        buf.prefetch(0, stream)
        buf.prefetch(f"cpu:{node}", stream)
        buf.synchronize()
        assert buf.hints.last_prefetch_location == numa
        np.testing.assert_array_equal(buf.host, data)
        assert buf.hints.range(0, PAGE).state().last_prefetch_location == numa
        # Disjoint ranges: the driver does not order the entries of one batched call.
        PrefetchPlan().add_range(buf, PAGE, buf.size, 0).add_range(buf, 0, PAGE, numa).execute(stream)
        buf.synchronize()
        assert buf.hints.range(0, PAGE).last_prefetch_location == numa
        assert buf.hints.range(PAGE, 2 * PAGE).last_prefetch_location == DEV0
        buf.prefetch("cpu", stream)
        buf.synchronize()
        assert buf.hints.last_prefetch_location == HOST
        _check_kernel_values(buf, rng, stream)


@pytest.mark.gpu
def test_missing_numa_node_refused_before_the_driver(rng):
    """Issue #22 item 2: a node the machine lacks is a ValueError; nothing reaches the driver."""
    nodes = _location.numa_nodes() or [0]
    missing = max(nodes) + 1
    buf, _ = _buffer(rng, pages=1)
    with buf:
        with pytest.raises(ValueError, match=f"host NUMA node {missing} does not exist"):
            buf.prefetch(f"cpu:{missing}")
        with pytest.raises(ValueError, match=f"host NUMA node {missing} does not exist"):
            buf.hints.set_preferred_location(Host(numa=missing))
        assert buf.hints.last_prefetch_location is None and buf.hints.preferred_location is None
        assert not buf._coherence_tracker.pending


@pytest.mark.gpu
def test_typed_range_attribute_read_directly_matches_the_binding(rng):
    """Issue #22 item 2: the driver entry point the typed reads use (cuda-bindings 13.3 refuses them)."""
    fn, ctypes = _driver._raw_range_get_attribute()
    c = _driver.consts()
    buf, _ = _buffer(rng, pages=1)
    with buf:
        buf.hints.set_preferred_location(0)
        out = ctypes.c_int32(-5)
        assert fn(ctypes.byref(out), 4, int(c.range_preferred), buf.ptr, buf.nbytes) == 0
        legacy = int(_driver.call("cuMemRangeGetAttribute", 4, c.range_preferred, buf.ptr, buf.nbytes))
        assert out.value == legacy == 0
        assert _driver.range_attribute_int(c.range_preferred_type, buf.ptr, buf.nbytes) == int(c.location_device)
        assert _driver.range_attribute_int(c.range_preferred_id, buf.ptr, buf.nbytes) == 0


@pytest.mark.gpu
def test_info_reports_numa_nodes_and_the_nearest_node():
    """Issue #22 item 2: info() lists the host's NUMA nodes and each device's nearest node."""
    data = um.info()
    assert data["numa_nodes"] == (_location.numa_nodes() or [])
    for d in data["devices"]:
        assert d["host_numa_id"] == -1 or d["host_numa_id"] in data["numa_nodes"]


# ---------------------------------------------------------------------------
# Item 5, GPU: prefetch on allocation.


@pytest.mark.gpu
@pytest.mark.parametrize("target", [0, "cpu"], ids=["device", "host"])
def test_constructors_prefetch_on_the_allocation_stream(rng, target):
    """Issue #22 item 5: empty/zeros/from_array(prefetch=) queue the prefetch on their stream; read back."""
    loc = um.as_location(target)
    stream = cuda.stream()
    handle = int(stream.handle)
    data = random_array(rng, 2 * PAGE, np.float32)
    bufs = [
        um.ManagedBuffer.empty(2 * PAGE, prefetch=target, stream=stream),
        um.ManagedBuffer.zeros(2 * PAGE, prefetch=target, stream=stream),
        um.ManagedBuffer.from_array(data, prefetch=target, stream=stream),
    ]
    try:
        for buf in bufs:
            assert handle in buf._coherence_tracker.pending  # queued on the allocation stream
        for buf in bufs:
            buf.synchronize()
            assert buf.hints.last_prefetch_location == loc
        np.testing.assert_array_equal(bufs[1].host, np.zeros(2 * PAGE, np.float32))
        np.testing.assert_array_equal(bufs[2].host, data)
        _check_kernel_values(bufs[0], rng, stream)
    finally:
        for buf in bufs:
            buf.close()
    empty = um.ManagedBuffer.empty(0, prefetch=target)  # nothing to prefetch, still checked
    assert empty.size == 0


@pytest.mark.gpu
def test_pool_buffer_prefetch_on_allocation(rng):
    """Issue #22 item 5: a pool buffer's prefetch follows its allocation on the same stream."""
    try:
        pool = um.MemoryPool("managed")
    except UnsupportedError as exc:
        pytest.skip(f"no managed pools here: {exc}")
    stream = cuda.stream()
    with pool:
        buf = um.ManagedBuffer.empty(2 * PAGE, pool=pool, stream=stream, prefetch=0)
        with buf:
            assert int(stream.handle) in buf._coherence_tracker.pending
            buf.synchronize()
            assert buf.hints.last_prefetch_location == DEV0
            _check_kernel_values(buf, rng, stream)


@pytest.mark.gpu
def test_host_numa_prefetch_on_allocation(rng):
    """Issue #22 items 2 and 5: a constructor can prefetch to a host NUMA node, read back as that node."""
    node = _numa_node()
    data = random_array(rng, PAGE, np.float32)
    with um.ManagedBuffer.from_array(data, prefetch=Host(numa=node), stream=cuda.stream()) as buf:
        buf.synchronize()
        assert buf.hints.last_prefetch_location == Host(numa=node)
        np.testing.assert_array_equal(buf.host, data)


# ---------------------------------------------------------------------------
# Item 6, CPU: Fortran order in the layout and copy layers.


class _FakeDeviceArray:
    def __init__(self, shape, strides=None, ptr=1 << 40):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": "<f4",
            "data": (ptr, False),
            "strides": strides,
            "version": 3,
        }


def test_f_order_layout_helpers_match_numpy():
    """Issue #22 item 6: F strides, dense orders and order= checks agree with numpy."""
    from umem_numba._arrays import _buffer, _layout

    for shape in ((3, 4, 5), (7,), (0, 3), (2, 1, 3), ()):
        ref = np.empty(shape, np.float64, order="F")
        assert _layout.f_strides(shape, 8) == ref.strides or 0 in shape
        flags = ("C" if ref.flags.c_contiguous else "") + ("F" if ref.flags.f_contiguous else "")
        assert _layout.dense_order(shape, _layout.f_strides(shape, 8), 8) == flags or 0 in shape
    assert _layout.dense_order((3, 4), (4, 12), 4) == "F"
    assert _layout.dense_order((3, 4), (16, 4), 4) == "C"
    assert _layout.dense_order((3, 4), (32, 4), 4) == ""
    assert _layout.check_order("f", "x") == "F"
    with pytest.raises(ValueError, match="order must be one of 'C', 'F', got 'K'"):
        _layout.check_order("K", "ManagedBuffer.empty")
    with pytest.raises(ValueError, match="order must be one of"):
        _layout.check_order(None, "x")
    assert _buffer.new_layout((3, 4), np.float32, "F")[3] == (4, 12)
    f_src, c_src = np.zeros((3, 4), order="F"), np.zeros((3, 4))
    assert _buffer.source_order(f_src, "K", "x") == "F"
    assert _buffer.source_order(c_src, "K", "x") == "C"
    assert _buffer.source_order(np.zeros(5), "K", "x") == "C"  # both: C
    assert _buffer.source_order(f_src, "C", "x") == "C"
    assert _buffer.source_order(c_src[:, ::2], "K", "x") == "C"  # strided: C
    assert _layout.as_axis(-1, 3, "transpose") == 2
    with pytest.raises(ValueError, match="axis 3 is out of bounds"):
        _layout.as_axis(3, 3, "transpose")


def test_copy_refuses_mixed_orders_before_the_driver():
    """Issue #22 item 6: a C-ordered and an F-ordered operand cannot be copied by DMA (bytes would scramble)."""
    c = _FakeDeviceArray((4, 5))
    f = _FakeDeviceArray((4, 5), strides=(4, 16), ptr=1 << 41)
    with pytest.raises(ValueError, match=r"source is F-ordered \(column-major\) and the destination C-ordered"):
        um.copy(c, f)
    with pytest.raises(ValueError, match="C-contiguous or F-contiguous"):
        um.copy(c, _FakeDeviceArray((4, 5), strides=(40, 8), ptr=1 << 41))
    # 1-d (and trivial-dimension) arrays are both C- and F-ordered: no conflict to report.
    from umem_numba._arrays import _copy

    one = _copy._from_cai(_FakeDeviceArray((5,)), "copy", "source")
    col = _copy._from_cai(_FakeDeviceArray((5, 1), strides=(4, 4), ptr=1 << 41), "copy", "source")
    assert one.order == "CF" and col.order == "CF"
    assert _copy._from_cai(f, "copy", "source").order == "F"


def test_advice_ranges_accept_f_contiguous_arrays():
    """Issue #22 item 6: advice and prefetch ranges take F-contiguous arrays (ranges in memory order)."""
    from umem_numba._hints._managed_span import element_count

    fake = _FakeManaged(1)
    fake.__cuda_array_interface__.update(shape=(4, 5), strides=(4, 16))
    assert element_count(fake, "x") == 20
    assert um.ManagedMemoryHints(fake, 5, 10).stop == 10
    fake.__cuda_array_interface__.update(strides=(8, 32))
    with pytest.raises(ValueError, match="C-contiguous"):
        element_count(fake, "x")


# ---------------------------------------------------------------------------
# Item 6, GPU (and numba's simulator): F-ordered buffers in kernels and copies.


@um.jit
def _mark2d(a):
    i, j = cuda.grid(2)
    if i < a.shape[0] and j < a.shape[1]:
        a[i, j] = a[i, j] * 2 + i * 10 + j


def _launch2d(kernel, buf, stream=0):
    kernel[((buf.shape[0] + 7) // 8, (buf.shape[1] + 7) // 8), (8, 8), stream](buf)


def _marked(data: np.ndarray) -> np.ndarray:
    i = np.arange(data.shape[0], dtype=data.dtype)[:, None]
    j = np.arange(data.shape[1], dtype=data.dtype)[None, :]
    return data * 2 + i * 10 + j


def _f_makers():
    return {
        "managed": um.ManagedBuffer.from_array,
        "pinned-devicemap": lambda a, **kw: um.PinnedBuffer.from_array(a, um.HostAllocFlags.DEVICEMAP, **kw),
        "device": um.DeviceBuffer.from_array,
    }


@pytest.mark.gpu
@pytest.mark.sim
@pytest.mark.parametrize("kind", ["managed", "pinned-devicemap", "device"])
def test_f_ordered_buffer_kernels_and_host_agree(rng, kind):
    """Issue #22 item 6: from_array keeps an F source's order; kernels index it as numpy does."""
    data = np.asfortranarray(random_array(rng, (37, 21), np.float32))
    with _f_makers()[kind](data) as buf:
        assert buf.is_f_contiguous and not buf.is_c_contiguous and buf.strides == data.strides
        _launch2d(_mark2d, buf)
        out = buf.copy_to_host()
        assert out.flags.f_contiguous
        np.testing.assert_allclose(out, _marked(data), rtol=1e-6)  # the kernel may fuse (FMA)
        c_out = np.empty(buf.shape, np.float32)  # the other order: rearranged on the host
        assert buf.copy_to_host(c_out) is c_out
        np.testing.assert_allclose(c_out, _marked(data), rtol=1e-6)  # the kernel may fuse (FMA)
    forced = _f_makers()[kind](data, order="C")
    with forced:
        assert forced.is_c_contiguous and not forced.is_f_contiguous
        np.testing.assert_array_equal(forced.copy_to_host(), data)


@pytest.mark.gpu
@pytest.mark.sim
def test_f_order_constructors_and_transposed_views(rng):
    """Issue #22 item 6: order="F" on empty/zeros; .T and transpose() are views kernels write through."""
    shape = (19, 13)
    made = [
        um.ManagedBuffer.empty(shape, order="F"),
        um.ManagedBuffer.zeros(shape, order="F"),
        um.managed_zeros(shape, order="F"),
        um.PinnedBuffer.zeros(shape, order="F"),
        um.DeviceBuffer.zeros(shape, order="F"),
    ]
    for buf in made:
        assert buf.strides == np.empty(shape, np.float64, order="F").strides  # float64: the default dtype
        buf.close()
    with pytest.raises(ValueError, match="order must be"):
        um.ManagedBuffer.empty(shape, order="X")
    data = random_array(rng, shape, np.float32)
    with um.ManagedBuffer.from_array(data) as buf:
        t = buf.T
        assert t.shape == (13, 19) and t.is_f_contiguous and t.is_view
        assert buf.transpose(1, 0).strides == t.strides == buf.transpose((1, 0)).strides
        assert t.T.strides == buf.strides
        _launch2d(_mark2d, t)
        np.testing.assert_allclose(buf.host, _marked(data.T).T, rtol=1e-6)  # the kernel may fuse (FMA)
        like = um.managed_like(t)
        with like:
            assert like.is_f_contiguous
    cube = um.ManagedBuffer.zeros((2, 3, 4))
    with cube:
        assert cube.transpose(2, 0, 1).shape == (4, 2, 3)
        with pytest.raises(ValueError, match="not a permutation"):
            cube.transpose(0, 0, 1)


@pytest.mark.gpu
def test_f_ordered_copies_between_buffers(rng):
    """Issue #22 item 6: um.copy between F-ordered buffers, numpy sources in either order, mixed orders refused."""
    data = np.asfortranarray(random_array(rng, (64, 48), np.float32))
    stream = cuda.stream()
    src = um.ManagedBuffer.from_array(data)
    dev = um.DeviceBuffer.empty(data.shape, np.float32, order="F")
    back = um.PinnedBuffer.empty(data.shape, np.float32, order="F")
    c_dev = um.DeviceBuffer.empty(data.shape, np.float32)
    with src, dev, back, c_dev:
        um.copy(dev, src, stream)
        um.copy(back, dev, stream)
        np.testing.assert_array_equal(back.host, data)
        with pytest.raises(ValueError, match="same order"):
            um.copy(c_dev, src, stream)
        fresh = random_array(rng, data.shape, np.float32)  # C-ordered numpy into an F buffer
        dev.copy_from_host(fresh, stream)
        np.testing.assert_array_equal(dev.copy_to_host(stream=stream), fresh)
        c_dev.copy_from_host(np.asfortranarray(fresh), stream)  # F-ordered numpy into a C buffer
        np.testing.assert_array_equal(c_dev.copy_to_host(stream=stream), fresh)
        # A C buffer's .T is F-ordered: it copies to and from F buffers of the transposed shape directly.
        t_dst = um.ManagedBuffer.empty(data.shape[::-1], np.float32, order="F")
        with t_dst:
            um.copy(t_dst, c_dev.T, stream)
            np.testing.assert_array_equal(t_dst.host, fresh.T)


@pytest.mark.gpu
def test_f_ordered_advice_ranges_are_in_memory_order(rng):
    """Issue #22 item 6: an F buffer's element range [k*rows, (k+1)*rows) is column k; hints read back."""
    rows, cols = PAGE, 4  # one column = one 64 KiB run of pages
    data = np.asfortranarray(random_array(rng, (rows, cols), np.float32))
    stream = cuda.stream()
    with um.ManagedBuffer.from_array(data) as buf:
        buf.prefetch(0, stream)
        buf.prefetch_range(rows, 2 * rows, "cpu", stream)  # column 1
        buf.hints.range(3 * rows, 4 * rows).set_preferred_location("cpu")  # column 3
        buf.synchronize()
        assert buf.hints.range(rows, 2 * rows).last_prefetch_location == HOST
        assert buf.hints.range(0, rows).last_prefetch_location == DEV0
        assert buf.hints.range(2 * rows, 3 * rows).last_prefetch_location == DEV0
        assert buf.hints.range(3 * rows, 4 * rows).preferred_location == HOST
        assert buf.hints.range(0, 3 * rows).preferred_location is None
        # The range's bytes are the column's: a host write to column 1 lands in elements [rows, 2*rows).
        col = random_array(rng, rows, np.float32)
        buf.host[:, 1] = col
        np.testing.assert_array_equal(buf.host.ravel(order="F")[rows : 2 * rows], col)
        t = buf.T  # C-ordered rows of the transposed view are the same bytes
        assert t.is_c_contiguous
        t.prefetch_range(2 * rows, 3 * rows, "cpu", stream)
        buf.synchronize()
        assert buf.hints.range(2 * rows, 3 * rows).last_prefetch_location == HOST
        _launch2d(_mark2d, buf, stream)
        expect = data.copy()
        expect[:, 1] = col
        np.testing.assert_allclose(buf.host, _marked(expect), rtol=1e-6)  # the kernel may fuse (FMA)


@pytest.mark.gpu
def test_f_ordered_exports_dlpack_and_cai(rng):
    """Issue #22 item 6: DLPack and the CUDA Array Interface describe the F layout."""
    su = pytest.importorskip("cuda.core.utils")
    data = np.asfortranarray(random_array(rng, (9, 7), np.float32))
    with um.ManagedBuffer.from_array(data) as buf:
        iface = buf.__cuda_array_interface__
        assert iface["strides"] == data.strides and iface["shape"] == data.shape
        view = su.StridedMemoryView.from_dlpack(buf, stream_ptr=-1)
        assert view.ptr == buf.ptr and view.shape == data.shape and view.strides == (1, 9)
        arr = cuda.as_cuda_array(buf)
        assert arr.is_f_contiguous() and not arr.is_c_contiguous()
        np.testing.assert_array_equal(arr.copy_to_host(), data)
    with um.PinnedBuffer.from_array(data) as host_buf:  # a CPU DLPack export
        got = np.from_dlpack(host_buf)
        assert got.flags.f_contiguous
        np.testing.assert_array_equal(got, data)


@pytest.mark.gpu
def test_f_ordered_vmm_buffer_and_its_growth_rule(rng):
    """Issue #22 item 6: VMMBuffer(order="F") works in kernels; growing a 2-d F buffer is refused clearly."""
    data = np.asfortranarray(random_array(rng, (16, 8), np.float32))
    with um.VMMBuffer.from_array(data) as buf:
        assert buf.is_f_contiguous
        _launch2d(_mark2d, buf)
        np.testing.assert_allclose(buf.copy_to_host(), _marked(data), rtol=1e-6)  # the kernel may fuse (FMA)
        with pytest.raises(ValueError, match="F-ordered"):
            buf.grow(32)
        assert buf.shape == (16, 8)
    with um.VMMBuffer.empty(10, order="F") as flat:  # 1-d: C and F at once, grows as usual
        flat.grow(20)
        assert flat.shape == (20,)


# ---------------------------------------------------------------------------
# Item 7, CPU: cuda.core objects as copy operands and from_array sources.


def _fake_cuda_core(name: str, **attrs):
    """An object that looks like a cuda.core one (recognised by its module, read by its attributes)."""
    cls = type(name, (), {"__module__": "cuda.core._memory._fake"})
    obj = cls()
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj


def _fake_view(shape, strides=None, *, device=True, readonly=False, ptr=1 << 42):
    return _fake_cuda_core(
        "StridedMemoryView",
        ptr=ptr,
        shape=shape,
        strides=strides,
        dtype=np.dtype(np.float32),
        is_device_accessible=device,
        readonly=readonly,
        device_id=0 if device else -1,
    )


def _fake_cc_buffer(size, *, closed=False, ptr=1 << 43):
    return _fake_cuda_core("Buffer", handle=ptr, size=size, is_closed=closed, device_id=0)


def test_cuda_core_operands_are_checked_before_the_driver():
    """Issue #22 item 7: cuda.core views and Buffers are copy operands; misuse is a clear error first."""
    from umem_numba._arrays import _copy

    dst = _FakeDeviceArray((4, 5))
    side = _copy.cuda_core_side(_fake_view((4, 5), (1, 4)), "copy", "source")
    assert side.order == "F"
    assert side.shape == (4, 5) and side.dtype == np.float32 and side.device_id == 0
    raw = _copy.cuda_core_side(_fake_cc_buffer(80), "copy", "source")
    assert raw.raw and raw.nbytes == 80 and raw.shape == (80,)
    with pytest.raises(ValueError, match="copied as bytes: 64 vs 80 bytes"):
        um.copy(dst, _fake_cc_buffer(64))
    with pytest.raises(ValueError, match="closed"):
        um.copy(dst, _fake_cc_buffer(80, closed=True))
    with pytest.raises(TypeError, match="of host memory"):
        um.copy(dst, _fake_view((4, 5), device=False))
    with pytest.raises(ValueError, match="read-only"):
        um.copy(_fake_view((4, 5), readonly=True), dst)
    with pytest.raises(ValueError, match="same order"):
        um.copy(dst, _fake_view((4, 5), (1, 4)))
    with pytest.raises(TypeError, match=r"cuda\.core Stream"):
        um.copy(dst, _fake_cuda_core("Stream"))


def test_from_array_of_a_cuda_core_source_keeps_its_order_or_refuses():
    """Issue #22 item 7: from_array of a cuda.core view copies it in its own order; another order is refused."""
    from umem_numba._arrays import _buffer

    f_view = _fake_view((4, 5), (1, 4))
    side, order = _buffer.cuda_core_source(f_view, "K", "ManagedBuffer.from_array")
    assert side is not None and order == "F"
    assert _buffer.cuda_core_source(_fake_cc_buffer(80), "C", "x")[1] == "C"
    with pytest.raises(ValueError, match="DMA copy keeps the order"):
        um.ManagedBuffer.from_array(f_view, order="C")
    with pytest.raises(ValueError, match="strided"):
        um.ManagedBuffer.from_array(_fake_view((4, 5), (10, 2)))
    assert _buffer.cuda_core_source(np.zeros(3), "K", "x") == (None, "")


def test_from_array_reads_a_host_cuda_core_view_through_dlpack():
    """Issue #22 item 7: a cuda.core view of host memory is read by numpy (no GPU needed to check)."""
    su = pytest.importorskip("cuda.core.utils")
    from umem_numba._arrays import _buffer

    data = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    view = su.StridedMemoryView.from_dlpack(data, stream_ptr=-1)
    assert _buffer.cuda_core_source(view, "K", "x") == (None, "")
    got = _buffer.host_source(view)
    np.testing.assert_array_equal(got, data)
    assert _buffer.source_order(got, "K", "x") == "F"


# ---------------------------------------------------------------------------
# Item 7, GPU: real cuda.core objects.


@pytest.mark.gpu
def test_cuda_core_views_and_buffers_copy_and_construct(rng):
    """Issue #22 item 7: um.copy and from_array take cuda.core StridedMemoryView / Buffer; values checked."""
    core = pytest.importorskip("cuda.core")
    su = pytest.importorskip("cuda.core.utils")
    data = np.asfortranarray(random_array(rng, (33, 17), np.float32))
    stream = cuda.stream()
    with um.ManagedBuffer.from_array(data) as src:
        view = su.StridedMemoryView.from_dlpack(src, stream_ptr=-1)
        for make in (um.ManagedBuffer.from_array, um.DeviceBuffer.from_array, um.VMMBuffer.from_array):
            with make(view) as copied:
                assert copied.is_f_contiguous and copied.shape == data.shape
                np.testing.assert_array_equal(copied.copy_to_host(), data)
        dst = um.DeviceBuffer.empty(data.shape, np.float32, order="F")
        with dst:
            um.copy(dst, view, stream)
            np.testing.assert_array_equal(dst.copy_to_host(stream=stream), data)
            raw = core.Buffer.from_handle(src.ptr, src.nbytes, owner=src)  # bytes, not an array
            as_bytes = um.PinnedBuffer.from_array(raw)
            with as_bytes:
                assert as_bytes.dtype == np.uint8 and as_bytes.shape == (data.nbytes,)
                np.testing.assert_array_equal(as_bytes.host, data.ravel(order="F").view(np.uint8))
            fresh = np.asfortranarray(random_array(rng, data.shape, np.float32))
            dst.copy_from_host(fresh, stream)
            um.copy(raw, dst, stream)  # a Buffer as the destination: byte for byte
            # The Buffer aliases src behind umem_numba's back: src's record knows nothing of this copy.
            stream.synchronize()
            np.testing.assert_array_equal(src.host, fresh)


@pytest.mark.gpu
def test_cuda_core_pool_memory_round_trip(rng):
    """Issue #22 item 7: memory from a cuda.core memory resource is a copy source and destination."""
    core = pytest.importorskip("cuda.core")
    dev = core.Device(0)
    dev.set_current()
    cstream = dev.create_stream()
    data = random_array(rng, 4096, np.float32)
    mr = core.DeviceMemoryResource(0)
    block = mr.allocate(data.nbytes, stream=cstream)
    try:
        with um.ManagedBuffer.from_array(data) as src, um.ManagedBuffer.empty(data.shape, np.float32) as back:
            um.copy(block, src, cstream)
            um.copy(back, block, cstream)
            np.testing.assert_array_equal(back.host, data)
            with um.DeviceBuffer.from_array(block, stream=cstream) as as_bytes:
                assert as_bytes.shape == (data.nbytes,)
                np.testing.assert_array_equal(as_bytes.copy_to_host(stream=cstream).view(np.float32), data)
    finally:
        block.close(cstream)
        cstream.sync()


@pytest.mark.gpu
def test_simulator_discards_garble_and_refuses_what_it_lacks_by_name(rng):
    """Issue #22 items 1, 2, 5: under the simulator a discard leaves garbage (a test that relied on
    discarded values fails there), host NUMA targets read back, and what it does not simulate
    (the calling thread's NUMA node) is refused by name."""
    from umem_numba._driver import _sim

    if not _sim.active():
        pytest.skip("checks the simulator's answers (the GPU's are tested above)")
    data = random_array(rng, 64, np.float32)
    stream = cuda.stream()
    with um.ManagedBuffer.from_array(data, prefetch="cpu:0") as buf:
        buf.synchronize()
        assert buf.hints.last_prefetch_location == Host(numa=0)
        np.testing.assert_array_equal(buf.host, data)
        buf.discard(stream)
        assert not np.array_equal(buf.host, data), "discarded values survived: they must be garbage"
        buf.host[:] = data
        buf.discard_prefetch(0, stream)
        buf.synchronize()
        assert buf.hints.last_prefetch_location == DEV0
        assert not np.array_equal(buf.host, data)
        buf.host[:] = data
        PrefetchPlan().add(buf, "cpu:0").execute(stream)  # a prefetch keeps the values
        np.testing.assert_array_equal(buf.host, data)
        drv = _driver.api().drv
        current = drv.CUmemLocation()
        current.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT
        with pytest.raises(UnsupportedError, match=r"HOST_NUMA_CURRENT.*simulator"):
            drv.cuMemPrefetchAsync(buf.ptr, buf.nbytes, current, 0, int(stream.handle))
