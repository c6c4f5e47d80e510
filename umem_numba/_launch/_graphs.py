"""CUDA graphs of toolkit work, replayed with coherence: :func:`capture` and :class:`Graph`.

``with umem_numba.capture(stream) as graph:`` captures what the thread queues
on ``stream`` (tracked launches: ``um.jit``, ``coherent``, ``launch``,
``forall``; plain numba launches of buffers; ``umem_numba.copy`` between
buffers and device arrays) into a CUDA graph instead of running it.  Inside
the capture nothing is ordered or recorded (the work does not run); the
launches and copies note which buffers they read and write
(:mod:`umem_numba._memory._capture`).  Each :meth:`Graph.launch` is then one
``cuGraphLaunch`` treated as one launch with the graph's read and write sets:
the stream first waits, on the device, for conflicting work on other streams,
and one event recorded after the graph is filed under every buffer it uses,
so host access waits for exactly the replays.

The graph keeps its buffers alive.  Closing one waits for the graph's launches
(or raises under ``"raise"``; pool memory queues its free after them), and the
graph then refuses to launch again rather than use freed memory; a ``VMMBuffer`` a live graph uses cannot
shrink.  Work the graph cannot hold (copies to or from numpy arrays,
allocations, prefetches, host access to a buffer it uses) is refused inside
the capture before anything reaches the stream, and the capture stays intact.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator
from typing import Any

from .. import _driver
from .._driver._location import StreamLike, stream_handle
from .._errors import BufferClosedError, CoherenceError
from .._memory import _capture
from .._memory._tracker import DeviceUse, Tracker, prefetch_touched, refuse_capture

__all__ = ["Graph", "capture"]


class Graph:
    """A CUDA graph captured from toolkit work by :func:`capture`; :meth:`launch` replays it.

    Not made directly: ``with umem_numba.capture(stream) as graph:`` gives
    one, usable once the block has ended.

    Notes
    -----
    Holds the buffers its work uses (and every other operand) until
    :meth:`close`, or until it is collected.
    """

    __slots__ = ("__weakref__", "_device", "_epochs", "_exec", "_finalizer", "_keep", "_state", "_stream", "_uses")

    def __init__(self, stream: Any, device: int) -> None:
        self._stream = stream
        self._device = device
        self._uses: list[tuple[Tracker, bool]] = []
        self._epochs: list[int | None] = []
        self._keep: list[Any] = []
        #: "capturing", "ready", "failed" or "closed".
        self._state = "capturing"
        self._finalizer: weakref.finalize[Any, Graph] | None = None
        self._exec: Any = None

    # -- made by capture() -------------------------------------------------------------
    def _ready(self, graph: Any, executable: Any, recorder: _capture.CaptureRecorder) -> None:
        self._uses = [(t, w) for t, (w, _) in recorder.uses.items()]
        self._epochs = [e for _, e in recorder.uses.values()]
        self._keep = recorder.keep
        trackers = [t for t, _ in self._uses]
        for tracker in trackers:
            tracker.count_uses(graphs=1)
        self._exec = executable
        self._finalizer = weakref.finalize(self, _destroy, graph, executable, trackers, self._device)
        self._state = "ready"

    # -- public ------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (or the capture failed)."""
        return self._state != "ready"

    @property
    def buffers_written(self) -> int:
        """How many allocations the graph's work writes (each launch files a write for them)."""
        return sum(1 for _, w in self._uses if w)

    @property
    def buffers_read(self) -> int:
        """How many allocations the graph's work only reads."""
        return sum(1 for _, w in self._uses if not w)

    def launch(self, stream: StreamLike | None = None) -> None:
        """Replay the graph on ``stream`` (default: the stream it was captured on), with coherence.

        The stream first waits, on the device, for work on other streams that
        conflicts with the graph's reads and writes; one event recorded after
        the graph is filed under every buffer it uses.  Managed memory the
        host touched since the device last had it is prefetched first, as
        for a launch.

        Parameters
        ----------
        stream : stream-like, optional
            A stream of the device the graph was captured on.

        Raises
        ------
        BufferClosedError
            The graph was closed, or a buffer it uses was closed since.
        CoherenceError
            ``stream`` is capturing a graph; the host holds a buffer the graph uses.
        """
        if self._state != "ready":
            raise BufferClosedError(
                "Graph.launch: the graph is closed"
                if self._state == "closed"
                else "Graph.launch: the capture did not finish, so there is no graph"
            )
        handle = stream_handle(self._stream if stream is None else stream, what="Graph.launch")
        executable = self._exec
        if not self._uses:  # no buffer to order or record (device arrays, raw memory): the launch alone
            with _driver.device_context(self._device):
                refuse_capture(handle, "a graph launch")
                _driver.call("cuGraphLaunch", executable, handle, detail="launching a captured graph")
            return
        with _driver.device_context(self._device), DeviceUse(self._uses, handle, "a graph launch", self._epochs):
            moves = [t for t, _ in self._uses if t.migrate]
            if moves:
                prefetch_touched(moves, handle, self._device)
            _driver.call("cuGraphLaunch", executable, handle, detail="launching a captured graph")

    def close(self) -> None:
        """Destroy the graph and let go of its buffers (a launch in flight still finishes)."""
        if self._state == "closed":
            return
        self._state = "closed"
        finalizer = self._finalizer
        if finalizer is not None:
            finalizer()
        self._keep = []
        self._uses = []
        self._exec = None

    def __enter__(self) -> Graph:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<umem_numba.Graph {self._state}: writes {self.buffers_written} and reads "
            f"{self.buffers_read} allocation(s)>"
        )


def _destroy(graph: Any, executable: Any, trackers: list[Tracker], device: int) -> None:
    """Free the graph (a launch in flight finishes first, as the driver documents); safe at exit."""
    for tracker in trackers:
        tracker.count_uses(graphs=-1)
    if _driver.shutting_down():
        return  # the driver frees them with the context
    try:
        with _driver.device_context(device):
            _driver.call("cuGraphExecDestroy", executable, detail="destroying a captured graph")
            _driver.call("cuGraphDestroy", graph, detail="destroying a captured graph")
    except Exception:  # a collected graph must not raise (the context may be gone)
        pass


@contextlib.contextmanager
def capture(stream: StreamLike, *, node_priorities: bool = False) -> Iterator[Graph]:
    """Capture the toolkit work this thread queues on ``stream`` into a :class:`Graph`.

    Inside the block, tracked launches (``um.jit``, :func:`coherent`,
    :func:`launch`, ``forall``), plain numba launches of buffers and
    :func:`copy` calls on ``stream`` are recorded into the graph instead of
    run; the graph notes which buffers each reads and writes.  Launch the graph after the block
    with :meth:`Graph.launch`: each launch is ordered and recorded like one
    coherent launch.

    Parameters
    ----------
    stream : stream-like
        A stream of the current device other than the legacy default stream
        (``cuda.stream()``).  The capture is in CUDA's thread-local mode:
        other threads may allocate and synchronise meanwhile.  Work on other
        streams forked into the capture (``cuda.event().record(stream)``
        waited for there, and joined back before the block ends) joins the
        graph too; launches of buffers are recorded on ``stream`` only.
    node_priorities : bool, optional
        ``False`` (default): the graph runs at the priority of the stream it
        is launched into, every node (copies too), as CUDA launches graphs.
        ``True``: each kernel keeps the priority of the stream it was
        captured on (``CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY``), so a
        branch forked onto a high-priority stream still goes first; copy
        nodes then run at the default priority, behind long kernels (a graph
        of small copies and kernels launched into a high-priority stream next
        to a long kernel elsewhere finishes sooner with the default).

    Yields
    ------
    Graph
        Usable once the block has ended.

    Raises
    ------
    ValueError
        ``stream`` is the legacy default stream (it cannot capture).
    CoherenceError
        ``stream`` is capturing already, or this thread is inside another
        ``capture``; inside the block: host access to a buffer the graph
        uses, or work the graph cannot hold (copies to or from numpy arrays,
        allocations and prefetches on the stream).
    BufferClosedError
        A buffer the graph uses was closed inside the block (no graph is made).
    CudaError
        The driver invalidated the capture (work from another thread joined it),
        or a stream forked into it was not joined back
        (``CUDA_ERROR_STREAM_CAPTURE_UNJOINED``); no graph is made.

    Notes
    -----
    A free in the capturing thread would invalidate the capture, so inside
    the block numba's deferred frees wait (``numba.cuda.defer_cleanup``) and
    the garbage collector is off; it collects once when the block begins.

    Examples
    --------
    >>> @um.jit                                                   # doctest: +SKIP
    ... def step(dst, src):
    ...     i = cuda.grid(1)
    ...     if i < dst.size:
    ...         dst[i] = 0.5 * src[i] + 1.0
    >>> a, b = um.ManagedBuffer.zeros(4096), um.ManagedBuffer.zeros(4096)
    >>> s = cuda.stream()
    >>> with um.capture(s) as graph:
    ...     for _ in range(10):
    ...         step[32, 128, s](b, a)
    ...         step[32, 128, s](a, b)
    >>> for _ in range(100):
    ...     graph.launch()
    >>> a.host   # waits for the last launch only
    """
    handle = stream_handle(stream, what="capture")
    c = _driver.consts()
    if handle in (0, c.stream_legacy):
        raise ValueError(
            "capture: the legacy default stream cannot capture a graph; pass a stream of your own (cuda.stream())"
        )
    device = _driver.ensure_context()
    if _driver.is_capturing(handle):
        raise CoherenceError("capture: the stream is capturing a graph already")
    if type(node_priorities) is not bool:
        raise TypeError(f"capture: node_priorities must be a bool, got {type(node_priorities).__name__}")
    recorder = _capture.CaptureRecorder(handle, device)
    _capture.start(recorder)  # refuses a second capture in this thread before anything reaches the stream
    graph = Graph(stream, device)
    drv = _driver.api().drv
    # A free in this thread would invalidate the capture (a potentially unsafe call): numba's
    # queued frees wait for the block's end, and the garbage collector, which may finalize
    # device arrays, collects now and not during the block.
    frees = contextlib.ExitStack()
    collecting = gc.isenabled()
    try:
        from numba import cuda

        frees.enter_context(cuda.defer_cleanup())
        gc.collect()
        gc.disable()
        _driver.call(
            "cuStreamBeginCapture",
            handle,
            drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            detail="beginning a graph capture",
        )
    except BaseException:
        _restore_frees(frees, collecting)
        _capture.stop()
        raise
    ended = False
    try:
        yield graph
    except BaseException:
        with contextlib.suppress(Exception):
            err, made = drv.cuStreamEndCapture(handle)
            ended = True
            if int(err) == 0 and made is not None:
                drv.cuGraphDestroy(made)
        graph._state = "failed"
        raise
    finally:
        try:
            if not ended and graph._state == "capturing":
                _end(graph, handle, recorder, node_priorities)
        finally:
            _restore_frees(frees, collecting)
            _capture.stop()


def _restore_frees(frees: contextlib.ExitStack, collecting: bool) -> None:
    """The capture is over: queued frees run, and the garbage collector runs again if it did before."""
    if collecting:
        gc.enable()
    frees.close()


def _end(graph: Graph, handle: int, recorder: _capture.CaptureRecorder, node_priorities: bool) -> None:
    """End the capture on ``handle``: instantiate its graph into ``graph``, or raise (no graph then)."""
    drv = _driver.api().drv
    err, made = drv.cuStreamEndCapture(handle)
    graph._state = "failed"
    if int(err) != 0:
        _driver.raise_for(
            err, "cuStreamEndCapture", "ending a graph capture (the driver invalidated it: see the message)"
        )
    try:
        closed = [t for t, (_, epoch) in recorder.uses.items() if t.is_closed() or t.epoch != epoch]
        if closed:
            raise BufferClosedError(
                f"capture: {len(closed)} buffer(s) the graph uses were closed inside the capture; no graph was made"
            )
        # With node priorities, kernels keep the priority of the stream they were captured on (a
        # high-priority side branch still goes first), but copy nodes have none and run at the
        # default: a band graph of copies and small kernels launched into a high-priority stream
        # then waited behind a long kernel on another stream (RankHeat on four H200s: 2.3x strong
        # speed-up with them, 2.9x without).  Without, every node runs at the launch stream's.
        flags = (
            int(drv.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY) if node_priorities else 0
        )
        executable = _driver.call("cuGraphInstantiate", made, flags, detail="instantiating a captured graph")
    except BaseException:
        with contextlib.suppress(Exception):
            drv.cuGraphDestroy(made)
        raise
    graph._ready(made, executable, recorder)
