"""The allocation cache: closed buffers' driver allocations kept for the next buffer of their size.

A ``ManagedBuffer`` or ``PinnedBuffer`` made without ``pool=`` gets its own
driver allocation (``cuMemAllocManaged``, ``cuMemHostAlloc``).  Allocating and
freeing one costs 20 to 60 µs for managed memory and far more for pinned
memory (the free waits for the device; pinning locks pages), against about
1 µs for a pool; CuPy's default allocator keeps ``cudaMalloc`` blocks, and its
and PyTorch's pinned allocators keep freed page-locked blocks, for that
reason.  The managed default is not a managed memory pool: the driver refuses
advice on managed-pool memory (``CUDA_ERROR_NOT_SUPPORTED`` on an H100), and a
default buffer must keep taking advice.  So the cache keeps the allocations
themselves, in lists per kind, device and size class, as a pool keeps its
blocks:

- a closed buffer's allocation joins the list of its size (rounded up to
  :data:`ROUND`) once its device work is done: closing waits for it, whatever
  the coherence policy, exactly as it does before a free (a host view that
  outlives ``close()`` keeps the final values).  Nothing can use it any more;
  the next buffer over it reopens the closed buffer's coherence record under
  a new epoch (:meth:`CachedMemory.reopened_record`), so a launch that took
  the old buffer's address is still refused;
- it goes back to the driver instead when it took advice or a stream
  attachment (the next buffer must not inherit them), when its address was
  shared (``ptr``, the CUDA Array Interface), when the cache is off
  or holds :func:`cache_limit` bytes already (a quarter of the device's
  memory; pinned memory at most :data:`PINNED_LIMIT`), or when it was made
  with flags other than the default ones (those allocations are not made
  here);
- :func:`release_allocation_cache` gives everything back; an allocation the
  driver refuses for lack of memory first releases the cache and tries again.

What the driver keeps about reused memory is the memory's, not the new
buffer's: the pages stay where the last buffer left them, and
``hints.last_prefetch_location`` reads the last prefetch of that memory (as
for pool memory).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .. import _driver
from ._lifetime import Memory, report_failed_free
from ._tracker import Tracker

__all__ = [
    "PINNED_LIMIT",
    "ROUND",
    "CachedMemory",
    "cache_limit",
    "cached_bytes",
    "get_allocation_cache",
    "release_allocation_cache",
    "set_allocation_cache",
    "take_or_allocate",
]

#: Cached allocations are made in multiples of this many bytes (the size classes).
ROUND = 512
_ROUND_UP, _ROUND_MASK = ROUND - 1, -ROUND

_enabled = True
_lock = threading.Lock()


class _SizeLists:
    """Cached allocations of one kind on one device: size class -> allocations, within a byte limit.

    Taking is lock-free: ``list.pop`` is atomic under the GIL, so each entry
    goes to exactly one taker (a buffer, or :meth:`drain`), and the taker
    logs the bytes it took in :attr:`taken` (an append, atomic too).  Only
    :meth:`keep` and :meth:`drain` change :attr:`held`, under the lock, after
    folding that log in: the count stays exact, and a default buffer's open
    takes no lock.

    Nothing allocated under the lock is a container: a garbage collection started
    there could run a collected buffer's release on this thread, which comes back
    here for the same lock (:meth:`keep`).
    """

    __slots__ = ("blocks", "held", "limit", "lock", "taken")

    def __init__(self, limit: int) -> None:
        #: Size class -> allocations.  A size's list, once made, is never replaced nor removed.
        self.blocks: dict[int, list[CachedMemory]] = {}
        #: Bytes listed, less those of :attr:`taken` (folded in under the lock).
        self.held = 0
        #: Sizes of the allocations taken since the last fold.
        self.taken: list[int] = []
        self.limit = limit
        self.lock = threading.Lock()

    def _fold_taken(self) -> None:
        """Subtract what was taken since the last fold from :attr:`held` (the caller holds the lock)."""
        taken = self.taken
        while taken:
            self.held -= taken.pop()

    # (``acquire``/``release`` rather than ``with``: every default buffer's close passes here,
    # and ``with`` costs twice as much.)
    def keep(self, memory: CachedMemory) -> bool:
        """List ``memory`` (False: no room, it must go back to the driver)."""
        size = memory.size
        blocks = self.blocks.get(size)
        new: list[CachedMemory] | None = [] if blocks is None else None  # made outside the lock
        lock = self.lock
        lock.acquire()
        try:
            if self.taken:
                self._fold_taken()
            if self.held + size > self.limit:
                return False
            self.held += size
            if blocks is None:
                blocks = self.blocks.setdefault(size, new)  # type: ignore[arg-type]
            blocks.append(memory)
            return True
        finally:
            lock.release()

    def take(self, size: int) -> CachedMemory | None:
        """A listed allocation of the size class ``size``, or None (no lock: see the class notes)."""
        blocks = self.blocks.get(size)
        if not blocks:
            return None
        try:
            memory = blocks.pop()
        except IndexError:  # another thread took the last one
            return None
        self.taken.append(size)
        return memory

    def bytes_held(self) -> int:
        """Bytes listed now."""
        lock = self.lock
        lock.acquire()
        try:
            self._fold_taken()
            return self.held
        finally:
            lock.release()

    def drain(self) -> list[CachedMemory]:
        """Take every listed allocation off the lists."""
        out: list[CachedMemory] = []  # made outside the lock (see the class notes)
        for blocks in list(self.blocks.values()):
            while True:
                try:
                    out.append(blocks.pop())  # each entry goes to one taker (a racing buffer, or here)
                except IndexError:
                    break
                self.taken.append(out[-1].size)
        self.bytes_held()  # folds what was taken, the drained entries included
        return out


#: (kind, device) -> that cache's lists.
_lists: dict[tuple[str, int], _SizeLists] = {}


#: The most pinned bytes the cache keeps: page-locked memory is taken from the OS's paging
#: for as long as it is cached, so the pinned cache stays small next to the managed one.
PINNED_LIMIT = 1 << 30


def cache_limit(device_id: int, kind: str = "managed") -> int:
    """The most bytes one kind's cache keeps for a device: a quarter of its memory (pinned: at most 1 GiB)."""
    quarter = int(_driver.call("cuDeviceTotalMem", device_id)) // 4
    return min(quarter, PINNED_LIMIT) if kind == "pinned" else quarter


def _lists_of(kind: str, device_id: int) -> _SizeLists:
    key = (kind, device_id)
    lists = _lists.get(key)
    if lists is None:
        made = _SizeLists(cache_limit(device_id, kind))  # outside the lock (see _SizeLists)
        with _lock:
            lists = _lists.setdefault(key, made)
    return lists


def rounded(nbytes: int) -> int:
    """The size class of a request of ``nbytes`` (what is allocated)."""
    return (nbytes + _ROUND_UP) & _ROUND_MASK


def take_or_allocate(
    kind: str, device_id: int, nbytes: int, alloc: Callable[[int], int], free_call: str
) -> tuple[CachedMemory, Tracker | None]:
    """Memory for a new buffer of ``nbytes``: a cached allocation of its size class and the closed
    buffer's reopened record (:meth:`CachedMemory.reopened_record`; None: make a new one), else a new
    allocation (:func:`allocate`, beside a user's graph capture too: allowed, and the capture goes on)."""
    lists = _lists.get((kind, device_id)) if _enabled else None
    if lists is not None:
        cached = lists.take((nbytes + _ROUND_UP) & _ROUND_MASK)
        if cached is not None:
            cached.nbytes = nbytes
            return cached, cached.reopened_record()
    with _driver.capture_safe():
        return allocate(kind, device_id, nbytes, alloc, free_call), None


class CachedMemory(Memory):
    """A driver allocation that goes to the allocation cache when its buffer closes.

    Parameters
    ----------
    kind : str
        Statistics bucket and cache (``"managed"``, ``"pinned"``).
    ptr : int
        The address the free call takes.
    nbytes : int
        The buffer's bytes (``size`` or less).
    size : int
        What was allocated (:func:`rounded`).
    free_call : str
        The driver function that frees it.
    device_id : int
        Whose context frees it.
    """

    __slots__ = ("advised", "device_id", "free_call", "kind", "lists", "nbytes", "ptr", "size", "tracker")
    #: Closed like a driver allocation: the release path first waits for the buffer's device
    #: work, whatever the policy, so what the cache holds has no work left to run.
    stream_ordered = False

    def __init__(self, kind: str, ptr: int, nbytes: int, size: int, free_call: str, device_id: int) -> None:
        self.kind = kind
        self.ptr = ptr
        self.nbytes = nbytes
        self.size = size
        self.free_call = free_call
        self.device_id = device_id
        self.advised = False
        #: The cache's lists this memory goes back to (found at its first close: making them asks
        #: the driver for the device's memory size).
        self.lists: _SizeLists | None = None
        #: While cached: the closed buffer's coherence record (blocked "closed"; see :meth:`reopened_record`).
        self.tracker: Tracker | None = None

    def reopened_record(self) -> Tracker | None:
        """The last buffer's record, reopened for the next buffer over this memory; None: make a new one.

        Reopening (:meth:`Tracker.recycle`, as a pool does for its free lists)
        bumps the record's epoch, so a launch that took the closed buffer's
        address and registers only now is refused; it saves the next buffer a
        new record (a lock and twenty fields).  A record a live graph or a
        capture still counts stays with the closed buffer.
        """
        tracker, self.tracker = self.tracker, None
        if tracker is None or tracker.graphs or tracker.capturing or not tracker.recycle():
            return None
        return tracker

    def describe(self) -> str:
        return f"{self.kind} memory at {self.ptr:#x} ({self.nbytes} bytes)"

    def note_advice(self) -> None:
        self.advised = True

    def free(self, tracker: Tracker) -> None:
        # The release path waited for ``tracker``'s work: the memory is idle.  Memory whose address
        # was shared (``ptr``, the CUDA Array Interface) may still be named by a raw pointer
        # somewhere: freed, so that a stale use faults rather than writes the next buffer.
        if _enabled and not self.advised and not tracker.escaped:
            self.tracker = tracker  # set before the memory is listed: another thread may take it at once
            lists = self.lists
            if lists is None:
                lists = self.lists = _lists_of(self.kind, self.device_id)
            if lists.keep(self):
                return
            self.tracker = None
        self.free_to_driver()

    def free_to_driver(self) -> None:
        """Give the (idle) allocation back to the driver."""
        with _driver.capture_safe():  # a free beside a user's graph capture leaves it intact
            _driver.call_on(self.device_id, self.free_call, self.ptr)


def allocate(kind: str, device_id: int, nbytes: int, alloc: Callable[[int], int], free_call: str) -> CachedMemory:
    """A new driver allocation of ``rounded(nbytes)`` made by ``alloc(size)``.

    The driver refusing for lack of memory releases the cache and tries once more.
    """
    from .._errors import OutOfMemoryError

    size = rounded(nbytes)
    try:
        ptr = alloc(size)
    except OutOfMemoryError:
        if not cached_bytes():
            raise
        release_allocation_cache()
        ptr = alloc(size)
    return CachedMemory(kind, ptr, nbytes, size, free_call, device_id)


def set_allocation_cache(enabled: bool) -> None:
    """Turn the allocation cache of buffers made without ``pool=`` on (the default) or off.

    Off, every such buffer gets a new driver allocation and its close frees
    it (after its device work), as before umem_numba 0.2; the allocations
    already cached are given back.

    Parameters
    ----------
    enabled : bool

    Raises
    ------
    TypeError
        ``enabled`` is not a bool.
    """
    global _enabled
    if type(enabled) is not bool:
        raise TypeError(f"set_allocation_cache: enabled must be a bool, got {type(enabled).__name__}")
    _enabled = enabled
    if not enabled:
        release_allocation_cache()


def get_allocation_cache() -> bool:
    """Whether buffers made without ``pool=`` reuse cached allocations (see :func:`set_allocation_cache`)."""
    return _enabled


def release_allocation_cache() -> None:
    """Give every cached allocation back to the driver, each after its recorded device work.

    Buffers in use are not affected.  Call it before handing the memory to
    another library or process; ``umem_numba.info()["allocation_cache"]``
    shows what the cache holds.
    """
    for lists in list(_lists.values()):
        for memory in lists.drain():
            try:
                memory.free_to_driver()
            except Exception as exc:
                report_failed_free(f"releasing cached {memory.describe()}", exc)


def cached_bytes() -> int:
    """Bytes the allocation cache holds, over every kind and device."""
    return sum(lists.bytes_held() for lists in list(_lists.values()))
