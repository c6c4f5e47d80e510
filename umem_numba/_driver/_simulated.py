"""A simulated CUDA driver over host memory, for numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``).

:mod:`umem_numba._driver` loads this object instead of ``cuda.bindings.driver``
when numba's simulator is on.  It offers the driver entry points umem_numba
calls, with the binding's ``(CUresult, *values)`` convention, and the
binding's own enums and structs (it borrows them from ``cuda.bindings.driver``,
which imports without a GPU).  Every buffer, pool, copy, tracker and launch
class of umem_numba then runs over it unchanged.

Memory
    Device, managed, pinned and pool memory are all host memory that this
    object owns (numpy byte arrays kept alive by address); a "device pointer"
    is the host address.  Each allocation remembers its kind, so pointer
    attributes, advice, range attributes and prefetch locations read back
    what was set.

Streams run late, in an adversarial order
    Each stream is a queue.  Work on it (kernels launched through umem_numba,
    copies, memsets, prefetches, event records, waits, stream-ordered frees)
    runs only when something needs it: a synchronisation of an event, a
    stream or the context, a query that then answers "done" (queries of
    unfinished work answer "not ready" a random number of times first), or a
    pageable copy that the real driver also
    completes before returning.  The work a synchronisation needs is run
    one operation at a time, each picked at random, with a seeded
    :class:`random.Random` (``UMEM_SIM_SEED``), among the streams whose next
    operation may run; now and then an operation of an unrelated stream runs
    too.  Host writes land at once; queued work sees them only if it runs
    later, as on a GPU.  A missing wait therefore shows as a stale read, a
    lost write or a corrupted block, the same way for the same seed.

    The legacy stream (handles 0 and 1) is ordered after all earlier work of
    blocking streams and they after its earlier work; handle 2 is a
    different per-thread stream in every thread; streams created with
    ``CU_STREAM_NON_BLOCKING`` have no implicit ordering.

Graph capture
    Work queued on a capturing stream is recorded into a graph instead of
    run; a launch of the instantiated graph queues it on the launch stream,
    late like any stream work.  The driver's capture rules and errors are kept
    (see :class:`_GraphCapture`).  Discards leave garbage drawn from the seed.

Refusals
    What it cannot do (several devices, peer access, IPC, loading modules,
    what a capture cannot record) it refuses with
    :class:`~umem_numba.UnsupportedError` naming the call and the simulator.
    It never gives a wrong answer.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import ctypes
import gc
import itertools
import os
import random
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .._errors import UnsupportedError

__all__ = ["DEFAULT_SEED", "SimDriver", "SimStream", "SimulatedFault", "install_numba", "seed"]

#: The seed used when ``UMEM_SIM_SEED`` is not set.
DEFAULT_SEED = 0
#: Bytes of the simulated device.
TOTAL_MEM = 4 << 30
#: Page size of advice and prefetch bookkeeping (the driver's is the OS page).
PAGE = 4096
#: VMM granularity (the driver's minimum on current GPUs).
GRANULARITY = 2 << 20
#: Chance that a synchronisation also runs an operation no one waits for (0: work runs as late as
#: possible, which is what turns a missing wait into a wrong value; the choice among the streams
#: a synchronisation needs is random in any case).
SPREAD = 0.0
#: How many queries of unfinished work answer "not ready" before one runs it (drawn per operation).
PATIENCE = (4, 24)
#: Chance that pool memory freed on another stream is reused, ordered after the free.
REUSE_ACROSS_STREAMS = 0.5

_SUCCESS = 0
_NOT_READY = 600
_INVALID_VALUE = 1
_INVALID_HANDLE = 400
_ILLEGAL_ADDRESS = 700
_OUT_OF_MEMORY = 2

_DEVICE_ATTRIBUTES = {
    "CONCURRENT_MANAGED_ACCESS": 1,
    "MANAGED_MEMORY": 1,
    "MEMORY_POOLS_SUPPORTED": 1,
    "HOST_MEMORY_POOLS_SUPPORTED": 1,
    "HOST_NUMA_MEMORY_POOLS_SUPPORTED": 1,
    "MEMPOOL_SUPPORTED_HANDLE_TYPES": 0,
    "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED": 1,
    "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED": 1,
    "MULTIPROCESSOR_COUNT": 4,
    "HOST_NUMA_ID": -1,
    "PAGEABLE_MEMORY_ACCESS": 0,
    "CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM": 1,
    "UNIFIED_ADDRESSING": 1,
    "CAN_MAP_HOST_MEMORY": 1,
    "COMPUTE_CAPABILITY_MAJOR": 5,
    "COMPUTE_CAPABILITY_MINOR": 2,
    "WARP_SIZE": 32,
    "MAX_THREADS_PER_BLOCK": 1024,
    "INTEGRATED": 0,
    "DIRECT_MANAGED_MEM_ACCESS_FROM_HOST": 0,
    "CONCURRENT_KERNELS": 1,
    "ASYNC_ENGINE_COUNT": 2,
}


_BY_VALUE: dict[int, int] = {}


def _device_attributes_by_value() -> dict[int, int]:
    """:data:`_DEVICE_ATTRIBUTES` by enum value: the binding names some attributes twice.

    ``CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`` is an alias of
    ``..._VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED`` (102), and the member's ``name`` is the latter.
    """
    if not _BY_VALUE:
        from cuda.bindings import driver

        for name, value in _DEVICE_ATTRIBUTES.items():
            member = getattr(driver.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + name, None)
            if member is not None:
                _BY_VALUE[int(member)] = value
    return _BY_VALUE


def seed() -> int:
    """The seed of this process's simulation: ``UMEM_SIM_SEED``, else :data:`DEFAULT_SEED`."""
    env = os.environ.get("UMEM_SIM_SEED", "").strip()
    return int(env) if env else DEFAULT_SEED


class _Op:
    """One operation queued on a stream."""

    __slots__ = ("deps", "done", "polls", "run", "stream", "what")

    def __init__(self, stream: _Stream, run: Callable[[], None] | None, deps: list[_Op], what: str) -> None:
        self.stream = stream
        self.run = run
        self.deps = deps
        self.done = False
        self.what = what
        self.polls = 0


class _Stream:
    __slots__ = ("blocking", "handle", "kind", "ops", "priority", "sid", "tail")

    def __init__(self, handle: int, sid: int, kind: str, blocking: bool, priority: int = 0) -> None:
        self.handle = handle
        self.sid = sid
        self.kind = kind  # "legacy", "per-thread", "created"
        self.blocking = blocking
        self.priority = priority
        self.ops: list[_Op] = []  # not yet run, in order
        self.tail: _Op | None = None


class _Event:
    __slots__ = ("flags", "op")

    def __init__(self, flags: int) -> None:
        self.flags = flags
        self.op: _Op | None = None  # the record operation of the last cuEventRecord


class _Memory:
    """One allocation: host bytes, their kind and the hints set on them."""

    __slots__ = (
        "accessed_by",
        "array",
        "attach",
        "base",
        "flags",
        "generation",
        "kind",
        "last_prefetch",
        "pool",
        "preferred",
        "read_mostly",
        "size",
    )

    def __init__(self, kind: str, size: int, flags: int = 0, pool: int = 0, base: int | None = None) -> None:
        pages = max(1, -(-size // PAGE))
        if base is None:
            # Page aligned, as the driver's allocations are (at least 256 bytes).
            self.array: np.ndarray | None = np.zeros(pages * PAGE + PAGE, np.uint8)
            addr = self.array.ctypes.data
            self.base = addr + (-addr % PAGE)
        else:  # a VMM mapping: the memory is a shared mapping of a memfd at a reserved address
            self.array = None
            self.base = base
        self.size = size
        self.kind = kind  # "device", "managed", "pinned"
        self.flags = flags
        self.pool = pool
        self.generation = 0  # pool memory: incremented at each reuse
        self.attach = 0
        if kind == "managed":
            self.read_mostly = np.zeros(pages, np.bool_)
            self.preferred = np.full(pages, -2, np.int32)
            self.accessed_by = np.zeros((pages, 2), np.bool_)  # device 0, host
            self.last_prefetch = np.full(pages, -2, np.int32)


class _PoolBlock:
    __slots__ = ("free_op", "memory", "stream")

    def __init__(self, memory: _Memory, stream: _Stream, free_op: _Op) -> None:
        self.memory = memory
        self.stream = stream
        self.free_op = free_op


class _Pool:
    __slots__ = ("attrs", "destroyed", "free", "kind", "preferred", "used")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.destroyed = False
        self.free: list[_PoolBlock] = []
        self.used = 0
        self.preferred = -2  # managed pools: the location code of their allocations' preferred location
        self.attrs: dict[str, int] = {"RELEASE_THRESHOLD": 0, "USED_MEM_HIGH": 0, "RESERVED_MEM_HIGH": 0}


class _Context:
    """What ``cuCtxGetCurrent`` gives: the one context of the one device."""

    def __int__(self) -> int:
        return 0x5100

    def __repr__(self) -> str:
        return "<simulated CUDA context>"


_CONTEXT = _Context()


def _int(value: Any) -> int:
    """A handle or pointer argument as an int (the binding's wrapper types too)."""
    if isinstance(value, int):
        return value
    if value is None:
        return 0
    try:
        return int(value)
    except TypeError:
        v = getattr(value, "value", None)
        return int(v or 0)


# ======================================================================================
# CUDA graph capture (cuStreamBeginCapture ... cuStreamEndCapture) and graph launches.
#
# Work queued on a capturing stream is recorded into the capture's graph instead of run;
# cuGraphLaunch of the instantiated graph queues the recorded work on the launch stream,
# late like any stream work.  The rules of the CUDA programming guide ("Prohibited and
# unhandled operations", cuThreadExchangeStreamCaptureMode) are kept: synchronising or
# querying a capturing stream, a captured event or the context, using the legacy stream
# while a blocking stream captures, and the potentially unsafe calls (allocations, frees)
# in a thread that a capture's mode prohibits, each fail with the driver's error and
# invalidate the capture (cuStreamEndCapture then returns
# CUDA_ERROR_STREAM_CAPTURE_INVALIDATED and no graph).  What is not simulated inside a
# capture (cross-stream capture, stream-ordered allocation nodes, prefetches and other
# operations without a node here) is refused with UnsupportedError naming it.

_CAPTURE_UNSUPPORTED = 900  # CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
_CAPTURE_INVALIDATED = 901  # CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
_CAPTURE_IMPLICIT = 906  # CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
_CAPTURED_EVENT = 907  # CUDA_ERROR_CAPTURED_EVENT
_CAPTURE_WRONG_THREAD = 908  # CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD
_ILLEGAL_STATE = 401  # CUDA_ERROR_ILLEGAL_STATE
_MODE_GLOBAL, _MODE_THREAD_LOCAL, _MODE_RELAXED = 0, 1, 2


class _Node(_Op):
    """Work recorded by a capture (never queued itself: a graph launch queues a copy of it)."""

    __slots__ = ("capture",)

    def __init__(self, capture: _Capture, stream: _Stream, run: Callable[[], None] | None, what: str) -> None:
        super().__init__(stream, run, [], what)
        self.capture = capture


class _Capture:
    """One capture sequence: its stream, mode, thread, state and the nodes recorded so far."""

    __slots__ = ("ident", "invalidated", "mode", "nodes", "stream", "thread")

    def __init__(self, ident: int, stream: _Stream, mode: int) -> None:
        self.ident = ident
        self.stream = stream
        self.mode = mode
        self.thread = threading.get_ident()
        self.invalidated = False
        self.nodes: list[_Node] = []  # in stream order (one stream: a chain)


class _Graph:
    """A captured graph, or an instantiated one (``cuGraphInstantiate`` copies the node list)."""

    __slots__ = ("last", "nodes")

    def __init__(self, nodes: list[tuple[str, Callable[[], None]]]) -> None:
        self.nodes = nodes
        self.last: _Op | None = None  # executable graphs: the end of the last launch


class _CaptureMode(threading.local):
    mode = _MODE_GLOBAL  # cuThreadExchangeStreamCaptureMode; the driver's default


def _refuse_in_capture(what: str) -> UnsupportedError:
    return UnsupportedError(
        f"{what}: not simulated inside a CUDA graph capture under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1); "
        "it needs a real GPU"
    )


class _GraphCapture:
    """The simulated driver's stream capture and graphs (mixed into :class:`SimDriver`)."""

    _lock: threading.RLock
    _register: Callable[[dict[int, Any], Callable[[int], Any]], tuple[Any, ...]]
    _unregister: Callable[[dict[int, Any], Any, int], tuple[Any, ...]]

    def _init_capture(self) -> None:
        self._captures: dict[_Stream, _Capture] = {}
        self._graphs: dict[int, _Graph] = {}
        self._execs: dict[int, _Graph] = {}
        self._capture_ids = itertools.count(1)
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
        if run is not None:  # event records and waits within the capture add no node
            cap.nodes.append(node)
        return node

    # -- entry points ----------------------------------------------------------------------
    def cuThreadExchangeStreamCaptureMode(self, mode: Any) -> tuple[Any, ...]:
        old = self._capture_mode.mode
        self._capture_mode.mode = _int(mode)
        return (_SUCCESS, self._real.CUstreamCaptureMode(old))  # type: ignore[attr-defined]

    def cuStreamBeginCapture(self, handle: Any, mode: Any) -> tuple[Any, ...]:
        m = _int(mode)
        if m not in (_MODE_GLOBAL, _MODE_THREAD_LOCAL, _MODE_RELAXED):
            return (_INVALID_VALUE,)
        with self._lock:
            try:
                s = self._stream(handle)  # type: ignore[attr-defined]
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
                s = self._stream(handle)  # type: ignore[attr-defined]
            except _Error as e:
                return (e.code, None)
            cap = self._captures.get(s)
            if cap is None:
                return (_ILLEGAL_STATE, None)
            if cap.mode != _MODE_RELAXED and cap.thread != threading.get_ident():
                return (_CAPTURE_WRONG_THREAD, None)
            del self._captures[s]
            if cap.invalidated:
                return (_CAPTURE_INVALIDATED, None)
            graph = _Graph([(n.what, n.run) for n in cap.nodes if n.run is not None])
            return self._register(self._graphs, lambda _: graph)

    def cuStreamIsCapturing(self, handle: Any) -> tuple[Any, ...]:
        status = self._real.CUstreamCaptureStatus  # type: ignore[attr-defined]
        with self._lock:
            try:
                s = self._stream(handle)  # type: ignore[attr-defined]
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
            # launch of the same executable graph; its nodes run in their captured order.
            after = [] if g.last is None else [g.last]
            for what, run in g.nodes:
                after = [self._enqueue(handle, run, f"graph: {what}", after)]  # type: ignore[attr-defined]
            g.last = self._enqueue(handle, None, "graph launch end", after)  # type: ignore[attr-defined]
        return (_SUCCESS,)

    # -- the rules, applied to the entry points by _guard_capture --------------------------
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
            ev = self._events.get(_int(args[1]))  # type: ignore[attr-defined]
            op = None if ev is None else ev.op
            if isinstance(op, _Node):
                if cap is op.capture:
                    return 0  # within the capture's own stream: ordered already
                raise _refuse_in_capture(f"{name} on an event recorded in a capture (cross-stream capture)")
            if cap is not None:
                raise _refuse_in_capture(f"{name}: a capturing stream waiting for an event recorded outside it")
            return 0
        if cap is None:
            return 0
        if rule == "refuse":
            raise _refuse_in_capture(name)
        if rule == "copy":
            dst, src = (args[0], args[2]) if name == "cuMemcpyPeerAsync" else (args[0], args[1])
            for p in (dst, src):
                ptr = p.ctypes.data if isinstance(p, np.ndarray) else _int(p)
                if self._find(ptr) is None:  # type: ignore[attr-defined]
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
        ev = self._events.get(_int(event))  # type: ignore[attr-defined]
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

    def refuse_plain_launch_in_capture(self, stream: Any) -> None:
        """numba's simulator runs a plain ``kernel[g, b, s](...)`` at the call: refuse it where it would be captured."""
        with self._lock:
            if not self._captures:
                return
            s = self._stream(stream)  # type: ignore[attr-defined]
            self._legacy_launch_gate(s)
            if s in self._captures:
                raise _refuse_in_capture("a plain numba launch on a capturing stream (numba's simulator runs it now)")


#: Entry points that take a stream: (index of the stream argument, values returned after the
#: CUresult, rule).  "record": queued work, recorded into the graph of a capturing stream;
#: "copy": the same, refusing pageable memory; "sync": synchronises or queries the stream,
#: not permitted while it captures; "wait": cuStreamWaitEvent; "refuse": not simulated in a capture.
_STREAM_RULES: dict[str, tuple[int, int, str]] = {
    "cuMemcpyAsync": (3, 0, "copy"),
    "cuMemcpyHtoDAsync": (3, 0, "copy"),
    "cuMemcpyDtoHAsync": (3, 0, "copy"),
    "cuMemcpyDtoDAsync": (3, 0, "copy"),
    "cuMemcpyPeerAsync": (5, 0, "copy"),
    "cuMemsetD8Async": (3, 0, "record"),
    "cuMemsetD32Async": (3, 0, "record"),
    "cuEventRecord": (1, 0, "record"),
    "cuStreamWaitEvent": (0, 0, "wait"),
    "cuStreamSynchronize": (0, 0, "sync"),
    "cuStreamQuery": (0, 0, "sync"),
    "cuStreamGetDevice": (0, 1, "sync"),
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


def _guard_capture(cls: type) -> None:
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


class SimDriver(_GraphCapture):
    """The simulated driver: the subset of ``cuda.bindings.driver`` that umem_numba uses."""

    #: How :mod:`umem_numba._driver` recognises it.
    SIMULATED = True

    def __init__(self, seed_value: int | None = None) -> None:
        from cuda.bindings import driver as real

        self._real = real
        self._lock = threading.RLock()
        self.seed = seed() if seed_value is None else seed_value
        self._rng = random.Random(self.seed)
        self._ids = itertools.count(1)
        self._handles = itertools.count(0x1000, 0x10)
        self._memory: dict[int, _Memory] = {}
        self._bases: list[int] = []
        self._events: dict[int, _Event] = {}
        self._pools: dict[int, _Pool] = {}
        self._defaults: dict[str, int] = {}
        self._current_pool = 0
        self._reserved: dict[int, int] = {}
        self._physical: dict[int, tuple[int, int, bool]] = {}
        self._legacy = _Stream(0, next(self._ids), "legacy", True)
        self._streams: dict[int, _Stream] = {}
        self._per_thread: dict[int, _Stream] = {}
        self._pending: list[_Op] = []
        self._running = False
        #: Operations run so far, as (stream id, what): tests read the order from it.
        self.trace: list[tuple[int, str]] = []
        self.keep_trace = False
        self._init_capture()
        self._range_get_attribute: Any = None

    # -- the binding's enums and structs -------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name.startswith("cu") and name[2:3].isupper():
            if name.endswith("_v2") or name == "cuMemPrefetchBatchAsync":
                raise AttributeError(name)  # optional entry points: umem_numba falls back
            return self._refuse(name)
        return getattr(self._real, name)

    @staticmethod
    def _refuse(name: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise UnsupportedError(
                f"{name}: not supported under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1); it needs a real GPU"
            )

        refuse.__name__ = name
        return refuse

    def reseed(self, value: int) -> None:
        """Restart the random order from ``value`` (pending work stays queued)."""
        with self._lock:
            self.seed = value
            self._rng = random.Random(value)

    # -- scheduling ------------------------------------------------------------------
    def _stream(self, handle: Any) -> _Stream:
        h = _int(handle)
        if h in (0, 1):
            return self._legacy
        if h == 2:
            tid = threading.get_ident()
            s = self._per_thread.get(tid)
            if s is None:
                s = self._per_thread[tid] = _Stream(2, next(self._ids), "per-thread", True)
            return s
        s = self._streams.get(h)
        if s is None:
            raise _Error(_INVALID_HANDLE)
        return s

    def _all_streams(self) -> list[_Stream]:
        return [self._legacy, *self._per_thread.values(), *self._streams.values()]

    def _register(self, table: dict[int, Any], make: Callable[[int], Any]) -> tuple[Any, ...]:
        """A new handle for ``make(handle)`` in ``table`` (lock held): the driver's ``(CUDA_SUCCESS, handle)``."""
        handle = next(self._handles)
        table[handle] = make(handle)
        return (_SUCCESS, handle)

    @staticmethod
    def _unregister(table: dict[int, Any], handle: Any, missing: int) -> tuple[Any, ...]:
        """Forget ``handle`` (lock held); ``missing`` is the driver's error for one it never gave out."""
        return (_SUCCESS,) if table.pop(_int(handle), None) is not None else (missing,)

    def _enqueue(self, handle: Any, run: Callable[[], None] | None, what: str, deps: list[_Op] | None = None) -> _Op:
        """Queue ``run`` on a stream (handle or :class:`_Stream`), after its earlier work and implicit orderings."""
        s = handle if isinstance(handle, _Stream) else self._stream(handle)
        after = [d for d in (deps or ()) if not d.done]
        if s.tail is not None and not s.tail.done:
            after.append(s.tail)
        if s.kind == "legacy":
            for other in self._all_streams():
                if other is not s and other.blocking and other.tail is not None and not other.tail.done:
                    after.append(other.tail)
        elif s.blocking:
            t = self._legacy.tail
            if t is not None and not t.done:
                after.append(t)
        op = _Op(s, run, after, what)
        s.ops.append(op)
        s.tail = op
        self._pending.append(op)
        return op

    def _needed(self, targets: list[_Op]) -> set[_Op]:
        need: set[_Op] = set()
        todo = [t for t in targets if not t.done]
        while todo:
            op = todo.pop()
            if op in need or op.done:
                continue
            need.add(op)
            todo.extend(op.deps)
            # Work earlier on its stream comes first too (it is among deps, but be sure).
            for earlier in op.stream.ops:
                if earlier is op:
                    break
                if not earlier.done and earlier not in need:
                    todo.append(earlier)
        return need

    @staticmethod
    def _ready(op: _Op) -> bool:
        return not op.done and op.stream.ops[0] is op and all(d.done for d in op.deps)

    def _drive(self, targets: list[_Op]) -> None:
        """Run queued work until every op of ``targets`` has run (lock held).

        Garbage collection is off meanwhile.  A finalizer it ran here would run in this thread,
        where the lock is re-entrant: one that waits for device work would drive the queues in the
        middle of this bookkeeping (CI saw an op taken off its stream and never marked done, and
        every later op of that stream then waited for it forever).  No garbage collection while
        simulated work runs, either: a finalizer run by a kernel's threads would call this driver,
        whose lock this thread holds while it waits for them.
        """
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._drive_with_gc_off(targets)
        finally:
            if collecting:
                gc.enable()

    def _drive_with_gc_off(self, targets: list[_Op]) -> None:
        while True:
            need = self._needed(targets)
            if not need:
                return
            if self._running:
                # Called while an operation runs (a finalizer during a simulated kernel): device
                # work cannot wait for the host, and numba's simulator runs one kernel at a time.
                raise RuntimeError("umem_numba simulated driver: waiting for device work from inside device work")
            ready = [op for op in need if self._ready(op)]
            if self._rng.random() < SPREAD:
                extra = [op for op in self._pending if op not in need and self._ready(op)]
                if extra:
                    ready = extra
            if not ready:  # pragma: no cover - every dependency is earlier work, so one is always ready
                raise RuntimeError("umem_numba simulated driver: no runnable work (dependency cycle)")
            ready.sort(key=lambda o: o.stream.sid)  # a deterministic list for the seeded choice
            op = self._rng.choice(ready)
            # Only if it is still next: a weakref callback run since ``ready`` was made (same
            # thread, re-entrant lock) may have waited for device work and run it already.
            if self._ready(op):
                self._run(op)

    def _run(self, op: _Op) -> None:
        op.stream.ops.pop(0)
        self._pending.remove(op)
        op.done = True
        op.deps = []
        run, op.run = op.run, None  # the tail of a stream and an event keep the op: not its arguments
        if self.keep_trace:
            self.trace.append((op.stream.sid, op.what))
        if run is not None:  # garbage collection is off (see _drive)
            self._running = True
            try:
                run()
            finally:
                self._running = False

    def _drain(self) -> None:
        self._drive(list(self._pending))

    def drain_quietly(self) -> list[BaseException]:
        """Run all queued work; return the errors it raised (each failed operation is dropped)."""
        errors: list[BaseException] = []
        with self._lock:
            while self._pending:
                try:
                    self._drain()
                except Exception as exc:
                    errors.append(exc)
        return errors

    def _stream_targets(self, s: _Stream) -> list[_Op]:
        return list(s.ops)

    # -- memory bookkeeping ------------------------------------------------------------
    def _add_memory(self, mem: _Memory) -> int:
        self._memory[mem.base] = mem
        bisect.insort(self._bases, mem.base)
        return mem.base

    def _remove_memory(self, mem: _Memory) -> None:
        del self._memory[mem.base]
        self._bases.remove(mem.base)

    def _find(self, ptr: int) -> _Memory | None:
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i < 0:
            return None
        mem = self._memory[self._bases[i]]
        return mem if ptr < mem.base + max(mem.size, 1) else None

    def _check_live(self, ptr: int, nbytes: int, what: str) -> None:
        """Raise (an illegal address, as a GPU would fault) unless ``[ptr, ptr + nbytes)`` is simulated memory."""
        end = ptr + nbytes
        while ptr < end:
            mem = self._find(ptr)
            if mem is None:
                raise SimulatedFault(
                    f"{what}: {end - ptr} bytes at {ptr:#x} are not allocated memory (freed, unmapped, or never)"
                )
            if mem.kind == "vmm" and not mem.flags:
                raise SimulatedFault(f"{what}: the device has no access to the VMM mapping at {mem.base:#x}")
            ptr = mem.base + mem.size

    def owns(self, ptr: int) -> bool:
        """Whether ``ptr`` lies in memory this driver allocated."""
        with self._lock:
            return self._find(_int(ptr)) is not None

    # -- kernels: the one entry point umem_numba's launch uses ---------------------------
    def queue_kernel(self, handle: Any, kernel: Any, args: tuple[Any, ...]) -> None:
        """Queue a launch of numba's simulated ``kernel`` (configured) on a stream.

        ``args`` holds numpy arrays over device memory where the kernel takes
        buffers: they become numba's simulator arrays when the kernel runs
        (no copies, so views and aliasing behave as on a GPU).
        """
        griddim, blockdim = kernel.grid_dim, kernel.block_dim
        shared = getattr(kernel, "dynshared_size", 0)
        name = getattr(kernel, "__name__", "kernel")

        def run() -> None:
            for a in ours:
                self._check_live(a.ctypes.data, a.nbytes, f"kernel {name}")
            run_kernel(kernel, griddim, blockdim, shared, _fake_args(args))

        with self._lock:
            # Arrays over this driver's memory must still be allocated when the kernel runs;
            # others (numba's simulator arrays: host memory) are kept alive by the arguments.
            ours = [a for a in _arrays_in(args) if a.size and self._find(a.ctypes.data) is not None]
            self._enqueue(handle, run, f"kernel {name}")

    # ==================================================================================
    # Entry points (alphabetical by group).  Each returns (CUresult, *values).

    # -- initialisation, devices, contexts -----------------------------------------------
    def cuInit(self, flags: int) -> tuple[Any, ...]:
        return (self._real.CUresult.CUDA_SUCCESS,)

    def cuDriverGetVersion(self) -> tuple[Any, ...]:
        return (_SUCCESS, 13000)

    def cuDeviceGetCount(self) -> tuple[Any, ...]:
        return (_SUCCESS, 1)

    def cuDeviceGet(self, ordinal: int) -> tuple[Any, ...]:
        return (_SUCCESS, 0) if _int(ordinal) == 0 else (_INVALID_VALUE, None)

    def cuDeviceGetName(self, length: int, device: Any) -> tuple[Any, ...]:
        return (_SUCCESS, b"umem_numba simulated device (numba CUDA simulator)")

    def cuDeviceGetUuid(self, device: Any) -> tuple[Any, ...]:
        uuid = self._real.CUuuid()
        return (_SUCCESS, uuid)

    def cuDeviceTotalMem(self, device: Any) -> tuple[Any, ...]:
        return (_SUCCESS, TOTAL_MEM)

    def cuDeviceGetAttribute(self, attr: Any, device: Any) -> tuple[Any, ...]:
        if _int(device) != 0:
            return (_INVALID_VALUE, None)
        return (_SUCCESS, _device_attributes_by_value().get(_int(attr), 0))

    def cuDeviceCanAccessPeer(self, dev: Any, peer: Any) -> tuple[Any, ...]:
        return (_SUCCESS, 0)

    def cuDevicePrimaryCtxGetState(self, device: Any) -> tuple[Any, ...]:
        return (_SUCCESS, 0, 1)

    def cuCtxGetCurrent(self) -> tuple[Any, ...]:
        return (_SUCCESS, _CONTEXT)

    def cuCtxSetCurrent(self, ctx: Any) -> tuple[Any, ...]:
        return (_SUCCESS,)

    def cuCtxPushCurrent(self, ctx: Any) -> tuple[Any, ...]:
        return (_SUCCESS,)

    def cuCtxPopCurrent(self) -> tuple[Any, ...]:
        return (_SUCCESS, _CONTEXT)

    def cuCtxGetDevice(self) -> tuple[Any, ...]:
        return (_SUCCESS, 0)

    def cuCtxGetStreamPriorityRange(self) -> tuple[Any, ...]:
        return (_SUCCESS, 0, -5)

    def cuCtxSynchronize(self) -> tuple[Any, ...]:
        with self._lock:
            self._drain()
        return (_SUCCESS,)

    def cuMemGetInfo(self) -> tuple[Any, ...]:
        with self._lock:
            used = self._used() - sum(m.size for m in self._memory.values() if m.kind == "pinned")
        return (_SUCCESS, TOTAL_MEM - used, TOTAL_MEM)

    # -- allocation --------------------------------------------------------------------
    def _allocate(self, kind: str, nbytes: Any, flags: int = 0, pool: int = 0) -> tuple[Any, ...]:
        n = _int(nbytes)
        if n <= 0:
            return (_INVALID_VALUE, None)
        with self._lock:
            if self._used() + n > TOTAL_MEM:
                return (_OUT_OF_MEMORY, None)
            try:
                mem = _Memory(kind, n, flags, pool)
            except MemoryError:
                return (_OUT_OF_MEMORY, None)
            return (_SUCCESS, self._add_memory(mem))

    def _used(self) -> int:
        """Device bytes in use: allocations (not VMM mappings) and VMM physical memory."""
        mapped = sum(m.size for m in self._memory.values() if m.kind != "vmm")
        return mapped + sum(size for _, size, _ in self._physical.values())

    def cuMemAlloc(self, nbytes: Any) -> tuple[Any, ...]:
        return self._allocate("device", nbytes)

    def cuMemAllocManaged(self, nbytes: Any, flags: Any) -> tuple[Any, ...]:
        res = self._allocate("managed", nbytes, _int(flags))
        if res[0] == _SUCCESS:
            self._memory[res[1]].attach = _int(flags)
        return res

    def cuMemHostAlloc(self, nbytes: Any, flags: Any) -> tuple[Any, ...]:
        return self._allocate("pinned", nbytes, _int(flags))

    def cuMemHostGetDevicePointer(self, ptr: Any, flags: Any) -> tuple[Any, ...]:
        with self._lock:
            mem = self._find(_int(ptr))
        if mem is None or mem.kind != "pinned":
            return (_INVALID_VALUE, None)
        return (_SUCCESS, _int(ptr))

    def cuMemHostGetFlags(self, ptr: Any) -> tuple[Any, ...]:
        with self._lock:
            mem = self._find(_int(ptr))
        if mem is None or mem.kind != "pinned" or mem.pool:  # cuMemHostAlloc memory only
            return (_INVALID_VALUE, None)
        return (_SUCCESS, mem.flags)

    def _free(self, ptr: Any, kinds: tuple[str, ...]) -> tuple[Any, ...]:
        p = _int(ptr)
        with self._lock:
            mem = self._memory.get(p)
            if mem is None or mem.kind not in kinds or mem.pool:
                return (_INVALID_VALUE,)
            # The driver's free waits for the device work queued before it (not possible from
            # a finalizer run while simulated work runs: that work holds what it uses).
            if not self._running:
                self._drain()
            self._remove_memory(mem)
        return (_SUCCESS,)

    def cuMemFree(self, ptr: Any) -> tuple[Any, ...]:
        return self._free(ptr, ("device", "managed"))

    def cuMemFreeHost(self, ptr: Any) -> tuple[Any, ...]:
        return self._free(ptr, ("pinned",))

    # -- pools ---------------------------------------------------------------------------
    def cuMemPoolCreate(self, props: Any) -> tuple[Any, ...]:
        managed = getattr(props.allocType, "name", "").endswith("MANAGED")
        if int(props.handleTypes):
            raise UnsupportedError(
                "cuMemPoolCreate: exportable memory pools are not supported under numba's CUDA simulator "
                "(NUMBA_ENABLE_CUDASIM=1); they need a real GPU"
            )
        preferred = -2
        host: dict[str, int] | None = None
        if managed:
            # A managed pool's location is its allocations' preferred location (device, host, host NUMA).
            try:
                preferred = self._location_code(props.location)
            except _Error as e:
                return (e.code, None)
        else:
            found = self._host_pool_location(props)
            if isinstance(found, int):
                return (found, None)
            host = found
        pool = _Pool("managed" if managed else "device" if host is None else "pinned")
        pool.preferred = preferred
        if host is not None:
            pool.attrs.update(host)
        with self._lock:
            return self._register(self._pools, lambda _: pool)

    def _pool(self, handle: Any) -> _Pool:
        pool = self._pools.get(_int(handle))
        if pool is None or pool.destroyed:
            raise _Error(_INVALID_VALUE)
        return pool

    def cuMemPoolDestroy(self, handle: Any) -> tuple[Any, ...]:
        with self._lock:
            pool = self._pools.get(_int(handle))
            if pool is None or pool.destroyed:
                return (_INVALID_VALUE,)
            # Outstanding allocations stay valid until freed, as the driver's do.
            pool.destroyed = True
            self._drain()
            for block in pool.free:
                if block.memory.base in self._memory:
                    self._remove_memory(block.memory)
            pool.free = []
        return (_SUCCESS,)

    def cuMemAllocFromPoolAsync(self, nbytes: Any, handle: Any, stream: Any) -> tuple[Any, ...]:
        n = _int(nbytes)
        with self._lock:
            try:
                pool = self._pool(handle)
                s = self._stream(stream)
            except _Error as e:
                return (e.code, None)
            size = -(-max(n, 1) // 512) * 512
            for i, block in enumerate(pool.free):
                if block.memory.size != size:
                    continue
                if block.stream is s or block.free_op.done:
                    pass  # stream order, or the free has run: reuse as the driver may
                elif self._rng.random() < REUSE_ACROSS_STREAMS:
                    # The driver may reuse it, ordering the allocation after the free.
                    self._enqueue(stream, None, "pool reuse dependency", [block.free_op])
                else:
                    continue
                del pool.free[i]
                pool.used += size
                mem = block.memory
                mem.generation += 1
                if mem.base not in self._memory:
                    self._add_memory(mem)
                return (_SUCCESS, mem.base)
            kind = pool.kind if pool.kind in ("managed", "pinned") else "device"
            res = self._allocate(kind, size, 0, _int(handle))
            if res[0] == _SUCCESS:
                pool.used += size
                if kind == "managed":
                    self._memory[res[1]].preferred[:] = pool.preferred
            return res

    def cuMemFreeAsync(self, ptr: Any, stream: Any) -> tuple[Any, ...]:
        p = _int(ptr)
        with self._lock:
            mem = self._memory.get(p)
            if mem is None or not mem.pool:
                return (_INVALID_VALUE,)
            pool = self._pools[mem.pool]
            if pool.destroyed:
                self._remove_memory(mem)
                return (_SUCCESS,)
            try:
                s = self._stream(stream)
            except _Error as e:
                return (e.code,)
            generation = mem.generation

            def run() -> None:
                # Freed memory holds garbage: work that reads it after the free shows it.
                ctypes.memset(mem.base, 0xFF, mem.size)
                if mem.generation == generation and mem.base in self._memory:
                    self._remove_memory(mem)  # not handed out again meanwhile: gone

            op = self._enqueue(s, run, "pool free")
            pool.free.append(_PoolBlock(mem, s, op))
            pool.used -= mem.size
        return (_SUCCESS,)

    def cuMemPoolTrimTo(self, handle: Any, keep: Any) -> tuple[Any, ...]:
        with self._lock:
            try:
                pool = self._pool(handle)
            except _Error as e:
                return (e.code,)
            kept = 0
            remaining = []
            for block in pool.free:
                if block.free_op.done and kept + block.memory.size > _int(keep):
                    continue  # released
                kept += block.memory.size
                remaining.append(block)
            pool.free = remaining
        return (_SUCCESS,)

    def cuMemPoolGetAttribute(self, handle: Any, attr: Any) -> tuple[Any, ...]:
        name = getattr(attr, "name", str(attr)).replace("CU_MEMPOOL_ATTR_", "")
        with self._lock:
            try:
                pool = self._pool(handle)
            except _Error as e:
                return (e.code, None)
            reserved = pool.used + sum(b.memory.size for b in pool.free)
            values = {
                "USED_MEM_CURRENT": pool.used,
                "RESERVED_MEM_CURRENT": reserved,
            }
            pool.attrs["USED_MEM_HIGH"] = max(pool.attrs["USED_MEM_HIGH"], pool.used)
            pool.attrs["RESERVED_MEM_HIGH"] = max(pool.attrs["RESERVED_MEM_HIGH"], reserved)
            value = values.get(name, pool.attrs.get(name, 0))
        plain = ("REUSE_FOLLOW_EVENT_DEPENDENCIES", "LOCATION_TYPE", "LOCATION_ID", "ALLOCATION_TYPE")
        return (_SUCCESS, self._real.cuuint64_t(value) if name not in plain else value)

    def cuMemPoolSetAttribute(self, handle: Any, attr: Any, value: Any) -> tuple[Any, ...]:
        name = getattr(attr, "name", str(attr)).replace("CU_MEMPOOL_ATTR_", "")
        with self._lock:
            try:
                pool = self._pool(handle)
            except _Error as e:
                return (e.code,)
            pool.attrs[name] = _int(value)
        return (_SUCCESS,)

    def cuMemPoolGetAccess(self, handle: Any, location: Any) -> tuple[Any, ...]:
        with self._lock:
            try:
                pool = self._pool(handle)
            except _Error as e:
                return (e.code, None)
            # A host (pinned) pool is mapped for no device until access is granted.
            own = 3 if int(location.id) == 0 and pool.kind != "pinned" else 0
            flags = pool.attrs.get(f"access{int(location.id)}", own)
        return (_SUCCESS, self._real.CUmemAccess_flags(flags))

    def cuMemPoolSetAccess(self, handle: Any, descs: Any, count: Any) -> tuple[Any, ...]:
        with self._lock:
            try:
                pool = self._pool(handle)
            except _Error as e:
                return (e.code,)
            for d in list(descs)[: _int(count)]:
                if int(d.location.id) != 0:
                    return (101,)  # CUDA_ERROR_INVALID_DEVICE: one device
                pool.attrs[f"access{int(d.location.id)}"] = int(d.flags)
        return (_SUCCESS,)

    def _default_pool(self, kind: str) -> int:
        handle = self._defaults.get(kind)
        if handle is None:
            handle = self._defaults[kind] = next(self._handles)
            self._pools[handle] = _Pool(kind)
        return handle

    def cuDeviceGetDefaultMemPool(self, device: Any) -> tuple[Any, ...]:
        with self._lock:
            return (_SUCCESS, self._default_pool("device"))

    def cuDeviceGetMemPool(self, device: Any) -> tuple[Any, ...]:
        with self._lock:
            return (_SUCCESS, self._current_pool or self._default_pool("device"))

    def cuDeviceSetMemPool(self, device: Any, handle: Any) -> tuple[Any, ...]:
        with self._lock:
            try:
                self._pool(handle)
            except _Error as e:
                return (e.code,)
            self._current_pool = _int(handle)
        return (_SUCCESS,)

    def cuMemGetDefaultMemPool(self, location: Any, kind: Any) -> tuple[Any, ...]:
        if not getattr(location.type, "name", "").endswith("DEVICE") or int(location.id) != 0:
            return (801, None)  # CUDA_ERROR_NOT_SUPPORTED: host pools are not simulated
        managed = getattr(kind, "name", "").endswith("MANAGED")
        with self._lock:
            return (_SUCCESS, self._default_pool("managed" if managed else "device"))

    # -- streams and events ------------------------------------------------------------
    def cuStreamCreate(self, flags: Any) -> tuple[Any, ...]:
        return self.cuStreamCreateWithPriority(flags, 0)

    def cuStreamCreateWithPriority(self, flags: Any, priority: Any) -> tuple[Any, ...]:
        blocking = not (_int(flags) & 1)
        with self._lock:
            return self._register(
                self._streams, lambda h: _Stream(h, next(self._ids), "created", blocking, _int(priority))
            )

    def cuStreamDestroy(self, handle: Any) -> tuple[Any, ...]:
        with self._lock:
            s = self._streams.pop(_int(handle), None)
            if s is None:
                return (_INVALID_HANDLE,)
            # Work already queued still runs when needed (its operations stay pending).
        return (_SUCCESS,)

    def cuStreamGetId(self, handle: Any) -> tuple[Any, ...]:
        with self._lock:
            try:
                return (_SUCCESS, self._stream(handle).sid)
            except _Error as e:
                return (e.code, None)

    def cuStreamGetDevice(self, handle: Any) -> tuple[Any, ...]:
        return (_SUCCESS, 0)

    def cuStreamGetFlags(self, handle: Any) -> tuple[Any, ...]:
        with self._lock:
            try:
                return (_SUCCESS, 0 if self._stream(handle).blocking else 1)
            except _Error as e:
                return (e.code, None)

    def cuStreamGetPriority(self, handle: Any) -> tuple[Any, ...]:
        with self._lock:
            return (_SUCCESS, self._stream(handle).priority)

    def cuStreamSynchronize(self, handle: Any) -> tuple[Any, ...]:
        with self._lock:
            try:
                s = self._stream(handle)
            except _Error as e:
                return (e.code,)
            self._drive(self._stream_targets(s))
        return (_SUCCESS,)

    def cuStreamQuery(self, handle: Any) -> tuple[Any, ...]:
        with self._lock:
            try:
                s = self._stream(handle)
            except _Error as e:
                return (e.code,)
            return self._query(self._stream_targets(s))

    def _query(self, targets: list[_Op]) -> tuple[Any, ...]:
        """Done if the work has run; else "not ready" the first time, then at random (or run it: done)."""
        pending = [t for t in targets if not t.done]
        if not pending:
            return (_SUCCESS,)
        last = pending[-1]
        if not last.polls:
            last.polls = self._rng.randint(*PATIENCE)
        last.polls -= 1
        # Queued work is still running, as a GPU's would be when checked at once; a program
        # that keeps polling sees it finish (run now) after a random number of polls.
        if last.polls:
            return (_NOT_READY,)
        self._drive(pending)
        return (_SUCCESS,)

    def cuStreamWaitEvent(self, handle: Any, event: Any, flags: Any) -> tuple[Any, ...]:
        with self._lock:
            ev = self._events.get(_int(event))
            if ev is None:
                return (_INVALID_HANDLE,)
            try:
                deps = [] if ev.op is None else [ev.op]
                self._enqueue(handle, None, "wait for an event", deps)
            except _Error as e:
                return (e.code,)
        return (_SUCCESS,)

    def cuStreamAttachMemAsync(self, handle: Any, ptr: Any, length: Any, flags: Any) -> tuple[Any, ...]:
        with self._lock:
            mem = self._find(_int(ptr))
            if mem is None or mem.kind != "managed":
                return (_INVALID_VALUE,)
            f = _int(flags)

            def run() -> None:
                mem.attach = f

            try:
                self._enqueue(handle, run, "attach memory")
            except _Error as e:
                return (e.code,)
        return (_SUCCESS,)

    def cuEventCreate(self, flags: Any) -> tuple[Any, ...]:
        with self._lock:
            return self._register(self._events, lambda _: _Event(_int(flags)))

    def cuEventDestroy(self, event: Any) -> tuple[Any, ...]:
        with self._lock:
            return self._unregister(self._events, event, _INVALID_HANDLE)

    def cuEventRecord(self, event: Any, handle: Any) -> tuple[Any, ...]:
        with self._lock:
            ev = self._events.get(_int(event))
            if ev is None:
                return (_INVALID_HANDLE,)
            try:
                ev.op = self._enqueue(handle, None, "event record")
            except _Error as e:
                return (e.code,)
        return (_SUCCESS,)

    def cuEventQuery(self, event: Any) -> tuple[Any, ...]:
        with self._lock:
            ev = self._events.get(_int(event))
            if ev is None:
                return (_INVALID_HANDLE,)
            return self._query([] if ev.op is None else [ev.op])

    def cuEventSynchronize(self, event: Any) -> tuple[Any, ...]:
        with self._lock:
            ev = self._events.get(_int(event))
            if ev is None:
                return (_INVALID_HANDLE,)
            if ev.op is not None:
                self._drive([ev.op])
        return (_SUCCESS,)

    # -- copies and memsets --------------------------------------------------------------
    def _copy(self, dst: Any, src: Any, nbytes: Any, handle: Any, what: str) -> tuple[Any, ...]:
        d, s_, n = _int(dst), _int(src), _int(nbytes)
        if n < 0:
            return (_INVALID_VALUE,)
        if n == 0:
            return (_SUCCESS,)
        with self._lock:
            try:
                stream = self._stream(handle)
            except _Error as e:
                return (e.code,)
            dst_known, src_known = self._find(d) is not None, self._find(s_) is not None
            if not src_known:
                # Pageable source: the driver has read it when the call returns.
                snapshot = ctypes.string_at(s_, n)

                def run() -> None:
                    if dst_known:
                        self._check_live(d, n, what)
                    ctypes.memmove(d, snapshot, n)

            else:

                def run() -> None:
                    if dst_known:
                        self._check_live(d, n, what)
                    self._check_live(s_, n, what)
                    ctypes.memmove(d, s_, n)

            op = self._enqueue(stream, run, what)
            if not dst_known:
                # Pageable destination: the call returns once the copy is done.
                self._drive([op])
        return (_SUCCESS,)

    def cuMemcpyAsync(self, dst: Any, src: Any, nbytes: Any, handle: Any) -> tuple[Any, ...]:
        return self._copy(dst, src, nbytes, handle, "cuMemcpyAsync")

    def cuMemcpyHtoDAsync(self, dst: Any, src: Any, nbytes: Any, handle: Any) -> tuple[Any, ...]:
        if isinstance(src, np.ndarray):
            src = src.ctypes.data
        return self._copy(dst, src, nbytes, handle, "cuMemcpyHtoDAsync")

    def cuMemcpyDtoHAsync(self, dst: Any, src: Any, nbytes: Any, handle: Any) -> tuple[Any, ...]:
        if isinstance(dst, np.ndarray):
            dst = dst.ctypes.data
        return self._copy(dst, src, nbytes, handle, "cuMemcpyDtoHAsync")

    def cuMemcpyDtoDAsync(self, dst: Any, src: Any, nbytes: Any, handle: Any) -> tuple[Any, ...]:
        return self._copy(dst, src, nbytes, handle, "cuMemcpyDtoDAsync")

    def cuMemcpyPeerAsync(
        self, dst: Any, dst_ctx: Any, src: Any, src_ctx: Any, nbytes: Any, handle: Any
    ) -> tuple[Any, ...]:
        return self._copy(dst, src, nbytes, handle, "cuMemcpyPeerAsync")

    def cuMemsetD8Async(self, ptr: Any, value: Any, count: Any, handle: Any) -> tuple[Any, ...]:
        p, v, n = _int(ptr), _int(value) & 0xFF, _int(count)
        with self._lock:
            if self._find(p) is None:
                return (_INVALID_VALUE,)

            def run() -> None:
                self._check_live(p, n, "cuMemsetD8Async")
                ctypes.memset(p, v, n)

            try:
                self._enqueue(handle, run, "cuMemsetD8Async")
            except _Error as e:
                return (e.code,)
        return (_SUCCESS,)

    def cuMemsetD32Async(self, ptr: Any, value: Any, count: Any, handle: Any) -> tuple[Any, ...]:
        p, v, n = _int(ptr), _int(value) & 0xFFFFFFFF, _int(count)
        with self._lock:
            if self._find(p) is None:
                return (_INVALID_VALUE,)

            def run() -> None:
                self._check_live(p, 4 * n, "cuMemsetD32Async")
                np.frombuffer((ctypes.c_uint32 * n).from_address(p), np.uint32)[:] = v  # type: ignore[call-overload]

            try:
                self._enqueue(handle, run, "cuMemsetD32Async")
            except _Error as e:
                return (e.code,)
        return (_SUCCESS,)

    # The synchronous forms: on the legacy stream, done when they return.
    def _sync(self, res: tuple[Any, ...]) -> tuple[Any, ...]:
        if res[0] == _SUCCESS:
            with self._lock:
                self._drive(list(self._legacy.ops))
        return res

    def cuMemsetD8(self, ptr: Any, value: Any, count: Any) -> tuple[Any, ...]:
        return self._sync(self.cuMemsetD8Async(ptr, value, count, 0))

    def cuMemsetD32(self, ptr: Any, value: Any, count: Any) -> tuple[Any, ...]:
        return self._sync(self.cuMemsetD32Async(ptr, value, count, 0))

    def cuMemcpy(self, dst: Any, src: Any, nbytes: Any) -> tuple[Any, ...]:
        return self._sync(self.cuMemcpyAsync(dst, src, nbytes, 0))

    def cuMemcpyHtoD(self, dst: Any, src: Any, nbytes: Any) -> tuple[Any, ...]:
        return self._sync(self.cuMemcpyHtoDAsync(dst, src, nbytes, 0))

    def cuMemcpyDtoH(self, dst: Any, src: Any, nbytes: Any) -> tuple[Any, ...]:
        return self._sync(self.cuMemcpyDtoHAsync(dst, src, nbytes, 0))

    def cuMemcpyDtoD(self, dst: Any, src: Any, nbytes: Any) -> tuple[Any, ...]:
        return self._sync(self.cuMemcpyDtoDAsync(dst, src, nbytes, 0))

    # -- pointer and range attributes, advice, prefetch ---------------------------------------
    def cuPointerGetAttribute(self, attr: Any, ptr: Any) -> tuple[Any, ...]:
        name = getattr(attr, "name", str(attr)).replace("CU_POINTER_ATTRIBUTE_", "")
        p = _int(ptr)
        with self._lock:
            mem = self._find(p)
        if mem is None:
            return (_INVALID_VALUE, None)
        mt = self._real.CUmemorytype
        values: dict[str, Any] = {
            "IS_MANAGED": mem.kind == "managed",
            "MEMORY_TYPE": mt.CU_MEMORYTYPE_HOST if mem.kind == "pinned" else mt.CU_MEMORYTYPE_DEVICE,
            "MAPPING_BASE_ADDR": mem.base,
            "MAPPING_SIZE": mem.size,
            "DEVICE_POINTER": p,
            "HOST_POINTER": p,
            "DEVICE_ORDINAL": 0,
            "CONTEXT": _CONTEXT,
            "MAPPED": True,
            "RANGE_START_ADDR": mem.base,
            "RANGE_SIZE": mem.size,
            "MEMPOOL_HANDLE": mem.pool or None,
            "IS_LEGACY_CUDA_IPC_CAPABLE": False,
            "SYNC_MEMOPS": True,
            "BUFFER_ID": mem.base,
            "ACCESS_FLAGS": 3,
        }
        if name not in values:
            raise UnsupportedError(
                f"cuPointerGetAttribute({name}): not supported under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)"
            )
        return (_SUCCESS, values[name])

    def _managed_pages(self, ptr: int, nbytes: int) -> tuple[_Memory, slice] | None:
        mem = self._find(ptr)
        if mem is None or mem.kind != "managed" or ptr + nbytes > mem.base + mem.size:
            return None
        lo = (ptr - mem.base) // PAGE
        hi = -(-(ptr - mem.base + nbytes) // PAGE)
        return mem, slice(lo, max(hi, lo + 1))

    def _legacy_id(self, location: Any) -> int:
        kind = getattr(location.type, "name", "")
        if kind.endswith(("HOST", "HOST_NUMA", "HOST_NUMA_CURRENT")):
            return -1
        if kind.endswith("DEVICE"):
            if int(location.id) != 0:
                raise _Error(101)  # CUDA_ERROR_INVALID_DEVICE
            return 0
        raise _Error(_INVALID_VALUE)

    def cuMemAdvise(self, ptr: Any, nbytes: Any, advice: Any, location: Any) -> tuple[Any, ...]:
        p, n = _int(ptr), _int(nbytes)
        name = getattr(advice, "name", str(advice)).replace("CU_MEM_ADVISE_", "")
        with self._lock:
            found = self._managed_pages(p, n)
            if found is None:
                return (_INVALID_VALUE,)
            mem, pages = found
            try:
                loc = self._location_code(location)
            except _Error as e:
                return (e.code,)
            col = 0 if loc == 0 else 1
            if name == "SET_READ_MOSTLY":
                mem.read_mostly[pages] = True
            elif name == "UNSET_READ_MOSTLY":
                mem.read_mostly[pages] = False
            elif name == "SET_PREFERRED_LOCATION":
                mem.preferred[pages] = loc
            elif name == "UNSET_PREFERRED_LOCATION":
                mem.preferred[pages] = -2
            elif name == "SET_ACCESSED_BY":
                mem.accessed_by[pages, col] = True
            elif name == "UNSET_ACCESSED_BY":
                mem.accessed_by[pages, col] = False
            else:
                return (_INVALID_VALUE,)
        return (_SUCCESS,)

    def cuMemPrefetchAsync(self, ptr: Any, nbytes: Any, location: Any, flags: Any, handle: Any) -> tuple[Any, ...]:
        p, n = _int(ptr), _int(nbytes)
        with self._lock:
            found = self._managed_pages(p, n)
            if found is None:
                return (_INVALID_VALUE,)
            mem, pages = found
            try:
                loc = self._location_code(location)
            except _Error as e:
                return (e.code,)

            # The driver reports the last location asked for, done or not.
            mem.last_prefetch[pages] = loc

            def run() -> None:
                self._check_live(p, n, "cuMemPrefetchAsync")

            try:
                self._enqueue(handle, run, "cuMemPrefetchAsync")
            except _Error as e:
                return (e.code,)
        return (_SUCCESS,)

    def cuMemRangeGetAttribute(self, size: Any, attr: Any, ptr: Any, nbytes: Any) -> tuple[Any, ...]:
        name = getattr(attr, "name", str(attr)).replace("CU_MEM_RANGE_ATTRIBUTE_", "")
        p, n, size = _int(ptr), _int(nbytes), _int(size)
        with self._lock:
            found = self._managed_pages(p, n)
            if found is None:
                return (_INVALID_VALUE, None)
            mem, pages = found

            def same(values: np.ndarray) -> int:
                return int(values[0]) if (values == values[0]).all() else -2

            if name == "READ_MOSTLY":
                return (_SUCCESS, int(bool(mem.read_mostly[pages].all())))
            if name == "PREFERRED_LOCATION":
                return (_SUCCESS, same(_legacy_codes(mem.preferred[pages])))
            if name == "LAST_PREFETCH_LOCATION":
                return (_SUCCESS, same(_legacy_codes(mem.last_prefetch[pages])))
            if name.endswith(("_LOCATION_TYPE", "_LOCATION_ID")):
                code = same(mem.preferred[pages] if name.startswith("PREFERRED") else mem.last_prefetch[pages])
                loc_type, loc_id = self._typed_location(code)
                return (_SUCCESS, loc_id if name.endswith("_ID") else loc_type)
            if name == "ACCESSED_BY":
                ids = [loc for col, loc in ((0, 0), (1, -1)) if mem.accessed_by[pages, col].all()]
                slots = max(size // 4, 1)
                return (_SUCCESS, (ids + [-2] * slots)[:slots])
        raise UnsupportedError(
            f"cuMemRangeGetAttribute({name}): not supported under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)"
        )

    # -- virtual memory management: reserved host address space, memfd "physical" memory ----------
    def cuMemGetAllocationGranularity(self, prop: Any, option: Any) -> tuple[Any, ...]:
        return (_SUCCESS, GRANULARITY)

    def cuMemAddressReserve(self, size: Any, alignment: Any, addr: Any, flags: Any) -> tuple[Any, ...]:
        n, align = _int(size), max(_int(alignment), GRANULARITY)
        if n <= 0 or n % GRANULARITY:
            return (_INVALID_VALUE, None)
        raw = _mmap(0, n + align, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1)
        if raw is None:
            return (_OUT_OF_MEMORY, None)
        base = raw + (-raw % align)
        if base > raw:
            _libc().munmap(ctypes.c_void_p(raw), ctypes.c_size_t(base - raw))
        tail = raw + n + align - (base + n)
        if tail:
            _libc().munmap(ctypes.c_void_p(base + n), ctypes.c_size_t(tail))
        with self._lock:
            self._reserved[base] = n
        return (_SUCCESS, base)

    def cuMemAddressFree(self, ptr: Any, size: Any) -> tuple[Any, ...]:
        p, n = _int(ptr), _int(size)
        with self._lock:
            if self._reserved.get(p) != n:
                return (_INVALID_VALUE,)
            if any(p <= m.base < p + n for m in self._memory.values() if m.kind == "vmm"):
                return (_INVALID_VALUE,)  # still mapped
            del self._reserved[p]
        _libc().munmap(ctypes.c_void_p(p), ctypes.c_size_t(n))
        return (_SUCCESS,)

    def cuMemCreate(self, size: Any, prop: Any, flags: Any) -> tuple[Any, ...]:
        n = _int(size)
        if n <= 0 or n % GRANULARITY:
            return (_INVALID_VALUE, None)
        if int(prop.location.id) != 0:
            return (101, None)
        with self._lock:
            if self._used() + n > TOTAL_MEM:
                return (_OUT_OF_MEMORY, None)
        fd = os.memfd_create("umem-sim-vmm", os.MFD_CLOEXEC)
        os.ftruncate(fd, n)
        with self._lock:
            return self._register(self._physical, lambda _: (fd, n, bool(int(prop.requestedHandleTypes))))

    def cuMemRelease(self, handle: Any) -> tuple[Any, ...]:
        with self._lock:
            entry = self._physical.pop(_int(handle), None)
        if entry is None:
            return (_INVALID_VALUE,)
        os.close(entry[0])  # mappings keep the memory, as the driver's do
        return (_SUCCESS,)

    def cuMemExportToShareableHandle(self, handle: Any, kind: Any, flags: Any) -> tuple[Any, ...]:
        with self._lock:
            entry = self._physical.get(_int(handle))
        if entry is None:
            return (_INVALID_VALUE, None)
        if not entry[2]:
            return (800, None)  # CUDA_ERROR_NOT_PERMITTED: not created exportable
        return (_SUCCESS, os.dup(entry[0]))

    def cuMemImportFromShareableHandle(self, fd: Any, kind: Any) -> tuple[Any, ...]:
        try:
            mine = os.dup(_int(fd))
            n = os.fstat(mine).st_size
        except OSError:
            return (_INVALID_VALUE, None)
        with self._lock:
            return self._register(self._physical, lambda _: (mine, n, True))

    def cuMemMap(self, ptr: Any, size: Any, offset: Any, handle: Any, flags: Any) -> tuple[Any, ...]:
        p, n, off = _int(ptr), _int(size), _int(offset)
        with self._lock:
            entry = self._physical.get(_int(handle))
            if entry is None or off + n > entry[1] or n <= 0:
                return (_INVALID_VALUE,)
            if not any(b <= p and p + n <= b + sz for b, sz in self._reserved.items()):
                return (_INVALID_VALUE,)
            if any(self._find(q) is not None for q in (p, p + n - 1)):
                return (_INVALID_VALUE,)  # already mapped
            if _mmap(p, n, _PROT_READ | _PROT_WRITE, _MAP_SHARED | _MAP_FIXED, entry[0], off) is None:
                return (_OUT_OF_MEMORY,)
            self._add_memory(_Memory("vmm", n, 0, 0, base=p))
        return (_SUCCESS,)

    def cuMemUnmap(self, ptr: Any, size: Any) -> tuple[Any, ...]:
        p, n = _int(ptr), _int(size)
        with self._lock:
            maps = [m for m in self._memory.values() if m.kind == "vmm" and p <= m.base < p + n]
            if not maps or any(m.base + m.size > p + n for m in maps):
                return (_INVALID_VALUE,)
            for m in maps:
                self._remove_memory(m)
        _mmap(p, n, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED, -1)
        return (_SUCCESS,)

    def cuMemSetAccess(self, ptr: Any, size: Any, descs: Any, count: Any) -> tuple[Any, ...]:
        p, n = _int(ptr), _int(size)
        flags = 0
        for d in list(descs)[: _int(count)]:
            if int(d.location.id) != 0:
                return (101,)
            flags = int(d.flags)
        with self._lock:
            maps = [m for m in self._memory.values() if m.kind == "vmm" and p <= m.base < p + n]
            if not maps:
                return (_INVALID_VALUE,)
            for m in maps:
                m.flags = flags
        return (_SUCCESS,)

    def cuMemGetAccess(self, location: Any, ptr: Any) -> tuple[Any, ...]:
        with self._lock:
            mem = self._find(_int(ptr))
        if mem is None or mem.kind != "vmm":
            return (_INVALID_VALUE, None)
        if int(location.id) != 0:
            return (_SUCCESS, 0)
        return (_SUCCESS, mem.flags)

    # -- what the GPU path would launch directly ---------------------------------------------
    def cuLaunchKernel(self, *args: Any) -> tuple[Any, ...]:
        raise UnsupportedError(
            "cuLaunchKernel: under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) kernels are run by the "
            "simulator (umem_numba queues them on their stream)"
        )

    # -- host NUMA locations, discards, the typed range attributes' raw entry point -------------
    # Locations are kept per page as one int32 code: a device ordinal (>= 0), -1 the host,
    # -2 none, and host NUMA node k as -3 - k (the legacy attributes say CU_DEVICE_CPU for it).
    def _location_code(self, location: Any) -> int:
        kind = getattr(location.type, "name", "")
        if kind.endswith("HOST_NUMA"):
            node = int(location.id)
            if node not in _host_numa_nodes():
                raise _Error(_INVALID_VALUE)  # no such node on this host
            return _NUMA_BASE - node
        if kind.endswith("HOST_NUMA_CURRENT"):
            raise UnsupportedError(
                "CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT: not simulated under numba's CUDA simulator "
                "(NUMBA_ENABLE_CUDASIM=1); name the host NUMA node instead"
            )
        return self._legacy_id(location)

    def _host_pool_location(self, props: Any) -> dict[str, int] | int | None:
        """A pinned pool's location attributes (``None``: not a host pool; an int: the driver's error)."""
        kind = getattr(props.location.type, "name", "")
        if not kind.endswith(("HOST", "HOST_NUMA")):
            return None
        node = int(props.location.id)
        if kind.endswith("HOST_NUMA") and node not in _host_numa_nodes():
            return _INVALID_VALUE
        return {
            "LOCATION_TYPE": int(props.location.type),
            "LOCATION_ID": node if kind.endswith("HOST_NUMA") else 0,
            "ALLOCATION_TYPE": int(props.allocType),
        }

    def _typed_location(self, code: int) -> tuple[int, int]:
        """``(CUmemLocationType, id)`` of a location code (the driver's typed range attributes)."""
        lt = self._real.CUmemLocationType
        if code <= _NUMA_BASE:
            return int(lt.CU_MEM_LOCATION_TYPE_HOST_NUMA), _NUMA_BASE - code
        if code == -1:
            return int(lt.CU_MEM_LOCATION_TYPE_HOST), 0
        if code == -2:
            return int(lt.CU_MEM_LOCATION_TYPE_INVALID), 0
        return int(lt.CU_MEM_LOCATION_TYPE_DEVICE), code

    def _discard_batch(
        self, call: str, dptrs: Any, sizes: Any, count: Any, locations: list[Any] | None, flags: Any, handle: Any
    ) -> tuple[Any, ...]:
        n = _int(count)
        ptrs, lengths = [_int(p) for p in list(dptrs)[:n]], [_int(z) for z in list(sizes)[:n]]
        if not n or len(ptrs) != n or len(lengths) != n or _int(flags):
            return (_INVALID_VALUE,)
        with self._lock:
            try:
                s = self._stream(handle)
            except _Error as e:
                return (e.code,)
            if s.kind == "legacy":
                return (_INVALID_VALUE,)  # "Must not be legacy NULL stream"
            spans = []
            for p, z in zip(ptrs, lengths, strict=True):
                found = self._managed_pages(p, z) if z > 0 else None
                if found is None:
                    return (_INVALID_VALUE,)  # managed memory only
                spans.append((p, z, found))
            codes: list[int] = []
            if locations is not None:
                try:
                    codes = [self._location_code(loc) for loc in locations]
                except _Error as e:
                    return (e.code,)
                for (_, _, (mem, pages)), code in zip(spans, codes, strict=True):
                    mem.last_prefetch[pages] = code  # the driver reports the last location asked for
            # Discarded contents are indeterminate: garbage, drawn from the seed, when the discard runs.
            salt = self._rng.getrandbits(32)

            def run() -> None:
                for i, (p, z, _) in enumerate(spans):
                    self._check_live(p, z, call)
                    garbage = np.random.default_rng((salt, i)).integers(0, 256, z, dtype=np.uint8)
                    ctypes.memmove(p, garbage.ctypes.data, z)

            self._enqueue(s, run, call)
        return (_SUCCESS,)

    def cuMemDiscardBatchAsync(self, dptrs: Any, sizes: Any, count: Any, flags: Any, handle: Any) -> tuple[Any, ...]:
        return self._discard_batch("cuMemDiscardBatchAsync", dptrs, sizes, count, None, flags, handle)

    def cuMemDiscardAndPrefetchBatchAsync(
        self,
        dptrs: Any,
        sizes: Any,
        count: Any,
        locations: Any,
        first: Any,
        nlocations: Any,
        flags: Any,
        handle: Any,
    ) -> tuple[Any, ...]:
        n, runs = _int(count), _int(nlocations)
        locs, starts = list(locations)[:runs], [_int(i) for i in list(first)[:runs]]
        if (
            not runs
            or runs > n
            or starts[0] != 0
            or any(b <= a for a, b in itertools.pairwise(starts))
            or starts[-1] >= n
        ):
            return (_INVALID_VALUE,)
        per_range = [locs[bisect.bisect_right(starts, i) - 1] for i in range(n)]
        return self._discard_batch("cuMemDiscardAndPrefetchBatchAsync", dptrs, sizes, count, per_range, flags, handle)

    def cuGetProcAddress(self, symbol: Any, version: Any, flags: Any) -> tuple[Any, ...]:
        """The driver's own ``cuMemRangeGetAttribute`` (umem_numba calls it through ctypes); nothing else."""
        name = symbol.decode() if isinstance(symbol, bytes) else str(symbol)
        if name != "cuMemRangeGetAttribute":
            return self._refuse(f"cuGetProcAddress({name})")()
        if self._range_get_attribute is None:
            proto = ctypes.CFUNCTYPE(
                ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64, ctypes.c_size_t
            )
            self._range_get_attribute = proto(self._raw_range_get_attribute)
        pfn = ctypes.cast(self._range_get_attribute, ctypes.c_void_p).value
        return (_SUCCESS, pfn, self._real.CUdriverProcAddressQueryResult.CU_GET_PROC_ADDRESS_SUCCESS)

    def _raw_range_get_attribute(self, out: int, size: int, attr: int, ptr: int, nbytes: int) -> int:
        """``CUresult cuMemRangeGetAttribute(void *data, size_t dataSize, attribute, devPtr, count)``."""
        try:
            res = self.cuMemRangeGetAttribute(size, self._real.CUmem_range_attribute(attr), ptr, nbytes)
        except Exception:  # an attribute the simulation does not answer: the driver's "invalid value"
            return _INVALID_VALUE
        if res[0] != _SUCCESS:
            return int(res[0])
        values = res[1] if isinstance(res[1], list) else [int(res[1])]
        slots = max(int(size) // 4, 1)
        (ctypes.c_int32 * slots).from_address(out)[:] = [int(v) for v in values[:slots]]
        return _SUCCESS


#: Host NUMA node k is kept as the location code _NUMA_BASE - k (see SimDriver._location_code).
_NUMA_BASE = -3


def _legacy_codes(codes: np.ndarray) -> np.ndarray:
    """Location codes as the legacy range attributes say them (a host NUMA node is CU_DEVICE_CPU, -1)."""
    return np.where(codes <= _NUMA_BASE, -1, codes)


_NUMA_NODES: tuple[int, ...] | None = None


def _host_numa_nodes() -> tuple[int, ...]:
    """This host's online NUMA nodes (the kernel's list; node 0 where it has none)."""
    global _NUMA_NODES
    if _NUMA_NODES is None:
        nodes: list[int] = []
        try:
            with open("/sys/devices/system/node/online") as f:
                for part in f.read().strip().split(","):
                    if part:
                        lo, _, hi = part.partition("-")
                        nodes.extend(range(int(lo), int(hi or lo) + 1))
        except (OSError, ValueError):
            pass
        _NUMA_NODES = tuple(nodes) or (0,)
    return _NUMA_NODES


_guard_capture(SimDriver)

_PROT_NONE, _PROT_READ, _PROT_WRITE = 0, 1, 2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _LIBC = lib
    return _LIBC


def _mmap(addr: int, size: int, prot: int, flags: int, fd: int, offset: int = 0) -> int | None:
    """libc's mmap (Python's cannot map at a given address); ``None`` on failure."""
    res = _libc().mmap(ctypes.c_void_p(addr or None), size, prot, flags, fd, offset)
    if res is None or res == ctypes.c_void_p(-1).value:
        return None
    return int(res)


class _Error(Exception):
    """A driver error code raised inside the simulation, returned as the call's result."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class SimulatedFault(RuntimeError):  # noqa: N818  (a fault, as a GPU's)
    """Device work of the simulation touched memory that is not allocated (a GPU would fault)."""


def _arrays_in(args: Any) -> Iterator[np.ndarray]:
    for a in args:
        if isinstance(a, np.ndarray):
            yield a
        elif isinstance(a, (tuple, list)):
            yield from _arrays_in(a)


def fake_array(array: np.ndarray) -> Any:
    """numba's simulator array over ``array`` (no copy)."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return FakeCUDAArray(array)


def _fake_args(args: Any) -> list[Any]:
    """numpy arrays over device memory as numba's simulator arrays (no copy, unlike a numpy argument)."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    out: list[Any] = []
    for a in args:
        if isinstance(a, np.ndarray):
            out.append(FakeCUDAArray(a))
        elif isinstance(a, tuple):
            out.append(tuple(_fake_args(a)))
        elif isinstance(a, list):
            out.append(_fake_args(a))
        else:
            out.append(a)
    return out


#: What a kernel may use only with its threads running side by side (numba's simulator runs
#: one Python thread per CUDA thread for them); any other kernel runs its threads one by one.
_TOGETHER = frozenset(
    {
        "syncthreads",
        "syncthreads_count",
        "syncthreads_and",
        "syncthreads_or",
        "syncwarp",
        "shared",
        "cg",
        "this_grid",
        "shfl_sync",
        "shfl_up_sync",
        "shfl_down_sync",
        "shfl_xor_sync",
        "all_sync",
        "any_sync",
        "eq_sync",
        "ballot_sync",
        "match_any_sync",
        "match_all_sync",
        "activemask",
        "lanemask_lt",
    }
)
_ONE_BY_ONE: dict[Any, bool] = {}


def _names(code: Any) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            yield from _names(const)


def _one_by_one(fn: Any, seen: set[int] | None = None) -> bool:
    """Whether ``fn`` (and the device functions it calls) can run its CUDA threads one after another."""
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return True
    seen.add(id(fn))
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    names = set(_names(code))
    if names & _TOGETHER:
        return False
    values = [fn.__globals__.get(n) for n in names]
    values += [_cell(c) for c in (fn.__closure__ or ())]
    for v in values:
        inner = getattr(v, "py_func", None) if type(v).__name__ == "FakeCUDAKernel" else None
        if inner is not None and not _one_by_one(inner, seen):
            return False
    return True


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _with_module(fn: Any, module: Any) -> Any:
    """``fn`` with ``cuda`` captured from an enclosing function (a closure) bound to ``module``.

    numba's simulator swaps the kernel's global ``cuda`` only; a kernel
    defined inside a function that imported ``cuda`` there gets it here.
    Its numba scalar types (``uint64(i)``) become :func:`_fast_scalars`'s.
    """
    from numba import cuda

    closure = fn.__closure__
    fast = _fast_scalars(fn)
    if fast is None and (not closure or not any(_cell(c) is cuda for c in closure)):
        return fn
    cells = closure and tuple(types.CellType(module) if _cell(c) is cuda else c for c in closure)
    glob = fn.__globals__
    if fast is not None:
        # A copy of the globals, with ``cuda`` swapped as numba swaps it in the original (where a
        # kernel of the same module running in another thread may have put its own fake module).
        from numba.cuda.simulator.kernelapi import FakeCUDAModule

        glob = {k: module if v is cuda or isinstance(v, FakeCUDAModule) else fast.get(k, v) for k, v in glob.items()}
    return types.FunctionType(fn.__code__, glob, fn.__name__, fn.__defaults__, cells)


_FAST_TYPES: dict[int, Any] = {}


def _fast_scalars(fn: Any) -> dict[str, Any] | None:
    """The kernel's global numba scalar types, each as a type that casts a number in a fraction of the time.

    ``uint64(i)`` in a simulated kernel calls numba's ``Type.__call__``: an
    import, an abstract-class check, then ``numpy.uint64(i)``; the stencil
    kernels index with it, and it took three quarters of their simulated
    time.  The stand-in is an instance of a subclass of the same numba type
    class with the same fields (``numpy_support.as_dtype``, ``isinstance`` and
    signatures still see a numba type); called with one number it returns
    ``getattr(numpy, name)(number)`` at once, exactly what numba's does, and
    anything else goes to numba's type itself.  None when the kernel names no
    such type.
    """
    from numba.core import types as nbtypes

    out: dict[str, Any] = {}
    for name in set(_names(fn.__code__)):
        v = fn.__globals__.get(name)
        if type(v) not in (nbtypes.Integer, nbtypes.Float, nbtypes.Complex):
            continue
        fast = _FAST_TYPES.get(id(v))
        if fast is None:
            cast = getattr(np, v.name)
            base = type(v)

            def call(self: Any, *args: Any, _cast: Any = cast, _numba: Any = v) -> Any:
                if len(args) == 1 and (type(args[0]) in (int, float, bool) or isinstance(args[0], np.generic)):
                    return _cast(args[0])
                return _numba(*args)  # a signature, or numba's own error: numba's type answers

            sub = type(f"_Fast{base.__name__}", (base,), {"__call__": call})
            fast = object.__new__(sub)
            fast.__dict__.update(v.__dict__)
            _FAST_TYPES[id(v)] = fast
        out[name] = fast
    return out or None


class _Clock(threading.local):
    """Sleep requested by the CUDA threads of the kernel this thread runs one by one."""

    longest: float | None = None  # seconds; None: not running a kernel one by one
    current = 0.0


_clock = _Clock()


def _nanosleep(ns: int) -> None:
    """``cuda.nanosleep`` in a simulated kernel: the kernel takes (at least) that long."""
    if _clock.longest is None:  # numba's threads run side by side: sleep for real
        time.sleep(ns * 1e-9)
    else:
        _clock.current += ns * 1e-9


_MODULES: dict[type, type] = {}


def _one_by_one_module(base: type) -> type:
    """numba's fake ``cuda`` module with the thread's indices as plain attributes (set per CUDA thread).

    numba's looks them up through ``threading.current_thread()`` at every use.
    """
    cls = _MODULES.get(base)
    if cls is None:
        cls = type(
            "OneByOneCUDAModule",
            (base,),
            {
                "threadIdx": None,
                "blockIdx": None,
                "thread_id": 0,
                "laneid": property(lambda self: self.thread_id % 32),
            },
        )
        _MODULES[base] = cls
    return cls


def run_kernel(kernel: Any, griddim: Any, blockdim: Any, shared: int, args: list[Any]) -> None:
    """Run numba's simulated ``kernel`` over ``args`` (simulator arrays), as configured when it was queued.

    numba's simulator starts one Python thread per CUDA thread, for
    ``syncthreads`` and the warp functions.  A kernel that uses none of them
    (nor calls a device function that does) runs its CUDA threads one by one
    in this thread instead, with the same results: far faster.  Anything
    else, a debug kernel, or a numba without the pieces this needs, takes
    numba's own path.
    """
    fn = getattr(kernel, "fn", None)
    ok = _ONE_BY_ONE.get(fn)
    if ok is None:
        try:
            ok = fn is not None and not kernel._debug and not kernel.extensions and _one_by_one(fn)
        except Exception:
            ok = False
        _ONE_BY_ONE[fn] = ok
    if not ok:
        kernel.grid_dim, kernel.block_dim, kernel.dynshared_size = griddim, blockdim, shared
        call = type(kernel).__call__
        getattr(call, "_numba", call)(kernel, *args)
        return
    from numba.cuda.simulator import kernel as simkernel
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray, FakeWithinKernelCUDAArray
    from numba.cuda.simulator.kernelapi import Dim3, FakeCUDAModule, swapped_cuda_module

    grid, block = griddim, blockdim
    module = _one_by_one_module(FakeCUDAModule)(grid, block, shared)
    retr: list[Any] = []

    from numba.cuda.simulator.args import ArgHint, InOut

    def fake(a: Any) -> Any:  # numba's simulator's own argument conversion
        if isinstance(a, np.ndarray) and a.ndim > 0:
            a = InOut(a).to_device(retr)
        elif isinstance(a, ArgHint):
            a = a.to_device(retr)
        elif isinstance(a, np.void):
            a = FakeCUDAArray(a)
        if isinstance(a, FakeCUDAArray):
            raw = a._ary
            # A plain numpy array indexes the same, several times faster; records keep numba's
            # wrapper (it makes `a[i].x = v` write through).
            if isinstance(raw, np.ndarray) and raw.dtype.fields is None and raw.ndim:
                return raw
            return FakeWithinKernelCUDAArray(a)
        return a

    fake_args = [fake(a) for a in args]
    me = threading.current_thread()
    saved = {k: me.__dict__.get(k) for k in ("threadIdx", "blockIdx", "thread_id")}
    bx, by, _ = block
    body = _with_module(fn, module)
    _clock.longest = 0.0
    threads = [(t, Dim3(*t), t[0] + bx * (t[1] + by * t[2])) for t in np.ndindex(*block)]
    with simkernel._push_kernel_context(module), swapped_cuda_module(fn, module):
        try:
            for g in np.ndindex(*grid):
                me.blockIdx = module.blockIdx = Dim3(*g)  # type: ignore[attr-defined]
                for t, idx, tid in threads:
                    me.threadIdx = module.threadIdx = idx  # type: ignore[attr-defined]
                    me.thread_id = module.thread_id = tid  # type: ignore[attr-defined]
                    _clock.current = 0.0
                    try:
                        body(*fake_args)
                        _clock.longest = max(_clock.longest, _clock.current)
                    except Exception as e:
                        msg = f"tid={list(t)} ctaid={list(g)}: {e}" if str(e) else f"tid={list(t)} ctaid={list(g)}"
                        raise type(e)(msg).with_traceback(e.__traceback__) from None
        finally:
            # The CUDA threads ran side by side on a GPU: the kernel took its longest sleep.
            slept, _clock.longest = _clock.longest, None
            for k, v in saved.items():
                if v is None:
                    me.__dict__.pop(k, None)
                else:
                    me.__dict__[k] = v
    if slept:
        time.sleep(slept)
    for wb in retr:
        wb()


@contextlib.contextmanager
def tracing(drv: SimDriver) -> Iterator[list[tuple[int, str]]]:
    """Record the operations run inside the block: ``[(stream id, what), ...]``."""
    with drv._lock:
        drv.trace = []
        drv.keep_trace = True
    try:
        yield drv.trace
    finally:
        drv.keep_trace = False


class SimStream:
    """What ``numba.cuda.stream()`` gives under the simulated driver: a stream of its own, with a handle.

    numba's simulator runs everything at the call and its streams are empty
    objects; umem_numba's simulated driver queues work per stream, so the
    stream objects of numba's API must name real (simulated) streams.
    """

    def __init__(self, drv: SimDriver, handle: int | None = None, *, flags: int = 0) -> None:
        self._drv = drv
        self._owned = handle is None
        if handle is None:
            _, handle = drv.cuStreamCreate(flags)
        self.handle = int(handle)
        if self._owned:
            import weakref

            weakref.finalize(self, drv.cuStreamDestroy, self.handle).atexit = False

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)

    def __int__(self) -> int:
        return self.handle

    def synchronize(self) -> None:
        """Run the stream's queued work (``cuStreamSynchronize``)."""
        self._drv.cuStreamSynchronize(self.handle)

    def query(self) -> bool:
        """Whether the stream's work has run (may run it, or answer False at random)."""
        return self._drv.cuStreamQuery(self.handle)[0] == _SUCCESS

    @contextlib.contextmanager
    def auto_synchronize(self) -> Iterator[SimStream]:
        yield self
        self.synchronize()

    def __repr__(self) -> str:
        return f"<simulated CUDA stream {self.handle:#x}>"


class _Holder:
    """numpy's array interface over another library's memory, keeping that library's object alive."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, interface: dict[str, Any], owner: Any) -> None:
        self.__array_interface__ = interface
        self.owner = owner


class SimEvent:
    """What ``numba.cuda.event()`` gives under the simulated driver: an event of it."""

    def __init__(self, drv: SimDriver, timing: bool = True) -> None:
        self._drv = drv
        self.handle = int(drv.cuEventCreate(0 if timing else 2)[1])
        import weakref

        weakref.finalize(self, drv.cuEventDestroy, self.handle).atexit = False

    def record(self, stream: Any = 0) -> None:
        self._drv.cuEventRecord(self.handle, _stream_int(stream))

    def wait(self, stream: Any = 0) -> None:
        self._drv.cuStreamWaitEvent(_stream_int(stream), self.handle, 0)

    def query(self) -> bool:
        """Whether the recorded work has run (answers False a random number of times first)."""
        return self._drv.cuEventQuery(self.handle)[0] == _SUCCESS

    def synchronize(self) -> None:
        self._drv.cuEventSynchronize(self.handle)

    def elapsed_time(self, other: Any) -> float:
        raise UnsupportedError(
            "event timing: the simulated driver (NUMBA_ENABLE_CUDASIM=1) has no device clock; it needs a real GPU"
        )


def _stream_int(stream: Any) -> int:
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    return int(getattr(stream, "handle", 0) or 0)


def install_numba(drv: SimDriver) -> None:
    """Give numba's simulator API streams of ``drv`` (``cuda.stream()``, the default streams, ``synchronize``).

    The one place where umem_numba changes numba: only under the simulator,
    only the stream constructors and ``cuda.synchronize`` of its fake API.
    """
    from numba import cuda

    api_modules = [cuda]
    try:
        from numba.cuda.simulator import api as sim_api

        api_modules.append(sim_api)
    except ImportError:  # pragma: no cover - numba-cuda always ships its simulator
        pass

    def stream() -> SimStream:
        return SimStream(drv)

    def default_stream() -> SimStream:
        return SimStream(drv, 0)

    def legacy_default_stream() -> SimStream:
        return SimStream(drv, 1)

    def per_thread_default_stream() -> SimStream:
        return SimStream(drv, 2)

    def external_stream(ptr: int) -> SimStream:
        return SimStream(drv, int(ptr))

    def synchronize() -> None:
        drv.cuCtxSynchronize()

    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    def interface(self: Any) -> dict[str, Any]:
        a = self._ary
        return {
            "shape": a.shape,
            "typestr": a.dtype.str,
            "descr": a.dtype.descr if a.dtype.fields else [("", a.dtype.str)],
            "data": (a.ctypes.data if a.size else 0, False),
            "strides": None if a.flags.c_contiguous else a.strides,
            "version": 3,
            "stream": None,
        }

    # numba's simulated device arrays are host numpy arrays: they offer the CUDA Array
    # Interface over that memory (which the simulated driver treats as pageable host memory).
    from numba.cuda.simulator.cudadrv.devices import FakeCUDADevice

    def device_attribute(self: Any, name: str) -> Any:
        if name == "id":
            return 0
        if name in _DEVICE_ATTRIBUTES:
            return _DEVICE_ATTRIBUTES[name]
        raise AttributeError(name)

    FakeCUDADevice.__getattr__ = device_attribute  # numba's device attributes, as the driver has them

    FakeCUDAArray.__cuda_array_interface__ = property(interface)
    FakeCUDAArray.device_ctypes_pointer = property(
        lambda self: ctypes.c_void_p(self._ary.ctypes.data if self._ary.size else 0)
    )

    def from_cuda_array_interface(desc: dict[str, Any], owner: Any = None, sync: bool = True) -> Any:
        shape = tuple(desc["shape"])
        descr = desc.get("descr") or []
        named = any(name for name, *_ in descr)
        dtype = np.dtype([tuple(d) for d in descr]) if named else np.dtype(desc["typestr"])
        ptr = desc["data"][0]
        if not ptr or 0 in shape:
            return FakeCUDAArray(np.empty(shape, dtype))
        iface = {
            "shape": shape,
            "typestr": dtype.str,
            "data": (ptr, False),
            "strides": desc.get("strides"),
            "version": 3,
        }
        return FakeCUDAArray(np.asarray(_Holder(iface, owner)))

    def as_cuda_array(obj: Any, sync: bool = True) -> Any:
        if not hasattr(obj, "__cuda_array_interface__"):
            raise TypeError("*obj* doesn't implement the cuda array interface.")
        return from_cuda_array_interface(obj.__cuda_array_interface__, owner=obj, sync=sync)

    def is_cuda_array(obj: Any) -> bool:
        return hasattr(obj, "__cuda_array_interface__")

    def managed_array(
        shape: Any,
        dtype: Any = np.float64,
        strides: Any = None,
        order: str = "C",
        stream: Any = 0,
        attach_global: bool = True,
    ) -> Any:
        dt = np.dtype(dtype)
        shp = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = int(np.prod(shp, dtype=np.int64)) * dt.itemsize
        if not nbytes:
            return FakeCUDAArray(np.empty(shp, dt))
        ptr = drv.cuMemAllocManaged(nbytes, 1 if attach_global else 2)[1]
        raw = (ctypes.c_byte * nbytes).from_address(ptr)
        arr = np.ndarray(shp, dt, buffer=raw, strides=strides, order=order)  # type: ignore[arg-type]
        out = FakeCUDAArray(arr)
        import weakref

        weakref.finalize(raw, drv.cuMemFree, ptr).atexit = False
        return out

    def pinned_array(shape: Any, dtype: Any = np.float64, strides: Any = None, order: str = "C") -> np.ndarray:
        # numba's simulator gives pageable memory, which the driver reads before a copy returns;
        # a GPU's is page-locked, read when the copy runs: the simulated driver's pinned memory.
        dt = np.dtype(dtype)
        shp = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = int(np.prod(shp, dtype=np.int64)) * dt.itemsize
        if not nbytes:
            return np.ndarray(shp, dt, strides=strides, order=order)  # type: ignore[arg-type]
        ptr = drv.cuMemHostAlloc(nbytes, 0)[1]
        raw = (ctypes.c_byte * nbytes).from_address(ptr)
        arr = np.ndarray(shp, dt, buffer=raw, strides=strides, order=order)  # type: ignore[arg-type]
        import weakref

        weakref.finalize(raw, drv.cuMemFreeHost, ptr).atexit = False
        return arr

    # Inside a simulated kernel numba swaps the kernel module's `cuda` for a fake module of
    # the thread-level API; other threads of the program may meanwhile use the same global:
    # the rest of the API stays reachable through it.  nanosleep (absent there) takes time:
    # a simulated kernel lasts as long as its longest-sleeping thread (see run_kernel).
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    def fallback(self: Any, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(cuda, name)

    FakeCUDAModule.__getattr__ = fallback
    FakeCUDAModule.nanosleep = staticmethod(_nanosleep)

    # A plain launch (kernel[g, b](...)) takes the same one-by-one path where it can.
    from numba.cuda.simulator import kernel as simkernel

    numba_call = simkernel.FakeCUDAKernel.__call__
    if not getattr(numba_call, "_umem", False):

        def call(self: Any, *args: Any) -> Any:
            if self._device or simkernel._kernel_context is not None or self.grid_dim is None:
                return numba_call(self, *args)
            from numba.cuda.errors import normalize_kernel_dimensions

            grid, block = normalize_kernel_dimensions(self.grid_dim, self.block_dim)
            drv.refuse_plain_launch_in_capture(getattr(self, "_umem_stream", 0))
            run_kernel(self, grid, block, self.dynshared_size, list(args))
            return None

        call._umem = True  # type: ignore[attr-defined]
        call._numba = numba_call  # type: ignore[attr-defined]
        simkernel.FakeCUDAKernel.__call__ = call

        # numba's simulator configures a launch by setting the kernel object's own grid: two
        # threads launching one kernel race, and a queued launch must keep its grid.  A
        # configured launch is a configured copy instead.
        numba_getitem = simkernel.FakeCUDAKernel.__getitem__

        def getitem(self: Any, configuration: Any) -> Any:
            configured = copy.copy(self)
            numba_getitem(configured, configuration)
            # numba's simulator ignores the stream; a graph capture needs it (see refuse_plain_launch_in_capture)
            configured._umem_stream = _stream_int(configuration[2]) if len(configuration) > 2 else 0
            return configured

        simkernel.FakeCUDAKernel.__getitem__ = getitem

    def event(timing: bool = True) -> SimEvent:
        return SimEvent(drv, timing)

    for mod in api_modules:
        mod.event = event
        mod.managed_array = managed_array
        mod.pinned_array = pinned_array
        mod.from_cuda_array_interface = from_cuda_array_interface
        mod.as_cuda_array = as_cuda_array
        mod.is_cuda_array = is_cuda_array
        mod.stream = stream
        mod.default_stream = default_stream
        mod.legacy_default_stream = legacy_default_stream
        mod.per_thread_default_stream = per_thread_default_stream
        mod.external_stream = external_stream
        mod.synchronize = synchronize
    cuda._umem_sim_driver = drv
