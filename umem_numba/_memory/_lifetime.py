"""One lifetime model: who frees driver memory, when, and how failures are reported.

Every kind of memory (managed, pinned, VMM, pool) is a :class:`Memory`: the
part that knows how to give itself back to the driver.  An
:class:`Allocation` owns one and frees it exactly once, through one release
path (:func:`_release`): wait for device work that may still use it, free,
count it in the statistics, report a failed free as a warning (never hide
it), and stay quiet at interpreter exit, when the driver has already let go
of everything.

The VMM building blocks (address ranges, physical memory, mappings) depend on
one another; :class:`Resource` frees such an object once its dependants are
gone.  :class:`Transaction` undoes the steps of a multi-step construction
that failed half way.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

from .. import _driver
from .._errors import BufferClosedError
from . import _resources, _stats
from ._tracker import Tracker

__all__ = ["Allocation", "DriverMemory", "Memory", "Resource", "Transaction", "report_failed_free"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_INTERNAL_FILES = (weakref.__file__, contextlib.__file__)


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside umem_numba.

    From a finalizer run by the garbage collector there is no such frame: the
    warning then points at this package (never into ``weakref.py``).
    """
    frame: FrameType | None = sys._getframe(2)
    level = 2
    deepest_ours = 2
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_PACKAGE_DIR):
            deepest_ours = level
        elif name not in _INTERNAL_FILES:
            return level
        frame = frame.f_back
        level += 1
    return deepest_ours


def report_failed_free(what: str, exc: BaseException) -> None:
    """Warn that freeing memory failed (the memory may be lost); quiet when the context is gone.

    Parameters
    ----------
    what : str
        What was being freed, e.g. ``"releasing managed memory at 0x7f..."``.
    exc : BaseException
        The failure.
    """
    if _driver.context_gone(exc) or _driver.shutting_down():
        return
    warnings.warn(f"umem_numba: {what} failed: {exc}", RuntimeWarning, stacklevel=_caller_stacklevel())


class Memory:
    """Driver memory that knows how to give itself back.

    Attributes
    ----------
    kind : str
        Statistics bucket (``umem_numba.stats()`` key).
    nbytes : int
        Bytes held now.
    stream_ordered : bool
        ``True`` when :meth:`free` orders the free after pending device work
        on a stream itself, so the release path must not wait on the host.
    """

    kind: str = ""
    nbytes: int = 0
    stream_ordered: bool = False

    def free(self, tracker: Tracker) -> None:
        """Give the memory back to the driver (called exactly once)."""
        raise NotImplementedError

    def describe(self) -> str:
        """Words for messages, e.g. ``"managed memory at 0x7f00 (4096 bytes)"``."""
        return f"{self.kind} memory ({self.nbytes} bytes)"

    def note_advice(self) -> None:
        """Advice (``cuMemAdvise``) was given on this memory (pool memory then never goes to another buffer)."""


class DriverMemory(Memory):
    """One driver allocation freed by one call (``cuMemFree``, ``cuMemFreeHost`` ...).

    Parameters
    ----------
    kind : str
        Statistics bucket.
    ptr : int
        The address the free call takes.
    nbytes : int
        Size in bytes.
    free_call : str
        The driver function that frees it.
    device_id : int
        Whose context frees it.
    """

    __slots__ = ("device_id", "free_call", "kind", "nbytes", "ptr")

    def __init__(self, kind: str, ptr: int, nbytes: int, free_call: str, device_id: int) -> None:
        self.kind = kind
        self.ptr = ptr
        self.nbytes = nbytes
        self.free_call = free_call
        self.device_id = device_id

    def free(self, tracker: Tracker) -> None:
        with _driver.capture_safe():  # a free beside a user's graph capture leaves it intact
            _driver.call_on(self.device_id, self.free_call, self.ptr)

    def describe(self) -> str:
        return f"{self.kind} memory at {self.ptr:#x} ({self.nbytes} bytes)"


def finalizer(obj: object, func: Callable[..., Any], *args: Any) -> weakref.finalize:
    """``weakref.finalize(obj, func, *args)`` that does not run at interpreter exit.

    At exit the driver reclaims every allocation, mapping and pool of the
    process anyway, and by then numba, PyTorch or CuPy may be tearing their
    contexts down: a free, unmap or pool destroy issued during shutdown can
    only fail, or crash inside the driver.  So umem_numba's finalizers stay
    silent then: not run by ``weakref``'s exit handler (``atexit=False``), and
    doing nothing when their object is collected once the process exits
    (:func:`umem_numba._driver.shutting_down`).
    """
    f = weakref.finalize(obj, _unless_exiting, func, *args)
    f.atexit = False
    return f


def _unless_exiting(func: Callable[..., Any], *args: Any, _quiet: Callable[[], bool] = _driver.shutting_down) -> None:
    """Run a finalizer's function, unless the process is exiting (:func:`umem_numba._driver.shutting_down`).

    ``atexit=False`` alone does not cover exit: a finalizer still runs when its
    object is collected while other ``atexit`` handlers run (numba's, PyTorch's,
    CuPy's teardown drop objects then), when contexts may be going.
    """
    if not _quiet():
        func(*args)


def _release(memory: Memory, tracker: Tracker, generation: int, settled: bool = False) -> None:
    """The one release path: wait, free, count, report.  Never raises.

    ``settled``: nothing can use the memory (:meth:`Tracker.close_if_idle`), so there is nothing to wait for.
    """
    if generation != _driver.fork_generation:
        # Made before fork() in the parent: the parent's context owns it, and a
        # forked child can make no CUDA call.  Only the count goes.
        _stats.record_free(memory.kind, memory.nbytes)
        return
    try:
        if not (settled or memory.stream_ordered):
            tracker.wait_all(f"releasing {memory.describe()}")
    except Exception as exc:  # the free below still runs
        report_failed_free(f"waiting for device work before releasing {memory.describe()}", exc)
    # Counted before the free: a stream-ordered free may hand the memory to the
    # next allocation of its pool at once (which counts it again).
    _stats.record_free(memory.kind, memory.nbytes)
    try:
        memory.free(tracker)
    except Exception as exc:
        report_failed_free(f"releasing {memory.describe()}", exc)


#: Serialises the export count and the closed flag of every allocation.  Exports
#: (numpy views, DLPack capsules) are rare next to allocations, so one lock
#: shared by all costs nothing measurable and saves a lock per allocation.
_exports_lock = threading.RLock()


class Allocation:
    """Owns one :class:`Memory` and frees it exactly once.

    It is freed when the owning buffer is closed, or when the last object
    that refers to it (the buffer, its views, numpy arrays over it) is
    collected.  A numpy array over the memory defers the release until it
    is gone, so host code never touches freed memory.

    Parameters
    ----------
    memory : Memory or None
        What to free; ``None`` for a zero-size buffer (nothing allocated).
    ptr : int
        Address the host uses (managed, pinned) or the device uses (VMM).
    device_id : int
        Device whose context owns the memory.
    tracker : Tracker
        Device work on the memory.
    device_ptr : int, optional
        Device address when it differs from ``ptr`` (mapped pinned memory).

    Notes
    -----
    The release on collection is ``__del__``, not ``weakref.finalize``: a
    finalizer costs about 2 µs to create, as much as a whole pool allocation
    should.  ``__del__`` never runs the release once the process exits
    (:func:`umem_numba._driver.shutting_down`: the driver reclaims everything
    then; see :func:`finalizer`).
    """

    __slots__ = (
        "__weakref__",
        "_exports",
        "_released",
        "closed",
        "device_id",
        "device_ptr",
        "generation",
        "kind",
        "memory",
        "ptr",
        "tracker",
    )

    def __init__(
        self,
        kind: str,
        memory: Memory | None,
        ptr: int,
        device_id: int,
        tracker: Tracker,
        *,
        device_ptr: int | None = None,
    ) -> None:
        self.kind = kind
        self.ptr = ptr
        self.device_ptr = ptr if device_ptr is None else device_ptr
        self.device_id = device_id
        self.tracker = tracker
        self.closed = False
        self.memory = memory
        self.generation = _driver.fork_generation
        self._exports = 0
        self._released = memory is None
        if memory is not None:
            _stats.record_alloc(memory.kind, memory.nbytes)

    @property
    def resource(self) -> _resources.MemoryResource:
        """What the memory is (:mod:`umem_numba._memory._resources`): where it is reachable, what it supports."""
        return _resources.RESOURCES[self.kind]

    def __del__(self, _quiet: Callable[[], bool] = _driver.shutting_down) -> None:
        # ``_quiet`` is bound early: at interpreter exit this module's globals may already be None.
        if not self._released:
            self._released = True
            if not _quiet():
                _release(self.memory, self.tracker, self.generation)  # type: ignore[arg-type]

    def _release_now(self) -> None:
        if _driver.shutting_down():
            # A DLPack consumer let go while the process exits (PyTorch, CuPy tear down then):
            # the driver reclaims the memory; a free now may run in a context being destroyed.
            return
        with _exports_lock:
            if self._released:
                return
            self._released = True
        _release(self.memory, self.tracker, self.generation)  # type: ignore[arg-type]

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return 0 if self.memory is None else self.memory.nbytes

    def close(self) -> None:
        """Release now; or, while exports live or the memory escaped to another library, once they are gone.

        Device work is settled first (per the coherence policy) without
        holding the lock, so a finalizer that runs during the wait cannot
        deadlock on it.  A numpy array or a DLPack consumer over the memory
        defers the release until it lets go; memory whose device view left
        for another library (CUDA Array Interface) is released when the last
        Python object over it is collected, since that library may still be
        using it.  Stream-ordered memory (pools) settles nothing on the host:
        its free is queued after the recorded work, and a launch still being
        registered is waited for by the free itself.
        """
        if self.closed:
            return
        memory = self.memory
        if memory is not None:
            # The common closes, each decided under the record's lock in one step (no launch can
            # register in between): stream-ordered memory outside its own lend block (its free is
            # queued after the recorded work), and other memory that nothing may use (nothing
            # pending or in flight, no capture, hold or lend).  The rest takes the path below.
            tracker = self.tracker
            if memory.stream_ordered:
                if tracker.close_unless_lending():
                    self._mark_closed()
                    return
            elif tracker.close_if_idle():
                self._mark_closed(settled=True)
                return
        # Inside its own lend block the lent work is not recorded yet: neither a wait for it
        # (which would never end) nor a free (which would not come after it) can be right.
        self.tracker.refuse_inside_own_lend(f"closing {self.kind} buffer")
        if memory is not None and memory.stream_ordered:
            # Work that took the address before this close must not register after it: memory
            # freed to the driver keeps the record blocked for good; a pool that hands the block
            # on reopens it under a new epoch (Tracker.recycle), which refuses such work too.
            self.tracker.block("closed")
            self._mark_closed()
            return
        tracker = self.tracker
        tracker.block("closing")
        closed = False
        try:
            # No launch can start from here on; those already registered are waited for.
            tracker.before_host_access(f"closing {self.kind} buffer")
            self._mark_closed()
            closed = True
        finally:
            # Closed: no launch registers any more, ever (one that checked the buffer before this
            # close would otherwise write memory its host views still hold).  Refused (policy
            # "raise"): the buffer stays open and usable.
            if closed:
                tracker.block("closed")
            else:
                tracker.unblock()

    def _mark_closed(self, settled: bool = False) -> None:
        """Set ``closed``; release unless exports live or the memory escaped (``settled``: see :func:`_release`)."""
        lock = _exports_lock
        lock.acquire()  # (not ``with``: every close passes here, and ``with`` costs twice as much)
        try:
            if self.closed:
                return
            self.closed = True
            if self._exports > 0 or self.tracker.escaped or self._released:
                return
            self._released = True
        finally:
            lock.release()
        _release(self.memory, self.tracker, self.generation, settled)  # type: ignore[arg-type]

    def add_export(self) -> None:
        """Count an object outside umem_numba over the memory (numpy array, DLPack consumer); refused once closed."""
        with _exports_lock:
            if self.closed:
                raise BufferClosedError(f"this {self.kind} buffer is closed")
            self._exports += 1

    def drop_export(self) -> None:
        """An export is gone; release if it was the last one after close (and nothing escaped)."""
        with _exports_lock:
            self._exports -= 1
            release = self.closed and self._exports == 0 and not self.tracker.escaped
        if release:
            self._release_now()

    @property
    def released(self) -> bool:
        """Whether the memory has been returned to the driver."""
        return self._released


class Resource:
    """One driver object, freed exactly once and only after the objects built on it.

    ``retain``/``unretain`` count the dependants (mappings); ``close`` marks it
    closed and frees it at once, or when the last dependant goes.

    Parameters
    ----------
    what : str
        Words for messages.
    free : callable
        Frees the object; its failure is reported by :func:`report_failed_free`.
    """

    __slots__ = ("_free", "_lock", "_users", "closed", "freed", "what")

    def __init__(self, what: str, free: Callable[[], None]) -> None:
        self.what = what
        self._free = free
        self._users = 0
        self.closed = False
        self.freed = False
        self._lock = threading.Lock()

    def retain(self) -> None:
        """Count a dependant; refused once closed."""
        with self._lock:
            if self.closed:
                raise BufferClosedError(f"{self.what} is closed")
            self._users += 1

    def unretain(self) -> None:
        """A dependant is gone; free now if closed and it was the last."""
        with self._lock:
            self._users -= 1
            run = self.closed and self._users == 0 and not self.freed
            if run:
                self.freed = True
        if run:
            self._run()

    def close(self) -> None:
        """Mark closed; free now unless dependants remain."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            run = self._users == 0
            if run:
                self.freed = True
        if run:
            self._run()

    def _run(self) -> None:
        free, self._free = self._free, _nothing  # drop what the free closure holds
        try:
            free()
        except Exception as exc:
            report_failed_free(f"freeing {self.what}", exc)


def _nothing() -> None:
    """What a freed :class:`Resource` holds instead of its free function."""


class Transaction(contextlib.ExitStack):
    """Undo steps of a construction unless it completes (:meth:`commit`).

    Examples
    --------
    >>> with Transaction() as tx:            # doctest: +SKIP
    ...     ptr = allocate()
    ...     tx.append(free, ptr)             # runs if anything below raises
    ...     map_it(ptr)
    ...     tx.commit()                      # success: keep everything
    """

    def append(self, undo: Callable[..., Any], *args: Any) -> None:
        """Register ``undo(*args)``, run (last first) if the block exits without :meth:`commit`."""
        self.callback(undo, *args)

    def commit(self) -> None:
        """Keep what was done: drop every registered undo step."""
        self.pop_all()
