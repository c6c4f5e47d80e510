"""The allocation cache of buffers made without ``pool=`` (#28 item 1): reuse without a hole.

A closed ``ManagedBuffer``'s allocation is reused by the next buffer of its size class.  The
close waits for the buffer's device work whatever the coherence policy, so a kernel still
sleeping on another stream when the buffer closes can never write into the next buffer;
memory that took advice or a stream attachment goes back to the driver instead.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from numba import cuda
from support.helpers import ORDERING_TRIALS, random_array, sleeping, while_threads_run

import umem_numba as um
from umem_numba import _driver
from umem_numba._driver import _sim
from umem_numba._errors import OutOfMemoryError
from umem_numba._memory import _cache

N = 1 << 16
TRIALS = 3 if _sim.active() else ORDERING_TRIALS
#: Device time of the sleeping writer on a GPU; over the simulated driver the work runs late anyway.
SLEEP_MS = 1 if _sim.active() else 20


#: Every test here runs with the allocation cache on (tests/memory/conftest.py).
pytestmark = pytest.mark.usefixtures("cache_on")


def _address(buf: um.ManagedBuffer) -> int:
    """The allocation's address (``buf.ptr`` would mark the buffer as shared: then it is never cached)."""
    return buf._alloc.ptr


def _cached() -> int:
    return um.info()["allocation_cache"]["cached_bytes"] if not _sim.active() else _cache.cached_bytes()


@pytest.mark.gpu
def test_a_closed_buffer_allocation_is_reused_by_the_next_of_its_size(rng):
    data = random_array(rng, N, np.float64)
    a = um.ManagedBuffer.from_array(data)
    ptr = _address(a)
    a.close()
    assert _cached() == _cache.rounded(N * 8)
    b = um.ManagedBuffer.empty(N - 3, np.float64)  # the same size class (512-byte steps)
    assert _address(b) == ptr, "the cached allocation was not reused"
    assert _cached() == 0
    fresh = random_array(rng, N - 3, np.float64)
    b.host[:] = fresh
    sleeping.fill[(N + 127) // 128, 128, cuda.stream()](b, 3.5, 0)
    np.testing.assert_array_equal(b.host, np.full(N - 3, 3.5))
    b.close()
    c = um.ManagedBuffer.empty(2 * N, np.float64)  # another size class: a new allocation
    assert _address(c) != ptr
    c.close()


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["sync", "warn", "off"])
def test_a_kernel_sleeping_at_close_never_writes_the_next_buffer(rng, policy):
    """A writer sleeps on s1; the buffer closes; the next buffer (same memory) is written on the host."""
    s1 = cuda.stream()
    with um.coherence_policy(policy):
        for trial in range(TRIALS):
            a = um.ManagedBuffer.zeros(N, np.float64)
            ptr = _address(a)
            um.coherent(sleeping.fill)[N // 128, 128, s1](a, -1.0, SLEEP_MS)
            if policy == "warn":
                with pytest.warns(um.CoherenceWarning):
                    a.close()
            else:
                a.close()
            b = um.ManagedBuffer.empty(N, np.float64)
            assert _address(b) == ptr, f"trial {trial}: not reused"
            fresh = random_array(rng, N, np.float64)
            b.host[:] = fresh
            cuda.synchronize()  # had the sleeping writer outlived the close, it would have run by now
            np.testing.assert_array_equal(b.host, fresh, err_msg=f"trial {trial}: the old kernel wrote the new buffer")
            b.close()


@pytest.mark.gpu
def test_a_plain_kernel_on_another_stream_after_reuse_sees_the_new_values(rng):
    """Reused memory, then a plain numba launch on another stream reads it: the new buffer's values."""
    s1, s2 = cuda.stream(), cuda.stream()
    for trial in range(TRIALS):
        a = um.ManagedBuffer.zeros(N, np.float64)
        sleeping.fill[N // 128, 128, s1](a, -2.0, SLEEP_MS)  # a plain launch: tracked per stream
        a.close()
        b = um.ManagedBuffer.from_array(random_array(rng, N, np.float64))
        expected = np.array(b.host)
        out = um.ManagedBuffer.empty(N, np.float64)
        sleeping.copy[N // 128, 128, s2](b, out, 0)
        np.testing.assert_array_equal(out.host, expected, err_msg=f"trial {trial}")
        b.close()
        out.close()


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["advice", "attach", "ptr"])
def test_memory_with_driver_state_goes_back_to_the_driver(rng, how):
    """Advice or a stream attachment is the memory's, and a shared address may be used later:
    such an allocation is never handed on."""
    a = um.ManagedBuffer.from_array(random_array(rng, N, np.float64))
    if how == "advice":
        a.hints.set_read_mostly()
    elif how == "attach":
        a.attach("global")
    else:
        assert a.ptr  # the address leaves the toolkit's sight
    a.close()
    del a  # a shared buffer's memory is released when its object goes
    assert _cached() == 0
    b = um.ManagedBuffer.empty(N, np.float64)
    assert not b.hints.read_mostly  # read back from the driver
    b.close()


@pytest.mark.gpu
def test_the_switch_and_release(rng, device_memory):
    a = um.ManagedBuffer.from_array(random_array(rng, N, np.float64))
    a.close()
    assert _cached() > 0
    um.release_allocation_cache()
    assert _cached() == 0
    um.set_allocation_cache(False)
    assert um.get_allocation_cache() is False
    b = um.ManagedBuffer.from_array(random_array(rng, N, np.float64))
    b.close()
    assert _cached() == 0, "cached with the cache off"
    um.set_allocation_cache(True)
    c = um.ManagedBuffer.empty(N, np.float64, attach="host")  # attached to the host: not cached either
    c.close()
    assert _cached() == 0
    with pytest.raises(TypeError, match="enabled must be a bool, got int"):
        um.set_allocation_cache(1)
    device_memory()


@pytest.mark.gpu
def test_set_allocation_cache_off_gives_the_cache_back(rng):
    um.ManagedBuffer.from_array(random_array(rng, N, np.float64)).close()
    assert _cached() > 0
    um.set_allocation_cache(False)
    assert _cached() == 0


def test_out_of_memory_releases_the_cache_and_tries_again(monkeypatch):
    """The driver refusing for lack of memory: the cache is given back, then the allocation is retried."""
    released = []
    monkeypatch.setattr(_cache, "cached_bytes", lambda: 1 << 20)
    monkeypatch.setattr(_cache, "release_allocation_cache", lambda: released.append(True))
    calls = []

    def alloc(size: int) -> int:
        calls.append(size)
        if len(calls) == 1:
            raise OutOfMemoryError("cuMemAllocManaged", 2, "CUDA_ERROR_OUT_OF_MEMORY")
        return 0x1000

    memory = _cache.allocate("managed", 0, 1000, alloc, "cuMemFree")
    assert released == [True] and calls == [1024, 1024] and memory.ptr == 0x1000 and memory.size == 1024


def test_out_of_memory_with_nothing_cached_is_raised(monkeypatch):
    monkeypatch.setattr(_cache, "cached_bytes", lambda: 0)

    def alloc(size: int) -> int:
        raise OutOfMemoryError("cuMemAllocManaged", 2, "CUDA_ERROR_OUT_OF_MEMORY")

    with pytest.raises(OutOfMemoryError):
        _cache.allocate("managed", 0, 1000, alloc, "cuMemFree")


@pytest.mark.gpu
def test_the_cache_keeps_at_most_its_limit(rng, monkeypatch):
    monkeypatch.setattr(_cache, "cache_limit", lambda device_id, kind="managed": 3 * 4096)
    _cache._lists.clear()  # made again with the patched limit
    try:
        bufs = [um.ManagedBuffer.empty(512, np.float64) for _ in range(4)]  # 4096 bytes each
        for b in bufs:
            b.close()
        assert _cached() == 3 * 4096, "more than the limit kept"
    finally:
        um.release_allocation_cache()
        _cache._lists.clear()
    assert _driver.device_count() >= 1


@pytest.mark.gpu
def test_threads_opening_and_closing_while_the_cache_drains_never_share_memory(rng):
    """Four threads open, fill (a kernel on their own stream), read and close default buffers of two
    size classes, while a fifth gives the cache back over and over: taking is lock-free (one ``pop``
    per entry), so an entry that went to two takers, or to a taker and the drain, shows as a wrong
    value (another thread's fill) or a fault; the byte count stays exact."""
    rounds = 6 if _sim.active() else 40
    failures: list[str] = []

    def worker(k: int) -> None:
        s = cuda.stream()
        try:
            for r in range(rounds):
                n = N if r % 2 else N // 2
                a = um.ManagedBuffer.empty(n, np.float64)
                b = um.ManagedBuffer.empty(n, np.float64)
                value = float(k * 1000 + r)
                um.coherent(sleeping.fill)[(n + 127) // 128, 128, s](a, value, 0)
                um.coherent(sleeping.fill)[(n + 127) // 128, 128, s](b, -value, 0)
                if not (np.all(a.host == value) and np.all(b.host == -value)):
                    failures.append(f"thread {k} round {r}: another buffer's values")
                a.close()
                b.close()
        except Exception as exc:  # reported below, with the thread that saw it
            failures.append(f"thread {k}: {type(exc).__name__}: {exc}")

    while_threads_run([functools.partial(worker, k) for k in range(4)], um.release_allocation_cache)
    assert not failures, failures[:5]
    listed = sum(m.size for lists in _cache._lists.values() for blocks in lists.blocks.values() for m in blocks)
    assert _cache.cached_bytes() == listed, "the cache's byte count drifted from what it lists"
    um.release_allocation_cache()
    assert _cache.cached_bytes() == 0
