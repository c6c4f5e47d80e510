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

from collections.abc import Iterable
from typing import Any, NamedTuple

from . import _driver
from ._errors import CudaError
from ._location import Location, StreamLike, Target, as_location, stream_device, stream_handle
from ._managed_span import ManagedSpan, check_range, element_count, managed_span, unsupported_from
from ._tracker import DeviceUse, Tracker, refuse_capture

__all__ = ["PrefetchPlan", "prefetch"]


def _check(res: tuple[Any, ...], call: str, detail: str, what: str) -> None:
    """Check a prefetch call, turning ``CUDA_ERROR_NOT_SUPPORTED`` into UnsupportedError."""
    try:
        _driver.check(res, call, detail)
    except CudaError as exc:
        unsupported = unsupported_from(exc, what)
        if unsupported is None:
            raise
        raise unsupported from exc


def _issue_one(span: ManagedSpan, loc: Location, handle: int, what: str) -> None:
    res = _driver.api().mem_prefetch(span.ptr, span.nbytes, loc.to_cu(), 0, handle)
    _check(res, "cuMemPrefetchAsync", f"{what}: prefetching {span.label} to {loc}", what)


def _uses(spans: Iterable[ManagedSpan]) -> list[tuple[Tracker, bool]]:
    """A prefetch reads (it moves pages, the values stay): ordered after writes, before later writes."""
    return [(s.tracker, False) for s in spans if s.tracker is not None]


def _prepare(obj: Any, target: Target, start: Any, stop: Any, what: str) -> tuple[ManagedSpan, Location]:
    lo, hi = check_range(start, stop, element_count(obj, what), what)
    loc = as_location(target, check=False, what=what)
    return managed_span(obj, lo, hi, what), as_location(loc, require_concurrent=True, what=what)


def prefetch(
    obj: Any, target: Target, stream: StreamLike = None, start: int | None = None, stop: int | None = None
) -> None:
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
    handle = stream_handle(stream, what=what)
    span, loc = _prepare(obj, target, start, stop, what)
    refuse_capture(handle, what)  # before cuStreamGetDevice, which a capture forbids
    device = stream_device(handle)
    as_location(device, require_concurrent=True, what=f"{what} (device of the stream)")
    with _driver.device_context(device), DeviceUse(_uses((span,)), handle, what):
        _issue_one(span, loc, handle, what)


def _batch_possible(handle: int, count: int) -> bool:
    """Whether a plan of ``count`` entries on ``handle`` goes out as one batched call."""
    api = _driver.api()
    # The batch call refuses the legacy NULL stream.
    if count < 2 or api.mem_prefetch_batch is None or handle in (0, api.c.stream_legacy):
        return False
    # The batch call needs concurrentManagedAccess on every device of the system.
    return all(_driver.concurrent_managed_access(d) for d in range(_driver.device_count()))


def _issue_batch(prepared: list[tuple[ManagedSpan, Location]], handle: int) -> None:
    """Issue all entries with one cuMemPrefetchBatchAsync."""
    api = _driver.api()
    drv = api.drv
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
    assert api.mem_prefetch_batch is not None  # _batch_possible said so
    res = api.mem_prefetch_batch(ptrs, sizes, len(prepared), locs, first, len(locs), 0, handle)
    _check(
        res,
        "cuMemPrefetchBatchAsync",
        f"prefetching {len(prepared)} ranges to {len(locs)} location run(s)",
        "PrefetchPlan.execute",
    )


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

    def add(self, obj: Any, target: Target) -> PrefetchPlan:
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

    def add_range(self, obj: Any, start: int, stop: int, target: Target) -> PrefetchPlan:
        """Add elements ``[start, stop)`` of ``obj`` to go to ``target`` (checked like :meth:`add`)."""
        return self._add(obj, start, stop, target, "PrefetchPlan.add_range")

    def _add(self, obj: Any, start: Any, stop: Any, target: Target, name: str) -> PrefetchPlan:
        what = f"{name} (entry {len(self._entries)})"
        lo, hi = check_range(start, stop, element_count(obj, what), what)
        loc = as_location(target, check=False, what=what)
        managed_span(obj, lo, hi, what)  # asks the driver whether a foreign array is managed
        as_location(loc, require_concurrent=True, what=what)
        self._entries.append(_Entry(obj, lo, hi, loc))
        return self

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> tuple[tuple[Any, int, int, Location], ...]:
        """``(array, start, stop, target)`` of every entry, in order."""
        return tuple((e.obj, e.start, e.stop, e.target) for e in self._entries)

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
        handle = stream_handle(stream, what="PrefetchPlan.execute")
        prepared: list[tuple[ManagedSpan, Location]] = []
        for i, e in enumerate(self._entries):
            what = f"PrefetchPlan.execute: entry {i} (elements [{e.start}, {e.stop}) to {e.target})"
            size = element_count(e.obj, what)
            if e.stop > size:  # a foreign array shrank since it was added
                raise IndexError(f"{what}: out of bounds for {size} element(s)")
            prepared.append(
                (managed_span(e.obj, e.start, e.stop, what), as_location(e.target, require_concurrent=True, what=what))
            )
        if not prepared:
            return
        refuse_capture(handle, "PrefetchPlan.execute")  # before cuStreamGetDevice, which a capture forbids
        device = stream_device(handle)
        as_location(device, require_concurrent=True, what="PrefetchPlan.execute (device of the stream)")
        with _driver.device_context(device), DeviceUse(_uses(s for s, _ in prepared), handle, "PrefetchPlan.execute"):
            if _batch_possible(handle, len(prepared)):
                _issue_batch(prepared, handle)
            else:
                for span, loc in prepared:
                    _issue_one(span, loc, handle, "PrefetchPlan.execute")

    def __repr__(self) -> str:
        shown = [f"{type(e.obj).__name__}[{e.start}:{e.stop}] -> {e.target}" for e in self._entries[:8]]
        if len(self._entries) > 8:
            shown.append(f"... {len(self._entries) - 8} more")
        n = len(self._entries)
        return f"PrefetchPlan({n} entr{'y' if n == 1 else 'ies'}" + (": " + ", ".join(shown) if shown else "") + ")"
