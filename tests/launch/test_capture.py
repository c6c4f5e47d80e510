"""CUDA graphs of toolkit work with coherence (#29 item 1): ``umem_numba.capture`` and ``Graph.launch``.

A captured graph is replayed as one launch with the graph's read and write sets: ordered after
conflicting work on other streams, recorded for every buffer it uses, so host access waits for
exactly the replays.  Buffers a live graph uses are kept alive, cannot be freed under it (closing
waits, a later launch is refused) or shrunk; work a graph cannot hold is refused inside the capture
and the capture stays intact.
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

pytestmark = pytest.mark.gpu

N = 4096
G, B = N // 128, 128
TRIALS = 3 if _sim.active() else 20
SLEEPS = 0 if _sim.active() else 20  # ~1 ms each on a GPU


@um.jit
def _halve_plus(dst, src):
    i = cuda.grid(1)
    if i < dst.shape[0]:
        dst[i] = src[i] * 0.5 + 1.0


#: ``_slow_copy[grid, block, stream](src, out, ms)``: sleep, then ``out[i] = src[i]``, tracked.
_slow_copy = um.coherent(sleeping.copy)


@cuda.jit
def _plain_scale(a, k):
    i = cuda.grid(1)
    if i < a.shape[0]:
        a[i] = a[i] * k


def _steps_reference(a: np.ndarray, steps: int) -> np.ndarray:
    a = a.copy()
    for _ in range(steps):
        a = a * 0.5 + 1.0
    return a


def _capture_ping_pong(s, a, b, pairs: int) -> um.Graph:
    with um.capture(s) as graph:
        for _ in range(pairs):
            _halve_plus[G, B, s](b, a)
            _halve_plus[G, B, s](a, b)
    return graph


def test_a_graph_replayed_100_times_with_host_reads_between(rng):
    """Each launch of 2 x 3 captured steps; the host reads after every launch: numpy's values."""
    s = cuda.stream()
    values = random_array(rng, N, np.float64)
    with um.ManagedBuffer.from_array(values) as a, um.DeviceBuffer.zeros(N) as b:
        graph = _capture_ping_pong(s, a, b, 3)
        assert graph.buffers_written == 2
        np.testing.assert_array_equal(a.host, values, err_msg="the capture ran the work")
        expected = values
        for replay in range(100 if not _sim.active() else 10):
            if replay % 10 == 0:  # fresh random data now and then, written on the host
                expected = random_array(rng, N, np.float64)
                a.host[:] = expected
            graph.launch()
            expected = _steps_reference(expected, 6)
            np.testing.assert_allclose(a.host, expected, rtol=0, atol=0, err_msg=f"launch {replay}")
        graph.close()
        with pytest.raises(um.BufferClosedError, match="closed"):
            graph.launch()


def test_a_launch_waits_for_a_writer_on_another_stream(rng):
    """A slow tracked writer of ``a`` on s2, then a launch of a graph reading ``a`` on s (20 trials)."""
    s, s2 = cuda.stream(), cuda.stream()
    with um.ManagedBuffer.zeros(N) as a, um.ManagedBuffer.zeros(N) as out:
        with um.capture(s) as graph:
            _halve_plus[G, B, s](out, a)
        for trial in range(TRIALS):
            values = random_array(rng, N, np.float64)
            with um.DeviceBuffer.from_array(values) as src:
                _slow_copy[G, B, s2](src, a, SLEEPS)
                graph.launch()
                np.testing.assert_array_equal(out.host, values * 0.5 + 1.0, err_msg=f"trial {trial}")
        graph.close()


def test_a_writer_on_another_stream_waits_for_a_launch_that_reads(rng):
    """Write after read: a graph whose kernel reads ``a`` slowly, then a tracked write of ``a`` on s2."""
    s, s2 = cuda.stream(), cuda.stream()
    with um.ManagedBuffer.zeros(N) as a, um.ManagedBuffer.zeros(N) as seen:
        with um.capture(s) as graph:
            _slow_copy[G, B, s](a, seen, SLEEPS)
        for trial in range(TRIALS):
            old, new = random_array(rng, N, np.float64), random_array(rng, N, np.float64)
            a.host[:] = old
            with um.DeviceBuffer.from_array(new) as src:
                graph.launch()
                _slow_copy[G, B, s2](src, a, 0)  # must not overwrite a before the graph read it
                np.testing.assert_array_equal(seen.host, old, err_msg=f"trial {trial}: the writer overtook the graph")
                np.testing.assert_array_equal(a.host, new)
        graph.close()


def test_host_access_waits_for_the_launch_only(rng):
    """Host access after a launch waits for the launch's event, not for the whole device."""
    s = cuda.stream()
    values = random_array(rng, N, np.float64)
    with um.ManagedBuffer.from_array(values) as a, um.ManagedBuffer.zeros(N) as b:
        graph = _capture_ping_pong(s, a, b, 1)
        graph.launch()
        events, unknown, _, escaped = a._coherence_tracker.pending_work()
        assert len(events) == 1 and not unknown and not escaped
        assert events[0].key == _driver.stream_key(um.stream_handle(s))
        np.testing.assert_array_equal(a.host, _steps_reference(values, 2))
        graph.close()


@pytest.mark.parametrize("policy", ["sync", "raise"])
@pytest.mark.parametrize("kind", ["managed", "pool device"])
def test_closing_a_buffer_under_a_live_graph(kind, policy, rng):
    """Closing a buffer a launch of the graph still reads: a managed buffer waits for the launch (under
    "raise": refuses while it runs); a pool buffer queues its free after it.  Either way the values are
    right and the graph then refuses to launch rather than use freed memory."""
    s = cuda.stream()
    values = random_array(rng, N, np.float64)
    out = um.ManagedBuffer.zeros(N)
    src = um.ManagedBuffer.from_array(values) if kind == "managed" else um.DeviceBuffer.from_array(values)
    with um.capture(s) as graph:
        _slow_copy[G, B, s](src, out, SLEEPS)
    graph.launch()
    with um.coherence_policy(policy):
        if policy == "raise" and kind == "managed":
            with pytest.raises(um.CoherenceError):
                src.close()
            assert not src.closed
            out.synchronize()
        src.close()
    np.testing.assert_array_equal(out.host, values)
    with pytest.raises(um.BufferClosedError):
        graph.launch()
    graph.close()
    out.close()


def test_a_vmm_buffer_cannot_shrink_under_a_live_graph(rng):
    s = cuda.stream()
    values = random_array(rng, N, np.float64)
    with um.VMMBuffer.from_array(values) as v, um.ManagedBuffer.zeros(N) as out:
        with um.capture(s) as graph:
            _halve_plus[G, B, s](out, v)
        with pytest.raises(um.CoherenceError, match="close the graph first"):
            v.shrink(N // 2)
        graph.launch()
        np.testing.assert_array_equal(out.host, values * 0.5 + 1.0)
        graph.close()
        v.shrink(N // 2)
        assert v.shape == (N // 2,)


def test_the_graph_keeps_its_buffers_alive(rng):
    """Buffers made for the capture and dropped: the graph holds them; the output read after launches."""
    s = cuda.stream()
    values = random_array(rng, N, np.float64)
    out = um.ManagedBuffer.zeros(N)

    def build() -> um.Graph:
        a = um.ManagedBuffer.from_array(values)
        tmp = um.DeviceBuffer.zeros(N)
        with um.capture(s) as graph:
            _halve_plus[G, B, s](tmp, a)
            _halve_plus[G, B, s](out, tmp)
        return graph

    graph = build()
    gc.collect()
    for _ in range(3):
        graph.launch()
    np.testing.assert_array_equal(out.host, _steps_reference(values, 2))
    graph.close()
    out.close()


def test_refused_work_inside_the_capture_leaves_it_intact(rng):
    """Host access to a captured buffer, a copy from the host and an allocation on the stream are refused;
    the graph still works."""
    s = cuda.stream()
    values = random_array(rng, N, np.float64)
    with um.ManagedBuffer.from_array(values) as a, um.ManagedBuffer.zeros(N) as b, um.ManagedBuffer.zeros(N) as c:
        with um.capture(s) as graph:
            _halve_plus[G, B, s](b, a)
            with pytest.raises(um.CoherenceError, match="being captured"):
                b.host
            with pytest.raises(um.CoherenceError, match="capturing a CUDA graph"):
                c.copy_from_host(values, stream=s)
            with pytest.raises(um.CoherenceError, match="capturing a CUDA graph"):
                um.DeviceBuffer.empty(N, stream=s)
            _halve_plus[G, B, s](c, b)
        graph.launch()
        np.testing.assert_array_equal(c.host, _steps_reference(values, 2))
        graph.close()


def test_an_error_inside_the_block_ends_the_capture_without_a_graph(rng):
    s = cuda.stream()
    values = random_array(rng, N, np.float64)
    with um.ManagedBuffer.from_array(values) as a, um.ManagedBuffer.zeros(N) as b:
        with pytest.raises(RuntimeError, match="boom"), um.capture(s) as graph:
            _halve_plus[G, B, s](b, a)
            raise RuntimeError("boom")
        assert graph.closed
        with pytest.raises(um.BufferClosedError, match="capture did not finish"):
            graph.launch()
        assert not _driver.is_capturing(um.stream_handle(s))
        _halve_plus[G, B, s](b, a)  # the stream and the buffers work as before
        np.testing.assert_array_equal(b.host, values * 0.5 + 1.0)


def test_closing_a_buffer_inside_the_capture_is_refused(rng):
    """Its captured work has not run and the graph will use it: close is refused, the capture goes on."""
    s = cuda.stream()
    values = random_array(rng, N, np.float64)
    a = um.ManagedBuffer.from_array(values)
    with um.ManagedBuffer.zeros(N) as b:
        with um.capture(s) as graph:
            _halve_plus[G, B, s](b, a)
            with pytest.raises(um.CoherenceError, match="being captured"):
                a.close()
        assert not a.closed
        graph.launch()
        np.testing.assert_array_equal(b.host, values * 0.5 + 1.0)
        graph.close()
    a.close()


def test_bad_captures_are_refused_before_the_driver():
    s = cuda.stream()
    with pytest.raises(ValueError, match="legacy default stream"), um.capture(0):
        pass
    with um.capture(s) as outer:
        with pytest.raises(um.CoherenceError, match="capturing a graph already"), um.capture(s):
            pass
        with pytest.raises(um.CoherenceError, match="already capturing"), um.capture(cuda.stream()):
            pass
    assert not outer.closed  # an empty graph: launching it does nothing
    outer.launch()
    outer.close()


def test_plain_numba_launches_join_the_graph(rng):
    """A plain ``@cuda.jit`` launch of a buffer inside the capture is recorded as a write of the graph."""
    s = cuda.stream()
    values = random_array(rng, N, np.float64)
    with um.ManagedBuffer.from_array(values) as a:
        with um.capture(s) as graph:
            _plain_scale[G, B, s](a, 2.0)
        assert graph.buffers_written == 1
        for _ in range(3):
            graph.launch()
        np.testing.assert_array_equal(a.host, values * 8.0)
        graph.close()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_heat2d_steps_from_a_graph_are_bitwise_the_launched_steps(dtype, rng):
    """The tuned heat step, 8 steps captured and launched 3 times, equals 24 launched steps bit for bit."""
    from umem_numba import kernels

    n = 96
    s = cuda.stream()
    start = random_array(rng, (n, n), dtype)
    with (
        um.ManagedBuffer.from_array(start) as a,
        um.ManagedBuffer.zeros((n, n), dtype) as b,
        um.ManagedBuffer.from_array(start) as c,
        um.ManagedBuffer.zeros((n, n), dtype) as d,
    ):
        with um.capture(s) as graph:
            for i in range(8):
                src, dst = (a, b) if i % 2 == 0 else (b, a)
                kernels.heat2d_step(src, dst, 0.25, stream=s)
        for _ in range(3):
            graph.launch()
        for i in range(24):
            src, dst = (c, d) if i % 2 == 0 else (d, c)
            kernels.heat2d_step(src, dst, 0.25, stream=s)
        np.testing.assert_array_equal(a.host, c.host)
        assert not np.array_equal(a.host, start)
        graph.close()


def test_a_graph_never_writes_pool_memory_handed_to_the_next_buffer(rng):
    """A pool buffer the graph writes is closed and its memory goes to the next buffer of that size: a
    launch of the graph is refused, and the next buffer keeps its values."""
    s = cuda.stream()
    pool = um.MemoryPool("device")
    try:
        src = um.DeviceBuffer.from_array(random_array(rng, N, np.float64), pool=pool, stream=s)
        a = um.DeviceBuffer.zeros(N, pool=pool, stream=s)
        with um.capture(s) as graph:
            _halve_plus[G, B, s](a, src)
        graph.launch()
        ptr = a._alloc.device_ptr  # not a.ptr: a raw address given out makes the memory escape
        a.close()
        fresh = random_array(rng, N, np.float64)
        b = um.DeviceBuffer.from_array(fresh, pool=pool, stream=s)
        assert b._alloc.device_ptr == ptr, "the pool did not hand the memory on: the case was not reached"
        with pytest.raises(um.BufferClosedError):
            graph.launch()
        np.testing.assert_array_equal(b.copy_to_host(), fresh)
        graph.close()
        for buf in (b, src):
            buf.close()
    finally:
        pool.close()


def test_the_use_counts_return_to_zero_after_threads_capture_and_graphs_go(rng):
    """Four threads capture graphs over the same buffers at once; half the graphs are closed, the rest
    collected: the buffers count no capture and no graph afterwards (a VMMBuffer could then shrink)."""
    import concurrent.futures

    values = random_array(rng, N, np.float64)
    with um.ManagedBuffer.from_array(values) as a, um.ManagedBuffer.zeros(N) as b:

        def job(_: int) -> list[um.Graph]:
            s = cuda.stream()
            made = []
            for _ in range(10):
                with um.capture(s) as graph:
                    _halve_plus[G, B, s](b, a)
                made.append(graph)
            return made

        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            graphs = [g for made in ex.map(job, range(4)) for g in made]
        tracker = a._coherence_tracker
        assert (tracker.graphs, tracker.capturing) == (40, 0)
        graphs[0].launch()
        np.testing.assert_array_equal(b.host, values * 0.5 + 1.0)
        for graph in graphs[::2]:
            graph.close()
        del graphs, graph
        gc.collect()
        assert (tracker.graphs, tracker.capturing) == (0, 0)
        assert (b._coherence_tracker.graphs, b._coherence_tracker.capturing) == (0, 0)


@pytest.mark.parametrize("kinds", [("managed", "device"), ("device", "vmm"), ("pinned", "managed")])
def test_copies_join_the_graph(kinds, rng):
    """``um.copy`` between buffers inside the capture is a node of the graph: a kernel, a copy, a kernel;
    each launch after the host wrote fresh data gives numpy's values, and a slow writer of the source on
    another stream is waited for (20 trials)."""
    make = {
        "managed": um.ManagedBuffer.from_array,
        "device": um.DeviceBuffer.from_array,
        "vmm": um.VMMBuffer.from_array,
        "pinned": um.PinnedBuffer.from_array,
    }
    s, s2 = cuda.stream(), cuda.stream()
    a = um.ManagedBuffer.zeros(N)
    mid = make[kinds[0]](np.zeros(N))
    copied = make[kinds[1]](np.zeros(N))
    out = um.ManagedBuffer.zeros(N)
    try:
        with um.capture(s) as graph:
            if kinds[0] == "pinned":
                um.copy(mid, a, stream=s)
            else:
                _halve_plus[G, B, s](mid, a)
            um.copy(copied, mid, stream=s)
            _halve_plus[G, B, s](out, copied)
        for trial in range(TRIALS):
            values = random_array(rng, N, np.float64)
            with um.DeviceBuffer.from_array(values) as src:
                _slow_copy[G, B, s2](src, a, SLEEPS)  # the graph reads a: it must wait for this
                graph.launch()
            first = values if kinds[0] == "pinned" else values * 0.5 + 1.0
            np.testing.assert_array_equal(out.host, first * 0.5 + 1.0, err_msg=f"trial {trial}")
        graph.close()
    finally:
        for buf in (a, mid, copied, out):
            buf.close()


def test_forked_streams_join_the_graph_and_must_join_back(rng):
    """numba launches on a stream forked into the capture (event record, wait) join the graph; an unjoined fork fails.

    Bitwise the same on the GPU and the simulated driver: both end an unjoined capture with
    ``CUDA_ERROR_STREAM_CAPTURE_UNJOINED`` and no graph, leaving the streams usable.
    """
    s, side = cuda.stream(), cuda.stream()
    fork, join = cuda.event(timing=False), cuda.event(timing=False)
    values = random_array(rng, N, np.float64)
    a, b = cuda.to_device(values, stream=s), cuda.to_device(values, stream=s)
    s.synchronize()
    with um.capture(s) as graph:
        fork.record(s)
        fork.wait(side)
        _plain_scale[G, B, s](a, 2.0)
        _plain_scale[G, B, side](b, 4.0)  # the other branch of the graph
        join.record(side)
        join.wait(s)
    for _ in range(2):
        graph.launch()
    s.synchronize()
    np.testing.assert_array_equal(a.copy_to_host(), values * 4.0)
    np.testing.assert_array_equal(b.copy_to_host(), values * 16.0)
    graph.close()
    with pytest.raises(um.CudaError, match="CUDA_ERROR_STREAM_CAPTURE_UNJOINED"), um.capture(s):
        fork.record(s)
        fork.wait(side)
        _plain_scale[G, B, side](b, 5.0)  # never joined back
    assert not _driver.is_capturing(int(s.handle)) and not _driver.is_capturing(int(side.handle))
    _plain_scale[G, B, side](b, 0.5)  # both streams work again; the failed capture's work never ran
    side.synchronize()
    np.testing.assert_array_equal(b.copy_to_host(), values * 8.0)


def test_garbage_freed_during_a_capture_does_not_break_it(rng):
    """Device arrays in reference cycles, collected by the garbage collector, free memory: not inside a capture.

    A free in the capturing thread invalidates a capture (on a GPU through numba's queued frees,
    on the simulated driver at once): ``capture`` collects before the block, and the garbage
    collector is off in it (numba's queued frees wait for its end too).
    """

    class Cycle:
        def __init__(self) -> None:
            self.me = self
            self.array = cuda.device_array(1024, np.float32)

    s = cuda.stream()
    values = random_array(rng, N, np.float64)
    a = cuda.to_device(values, stream=s)
    s.synchronize()
    for _ in range(50):
        Cycle()  # garbage, freed only by a collection
    later = [Cycle() for _ in range(200)]
    collecting = gc.isenabled()
    with um.capture(s) as graph:
        assert not gc.isenabled()
        for _ in range(40):
            _plain_scale[G, B, s](a, 1.0)
            for _ in range(5):
                later.pop()  # more garbage in the block (allocating there would invalidate the capture)
        _plain_scale[G, B, s](a, 2.0)
    assert gc.isenabled() == collecting
    graph.launch()
    s.synchronize()
    np.testing.assert_array_equal(a.copy_to_host(), values * 2.0)
    graph.close()


def test_buffers_launched_on_a_forked_stream_are_refused_or_right(rng):
    """A plain launch of a buffer on a stream forked into the capture: refused, or every replay's write seen.

    The graph's read and write sets hold what the capturing stream's launches use; a buffer
    written on a forked branch would be replayed untracked (a host read after the second launch
    would not wait for it).  The launch is refused inside the block and the capture goes on.
    """
    s, side = cuda.stream(), cuda.stream()
    fork, join = cuda.event(timing=False), cuda.event(timing=False)
    with um.ManagedBuffer.from_array(random_array(rng, N, np.float64)) as a:
        refused = False
        with um.capture(s) as graph:
            fork.record(s)
            fork.wait(side)
            try:
                _plain_scale[G, B, side](a, 2.0)
            except um.CoherenceError as exc:
                refused = True
                assert "forked" in str(exc)
            join.record(side)
            join.wait(s)
            _plain_scale[G, B, s](a, 4.0)  # the capture goes on
        for _ in range(TRIALS):
            values = random_array(rng, N, np.float64)
            a.host[:] = values
            graph.launch()
            np.testing.assert_array_equal(a.host, values * (4.0 if refused else 8.0))
        graph.close()
        assert refused


def test_a_plain_launch_of_a_buffer_in_a_capture_umem_numba_did_not_begin_is_refused(rng):
    """``cuStreamBeginCapture`` called directly: a plain launch of a buffer there is refused, the capture intact.

    (A launch filed under a stream mark made before the capture began asks nothing of the
    stream, so it is not seen: docs/concepts/graphs.md says so.)
    """
    values = random_array(rng, N, np.float64)
    s = cuda.stream()
    h = um.stream_handle(s)
    with um.ManagedBuffer.from_array(values) as a:
        drv = _driver.api().drv
        _driver.call("cuStreamBeginCapture", h, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        try:
            with pytest.raises(um.CoherenceError, match="did not begin"):
                _plain_scale[G, B, s](a, 2.0)
            assert _driver.is_capturing(h), "the refusal broke the capture"
        finally:
            err, graph = drv.cuStreamEndCapture(h)
            assert int(err) == 0, "the refusal invalidated the capture"
            _driver.call("cuGraphDestroy", graph)
        _plain_scale[G, B, s](a, 2.0)  # the stream and the buffer work as before
        np.testing.assert_array_equal(a.host, values * 2.0)


@pytest.mark.parametrize("node_priorities", [False, True])
def test_node_priorities_choose_the_instantiation_flag(rng, monkeypatch, node_priorities):
    """Default: the graph runs at its launch stream's priority (instantiated without USE_NODE_PRIORITY).

    The flags are seen at the instantiation call: the driver does not read USE_NODE_PRIORITY back
    (``cuGraphExecGetFlags`` answered 0 for a graph instantiated with it, 4 x H100, driver 580).
    """
    s = cuda.stream()
    data = random_array(rng, N, np.float64)
    a, b = um.ManagedBuffer.from_array(data), um.ManagedBuffer.zeros(N)
    passed: list[int] = []
    real_call = _driver.call

    def call(name, *args, **kw):
        if name == "cuGraphInstantiate":
            passed.append(int(args[1]))
        return real_call(name, *args, **kw)

    monkeypatch.setattr(_driver, "call", call)
    kwargs = {"node_priorities": True} if node_priorities else {}
    with um.capture(s, **kwargs) as graph:
        _halve_plus[G, B, s](b, a)
    use_node = int(_driver.api().drv.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY)
    assert passed == [use_node if node_priorities else 0], f"instantiation flags {passed}"
    graph.launch(s)
    np.testing.assert_array_equal(b.host, data * 0.5 + 1.0)
    with pytest.raises(TypeError, match="node_priorities must be a bool"), um.capture(s, node_priorities=1):
        pass
    assert not _driver.is_capturing(int(s.handle))  # the refusal came before the capture began
    for buf in (a, b):
        buf.close()
    del graph
