"""CUDA graph capture (cuStreamBeginCapture ... cuStreamEndCapture) and graph launches.

Mixed into :class:`~umem_numba._driver._simulated.SimDriver` as :class:`GraphCapture`; :func:`guard_capture`
applies the capture rules to the driver's entry points.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..._errors import UnsupportedError
from ._common import (
    _INVALID_VALUE,
    _SUCCESS,
    _Error,
    _int,
)
from ._memory import Allocations
from ._scheduling import _Op, _Stream

# Work queued on a capturing stream is recorded into the capture's graph instead of run;
# cuGraphLaunch of the instantiated graph queues the recorded work on the launch stream,
# late like any stream work.  The rules of the CUDA programming guide ("Prohibited and
# unhandled operations", cuThreadExchangeStreamCaptureMode) are kept: synchronising or
# querying a capturing stream, a captured event or the context, using the legacy stream
# while a blocking stream captures, and the potentially unsafe calls (allocations, frees)
# in a thread that a capture's mode prohibits, each fail with the driver's error and
# invalidate the capture (cuStreamEndCapture then returns
# CUDA_ERROR_STREAM_CAPTURE_INVALIDATED and no graph).  A stream that waits for an event
# recorded in a capture joins it (a fork); the capture ends on its origin stream, and only
# once every joined stream's work is joined back into the origin (cudaStreamCaptureUnjoined
# otherwise).  The graph keeps each node's captured dependencies (the latest work of every
# stream its stream's frontier covers), and a launch runs the nodes in any order they allow,
# drawn from the seed like the order of streams: branches forked in the capture interleave,
# so a node that misses a dependency it needs can run first, as on a GPU.  What is not simulated
# inside a capture (merging two captures, waiting for an event from outside, stream-ordered
# allocation nodes, prefetches and other operations without a node here) is refused with
# UnsupportedError naming it.

_CAPTURE_UNSUPPORTED = 900  # CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
_CAPTURE_INVALIDATED = 901  # CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
_CAPTURE_UNMATCHED = 903  # CUDA_ERROR_STREAM_CAPTURE_UNMATCHED
_CAPTURE_UNJOINED = 904  # CUDA_ERROR_STREAM_CAPTURE_UNJOINED
_CAPTURE_IMPLICIT = 906  # CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
_CAPTURED_EVENT = 907  # CUDA_ERROR_CAPTURED_EVENT
_CAPTURE_WRONG_THREAD = 908  # CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD
_ILLEGAL_STATE = 401  # CUDA_ERROR_ILLEGAL_STATE
_MODE_GLOBAL, _MODE_THREAD_LOCAL, _MODE_RELAXED = 0, 1, 2


class _Node(_Op):
    """Work recorded by a capture (never queued itself: a graph launch queues a copy of it).

    ``frontier``: per stream of the capture, how much of its work comes before this node
    (what a wait for an event recorded here joins).
    """

    __slots__ = ("capture", "frontier")

    def __init__(self, capture: _Capture, stream: _Stream, run: Callable[[], None] | None, what: str) -> None:
        super().__init__(stream, run, [], what)
        self.capture = capture
        self.frontier: dict[_Stream, int] = {}


class _Capture:
    """One capture sequence: its origin stream, mode, thread, state and the nodes recorded so far.

    Streams joined through a captured event (forks) record into it too.  Per stream,
    ``counts`` says how many operations it recorded and ``frontiers`` how much of each
    stream's work its next operation comes after; the capture may end once the origin's
    frontier covers every stream's work (each fork joined back).
    """

    __slots__ = ("counts", "frontiers", "ident", "invalidated", "mode", "nodes", "recorded", "stream", "thread")

    def __init__(self, ident: int, stream: _Stream, mode: int) -> None:
        self.ident = ident
        self.stream = stream
        self.mode = mode
        self.thread = threading.get_ident()
        self.invalidated = False
        self.nodes: list[_Node] = []  # in the order the host issued them
        self.counts: dict[_Stream, int] = {stream: 0}
        self.frontiers: dict[_Stream, dict[_Stream, int]] = {stream: {}}
        #: Per stream, the index in ``nodes`` of the latest node with work at each of its records
        #: (-1 before any): what a frontier's count on that stream depends on.
        self.recorded: dict[_Stream, list[int]] = {stream: []}

    def note(self, node: _Node) -> None:
        """``node`` was recorded on its stream: it comes after that stream's frontier."""
        s = node.stream
        self.counts[s] += 1
        frontier = self.frontiers[s]
        frontier[s] = self.counts[s]
        node.frontier = dict(frontier)

    def add(self, node: _Node) -> None:
        """Note ``node`` (:meth:`note`) and, if it does work, make it a node of the graph."""
        self.note(node)
        marks = self.recorded[node.stream]
        if node.run is not None:
            self.nodes.append(node)
            marks.append(len(self.nodes) - 1)
        else:  # an event record or wait: no node, it stands for the latest one before it
            marks.append(marks[-1] if marks else -1)

    def dependencies(self, node: _Node) -> tuple[int, ...]:
        """Indices in ``nodes`` of the nodes ``node`` comes after: per stream its frontier covers,
        the latest node with work that stream recorded up to there (before ``node`` on its own)."""
        deps = set()
        for t, n in node.frontier.items():
            upto = n - 1 if t is node.stream else n  # its own record is the n-th of its stream
            if upto > 0:
                i = self.recorded[t][upto - 1]
                if i >= 0:
                    deps.add(i)
        return tuple(sorted(deps))

    def join(self, s: _Stream, after: _Node) -> None:
        """Stream ``s`` waits for ``after`` (an event recorded in this capture): it comes after its frontier."""
        if s not in self.counts:  # a fork: s joins the capture
            self.counts[s] = 0
            self.frontiers[s] = {}
            self.recorded[s] = []
        frontier = self.frontiers[s]
        for other, n in after.frontier.items():
            if frontier.get(other, 0) < n:
                frontier[other] = n

    def unjoined(self) -> list[_Stream]:
        """The streams whose recorded work the origin's frontier does not cover."""
        done = self.frontiers[self.stream]
        return [s for s, n in self.counts.items() if s is not self.stream and done.get(s, 0) < n]


#: A graph node: what it is, its work, the memory it uses, the indices of the nodes it comes after.
_GraphNode = tuple[str, Callable[[], None] | None, tuple[tuple[int, int], ...], tuple[int, ...]]


class _Graph:
    """A captured graph, or an instantiated one (``cuGraphInstantiate`` copies the node list)."""

    __slots__ = ("last", "nodes")

    def __init__(self, nodes: list[_GraphNode]) -> None:
        self.nodes = nodes
        self.last: _Op | None = None  # executable graphs: the end of the last launch


class _CaptureMode(threading.local):
    mode = _MODE_GLOBAL  # cuThreadExchangeStreamCaptureMode; the driver's default


def _refuse_in_capture(what: str) -> UnsupportedError:
    return UnsupportedError(
        f"{what}: not simulated inside a CUDA graph capture under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1); "
        "it needs a real GPU"
    )


class GraphCapture(Allocations):
    """The simulated driver's stream capture and graphs."""

    def _init_capture(self) -> None:
        self._captures: dict[_Stream, _Capture] = {}
        self._graphs: dict[int, _Graph] = {}
        self._execs: dict[int, _Graph] = {}
        self._capture_ids = itertools.count(1)
        self._branch_ids = itertools.count(1)  # graph nodes' streams: negative sids, never a stream's
        self._capture_mode = _CaptureMode()

    # -- rules ---------------------------------------------------------------------------
    def _capture_of(self, s: _Stream) -> _Capture | None:
        return self._captures.get(s)

    def _invalidate(self, captures: Iterator[_Capture] | list[_Capture]) -> None:
        for cap in captures:
            cap.invalidated = True

    def _blocking_captures(self) -> list[_Capture]:
        return [c for s, c in self._captures.items() if s.blocking and s.kind != "legacy"]

    def _prohibiting(self) -> list[_Capture]:
        """The captures that prohibit this thread's potentially unsafe calls (cuThreadExchangeStreamCaptureMode)."""
        me = threading.get_ident()
        mode = self._capture_mode.mode
        if mode == _MODE_RELAXED:
            return []
        own = [c for c in self._captures.values() if c.thread == me and c.mode != _MODE_RELAXED]
        if mode == _MODE_GLOBAL:
            own += [c for c in self._captures.values() if c.thread != me and c.mode == _MODE_GLOBAL]
        return own

    def _capture_record(self, s: _Stream, run: Callable[[], None] | None, what: str) -> _Node | None:
        """Record work queued on a capturing stream into its graph (``None``: the stream is not capturing)."""
        cap = self._captures.get(s)
        if cap is None:
            return None
        node = _Node(cap, s, run, what)
        cap.add(node)  # event records and waits within the capture add no node
        return node

    # -- entry points ----------------------------------------------------------------------
    def cuThreadExchangeStreamCaptureMode(self, mode: Any) -> tuple[Any, ...]:
        old = self._capture_mode.mode
        self._capture_mode.mode = _int(mode)
        return (_SUCCESS, self._real.CUstreamCaptureMode(old))

    def cuStreamBeginCapture(self, handle: Any, mode: Any) -> tuple[Any, ...]:
        m = _int(mode)
        if m not in (_MODE_GLOBAL, _MODE_THREAD_LOCAL, _MODE_RELAXED):
            return (_INVALID_VALUE,)
        with self._lock:
            try:
                s = self._stream(handle)
            except _Error as e:
                return (e.code,)
            if s.kind == "legacy":
                return (_CAPTURE_UNSUPPORTED,)  # the legacy stream cannot capture
            if s in self._captures:
                return (_ILLEGAL_STATE,)
            self._captures[s] = _Capture(next(self._capture_ids), s, m)
        return (_SUCCESS,)

    def cuStreamEndCapture(self, handle: Any) -> tuple[Any, ...]:
        with self._lock:
            try:
                s = self._stream(handle)
            except _Error as e:
                return (e.code, None)
            cap = self._captures.get(s)
            if cap is None:
                return (_ILLEGAL_STATE, None)
            if cap.stream is not s:
                return (_CAPTURE_UNMATCHED, None)  # a joined stream cannot end the capture
            if cap.mode != _MODE_RELAXED and cap.thread != threading.get_ident():
                return (_CAPTURE_WRONG_THREAD, None)
            for joined in cap.counts:
                del self._captures[joined]
            if cap.invalidated:
                return (_CAPTURE_INVALIDATED, None)
            if cap.unjoined():
                return (_CAPTURE_UNJOINED, None)
            graph = _Graph([(n.what, n.run, n.spans, cap.dependencies(n)) for n in cap.nodes])
            return self._register(self._graphs, lambda _: graph)

    def cuStreamIsCapturing(self, handle: Any) -> tuple[Any, ...]:
        status = self._real.CUstreamCaptureStatus
        with self._lock:
            try:
                s = self._stream(handle)
            except _Error as e:
                return (e.code, None)
            if s.kind == "legacy" and self._blocking_captures():
                return (_CAPTURE_IMPLICIT, None)  # not invalidating, as the driver documents
            cap = self._captures.get(s)
        if cap is None:
            return (_SUCCESS, status.CU_STREAM_CAPTURE_STATUS_NONE)
        if cap.invalidated:
            return (_SUCCESS, status.CU_STREAM_CAPTURE_STATUS_INVALIDATED)
        return (_SUCCESS, status.CU_STREAM_CAPTURE_STATUS_ACTIVE)

    def cuGraphGetNodes(self, graph: Any, count: Any = 0) -> tuple[Any, ...]:
        with self._lock:
            g = self._graphs.get(_int(graph))
            if g is None:
                return (_INVALID_VALUE, None, 0)
            n = len(g.nodes)
        want = _int(count)
        if not want:
            return (_SUCCESS, [], n)
        # Node handles are opaque: the graph handle plus the index identify a node.
        nodes: list[Any] = [_int(graph) + 1 + i for i in range(min(n, want))]
        return (_SUCCESS, nodes + [None] * (want - len(nodes)), min(n, want))

    def cuGraphDestroy(self, graph: Any) -> tuple[Any, ...]:
        with self._lock:
            return self._unregister(self._graphs, graph, _INVALID_VALUE)

    def cuGraphInstantiate(self, graph: Any, flags: Any = 0) -> tuple[Any, ...]:
        with self._lock:
            g = self._graphs.get(_int(graph))
            if g is None:
                return (_INVALID_VALUE, None)
            # A copy of the nodes: later changes to the graph do not reach what was instantiated.
            # Node priorities are not simulated.  No cuGraphExecGetFlags: the driver does not read
            # every flag back (USE_NODE_PRIORITY came back 0 on an H100, driver 580).
            return self._register(self._execs, lambda _: _Graph(list(g.nodes)))

    def cuGraphExecDestroy(self, graph_exec: Any) -> tuple[Any, ...]:
        with self._lock:
            # A launch in flight still runs: its operations are queued already.
            return self._unregister(self._execs, graph_exec, _INVALID_VALUE)

    def cuGraphLaunch(self, graph_exec: Any, handle: Any) -> tuple[Any, ...]:
        with self._lock:
            g = self._execs.get(_int(graph_exec))
            if g is None:
                return (_INVALID_VALUE,)
            # Each launch is ordered after the stream's earlier work and after the previous
            # launch of the same executable graph (the start); its nodes run after the start and
            # the nodes they depend on, each on a stream of its own, so that the order in which
            # independent branches run is drawn like any streams'; the end comes after them all.
            start = self._enqueue(handle, None, "graph launch start", [] if g.last is None else [g.last])
            ops: list[_Op] = []
            for what, run, spans, deps in g.nodes:
                branch = _Stream(0, -next(self._branch_ids), "graph node", False)
                op = self._enqueue(branch, run, f"graph: {what}", [start, *(ops[i] for i in deps)])
                op.spans = spans  # the memory it uses, as the captured work's (see cuMemUnmap)
                ops.append(op)
            g.last = self._enqueue(handle, None, "graph launch end", [start, *ops])
        return (_SUCCESS,)

    # -- the rules, applied to the entry points by guard_capture ---------------------------
    def _capture_gate(self, name: str, rule: str, s: _Stream, args: tuple[Any, ...]) -> int:
        """An error code (0: go on) for ``name`` on stream ``s`` while captures exist; may raise UnsupportedError."""
        cap = self._captures.get(s)
        if s.kind == "legacy":
            blocking = self._blocking_captures()
            if blocking:  # the legacy stream would depend on the capturing streams: invalid
                self._invalidate(blocking)
                return _CAPTURE_IMPLICIT
        if rule == "sync":
            if cap is not None:
                cap.invalidated = True
                return _CAPTURE_UNSUPPORTED
            return 0
        if rule == "wait":
            ev = self._events.get(_int(args[1]))
            op = None if ev is None else ev.op
            if isinstance(op, _Node):
                if cap is None and self._captures.get(op.stream) is op.capture:
                    self._captures[s] = op.capture  # a fork: the stream joins the capture
                elif cap is not op.capture:
                    raise _refuse_in_capture(
                        f"{name} on an event recorded in another capture (merging two captures), "
                        "or in a capture that has ended"
                    )
                op.capture.join(s, op)
                return 0
            if cap is not None:
                raise _refuse_in_capture(f"{name}: a capturing stream waiting for an event recorded outside it")
            return 0
        if cap is None:
            return 0
        if rule == "refuse":
            raise _refuse_in_capture(name)
        if rule == "unsupported":  # the driver's answer: an error, and the capture is invalid
            cap.invalidated = True
            return _CAPTURE_UNSUPPORTED
        if rule == "copy":
            dst, src = args[0], args[1]
            for p in (dst, src):
                ptr = p.ctypes.data if isinstance(p, np.ndarray) else _int(p)
                if self._find(ptr) is None:
                    raise _refuse_in_capture(f"{name} from or to pageable host memory")
        return 0

    def _unsafe_gate(self, name: str) -> int:
        """An error code (0: go on) for a potentially unsafe call while captures exist."""
        if name == "cuCtxSynchronize":
            active = list(self._captures.values())
            if active:  # the context holds capturing streams: cannot be synchronised
                self._invalidate(active)
                return _CAPTURE_UNSUPPORTED
            return 0
        prohibiting = self._prohibiting()
        if not prohibiting:
            return 0
        if name in _UNSAFE_NOT_SIMULATED:
            raise _refuse_in_capture(f"{name} while a capture's mode prohibits potentially unsafe calls")
        self._invalidate(prohibiting)
        return _CAPTURE_UNSUPPORTED

    def _event_gate(self, event: Any) -> int:
        ev = self._events.get(_int(event))
        op = None if ev is None else ev.op
        if isinstance(op, _Node):
            if self._captures.get(op.stream) is op.capture:
                op.capture.invalidated = True
            return _CAPTURED_EVENT
        return 0

    def _legacy_launch_gate(self, s: _Stream) -> None:
        """A launch on the legacy stream while a blocking stream captures: the driver's error, the capture invalid."""
        blocking = self._blocking_captures() if s.kind == "legacy" else []
        if blocking:
            from .._errors import CudaError

            self._invalidate(blocking)
            raise CudaError(
                "cuLaunchKernel",
                _CAPTURE_IMPLICIT,
                "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
                "a launch on the legacy stream while a blocking stream captures a graph",
            )

    def refuse_plain_launch_in_capture(self, stream: Any, host_arguments: bool) -> None:
        """A plain ``kernel[g, b, s](...)`` on a capturing stream is recorded, unless numba copies host arrays."""
        with self._lock:
            if not self._captures:
                return
            s = self._stream(stream)
            self._legacy_launch_gate(s)
            if host_arguments and s in self._captures:
                raise _refuse_in_capture(
                    "a plain numba launch of host arrays on a capturing stream (numba copies them at the call)"
                )


#: Entry points that take a stream: (index of the stream argument, values returned after the
#: CUresult, rule).  "record": queued work, recorded into the graph of a capturing stream;
#: "unsupported": failing in a capture with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, which invalidates it;
#: "copy": the same, refusing pageable memory; "sync": synchronises or queries the stream,
#: not permitted while it captures; "wait": cuStreamWaitEvent; "refuse": not simulated in a capture.
_STREAM_RULES: dict[str, tuple[int, int, str]] = {
    "cuMemcpyAsync": (3, 0, "copy"),
    "cuMemcpyHtoDAsync": (3, 0, "copy"),
    "cuMemcpyDtoHAsync": (3, 0, "copy"),
    "cuMemcpyDtoDAsync": (3, 0, "copy"),
    "cuMemcpyPeerAsync": (5, 0, "unsupported"),  # CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED in a capture (H200, 580)
    "cuMemsetD8Async": (3, 0, "record"),
    "cuMemsetD32Async": (3, 0, "record"),
    "cuEventRecord": (1, 0, "record"),
    "cuStreamWaitEvent": (0, 0, "wait"),
    "cuStreamSynchronize": (0, 0, "sync"),
    "cuStreamQuery": (0, 0, "sync"),
    "cuStreamGetDevice": (0, 1, "sync"),
    "cuStreamGetId": (0, 1, "sync"),  # refused in a capture on an H100 (driver 580), global and relaxed modes
    "cuMemPrefetchAsync": (4, 0, "refuse"),
    "cuStreamAttachMemAsync": (0, 0, "refuse"),
    "cuMemAllocFromPoolAsync": (2, 1, "refuse"),
    "cuMemFreeAsync": (1, 0, "refuse"),
    "cuGraphLaunch": (1, 0, "refuse"),
    "cuMemDiscardBatchAsync": (4, 0, "refuse"),
    "cuMemDiscardAndPrefetchBatchAsync": (7, 0, "refuse"),
}
#: Potentially unsafe calls (cuThreadExchangeStreamCaptureMode): values returned after the CUresult.
_UNSAFE: dict[str, int] = {
    "cuMemAlloc": 1,
    "cuMemAllocManaged": 1,
    "cuMemHostAlloc": 1,
    "cuMemFree": 0,
    "cuMemFreeHost": 0,
    "cuCtxSynchronize": 0,
}
#: Calls whose behaviour in a prohibiting capture is not simulated: refused then.
_UNSAFE_NOT_SIMULATED = (
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemSetAccess",
    "cuMemPoolCreate",
    "cuMemPoolDestroy",
    "cuMemPoolTrimTo",
)


def guard_capture(cls: type) -> None:
    """Wrap ``cls``'s entry points with the capture rules (a no-op check while nothing captures)."""
    import functools

    def stream_rule(name: str, fn: Callable[..., Any], index: int, values: int, rule: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def guarded(self: Any, *args: Any) -> Any:
            if self._captures and index < len(args):
                with self._lock:
                    try:
                        s = self._stream(args[index])
                    except _Error:
                        s = None
                    code = 0 if s is None else self._capture_gate(name, rule, s, args)
                if code:
                    return (code,) + (None,) * values
            return fn(self, *args)

        return guarded

    def unsafe_rule(name: str, fn: Callable[..., Any], values: int) -> Callable[..., Any]:
        @functools.wraps(fn)
        def guarded(self: Any, *args: Any) -> Any:
            if self._captures:
                with self._lock:
                    code = self._unsafe_gate(name)
                if code:
                    return (code,) + (None,) * values
            return fn(self, *args)

        return guarded

    def event_rule(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def guarded(self: Any, event: Any) -> Any:
            with self._lock:
                code = self._event_gate(event)
            return (code,) if code else fn(self, event)

        return guarded

    def enqueue(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def recorded(self: Any, handle: Any, run: Any, what: str, deps: Any = None) -> Any:
            if self._captures:
                s = handle if isinstance(handle, _Stream) else self._stream(handle)
                node = self._capture_record(s, run, what)
                if node is not None:
                    return node
            return fn(self, handle, run, what, deps)

        return recorded

    def queue_kernel(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def guarded(self: Any, handle: Any, kernel: Any, args: Any) -> Any:
            if self._captures:
                with self._lock:
                    self._legacy_launch_gate(self._stream(handle))
            return fn(self, handle, kernel, args)  # on a capturing stream: recorded

        return guarded

    for name, (index, values, rule) in _STREAM_RULES.items():
        fn = getattr(cls, name, None)
        if fn is not None:
            setattr(cls, name, stream_rule(name, fn, index, values, rule))
    for name, values in _UNSAFE.items():
        setattr(cls, name, unsafe_rule(name, getattr(cls, name), values))
    for name in _UNSAFE_NOT_SIMULATED:
        fn = getattr(cls, name, None)
        if fn is not None:
            setattr(cls, name, unsafe_rule(name, fn, 1))
    for name in ("cuEventQuery", "cuEventSynchronize"):
        setattr(cls, name, event_rule(getattr(cls, name)))
    cls._enqueue = enqueue(cls._enqueue)  # type: ignore[attr-defined]
    cls.queue_kernel = queue_kernel(cls.queue_kernel)  # type: ignore[attr-defined]
