"""Stream work: operations queued per stream, events, and the seeded loop that runs them late.

Mixed into :class:`~umem_numba._driver._simulated.SimDriver` as :class:`Scheduling`.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ._common import (
    _INVALID_HANDLE,
    _NOT_READY,
    _SUCCESS,
    SimulatedFault,
    _Error,
    _int,
)


class _Op:
    """One operation queued on a stream."""

    __slots__ = ("deps", "done", "run", "spans", "stream", "then", "what")

    def __init__(self, stream: _Stream, run: Callable[[], None] | None, deps: list[_Op], what: str) -> None:
        self.stream = stream
        self.run = run
        self.deps = deps
        self.done = False
        self.what = what
        #: The byte ranges ``(start, end)`` of driver memory it reads or writes, where known.
        self.spans: tuple[tuple[int, int], ...] = ()
        #: What the driver does once it has run (release a destroyed stream's or event's handle).
        self.then: list[Callable[[], None]] | None = None


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


class Scheduling:
    """Streams, events and the order their work runs in."""

    def _init_scheduling(self, seed_value: int) -> None:
        from cuda.bindings import driver as real

        self._real: Any = real  # the binding: its enums and structs
        self._lock = threading.RLock()
        self.seed = seed_value
        self._rng = random.Random(seed_value)
        # Chance that a synchronisation runs an operation no one waits for instead of one it needs
        # (see reseed); 0: work runs as late as possible, which turns a missing wait into a wrong value.
        self._spread = 0.0
        self._ids = itertools.count(1)  # stream ids (cuStreamGetId): never reused
        self._handles = itertools.count(0x1000, 0x10)
        # Handles of destroyed streams and events, handed out again last freed first, as a GPU
        # driver's are (they are addresses of its own objects): code that keys anything by a raw
        # handle then meets a new stream or event under an old key.  Only these two tables reuse.
        self._free_streams: list[int] = []
        self._free_events: list[int] = []
        self._events: dict[int, _Event] = {}
        self._legacy = _Stream(0, next(self._ids), "legacy", True)
        self._streams: dict[int, _Stream] = {}
        self._per_thread: dict[int, _Stream] = {}
        self._pending: list[_Op] = []
        self._running = False
        # The first fault of device work (an operation that raised), reported by every later
        # synchronisation, as a GPU's context is unusable after one, until drain_quietly resets it.
        self._fault: SimulatedFault | None = None
        # Effects that land once all their operations have run, at the end of that synchronisation:
        # unordered with the work run meanwhile (see ManagedHints._discard_batch).
        self._late_effects: list[tuple[list[_Op], Callable[[], None]]] = []
        #: Operations run so far, as (stream id, what): tests read the order from it.
        self.trace: list[tuple[int, str]] = []
        self.keep_trace = False

    def reseed(self, value: int, spread: float = 0.0) -> None:
        """Restart the random order from ``value`` (pending work stays queued).

        ``spread``: the chance, at each operation a synchronisation runs, that it runs instead one
        that nothing being waited for needs (ready on another stream): independent streams run
        ahead, as a GPU's do, and a writer can overtake a reader queued earlier on another stream
        when nothing orders them.  0 (the default) runs only what is needed, as late as possible.
        """
        if not 0.0 <= spread <= 1.0:
            raise ValueError(f"spread is a probability (0 to 1), got {spread!r}")
        with self._lock:
            self.seed = value
            self._rng = random.Random(value)
            self._spread = float(spread)

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

    def _register(
        self, table: dict[int, Any], make: Callable[[int], Any], free: list[int] | None = None
    ) -> tuple[Any, ...]:
        """A handle for ``make(handle)`` in ``table`` (lock held): the driver's ``(CUDA_SUCCESS, handle)``.

        ``free``: handles given back to this table (see :meth:`_release_after`), of which the last
        one freed is handed out first; otherwise, and for the other tables, a new handle.
        """
        handle = free.pop() if free else next(self._handles)
        table[handle] = make(handle)
        return (_SUCCESS, handle)

    @staticmethod
    def _release_after(op: _Op | None, free: list[int], handle: int) -> None:
        """Put ``handle`` on ``free`` once ``op`` has run (at once if none, or done; lock held).

        The driver releases a destroyed stream's or event's resources, its handle among them,
        only once the work queued before has completed (cuStreamDestroy, cuEventDestroy; an H100
        with driver 580 did not hand a destroyed stream's handle out while its work ran).
        """
        if op is None or op.done:
            free.append(handle)
        else:
            op.then = [*(op.then or ()), lambda: free.append(handle)]

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
            self._land_late_effects()
        finally:
            if collecting:
                gc.enable()
        self._raise_fault()

    def _land_late_effects(self) -> None:
        if self._late_effects:
            landing = [e for e in self._late_effects if all(op.done for op in e[0])]
            self._late_effects = [e for e in self._late_effects if e not in landing]
            for _, effect in landing:
                effect()

    def _unfinished_work_on(self, spans: list[tuple[int, int]], other_than: _Stream) -> list[_Op]:
        """Queued operations of streams other than ``other_than`` that use any of ``spans`` (lock held)."""
        return [
            op
            for op in self._pending
            if op.stream is not other_than and any(a < end and start < b for a, b in op.spans for start, end in spans)
        ]

    def _raise_fault(self) -> None:
        """Report the fault of earlier device work, if any: every synchronisation after it fails (lock held)."""
        if self._fault is not None:
            raise SimulatedFault(str(self._fault)) from self._fault.__cause__

    def _drive_with_gc_off(self, targets: list[_Op]) -> None:
        while True:
            need = self._needed(targets)
            if not need:
                return
            if self._running:
                # Called while an operation runs (a finalizer during a simulated kernel): device
                # work cannot wait for the host, and numba's simulator runs one kernel at a time.
                raise RuntimeError("umem_numba simulated driver: waiting for device work from inside device work")
            op = self._pick(need)
            # Only if it is still next: a weakref callback run since it was picked (same
            # thread, re-entrant lock) may have waited for device work and run it already.
            if self._ready(op):
                self._run(op)

    def _pick(self, need: set[_Op]) -> _Op:
        """The next operation to run, of those in ``need`` (not empty) or, with the spread's chance, of others."""
        ready = [op for op in need if self._ready(op)]
        # Drawn at every step, whatever the spread: a seed gives the same order as before there was one.
        if self._rng.random() < self._spread:
            # Time passes on the other streams too: one of their ready operations runs instead.
            extra = [op for op in self._pending if op not in need and self._ready(op)]
            if extra:
                ready = extra
        if not ready:  # pragma: no cover - every dependency is earlier work, so one is always ready
            raise RuntimeError("umem_numba simulated driver: no runnable work (dependency cycle)")
        ready.sort(key=lambda o: o.stream.sid)  # a deterministic list for the seeded choice
        return self._rng.choice(ready)

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
            except Exception as exc:
                # A fault, as a GPU's: the synchronisation that waits for this work reports it
                # (not the one that happened to run it), and so does every later one.
                if self._fault is None:
                    fault = SimulatedFault(f"{op.what} faulted on the device ({type(exc).__name__}: {exc})")
                    fault.__cause__ = exc
                    self._fault = fault
            finally:
                self._running = False
        if op.then is not None:
            then, op.then = op.then, None
            for release in then:
                release()

    def _drain(self) -> None:
        self._drive(list(self._pending))

    def drain_quietly(self) -> list[BaseException]:
        """Run all queued work; return the errors it raised that were not reported yet, and forget the fault.

        The simulation's "new process" between tests: after it the context is usable again.
        """
        errors: list[BaseException] = []
        with self._lock:
            reported = self._fault
            while self._pending:
                try:
                    self._drain()
                except Exception as exc:
                    if not (isinstance(exc, SimulatedFault) and self._fault is reported):  # reported already
                        errors.append(exc)
            self._fault = None
        return errors

    def _stream_targets(self, s: _Stream) -> list[_Op]:
        return list(s.ops)

    def synchronous_copy_sync(self, handle: Any) -> None:
        """Run what a synchronous copy on stream ``handle`` waits for (numba's own device arrays' host copies).

        On the legacy stream that is all earlier work of the blocking streams too.
        """
        with self._lock:
            s = self._stream(handle)
            targets = list(s.ops)
            if s.kind == "legacy":
                targets += [op for other in self._all_streams() if other.blocking for op in other.ops]
            self._drive(targets)

    def cuCtxSynchronize(self) -> tuple[Any, ...]:
        with self._lock:
            self._drain()
        return (_SUCCESS,)

    # -- streams and events ------------------------------------------------------------
    def cuStreamCreate(self, flags: Any) -> tuple[Any, ...]:
        return self.cuStreamCreateWithPriority(flags, 0)

    def cuStreamCreateWithPriority(self, flags: Any, priority: Any) -> tuple[Any, ...]:
        blocking = not (_int(flags) & 1)
        with self._lock:
            return self._register(
                self._streams,
                lambda h: _Stream(h, next(self._ids), "created", blocking, _int(priority)),
                self._free_streams,
            )

    def cuStreamDestroy(self, handle: Any) -> tuple[Any, ...]:
        h = _int(handle)
        with self._lock:
            s = self._streams.pop(h, None)
            if s is None:
                return (_INVALID_HANDLE,)
            # Work already queued still runs when needed (its operations stay pending, on this
            # _Stream: a new stream given the handle is another _Stream, not ordered with them);
            # the handle is free once that work has run.
            self._release_after(s.ops[-1] if s.ops else None, self._free_streams, h)
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
        """Done if the work has run, else "not ready"; then time passes: one operation runs.

        The answer is what has run, as a GPU's is.  The step after an answer of "not ready"
        stands for the time a program's polling takes, so that a polling loop finishes: one
        operation runs, picked as a synchronisation of the same work picks its next one (among
        those the work needs, or with the spread's chance one that nothing awaits: see reseed).
        """
        self._raise_fault()
        if all(t.done for t in targets):
            return (_SUCCESS,)
        if not self._running:  # a query from inside device work (a finalizer in a kernel): no time passes
            collecting = gc.isenabled()
            gc.disable()  # as in _drive: no finalizer may drive the queues in the middle of _run
            try:
                need = self._needed(targets)
                if need:
                    op = self._pick(need)
                    if self._ready(op):
                        self._run(op)
                self._land_late_effects()
            finally:
                if collecting:
                    gc.enable()
        return (_NOT_READY,)

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

    def cuEventCreate(self, flags: Any) -> tuple[Any, ...]:
        with self._lock:
            return self._register(self._events, lambda _: _Event(_int(flags)), self._free_events)

    def cuEventDestroy(self, event: Any) -> tuple[Any, ...]:
        h = _int(event)
        with self._lock:
            ev = self._events.pop(h, None)
            if ev is None:
                return (_INVALID_HANDLE,)
            op = ev.op
            # Free once its record has run (a record in a capture is never queued: free at once).
            pending = op is not None and not op.done and op in op.stream.ops
            self._release_after(op if pending else None, self._free_events, h)
        return (_SUCCESS,)

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
            self._drive([] if ev.op is None else [ev.op])
        return (_SUCCESS,)


@contextlib.contextmanager
def tracing(drv: Scheduling) -> Iterator[list[tuple[int, str]]]:
    """Record the operations run inside the block: ``[(stream id, what), ...]``."""
    with drv._lock:
        drv.trace = []
        drv.keep_trace = True
    try:
        yield drv.trace
    finally:
        drv.keep_trace = False
