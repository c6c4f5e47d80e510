"""Prefetching managed memory to a device or the host: one range at a time, or a plan.

A prefetch is device work on a stream, asynchronous to the host.  umem_numba
records it on the buffer's coherence tracker exactly like a kernel launch, so
host access to the buffer (``.host``, ``np.asarray``, ``close``) waits for it:
after ``buf.prefetch("cpu", s)`` the first host read finds the data migrated.

Ranges are element ranges ``[start, stop)`` of the flat C-ordered buffer (see
:mod:`umem_numba._advice`).  Prefetching needs concurrentManagedAccess on the
target device and on the stream's device; elsewhere it raises
:class:`~umem_numba.UnsupportedError` instead of doing nothing.

"Asynchronous" is the driver's word: it orders the migration on the stream,
but the call itself may do much of the work before returning (a prefetch to
the host, or a batched :class:`PrefetchPlan`, can hold the calling thread for
its whole duration).  A device->host prefetch can be much slower than a
pinned copy of the same bytes: when the host needs the data fast, copy into a
:class:`~umem_numba.PinnedBuffer` instead.  ``python -m umem_numba bench
prefetch`` measures both on the machine at hand.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple

from . import _driver, _events
from ._advice import (
    _check_range,
    _check_target,
    _extent,
    _not_supported,
    _parse_target,
    _region,
    _Region,
    _require_concurrent,
)
from ._errors import CudaError
from ._location import Location, StreamLike, Target, stream_handle

__all__ = ["PrefetchPlan"]

#: Stream handles that mean "a default stream of the current context":
#: 0 and CU_STREAM_LEGACY (1) are the legacy stream, 2 is CU_STREAM_PER_THREAD.
_DEFAULT_STREAMS = frozenset({0, 1, 2})
#: cuMemPrefetchBatchAsync refuses the legacy NULL stream.
_LEGACY_STREAMS = frozenset({0, 1})

#: Set when the binding has cuMemPrefetchBatchAsync but the installed driver does not.
_batch_missing = False


def _stream_device(handle: int) -> int:
    """Ordinal of the device a stream belongs to (events must be recorded in its context)."""
    if handle in _DEFAULT_STREAMS:
        return _driver.ensure_context()
    get = getattr(_driver.api().drv, "cuStreamGetDevice", None)
    if get is None:  # cuda-bindings older than 12.8: assume the current device's stream
        return _driver.ensure_context()
    return int(_driver.check(get(handle), "cuStreamGetDevice", f"finding the device of stream {handle:#x}"))


def _issue_one(region: _Region, loc: Location, handle: int, what: str) -> None:
    res = _driver.api().mem_prefetch(region.ptr, region.nbytes, loc.to_cu(), 0, handle)
    try:
        _driver.check(res, "cuMemPrefetchAsync", f"{what}: prefetching {region.label} to {loc}")
    except CudaError as exc:
        raise _not_supported(exc, what) from exc


def _record(handle: int, device_id: int, regions: Iterable[_Region]) -> None:
    """File one event after the prefetches under every buffer they touched."""
    trackers = {id(r.tracker): r.tracker for r in regions if r.tracker is not None}
    if not trackers:
        return
    event = _events.record(handle, device_id)
    for tracker in trackers.values():
        tracker.add(handle, event)


def _prepare(obj: Any, target: Target, start: Any, stop: Any, what: str) -> tuple[_Region, Location]:
    size, _ = _extent(obj, what)
    lo, hi = _check_range(start, stop, size, what)
    loc = _parse_target(target, what)
    return _region(obj, lo, hi, what), _check_target(loc, what)


def prefetch(obj: Any, target: Target, stream: StreamLike = None,
             start: int | None = None, stop: int | None = None) -> None:
    """Prefetch elements ``[start, stop)`` of ``obj`` to ``target`` on ``stream``.

    Parameters
    ----------
    obj : ManagedBuffer or managed array
    target : numba device, int, "cpu"/"host" or Location
    stream : numba stream, 0 or None
        ``None``/``0``: the legacy default stream of the current context.
    start, stop : int, optional
        Element range; the whole array by default.

    Raises
    ------
    TypeError, IndexError, ValueError
        Bad object, range or target (before any driver call).
    UnsupportedError
        Not managed memory, or no concurrentManagedAccess on the target
        device or the stream's device.
    """
    whole = start is None and stop is None
    what = "prefetch" if whole else f"prefetch_range({start}, {stop})"
    handle = stream_handle(stream)
    region, loc = _prepare(obj, target, start, stop, what)
    device = _stream_device(handle)
    _require_concurrent(device, f"{what} (device of the stream)")
    with _driver.device_context(device):
        try:
            _issue_one(region, loc, handle, what)
        finally:
            # Recorded even after a failure: the driver may have queued part of it.
            _record(handle, device, (region,))


def _batch_possible(handle: int, count: int) -> bool:
    """Whether a plan of ``count`` entries on ``handle`` goes out as one batched call."""
    if count < 2 or _batch_missing or handle in _LEGACY_STREAMS:
        return False
    if _driver.api().mem_prefetch_batch is None:
        return False
    # The batch call needs concurrentManagedAccess on every device of the system.
    return all(_driver.device_attribute("CONCURRENT_MANAGED_ACCESS", d) for d in range(_driver.device_count()))


def _issue_batch(prepared: list[tuple[_Region, Location]], handle: int) -> bool:
    """Issue all entries with cuMemPrefetchBatchAsync; False if the driver lacks it."""
    global _batch_missing
    drv = _driver.api().drv
    locs: list[Any] = []
    first: list[int] = []
    previous: Location | None = None
    # One location entry per run of consecutive entries with the same target
    # (prefetchLocIdxs holds the index of each run's first entry).
    for i, (_, loc) in enumerate(prepared):
        if loc != previous:
            locs.append(loc.to_cu())
            first.append(i)
            previous = loc
    ptrs = [drv.CUdeviceptr(r.ptr) for r, _ in prepared]
    sizes = [r.nbytes for r, _ in prepared]
    try:
        res = _driver.api().mem_prefetch_batch(ptrs, sizes, len(prepared), locs, first, len(locs), 0, handle)
    except RuntimeError as exc:
        if isinstance(exc, CudaError) or "not found" not in str(exc):
            raise
        _batch_missing = True  # the binding knows the call, this driver does not
        return False
    try:
        _driver.check(res, "cuMemPrefetchBatchAsync",
                      f"prefetching {len(prepared)} ranges to {len(locs)} location run(s)")
    except CudaError as exc:
        raise _not_supported(exc, "PrefetchPlan.execute") from exc
    return True


class _Entry(NamedTuple):
    obj: Any
    start: int
    stop: int
    target: Location


class PrefetchPlan:
    """A list of prefetches (buffer or range, target) issued together.

    Build it with chained :meth:`add` / :meth:`add_range` calls and run it
    with :meth:`execute`; a plan can be executed again and again.

    Examples
    --------
    >>> plan = PrefetchPlan().add(a, 0).add_range(b, 0, 1024, "cpu")  # doctest: +SKIP
    >>> plan.execute(stream)                                            # doctest: +SKIP

    Notes
    -----
    :meth:`execute` validates every entry before issuing any, so a plan with
    one bad entry (a buffer closed since it was added, a missing device)
    issues nothing.  On a non-default stream with cuda-bindings 13 and a
    driver that has it, the whole plan is one ``cuMemPrefetchBatchAsync``
    call; otherwise (including the legacy default stream, which the batch
    call refuses) one ``cuMemPrefetchAsync`` per entry, in order.

    The batched call may return only when the migration is done, where
    single calls return after issuing it; one whole-buffer prefetch is
    usually the fastest way to move a whole buffer (``bench prefetch``
    compares them).
    """

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: list[_Entry] = []

    def add(self, obj: Any, target: Target) -> "PrefetchPlan":
        """Add all of ``obj`` (a ManagedBuffer, view or managed array) to go to ``target``.

        Returns
        -------
        PrefetchPlan
            This plan, for chaining.

        Raises
        ------
        TypeError, ValueError, UnsupportedError, BufferClosedError
            The entry is invalid now; the plan is left unchanged.
        """
        return self._add(obj, None, None, target, "PrefetchPlan.add")

    def add_range(self, obj: Any, start: int, stop: int, target: Target) -> "PrefetchPlan":
        """Add elements ``[start, stop)`` of ``obj`` to go to ``target`` (checked like :meth:`add`)."""
        return self._add(obj, start, stop, target, "PrefetchPlan.add_range")

    def _add(self, obj: Any, start: Any, stop: Any, target: Target, name: str) -> "PrefetchPlan":
        what = f"{name} (entry {len(self._entries)})"
        size, _ = _extent(obj, what)
        lo, hi = _check_range(start, stop, size, what)
        loc = _parse_target(target, what)
        _region(obj, lo, hi, what)  # asks the driver whether a foreign array is managed
        _check_target(loc, what)
        self._entries.append(_Entry(obj, lo, hi, loc))
        return self

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> tuple[tuple[Any, int, int, Location], ...]:
        """``(array, start, stop, target)`` of every entry, in order."""
        return tuple(tuple(e) for e in self._entries)  # type: ignore[misc]

    def clear(self) -> None:
        """Remove every entry."""
        self._entries.clear()

    def execute(self, stream: StreamLike = None) -> None:
        """Validate every entry, then issue all of them asynchronously on ``stream``.

        Parameters
        ----------
        stream : numba stream, 0 or None
            Where the prefetches are queued; host access to the buffers waits
            for them.

        Raises
        ------
        BufferClosedError, IndexError, ValueError, UnsupportedError
            An entry is invalid (message names its index): nothing was issued.
        """
        handle = stream_handle(stream)
        prepared: list[tuple[_Region, Location]] = []
        for i, e in enumerate(self._entries):
            what = f"PrefetchPlan.execute: entry {i} (elements [{e.start}, {e.stop}) to {e.target})"
            size, _ = _extent(e.obj, what)
            if e.stop > size:  # a foreign array shrank since it was added
                raise IndexError(f"{what}: out of bounds for {size} element(s)")
            prepared.append((_region(e.obj, e.start, e.stop, what), _check_target(e.target, what)))
        if not prepared:
            return
        device = _stream_device(handle)
        _require_concurrent(device, "PrefetchPlan.execute (device of the stream)")
        issued = 0
        with _driver.device_context(device):
            try:
                if _batch_possible(handle, len(prepared)):
                    issued = len(prepared)  # a failed batch may have queued any part of it
                    if not _issue_batch(prepared, handle):
                        issued = 0
                if not issued:
                    for region, loc in prepared:
                        issued += 1
                        _issue_one(region, loc, handle, "PrefetchPlan.execute")
            finally:
                _record(handle, device, (r for r, _ in prepared[:issued]))

    def __repr__(self) -> str:
        shown = [f"{type(e.obj).__name__}[{e.start}:{e.stop}] -> {e.target}" for e in self._entries[:8]]
        if len(self._entries) > 8:
            shown.append(f"... {len(self._entries) - 8} more")
        n = len(self._entries)
        return f"PrefetchPlan({n} entr{'y' if n == 1 else 'ies'}" + (": " + ", ".join(shown) if shown else "") + ")"
