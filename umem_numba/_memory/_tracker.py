"""Coherence tracking: host code never touches memory that device work may still use.

Every allocation owns a :class:`Tracker` (this module sits below the buffers;
launching, which files work under trackers, sits above them in
:mod:`umem_numba._launch._coherent`).  Launches through
:func:`launch`, :func:`coherent` or :func:`jit` record one CUDA event on the
launch stream and file it under every buffer argument (views included), with
no host synchronisation on the launch path.  Host access (``.host``,
``np.asarray``, copies to the host, ``close``) first *settles* the tracker:
under the default ``"sync"`` policy it waits on exactly those events, not on
the whole device.

Device-side ordering: work the toolkit issues on stream S (kernels, copies,
prefetches, memsets) first makes S wait, on the device (``cuStreamWaitEvent``),
for earlier toolkit work on *other* streams that conflicts with it: a read
waits for the last write, a write waits for the last write and every read
since.  Readers on different streams stay concurrent.  Streams are told apart
by their ``cuStreamGetId``, never by the raw handle.

A plain numba launch (``kernel[grid, block, stream](buf)``) is ordered and
filed on its stream too (:mod:`umem_numba._memory._plain_launch`), through
numba's ``ArgHint`` protocol.  Work the toolkit cannot see is still accounted for:

* a buffer reaching a kernel through numba's own hints (``cuda.In(buf)``),
  which name no stream, marks the allocation as used on an *unknown* stream
  of the current device; the next host access synchronises that device
  (``"sync"``) or raises;
* a device view that leaves the toolkit (``__cuda_array_interface__`` read by
  CuPy, PyTorch, ``cuda.as_cuda_array``; ``__dlpack__``) *escapes*: the other
  library may use it at any time, so from then on every host access
  synchronises every device with an active context.  ``buf.lend(stream)`` is
  the precise alternative: the work on that stream is recorded when the block
  ends.

Policies
--------
``"sync"`` (default)
    wait for the pending work, then proceed.
``"raise"``
    raise :class:`~umem_numba.CoherenceError` naming the busy stream.
``"warn"``
    emit a :class:`CoherenceWarning` and proceed without waiting.
``"off"``
    no check at all.

The policy in force for a buffer is its own (``buf.coherence_policy``) if set,
else the innermost ``with coherence_policy(...)`` block of the calling
thread, else the global default (:func:`set_coherence_policy`).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from .. import _driver
from .._errors import BufferClosedError, CoherenceError
from . import _events

__all__ = [
    "POLICIES",
    "CoherenceWarning",
    "DeviceUse",
    "Tracker",
    "check_policy",
    "coherence_policy",
    "get_auto_prefetch",
    "get_coherence_policy",
    "prefetch_touched",
    "refuse_capture",
    "set_auto_prefetch",
    "set_coherence_policy",
]

POLICIES = ("sync", "raise", "warn", "off")

#: begin_use's answer when the stream need not wait (never mutated).
_NO_WAITS: list[Any] = []

#: Guards Tracker.capturing and Tracker.graphs (see Tracker.count_uses).
_use_counts_lock = threading.Lock()


class CoherenceWarning(RuntimeWarning):
    """Host access to a buffer with device work that may still be running."""


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"unknown coherence policy {policy!r}; choose one of {', '.join(POLICIES)}")
    return policy


_global_policy = "sync"
_block_policy: contextvars.ContextVar[str | None] = contextvars.ContextVar("umem_coherence_policy", default=None)


#: Whether managed memory is prefetched where it is needed (set_auto_prefetch).
_auto_prefetch = True


def set_auto_prefetch(enabled: bool) -> None:
    """Turn automatic prefetch of managed memory on (the default) or off, process-wide.

    When on, managed memory moves where it is needed by prefetch rather than
    by page faults, both ways:

    * a tracked launch (``um.jit``, :func:`launch`, :func:`coherent`) or a
      plain numba launch of a :class:`~umem_numba.ManagedBuffer` whose memory
      the host touched since the device last had it (a host view:
      ``buf.host``, ``np.asarray(buf)``, element access, ``on_host()``,
      ``from_array``) first prefetches the whole allocation to the launching
      device, on the launch stream, before the kernel; a launch whose
      arguments the host did not touch makes no driver call for it;
    * a host view that reads (``buf.host``, ``np.asarray(buf)``,
      ``on_host()``) at least 1 MiB of a ``ManagedBuffer`` the device wrote
      prefetches it to the host first, under the ``"sync"`` policy.

    Devices without concurrentManagedAccess never prefetch
    (docs: concepts/hints-prefetch).

    Parameters
    ----------
    enabled : bool
        ``False``: pages migrate by faults, as the driver does by itself.

    Raises
    ------
    TypeError
        ``enabled`` is not a bool.
    """
    global _auto_prefetch
    if not isinstance(enabled, bool):
        raise TypeError(f"set_auto_prefetch: enabled must be a bool, got {type(enabled).__name__}")
    _auto_prefetch = enabled


def get_auto_prefetch() -> bool:
    """Whether managed memory is prefetched where it is needed (see :func:`set_auto_prefetch`)."""
    return _auto_prefetch


#: device ordinal -> its CUmemLocation (made once).
_device_locations: dict[int, Any] = {}


def prefetch_touched(trackers: list[Tracker], handle: int, device: int) -> None:
    """Before a launch on stream ``handle``: prefetch to ``device`` what the host touched (``migrate``).

    A hint: a prefetch the driver refuses (memory of a managed pool, on some
    drivers) is not an error; that memory migrates by faults from then on.
    """
    if not _auto_prefetch:
        return
    loc = _device_locations.get(device)
    if loc is None:
        from .._driver._location import Location

        loc = _device_locations[device] = Location.device(device).to_cu()
    prefetch = _driver.api().mem_prefetch
    for tracker in trackers:
        span = tracker.migrate
        if not span:
            continue
        assert isinstance(span, tuple)
        tracker.migrate = None
        if prefetch(span[0], span[1], loc, 0, handle)[0] != 0:
            tracker.migrate = 0


def set_coherence_policy(policy: str) -> None:
    """Set the process-wide default coherence policy.

    Parameters
    ----------
    policy : {"sync", "raise", "warn", "off"}
    """
    global _global_policy
    _global_policy = check_policy(policy)


def get_coherence_policy() -> str:
    """The policy in force here: the innermost ``with`` block's, else the global one."""
    return _block_policy.get() or _global_policy


@contextlib.contextmanager
def coherence_policy(policy: str) -> Iterator[str]:
    """Use ``policy`` for host accesses inside the ``with`` block (this thread/task only).

    Examples
    --------
    >>> with umem_numba.coherence_policy("raise"):  # doctest: +SKIP
    ...     buf.host  # CoherenceError if a kernel may still write buf
    """
    token = _block_policy.set(check_policy(policy))
    try:
        yield policy
    finally:
        _block_policy.reset(token)


class _Launching(threading.local):
    """The trackers of the launch the calling thread is making right now.

    numba reads each argument's type and device pointer while the toolkit
    launches; those reads are the toolkit's own and must not mark the
    allocation as used by an unknown launch.  Only the launch's own
    arguments are exempt, not every buffer touched on the thread meanwhile.
    """

    current: tuple[Tracker, ...] = ()


_launching = _Launching()


class Tracker:
    """Outstanding device work and host holds of one allocation.

    Parameters
    ----------
    device_id : int
        The device whose context the allocation belongs to.
    concurrent : bool
        The device's concurrentManagedAccess: without it *any* running kernel
        makes host access to managed memory fault, so settling waits for the
        whole context.

    Notes
    -----
    Every field is read and written under one lock; the driver is never
    called with it held, so a garbage collection (which may run a buffer's
    finalizer) can never deadlock on it.
    """

    __slots__ = (
        "_blocked",
        "_idle",
        "_lenders",
        "_lock",
        "_records",
        "_unknown_gen",
        "_waiters",
        "attached",
        "capturing",
        "concurrent",
        "device_id",
        "device_wrote",
        "epoch",
        "escaped",
        "graphs",
        "holds",
        "inflight",
        "migrate",
        "policy",
        "reads",
        "unknown_devices",
        "writes",
    )

    def __init__(self, device_id: int, concurrent: bool = True) -> None:
        self._lock = threading.Lock()
        # Made by the first thread that must wait for in-flight registrations
        # (rare): a Condition costs as much to create as a pool allocation.
        self._idle: threading.Condition | None = None
        self._waiters = 0  # threads waiting for in-flight registrations to end
        #: Writes not known to be implied by a later one, by identity.  A new
        #: write supersedes exactly the events it was ordered after (see
        #: begin_use); one that was filed meanwhile by another thread stays.
        self.writes: dict[int, _events.Event] = {}
        #: Reads since those writes, by identity.
        self.reads: dict[int, _events.Event] = {}
        #: Devices on which a launch the toolkit did not make used the memory.
        self.unknown_devices: set[int] = set()
        self._unknown_gen = 0
        #: Events filed so far (see mark()).
        self._records = 0
        #: A device view left the toolkit: work on it can appear at any time.
        self.escaped = False
        #: Toolkit work between its begin and its recorded event.
        self.inflight = 0
        #: Bumped when a pool hands the record on to the next buffer over the memory (:meth:`recycle`):
        #: work that took the address before must not register under the next owner.
        self.epoch = 0
        self.holds = 0
        #: Graph captures under way that use the memory (its captured work has not run yet).
        self.capturing = 0
        #: Live graphs (umem_numba.Graph) whose replays use the memory.
        self.graphs = 0
        #: Why new device use is refused right now (closing, resizing), or None.
        self._blocked: str | None = None
        #: Threads inside a ``lend`` block of this allocation (ident -> open blocks), or None.
        self._lenders: dict[int, int] | None = None
        self.policy: str | None = None
        self.device_id = device_id
        self.concurrent = concurrent
        #: None (attached globally), "host", or the stream handle it is attached to.
        self.attached: str | int | None = None
        #: Managed memory the host touched since the device last had it: ``(ptr, nbytes)`` to
        #: prefetch to the device before the next launch (see :func:`prefetch_touched`); None
        #: when there is nothing to move; 0 once the driver refused such a prefetch.
        self.migrate: tuple[int, int] | int | None = None
        #: The device may have written the memory since the host last took a view of it: the next
        #: reading host view of a managed buffer prefetches it to the host (even once the work is
        #: settled and its events forgotten, as after ``synchronize()``).  Set under the lock where
        #: device writes are filed; cleared by the host view (Buffer._host_array).
        self.device_wrote = False

    # -- what tests and tools read ---------------------------------------------
    @property
    def pending(self) -> dict[int, _events.Event]:
        """Recorded work not yet known to be done, by stream handle (a snapshot)."""
        with self._lock:
            events = [*self.writes.values(), *self.reads.values()]
        return {e.stream: e for e in events}

    @property
    def unknown(self) -> bool:
        """Whether a launch the toolkit did not make may still use the memory."""
        return bool(self.unknown_devices)

    # -- device side -------------------------------------------------------------
    def on_device_export(self, escape: bool) -> None:
        """A device view was taken outside a toolkit launch.

        Parameters
        ----------
        escape : bool
            ``True``: the view left the toolkit for good (CUDA Array
            Interface, DLPack).  ``False``: numba is launching with it right
            now on the current device (a plain launch).
        """
        if self in _launching.current:
            return
        if not escape and (self.writes or self.reads or self.unknown_devices or self.escaped or self.inflight):
            # numba launches on a stream umem_numba is not told: the launch cannot be ordered
            # after earlier device work on the device, so that work is settled on the host first.
            self.settle("a kernel launch umem_numba does not track", self.effective_policy())
        device = -1 if escape else _driver.current_device()
        with self._lock:
            self._refuse_device_use()
            self.device_wrote = True
            if escape:
                self.escaped = True
            else:
                self.unknown_devices.add(device)
                self._unknown_gen += 1

    def begin_plain_launch(
        self, key: int, device: int, mark: Any = None
    ) -> tuple[list[_events.Event], tuple[_events.Event, ...], int | None]:
        """A plain numba launch about to be queued on stream ``key`` of ``device`` (counted as a write).

        Work on an unknown stream is settled on the host first, as for any
        launch.  With ``mark`` (the stream's ``StreamMark``) the mark is filed
        now: recorded only when needed, it will cover the kernel; what it
        supersedes is dropped by :meth:`supersede` once the stream waits for
        ``waits``.  Without, until :meth:`end_plain_launch` files the launch's
        event the memory counts as used on an unknown stream of ``device``
        (host access synchronises the device): a launch that fails before
        then leaves that conservative mark, never a registration to wait for.

        Returns
        -------
        waits : list of Event
            What the launch stream must wait for, on the device: every write
            and read on another stream.
        covered : tuple of Event
            Everything pending before: pass it to :meth:`supersede` (with a
            mark) or :meth:`end_plain_launch`.
        generation : int or None
            Without a mark: the unknown mark's generation if it is the only
            one (then :meth:`end_plain_launch` removes it); ``None`` otherwise.

        Raises
        ------
        CoherenceError
            The host holds the buffer, or (``"raise"``) work on an unknown stream is pending.
        BufferClosedError
            The buffer is being closed.
        """
        if self.unknown_devices or self.escaped or self.inflight:
            # Work on an unknown stream cannot be ordered on the device: settled on the host first.
            self.settle("a kernel launch", self.effective_policy())
        with self._lock:
            self._refuse_device_use()
            self.device_wrote = True
            covered = (*self.writes.values(), *self.reads.values())
            waits = [e for e in covered if e.key != key] if covered else _NO_WAITS
            if mark is not None:
                if id(mark) not in self.writes:
                    self.writes[id(mark)] = mark
                    self._records += 1
                return waits, covered, None
            alone = not self.unknown_devices
            self.unknown_devices.add(device)
            self._unknown_gen += 1
            return waits, covered, self._unknown_gen if alone else None

    def plain_launch_unchanged(self, mark: Any) -> bool:
        """Whether a plain launch under ``mark`` (a stream's current mark) changes nothing here.

        True when ``mark`` is all this memory waits for: nothing else pending,
        nothing refusing device use.  The launch then files nothing: the
        mark, recorded later, covers it.
        """
        with self._lock:
            return (
                len(self.writes) == 1
                and id(mark) in self.writes
                and not self.reads
                and self._blocked is None
                and not self.holds
                and not self.unknown_devices
                and not self.escaped
                and not self.inflight
                and not self.migrate
            )

    def supersede(self, covered: tuple[_events.Event, ...], mark: Any) -> None:
        """Drop ``covered`` (see :meth:`begin_plain_launch`): the mark's stream waited for them."""
        with self._lock:
            for old in covered:
                if old is not mark:
                    self.writes.pop(id(old), None)
                    self.reads.pop(id(old), None)

    def end_plain_launch(self, event: _events.Event, covered: tuple[_events.Event, ...], mark: int | None) -> None:
        """File the event recorded after a plain launch (see :meth:`begin_plain_launch`): a write."""
        with self._lock:
            self._records += 1
            self.device_wrote = True
            for old in covered:
                self.writes.pop(id(old), None)
                self.reads.pop(id(old), None)
            self.writes[id(event)] = event
            if mark is not None and mark == self._unknown_gen:
                self.unknown_devices.clear()  # the launch's own mark, the only one: now its event says it

    def begin_use(
        self, key: int, write: bool, what: str, epoch: int | None = None
    ) -> tuple[list[_events.Event], tuple[_events.Event, ...]]:
        """Register device work about to be issued on stream ``key``.

        ``epoch``: :attr:`epoch` as read when the work took the buffer's address
        (before checking that the buffer was open).  Pool memory is handed on
        with its record when a buffer closes: work that took the closed
        buffer's address and registers only now would write the next buffer's
        memory, so it is refused.

        Returns
        -------
        waits : list of Event
            What the stream must wait for, on the device: the writes on other
            streams, and for a write also the reads on other streams.
        covered : tuple of Event
            Every event the work will come after (those waited for, and the
            earlier ones of its own stream): pass it to :meth:`end_use`.

        Raises
        ------
        CoherenceError
            The host holds the buffer (or it is being resized).
        BufferClosedError
            The buffer is being closed.
        """
        if self.unknown_devices or self.escaped:
            # Work on an unknown stream (a plain launch, or another library's work on an escaped
            # view) cannot be ordered on the device: settle it on the host first.
            self.settle(what, self.effective_policy())
        with self._lock:
            if epoch is not None and epoch != self.epoch:
                raise BufferClosedError(f"{what}: the buffer was closed (its pool memory went to another buffer)")
            if self._blocked is not None or self.holds:
                self._refuse_if_blocked(what)
                raise CoherenceError(
                    f"{what}: the buffer is held by the host (inside `with buf.on_host()`); leave the block first"
                )
            self.inflight += 1
            writes, reads = self.writes, self.reads
            if not writes and not reads:
                return _NO_WAITS, ()
            if write:
                covered = (*writes.values(), *reads.values())
            elif reads:
                covered = (*writes.values(), *(e for e in reads.values() if e.key == key))
            else:
                covered = tuple(writes.values())
            for e in covered:
                if e.key != key:  # work on another stream: the stream must wait for it
                    return [e for e in covered if e.key != key], covered
            return _NO_WAITS, covered

    def end_use(
        self,
        key: int,
        event: _events.Event | None,
        write: bool,
        covered: tuple[_events.Event, ...] = (),
        *,
        issued: bool = True,
    ) -> None:
        """File the event recorded after work registered by :meth:`begin_use`.

        ``event`` is ``None`` when recording failed: if the work was
        ``issued`` the memory is then treated as used by an unknown launch.
        """
        with self._lock:
            self.inflight -= 1
            if write and (event is not None or issued):
                self.device_wrote = True
            if event is not None:
                self._records += 1
                if write:  # ordered after every covered write and read: they are implied by this event
                    for old in covered:
                        self.writes.pop(id(old), None)
                        self.reads.pop(id(old), None)
                    self.writes[id(event)] = event
                else:  # a read supersedes only earlier reads of its own stream; writes stay for others
                    for old in covered:
                        if old.key == key:
                            self.reads.pop(id(old), None)
                    self.reads[id(event)] = event
            elif issued:
                self.unknown_devices.add(event_device_fallback(self.device_id))
                self._unknown_gen += 1
            if not self.inflight and self._waiters:
                assert self._idle is not None  # made by the waiter
                self._idle.notify_all()

    def is_closed(self) -> bool:
        """Whether the memory's buffer was closed for good (:meth:`block` with ``"closed"``)."""
        return self._blocked == "closed"

    def join_capture(self) -> None:
        """Count a graph capture that uses the memory (refused while the host holds it, or it closes or resizes)."""
        with self._lock:
            self._refuse_device_use()
        self.count_uses(captures=1)

    def count_uses(self, *, captures: int = 0, graphs: int = 0) -> None:
        """Change the counts of captures and live graphs that use the memory.

        Under a lock of their own, not the tracker's: a collected graph's
        finalizer calls this, and a garbage collection may run while this
        thread holds the tracker's lock.  Nothing in the block allocates a
        container, so no collection (no finalizer) can start inside it.
        """
        with _use_counts_lock:
            self.capturing += captures
            self.graphs += graphs

    def _refuse_device_use(self) -> None:
        """Under the lock: refuse device use while closing or resizing, or while the host holds the buffer."""
        self._refuse_if_blocked("device use")
        if self.holds:
            raise CoherenceError(
                "a kernel launch (or other device use) was attempted while the host "
                "holds this buffer (inside `with buf.on_host()`)"
            )

    def _refuse_if_blocked(self, what: str) -> None:
        blocked = self._blocked
        if blocked is None:
            return
        if blocked == "closed":  # for good: close() returned (recycle() reopens pool memory)
            raise BufferClosedError(f"{what}: the buffer is closed")
        error = BufferClosedError if blocked == "closing" else CoherenceError
        raise error(f"{what}: the buffer is being {'closed' if blocked == 'closing' else blocked} by another thread")

    def block(self, reason: str) -> None:
        """Refuse new device use (``reason``: "closing", "closed", "resized") until :meth:`unblock`.

        ``"closed"`` is for good: a launch that took a buffer's address before ``close()``
        (on another thread) and registers after it returned must not write memory that host
        views still hold, with nothing to wait for it.

        Work registered before is waited for by the settling done while
        blocked; nothing can start between that wait and :meth:`unblock`.
        """
        with self._lock:
            self._blocked = reason

    def close_if_idle(self) -> bool:
        """Block device use for good (``"closed"``) if nothing may use the memory: True when it did.

        The common close (nothing launched since the host last settled, as
        in an allocate / fill / read / close loop) then needs no settling and
        no wait: what :meth:`before_host_access` and :meth:`wait_all` would
        find is checked and the block is set under one lock, so no launch can
        register in between.  False, and nothing changed, whenever anything
        is pending or in flight, a capture, a host hold or a ``lend`` block
        uses the memory, or the device lacks concurrentManagedAccess: the
        caller takes the full close path.
        """
        lock = self._lock
        lock.acquire()  # (not ``with``: every default buffer's close passes here, and ``with`` costs twice as much)
        try:
            if (
                self._blocked is None
                and not self.writes
                and not self.reads
                and not self.unknown_devices
                and not self.escaped
                and not self.inflight
                and not self.holds
                and not self.capturing
                and not self._lenders
                and self.concurrent
            ):
                self._blocked = "closed"
                return True
            return False
        finally:
            lock.release()

    def close_unless_lending(self) -> bool:
        """Block device use for good (``"closed"``) unless the calling thread is inside a ``lend`` block of it.

        The close of stream-ordered memory (pools), whose free is queued after
        the recorded work: False, and nothing changed, only inside the
        thread's own ``lend`` block, where the caller raises
        (:meth:`refuse_inside_own_lend`).
        """
        lenders = self._lenders
        if lenders and threading.get_ident() in lenders:
            return False
        lock = self._lock
        lock.acquire()  # (as in close_if_idle)
        try:
            self._blocked = "closed"
        finally:
            lock.release()
        return True

    def unblock(self) -> None:
        """End :meth:`block`."""
        with self._lock:
            self._blocked = None

    @contextlib.contextmanager
    def exclusive(self, reason: str) -> Iterator[None]:
        """:meth:`block` for the ``with`` block."""
        self.block(reason)
        try:
            yield
        finally:
            self.unblock()

    def add(self, stream: int, event: _events.Event) -> None:
        """File ``event`` as a write that comes before any other use (a pool allocation)."""
        with self._lock:
            self.writes[id(event)] = event
            self._records += 1

    def recycle(self) -> bool:
        """Ready this record for the next buffer over the same memory (a pool's free list).

        The recorded events stay: the next buffer's host access and its work
        on other streams wait for them, as they would for a stream-ordered
        free.  Returns ``False`` (and changes nothing) when work umem_numba
        cannot see may use the memory, or work is being registered: such
        memory must go back to the driver.
        """
        # No lock: the buffer is closed, so no new work can start on it; a launch
        # that was still registering files its event here, which the next buffer
        # then waits for (conservative, never unsafe: the memory stays the pool's).
        if self.unknown_devices or self.escaped or self.holds or self.inflight:
            return False
        self.policy = None
        self.attached = None
        self.epoch += 1  # before reopening: a late registration of the closed buffer is refused
        self._blocked = None
        return True

    def mark(self) -> int:
        """A token for :meth:`recorded_since`: how many events were filed so far."""
        return self._records

    def recorded_since(self, mark: int) -> bool:
        """Whether an event was filed after :meth:`mark` returned ``mark``."""
        return self._records != mark

    def pending_work(self) -> tuple[list[_events.Event], set[int], int, bool]:
        """``(events, unknown devices, generation, escaped)`` once in-flight registrations have ended."""
        with self._lock:
            return self._snapshot()

    # -- host side -------------------------------------------------------------------
    def effective_policy(self) -> str:
        """The policy in force: the buffer's, else the ``with`` block's, else the global one."""
        return self.policy or _block_policy.get() or _global_policy

    def before_host_access(self, what: str) -> None:
        """Settle before host code reads or writes the memory."""
        if (
            not self.writes
            and not self.reads
            and not self.unknown_devices
            and not self.escaped
            and not self.inflight
            and self.concurrent
            and not self.capturing
        ):
            return
        if self.capturing:
            raise CoherenceError(
                f"{what}: this buffer is used by the CUDA graph being captured (umem_numba.capture), whose "
                "work has not run: it runs when the graph is launched; access it after the capture, and after "
                "a launch of the graph for its results"
            )
        self.settle(what, self.effective_policy())

    # -- lend blocks ---------------------------------------------------------------------
    def lend_entered(self) -> int:
        """A ``lend`` block of this allocation starts on the calling thread; returns the thread's ident.

        Call it after the block's registration (:class:`DeviceUse`) began.
        """
        ident = threading.get_ident()
        with self._lock:
            lenders = self._lenders
            if lenders is None:
                lenders = self._lenders = {}
            lenders[ident] = lenders.get(ident, 0) + 1
        return ident

    def file_lent_work(self, events: list[_events.Event], write: bool, unseen_device: int | None) -> None:
        """File the work of a lend's consumers (events on their streams; a device where it is unseen).

        Nothing is superseded: the consumers were ordered after the lending
        stream, not necessarily after other work filed meanwhile.
        """
        if not events and unseen_device is None:
            return
        with self._lock:
            if write:
                self.device_wrote = True
            table = self.writes if write else self.reads
            for event in events:
                table[id(event)] = event
                self._records += 1
            if unseen_device is not None:
                self.unknown_devices.add(unseen_device)
                self._unknown_gen += 1

    def lend_left(self, ident: int) -> None:
        """The ``lend`` block that :meth:`lend_entered` returned ``ident`` for has ended."""
        with self._lock:
            lenders = self._lenders
            assert lenders is not None
            if lenders[ident] == 1:
                del lenders[ident]
            else:
                lenders[ident] -= 1

    def refuse_inside_own_lend(self, what: str) -> None:
        """Raise :class:`CoherenceError` if the calling thread is inside a ``lend`` block of this allocation.

        Waiting for the lent work there would wait for the block's own
        registration, which ends only when the block does: it would never
        return.  Another thread may wait: the block ends without it.
        """
        lenders = self._lenders
        if lenders and threading.get_ident() in lenders:
            raise CoherenceError(
                f"{what}: this buffer is lent (inside `with buf.lend(...)`) by this thread, and its lent "
                "work is recorded only when the block ends: leave the lend block first"
            )

    def _snapshot(self, what: str = "waiting for device work") -> tuple[list[_events.Event], set[int], int, bool]:
        """Wait for in-flight registrations, then copy what is pending (lock held by the caller).

        Raises
        ------
        CoherenceError
            The calling thread's own ``lend`` block is among them (it would wait for itself).
        """
        if self.inflight:
            self.refuse_inside_own_lend(what)
        while self.inflight:
            if self._idle is None:
                self._idle = threading.Condition(self._lock)
            self._waiters += 1
            try:
                self._idle.wait()
            finally:
                self._waiters -= 1
        events = [*self.writes.values(), *self.reads.values()]
        return events, set(self.unknown_devices), self._unknown_gen, self.escaped

    def _forget(self, done: list[_events.Event], unknown_gen: int | None) -> None:
        """Drop finished events (only those still filed) and, if nothing new came, the unknown mark."""
        with self._lock:
            for event in done:
                self.writes.pop(id(event), None)
                self.reads.pop(id(event), None)
            if unknown_gen is not None and unknown_gen == self._unknown_gen:
                self.unknown_devices.clear()

    def _no_concurrent_wait(self) -> str | int | None:
        """On a device without concurrentManagedAccess: the context, or the attached stream, to wait for."""
        if self.concurrent or self.attached == "host":
            return None
        return "context" if self.attached is None else self.attached

    def settle(self, what: str, policy: str, *, always_wait: bool = False) -> None:
        """Make host access safe under ``policy`` (``always_wait``: warn/off still wait, for unmapping)."""
        if policy == "off" and not always_wait:
            return
        with self._lock:
            events, unknown, gen, escaped = self._snapshot(what)
        busy = [e for e in events if not e.done()]
        extra = self._no_concurrent_wait()
        if not busy and not unknown and not escaped and extra is None:
            self._forget(events, None)
            return
        if policy in ("raise", "warn") and (busy or unknown or escaped):
            msg = _busy_message(what, busy, unknown, escaped)
            if policy == "raise":
                raise CoherenceError(msg)
            if not always_wait:
                warnings.warn(msg, CoherenceWarning, stacklevel=4)
                if extra is None:
                    return
                busy, unknown, escaped = [], set(), False  # only the no-concurrent-access rule is kept
        # The no-concurrent-access rule is enforced under every policy but "off":
        # breaking it is a segmentation fault, not a stale read.
        self._wait(events, busy, unknown, gen, escaped, extra, what)

    def _wait(
        self,
        events: list[_events.Event],
        busy: list[_events.Event],
        unknown: set[int],
        gen: int,
        escaped: bool,
        extra: str | int | None,
        what: str,
    ) -> None:
        for event in busy:
            event.synchronize()
        if escaped:
            _driver.synchronize_devices(None, f"{what}: waiting for other libraries' work on a shared buffer")
        elif unknown:
            _driver.synchronize_devices(
                unknown | {self.device_id}, f"{what}: waiting for a launch umem_numba did not make"
            )
        if extra == "context" and not escaped:
            _driver.synchronize_devices({self.device_id}, f"{what}: waiting for the device (no concurrent access)")
        elif isinstance(extra, int):
            with _driver.device_context(self.device_id):
                _driver.call("cuStreamSynchronize", extra, detail="waiting for the stream this buffer is attached to")
        self._forget(events, gen if (unknown or escaped) else None)

    def wait_all(self, what: str) -> None:
        """Wait for everything that may use the memory, whatever the policy (before it is freed)."""
        with self._lock:
            events, unknown, gen, escaped = self._snapshot(what)
        self._wait(events, events, unknown, gen, escaped, None, what)

    def hold(self, what: str) -> None:
        """Refuse device use from now on, then settle (atomically: no launch slips in between)."""
        with self._lock:
            self.holds += 1
        try:
            self.settle(what, self.effective_policy())
        except BaseException:
            self.release_hold()
            raise

    def release_hold(self) -> None:
        """End one :meth:`hold`."""
        with self._lock:
            self.holds -= 1

    def busy_streams(self) -> list[int]:
        """Stream handles with recorded work not yet known to be finished."""
        return [s for s, e in self.pending.items() if not e.done()]


def event_device_fallback(device_id: int) -> int:
    """The device to synchronise when work was issued but its event could not be recorded."""
    try:
        return _driver.current_device()
    except Exception:
        return device_id


def _busy_message(what: str, busy: list[_events.Event], unknown: set[int], escaped: bool) -> str:
    if busy:
        streams = ", ".join(f"{e.stream:#x}" if e.stream else "0 (default)" for e in busy)
        return f"{what}: device work on stream(s) {streams} may still be using this buffer"
    if unknown:
        return (
            f"{what}: a kernel was launched on this buffer outside umem_numba (stream unknown, device(s) "
            f"{', '.join(map(str, sorted(unknown)))}); launch through umem_numba.launch/coherent/jit "
            "or call buf.synchronize() first"
        )
    return (
        f"{what}: this buffer was handed to another library (CUDA Array Interface or DLPack) outside "
        "`buf.lend(stream)`, so its work cannot be seen; lend it instead, or call buf.synchronize() "
        "and access it under coherence_policy('off')"
    )


def refuse_capture(stream: int, what: str) -> None:
    """Raise :class:`CoherenceError` if ``stream`` is capturing a CUDA graph.

    Call it before any other work on the stream (and before calls a capture
    forbids): an operation that refuses a capture must leave it intact.  An
    event recorded inside a capture cannot be waited for, so umem_numba
    cannot track work there.
    """
    if _driver.is_capturing(stream):
        raise CoherenceError(
            f"{what}: the stream is capturing a CUDA graph; umem_numba cannot track work inside a capture"
        )


class DeviceUse:
    """Order toolkit work on a stream against every buffer it touches, then record it.

    Parameters
    ----------
    uses : sequence of (Tracker, bool)
        Each tracker and whether the work writes its memory.
    stream : int
        The stream handle; the block must run with that stream's context
        current (the event is recorded there).
    what : str
        Words for messages.
    epochs : list of int or None, optional
        Per entry of ``uses``, the tracker's :attr:`Tracker.epoch` when the
        work took the buffer's address (``None``: not known).

    Examples
    --------
    >>> with DeviceUse([(tracker, True)], handle, "zeroing"):   # doctest: +SKIP
    ...     _driver.call("cuMemsetD8Async", ptr, 0, n, handle)
    """

    __slots__ = ("covered", "epochs", "event", "key", "stream", "uses", "what")

    def __init__(
        self, uses: list[tuple[Tracker, bool]], stream: int, what: str, epochs: list[int | None] | None = None
    ) -> None:
        merged: dict[int, tuple[Tracker, bool]] = {}
        #: Per tracker, the epoch its address was taken in (see Tracker.begin_use); None: none known.
        self.epochs: dict[int, int | None] | None = None
        for tracker, write in uses:
            old = merged.get(id(tracker))
            merged[id(tracker)] = (tracker, write or (old is not None and old[1]))
        if epochs is not None:  # only the copy layer passes them: no dict on the other paths
            self.epochs = {id(t): e for (t, _), e in zip(uses, epochs, strict=True)}
        self.uses = list(merged.values())
        self.stream = stream
        self.what = what
        self.key = 0
        #: The event recorded after the work (once the block ended without error).
        self.event: _events.Event | None = None
        self.covered: list[tuple[_events.Event, ...]] = []

    def __enter__(self) -> DeviceUse:
        refuse_capture(self.stream, self.what)
        self.key = _driver.stream_key(self.stream)
        begun: list[tuple[Tracker, bool]] = []
        try:
            waits: dict[int, _events.Event] = {}
            for tracker, write in self.uses:
                epoch = self.epochs.get(id(tracker)) if self.epochs is not None else None
                wait, covered = tracker.begin_use(self.key, write, self.what, epoch)
                begun.append((tracker, write))
                self.covered.append(covered)
                for event in wait:
                    waits[id(event)] = event
            for event in waits.values():
                _driver.call("cuStreamWaitEvent", self.stream, event.handle, 0, detail=self.what)
        except BaseException:
            for tracker, write in begun:
                tracker.end_use(self.key, None, write, issued=False)
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        event = None
        if exc_type is None:
            try:
                event = self.event = _events.record(self.stream, _driver.current_device(), self.key)
            finally:
                for (tracker, write), covered in zip(self.uses, self.covered, strict=True):
                    tracker.end_use(self.key, event, write, covered)
        else:
            # Part of the work may have been queued before the failure.
            for tracker, write in self.uses:
                tracker.end_use(self.key, None, write)
