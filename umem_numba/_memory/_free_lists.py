"""A pool's free lists: which freed memory is kept, under which key, and when it may be reused.

This is the policy half of a pool, as CuPy keeps ``_Arena`` apart from
``SingleDeviceMemoryPool``: :class:`FreeLists` knows nothing of streams'
handles, driver pools or statistics.  :class:`~umem_numba._memory._pool.MemoryPool`
(the façade) resolves streams to their ``cuStreamGetId``, asks the driver for
memory when no list has any, and hands freed memory here.  The rules
themselves are in :mod:`umem_numba._memory._pool`'s module notes; in short:

- **buffer lists** (rounded size -> memory of closed buffers) keep each block
  with its coherence record, so the next buffer waits for the old work;
- **raw lists** (stream id -> rounded size -> addresses) hand an address out
  again on the stream that freed it only, where stream order makes it safe;
- **held** blocks (work umem_numba could not see may use them on any stream)
  wait for a device synchronise that began after they were held, then become
  **idle**: reusable on any stream.

The synchronise tickets at the end of this module tell when held memory is
settled; every synchronise umem_numba makes for reuse goes through
:func:`synchronize_for_reuse`, so that it counts.

Nothing here locks: list appends and pops are atomic under the GIL, every
entry is taken by exactly one ``pop``, and two threads racing past the limit
overshoot it by one block at most.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from .. import _driver
from ._tracker import Tracker

#: A limit that keeps everything (the default release threshold of a pool made by umem_numba).
KEEP_ALL = (1 << 64) - 1
#: Held blocks that make the next allocation needing memory synchronise their devices once.
HELD_SYNC_COUNT = 32
#: Held bytes that do the same.
HELD_SYNC_BYTES = 256 << 20


class ListedMemory(Protocol):
    """What a buffer list keeps: a pool block that can give itself back after its recorded work."""

    size: int
    tracker: Tracker | None

    def free_to_driver(self, tracker: Tracker) -> None: ...


#: What a pool's buffer lists hold (its own block type, so that it gets that type back).
M = TypeVar("M", bound=ListedMemory)


class FreeLists(Generic[M]):
    """The free lists of one pool (see the module notes).

    Parameters
    ----------
    device_id : int
        The pool's device: whose context frees run in, and what a held block's
        synchronise covers at least.
    limit : int
        The most bytes the lists keep (:data:`KEEP_ALL`: no limit; 0: keep
        nothing, as a pool other libraries share does).

    Notes
    -----
    The object never refers to its pool, so that a pool nobody uses can be
    collected and its finalizer give these lists back (:meth:`release`).
    """

    __slots__ = ("buffers", "closed", "device_id", "freed", "held", "held_seen", "idle", "limit", "raw")

    def __init__(self, device_id: int, limit: int, freed: Callable[[], None] = lambda: None) -> None:
        self.device_id = device_id
        self.limit = limit
        #: Called after each ``cuMemFreeAsync`` of an address (the pool counts what is outstanding).
        self.freed = freed
        #: No entry joins the lists any more (the pool closed); a racing one is given back.
        self.closed = False
        #: Closed buffers' memory: rounded size -> blocks, each with its coherence record.
        self.buffers: dict[int, list[M]] = {}
        #: The raw interface's addresses: stream id -> rounded size -> addresses.  A stream's dict
        #: is never replaced nor removed (the pool's last-stream cache may refer to it).
        self.raw: dict[int, dict[int, list[int]]] = {}
        #: Memory of work umem_numba could not see, waiting for a device synchronise.
        self.held: list[Held] = []
        #: The synchronise generation when :attr:`held` was last scanned.
        self.held_seen = -1
        #: Held memory a synchronise has settled: rounded size -> addresses, usable on any stream.
        self.idle: dict[int, list[int]] = {}

    # -- what is kept ----------------------------------------------------------------
    @property
    def cached_bytes(self) -> int:
        """Bytes on every list, held memory included."""
        buffers = sum(size * len(blocks) for size, blocks in list(self.buffers.items()))
        raw = sum(size * len(addrs) for per in list(self.raw.values()) for size, addrs in list(per.items()))
        idle = sum(size * len(addrs) for size, addrs in list(self.idle.items()))
        return buffers + raw + idle + sum(e.size for e in list(self.held))

    def has_room(self, size: int) -> bool:
        """Whether a block of ``size`` bytes may join the lists (open, and within the limit)."""
        limit = self.limit
        return not self.closed and (limit == KEEP_ALL or self.cached_bytes + size <= limit)

    # -- buffers -----------------------------------------------------------------------
    def take_buffer(self, size: int) -> M | None:
        """A closed buffer's block of ``size``, its record in ``memory.tracker``, or None."""
        blocks = self.buffers.get(size)
        if blocks:
            try:
                memory = blocks.pop()
            except IndexError:  # another thread took the last one
                return None
            return memory
        return None

    def put_back(self, memory: M) -> None:
        """Return an entry :meth:`take_buffer` gave out, unused (its record still in ``memory.tracker``)."""
        self.buffers.setdefault(memory.size, []).append(memory)
        if self.closed:  # the pool closed meanwhile and emptied the lists: this entry too
            _release_buffers(self.buffers)

    def keep_buffer(self, memory: M, tracker: Tracker) -> bool:
        """List a closed buffer's block with its record (False: it must go back to the driver)."""
        if not self.has_room(memory.size) or not tracker.recycle():
            return False
        memory.tracker = tracker
        blocks = self.buffers.get(memory.size)
        if blocks is None:
            blocks = self.buffers.setdefault(memory.size, [])
        blocks.append(memory)
        if self.closed:  # the pool closed meanwhile and emptied the lists: this entry too
            _release_buffers(self.buffers)
        return True

    # -- raw addresses -------------------------------------------------------------------
    def raw_for(self, key: int) -> dict[int, list[int]]:
        """The raw lists of the stream ``key`` (rounded size -> addresses), made on first use."""
        lists = self.raw.get(key)
        if lists is None:
            lists = self.raw.setdefault(key, {})
        return lists

    def keep_raw(self, lists: dict[int, list[int]], size: int, ptr: int) -> None:
        """List ``ptr`` in a stream's raw lists (from :meth:`raw_for`); the caller checked :meth:`has_room`."""
        addrs = lists.get(size)
        if addrs is None:
            addrs = lists.setdefault(size, [])
        addrs.append(ptr)
        if self.closed:  # the pool closed meanwhile: this entry too
            self.release()

    # -- memory of unseen work ---------------------------------------------------------
    def hold(self, ptr: int, size: int, devices: set[int], reuse: bool) -> None:
        """Keep ``ptr`` until a synchronise of ``devices`` that begins after now has completed.

        ``reuse`` False: the block goes back to the driver once settled (memory
        that took advice).  A closed pool's block is settled and freed at once.
        """
        if self.closed:
            synchronize_for_reuse(devices, "settling pool memory of work umem_numba could not see")
            self._free(ptr)
            return
        self.held.append(Held(ptr, size, sync_tickets(devices), reuse))
        if self.closed:  # the pool closed meanwhile: this entry too
            _release_parked(self.held, self.idle, self.device_id, self.freed)

    def take_settled(self, size: int, capturing: Callable[[], bool]) -> int:
        """An address of ``size`` that nothing can still use (held memory a synchronise settled), or 0.

        When :data:`HELD_SYNC_COUNT` blocks or :data:`HELD_SYNC_BYTES` bytes
        are held, their devices are synchronised once here and the batch
        reclaimed, unless ``capturing()`` says the allocation's stream captures
        a graph (a synchronise would break the capture).
        """
        addr = _pop(self.idle, size)
        if addr:
            return addr
        held = self.held
        if not held:
            return 0
        if self.held_seen != _sync_generation[0]:  # a synchronise completed since the last look
            self.reclaim(sync=False)
        entries = list(held)
        if entries and (len(entries) >= HELD_SYNC_COUNT or sum(e.size for e in entries) >= HELD_SYNC_BYTES):
            try:
                if capturing():
                    return 0
                self.reclaim(sync=True)
            except Exception:  # a synchronise refused (e.g. a capture in progress): use new memory
                return 0
        return _pop(self.idle, size)

    def reclaim(self, *, sync: bool) -> None:
        """Move held blocks whose synchronise has completed to the idle lists (``sync``: synchronise first)."""
        held = self.held
        if sync:
            devices: set[int] = set()
            for entry in list(held):
                devices.update(d for d, _ in entry.tickets)
            synchronize_for_reuse(devices, "settling pool memory of work umem_numba could not see")
        self.held_seen = _sync_generation[0]
        entries: list[Held] = []
        while True:
            try:
                entries.append(held.pop())  # atomic: two reclaims never take one entry twice
            except IndexError:
                break
        entries.reverse()
        waiting = []
        for entry in entries:
            if not settled(entry.tickets):
                waiting.append(entry)
            elif not entry.reuse or not self.has_room(entry.size):
                self._free(entry.ptr)
            else:
                idle = self.idle.get(entry.size)
                if idle is None:
                    idle = self.idle.setdefault(entry.size, [])
                idle.append(entry.ptr)
        held.extend(waiting)
        if self.closed:
            _release_parked(self.held, self.idle, self.device_id, self.freed)

    # -- giving back -------------------------------------------------------------------
    def release(self) -> None:
        """Every listed, raw, held and idle block back to the driver's pool (stream-ordered where it can be).

        Buffer blocks are freed after their recorded work; raw addresses
        after a synchronise of the device (the stream that freed one may be
        gone); held ones after a synchronise of their devices.
        """
        _release_buffers(self.buffers)
        _release_raw(self.raw, self.device_id, self.freed)
        _release_parked(self.held, self.idle, self.device_id, self.freed)

    def _free(self, ptr: int) -> None:
        """Give memory nothing can use any more back to the driver (any stream would do: the legacy one)."""
        _free_addresses([ptr], self.device_id, self.freed)


def _pop(lists: dict[int, list[int]], size: int) -> int:
    addrs = lists.get(size)
    if addrs:
        try:
            return addrs.pop()
        except IndexError:  # another thread took the last one
            pass
    return 0


def _release_buffers(lists: dict[int, list[M]]) -> None:
    """Free every listed buffer block to the driver (each exactly once, whoever else pops)."""
    for blocks in list(lists.values()):
        while True:
            try:
                memory = blocks.pop()
            except IndexError:
                break
            tracker = memory.tracker
            memory.tracker = None
            if tracker is not None:
                memory.free_to_driver(tracker)


def _release_raw(lists: dict[int, dict[int, list[int]]], device_id: int, freed: Callable[[], None]) -> None:
    """Free the raw interface's listed addresses to the driver.

    An entry was freed on its stream, which may be gone by now: the device is
    synchronised first, then each address is freed on the legacy stream.
    """
    raw = [addrs for per_stream in list(lists.values()) for addrs in list(per_stream.values()) if addrs]
    if not raw:
        return
    synchronize_for_reuse({device_id}, "settling raw pool memory before giving it back")
    ptrs = []
    for addrs in raw:
        while True:
            try:
                ptrs.append(addrs.pop())
            except IndexError:
                break
    _free_addresses(ptrs, device_id, freed)


def _release_parked(held: list[Held], idle: dict[int, list[int]], device_id: int, freed: Callable[[], None]) -> None:
    """Give held and idle memory back to the driver (held memory after a synchronise of its devices)."""
    entries: list[Held] = []
    while True:
        try:
            entries.append(held.pop())
        except IndexError:
            break
    ptrs = [e.ptr for e in entries]
    for addrs in list(idle.values()):
        while True:
            try:
                ptrs.append(addrs.pop())
            except IndexError:
                break
    if not ptrs:
        return
    pending = {d for e in entries if not settled(e.tickets) for d, _ in e.tickets}
    if pending:
        synchronize_for_reuse(pending, "settling pool memory of work umem_numba could not see")
    _free_addresses(ptrs, device_id, freed)  # nothing can use them any more: any stream will do


def _free_addresses(ptrs: list[int], device_id: int, freed: Callable[[], None]) -> None:
    """``cuMemFreeAsync`` each address on the legacy stream of ``device_id``, counting each free (``freed``)."""
    if not ptrs:
        return
    with _driver.device_context(device_id):
        for ptr in ptrs:
            _driver.call("cuMemFreeAsync", ptr, 0, detail=f"freeing {ptr:#x} into its memory pool")
            freed()


# ---------------------------------------------------------------------------
# Synchronise tickets: when held memory is settled

_sync_lock = threading.RLock()  # re-entrant: a finalizer run by a collection may synchronise too
#: Per device: tickets of the synchronises begun so far.
_sync_started: dict[int, int] = {}
#: Per device: the highest ticket of a synchronise that has completed.
_sync_done: dict[int, int] = {}
#: Bumped whenever a synchronise completes (a one-int "anything new?" test); a list, so it is shared.
_sync_generation = [0]


class Held:
    """Memory of work umem_numba could not see: ``ptr`` and ``size``, and per device the last ticket begun."""

    __slots__ = ("ptr", "reuse", "size", "tickets")

    def __init__(self, ptr: int, size: int, tickets: tuple[tuple[int, int], ...], reuse: bool) -> None:
        self.ptr = ptr
        self.size = size
        self.tickets = tickets
        #: False: back to the driver once settled (memory that took advice).
        self.reuse = reuse


def sync_tickets(devices: set[int] | list[int] | tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Per device, the ticket of the last synchronise begun so far: a block held now needs a later one.

    Read after the work that used the memory was issued (it was, since the
    memory is being released): a synchronise with a later ticket begins after
    that work was queued, so it waits for it.
    """
    return tuple((d, _sync_started.get(d, 0)) for d in sorted(devices))


def settled(tickets: tuple[tuple[int, int], ...]) -> bool:
    """Whether, on every device of ``tickets``, a synchronise begun after them has completed."""
    return all(_sync_done.get(device, 0) > ticket for device, ticket in tickets)


def synchronize_for_reuse(devices: set[int] | list[int], what: str) -> None:
    """``cuCtxSynchronize`` on each device, counted (begin ticket, then done mark) for :func:`settled`."""
    for device in sorted(devices):
        with _sync_lock:
            ticket = _sync_started[device] = _sync_started.get(device, 0) + 1
        with _driver.device_context(device):
            _driver.call("cuCtxSynchronize", detail=what)
        with _sync_lock:
            if _sync_done.get(device, 0) < ticket:
                _sync_done[device] = ticket
            _sync_generation[0] += 1
