"""Prefetching managed memory to a device or the host: one range at a time, or a plan.

A prefetch is device work on a stream, asynchronous to the host.  umem_numba
records it on the buffer's coherence tracker exactly like a kernel launch, so
host access to the buffer (``.host``, ``np.asarray``, ``close``) waits for it:
after ``buf.prefetch("cpu", s)`` the first host read finds the data migrated.

Ranges are element ranges ``[start, stop)`` of the flat buffer in memory order
(see :mod:`umem_numba._hints._managed_span`).  Prefetching needs concurrentManagedAccess on the
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

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from .. import _driver
from .._driver._location import Location, StreamLike, Target, as_location, stream_device, stream_handle
from .._errors import CudaError, UnsupportedError
from .._memory import _events
from .._memory._tracker import DeviceUse, Tracker, refuse_capture
from ._managed_span import ManagedSpan, check_range, element_count, managed_span, unsupported_from

__all__ = ["PrefetchPlan", "discard", "discard_prefetch", "prefetch"]


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


def _placed(spans: Iterable[ManagedSpan]) -> None:
    """The user placed (or discarded) these pages: the automatic prefetch stands aside.

    A host view marks a managed allocation for the automatic prefetch of its
    next launch (:func:`umem_numba.set_auto_prefetch`).  An explicit prefetch or
    discard issued after that view says where the pages should be, so the mark
    is dropped: the launch must not move them again.  The next host view marks
    the allocation afresh.
    """
    for span in spans:
        if span.tracker is not None and span.tracker.migrate:
            span.tracker.migrate = None


def _require_target(target: Target, what: str) -> None:
    """Refuse ``None`` as a prefetch target, before any driver call.

    Elsewhere ``None`` means the current device (:func:`as_location`); for a
    migration that reads as "nowhere in particular", so it is refused instead
    of moving the memory to whichever device happens to be current.
    """
    if target is None:
        raise TypeError(
            f"{what}: the target is None; say where the memory should go: a device (an ordinal such as 0, "
            "or a numba device), 'cpu' ('cpu:N' for host NUMA node N) or a Location"
        )


def _prepare(obj: Any, target: Target, start: Any, stop: Any, what: str) -> tuple[ManagedSpan, Location]:
    _require_target(target, what)
    lo, hi = check_range(start, stop, element_count(obj, what), what, whole_may_be_empty=True)
    loc = as_location(target, check=False, what=what)
    return managed_span(obj, lo, hi, what), as_location(loc, require_concurrent=True, what=what)


def prefetch(
    obj: Any, target: Target, stream: StreamLike = None, start: int | None = None, stop: int | None = None
) -> None:
    """Prefetch elements ``[start, stop)`` of ``obj`` to ``target`` on ``stream``.

    Parameters
    ----------
    obj : ManagedBuffer or managed array
    target : numba device, int, "cpu"/"host", "cpu:N" (host NUMA node N) or Location
        Where the memory goes; ``None`` is refused (``TypeError``), not read
        as the current device.
    stream : numba stream, 0 or None
        ``None``/``0``: the legacy default stream of the current context.
    start, stop : int, optional
        Element range; the whole array by default.

    Raises
    ------
    TypeError, IndexError, ValueError
        Bad object, range or target (``None`` included), before any driver call.
    UnsupportedError
        Not managed memory, or no concurrentManagedAccess on the target
        device or the stream's device.
    """
    whole = start is None and stop is None
    what = "prefetch" if whole else f"prefetch_range({start}, {stop})"
    handle = stream_handle(stream, what=what)
    span, loc = _prepare(obj, target, start, stop, what)
    if not span.nbytes:  # a zero-size buffer: nothing to move (its arguments were checked)
        return
    refuse_capture(handle, what)  # before cuStreamGetDevice, which a capture forbids
    device = stream_device(handle)
    as_location(device, require_concurrent=True, what=f"{what} (device of the stream)")
    with _driver.device_context(device), DeviceUse(_uses((span,)), handle, what):
        _issue_one(span, loc, handle, what)
    _placed((span,))


# ---------------------------------------------------------------------------
# Discards.

_PREFETCH, _DISCARD, _DISCARD_PREFETCH = "prefetch", "discard", "discard_prefetch"


def _require_discard(what: str) -> None:
    """Raise UnsupportedError where ``cuMemDiscard*BatchAsync`` cannot be used (after the input was checked)."""
    api = _driver.api()
    if api.discard_missing:
        raise UnsupportedError(f"{what}: {api.discard_missing}")
    lacking = [d for d in range(_driver.device_count()) if not _driver.concurrent_managed_access(d)]
    if lacking:
        raise UnsupportedError(
            f"{what}: cuMemDiscardBatchAsync needs concurrentManagedAccess on every device of the system; "
            f"device(s) {', '.join(map(str, lacking))} lack it"
        )


@contextlib.contextmanager
def _batch_stream(handle: int, device_id: int) -> Iterator[int]:
    """A stream the batch calls accept, ordered exactly like ``handle``.

    The batch calls refuse the legacy NULL stream.  There the work goes on a
    private stream that waits for everything queued on ``handle`` so far,
    and ``handle`` then waits for the private stream: to every other stream
    and to the host it is as if the work had been queued on ``handle``.
    """
    if handle not in (0, _driver.consts().stream_legacy):
        yield handle
        return
    side = _driver.side_stream(device_id)
    before = _events.record(handle, device_id)
    _driver.call("cuStreamWaitEvent", side, before.handle, 0, detail="ordering a batch after the legacy stream")
    yield side
    after = _events.record(side, device_id)
    _driver.call("cuStreamWaitEvent", handle, after.handle, 0, detail="ordering the legacy stream after a batch")


def _issue_discards(prepared: list[tuple[ManagedSpan, Location | None]], handle: int, what: str) -> None:
    """One ``cuMemDiscardBatchAsync``, or ``cuMemDiscardAndPrefetchBatchAsync`` when entries have targets."""
    api = _driver.api()
    drv = api.drv
    ptrs = [drv.CUdeviceptr(s.ptr) for s, _ in prepared]
    sizes = [s.nbytes for s, _ in prepared]
    if prepared[0][1] is None:
        assert api.mem_discard_batch is not None  # _require_discard said so
        call = "cuMemDiscardBatchAsync"
        detail = f"{what}: discarding {len(prepared)} range(s)"
        res = api.mem_discard_batch(ptrs, sizes, len(prepared), 0, handle)
    else:
        locs, first = _location_runs([loc for _, loc in prepared if loc is not None])
        assert api.mem_discard_prefetch_batch is not None
        call = "cuMemDiscardAndPrefetchBatchAsync"
        detail = f"{what}: discarding {len(prepared)} range(s) and prefetching them to {len(locs)} location run(s)"
        res = api.mem_discard_prefetch_batch(ptrs, sizes, len(prepared), locs, first, len(locs), 0, handle)
    _check(res, call, detail, what)


def _discard(obj: Any, target: Target | None, stream: StreamLike, start: Any, stop: Any, what: str) -> None:
    handle = stream_handle(stream, what=what)
    lo, hi = check_range(start, stop, element_count(obj, what), what, whole_may_be_empty=True)
    loc = None if target is None else as_location(target, check=False, what=what)
    span = managed_span(obj, lo, hi, what)
    if loc is not None:
        loc = as_location(loc, require_concurrent=True, what=what)
    _require_discard(what)
    if not span.nbytes:  # a zero-size buffer: nothing to discard (its arguments were checked)
        return
    refuse_capture(handle, what)  # before cuStreamGetDevice, which a capture forbids (and which invalidates it)
    device = stream_device(handle)
    uses = _discard_uses((span,))
    with _driver.device_context(device):
        _settle_before_discard((span,), handle, what)
        with DeviceUse(uses, handle, what), _batch_stream(handle, device) as h:
            _issue_discards([(span, loc)], h, what)
    _placed((span,))


def _settle_before_discard(spans: Iterable[ManagedSpan], handle: int, what: str) -> None:
    """Wait on the host for the work recorded on the discarded memory, and for the discard's stream.

    On an H100 (driver 580) a discard queued behind a pending writer (made to
    wait for it on the device, ``cuStreamWaitEvent``) lost the write that
    came after it on its stream: the driver does not order the discard as
    stream work.  So it is issued only once nothing recorded on the memory,
    and nothing on its stream, is still running, whatever the coherence
    policy (as for internal memory): the discard then comes after every
    earlier use and before every later one.  Call it in the stream's context.
    """
    for span in spans:
        if span.tracker is not None:
            span.tracker.wait_all(what)
    _driver.call("cuStreamSynchronize", handle, detail=f"{what}: the discard's stream first finishes its work")


def _discard_uses(spans: Iterable[ManagedSpan]) -> list[tuple[Tracker, bool]]:
    """A discard writes (the values become indeterminate): ordered after every use, before every later one."""
    return [(s.tracker, True) for s in spans if s.tracker is not None]


def discard(obj: Any, stream: StreamLike = None, start: int | None = None, stop: int | None = None) -> None:
    """Discard elements ``[start, stop)`` of ``obj`` on ``stream``: their contents are no longer needed.

    Parameters
    ----------
    obj : ManagedBuffer or managed array
    stream : numba stream, 0 or None
        ``None``/``0``: the legacy default stream (the driver refuses it for
        discards; umem_numba orders a private stream exactly like it).
    start, stop : int, optional
        Element range; the whole array by default.

    Raises
    ------
    TypeError, IndexError, ValueError
        Bad object or range (before any driver call).
    UnsupportedError
        Not managed memory; the binding or driver lacks
        ``cuMemDiscardBatchAsync`` (cuda-bindings 13 and a CUDA 13 driver);
        or a device of the system lacks concurrentManagedAccess.
    """
    whole = start is None and stop is None
    _discard(obj, None, stream, start, stop, "discard" if whole else f"discard_range({start}, {stop})")


def discard_prefetch(
    obj: Any, target: Target, stream: StreamLike = None, start: int | None = None, stop: int | None = None
) -> None:
    """Discard elements ``[start, stop)`` of ``obj`` and prefetch them to ``target``, on ``stream``.

    The range is then resident at ``target`` without its old contents
    having moved: use it for memory that is about to be overwritten there.
    Parameters and errors as in :func:`discard`, with ``target`` as in
    :func:`prefetch`.
    """
    whole = start is None and stop is None
    what = "discard_prefetch" if whole else f"discard_prefetch_range({start}, {stop})"
    _require_target(target, what)
    _discard(obj, target, stream, start, stop, what)


def _location_runs(targets: list[Location]) -> tuple[list[Any], list[int]]:
    """``(locations, index of each run's first entry)`` for the batch calls' location arrays."""
    locs: list[Any] = []
    first: list[int] = []
    previous: Location | None = None
    # One location entry per run of consecutive entries with the same target.
    for i, loc in enumerate(targets):
        if loc != previous:
            locs.append(loc.to_cu())
            first.append(i)
            previous = loc
    return locs, first


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
    locs, first = _location_runs([loc for _, loc in prepared])
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
    target: Location | None
    op: str


class PrefetchPlan:
    """A list of prefetches and discards (buffer or range, target) issued together.

    Build it with chained :meth:`add` / :meth:`add_range` (prefetches, or
    discard-and-prefetch with ``discard=True``) and :meth:`add_discard` /
    :meth:`add_discard_range` calls, and run it with :meth:`execute`; a plan
    can be executed again and again.

    Examples
    --------
    >>> plan = PrefetchPlan().add(a, 0).add_range(b, 0, 1024, "cpu")  # doctest: +SKIP
    >>> plan.add(scratch, 0, discard=True)                              # doctest: +SKIP
    >>> plan.execute(stream)                                            # doctest: +SKIP

    Notes
    -----
    :meth:`execute` validates every entry before issuing any, so a plan with
    one bad entry (a buffer closed since it was added, a missing device, a
    discard the driver cannot do) issues nothing.  Entries go out in plan
    order, as runs of consecutive entries of one kind.  A run of discards is
    one ``cuMemDiscardBatchAsync``, a run of discard-and-prefetches one
    ``cuMemDiscardAndPrefetchBatchAsync`` (the driver does not order the
    ranges *within* one such call).  A run of prefetches on a non-default
    stream with cuda-bindings 13 and a driver that has it is one
    ``cuMemPrefetchBatchAsync`` call; otherwise (including the legacy
    default stream, which the batch call refuses) one ``cuMemPrefetchAsync``
    per entry, in order.

    The batched call may return only when the migration is done, where
    single calls return after issuing it; one whole-buffer prefetch is
    usually the fastest way to move a whole buffer (``bench prefetch``
    compares them).
    """

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: list[_Entry] = []

    def add(self, obj: Any, target: Target, *, discard: bool = False) -> PrefetchPlan:
        """Add all of ``obj`` (a ManagedBuffer, view or managed array) to go to ``target``.

        Parameters
        ----------
        obj : ManagedBuffer or managed array
        target : numba device, int, "cpu"/"cpu:N" or Location
        discard : bool
            Discard the contents first (see :func:`discard_prefetch`): the
            range arrives at ``target`` without its old values.

        Returns
        -------
        PrefetchPlan
            This plan, for chaining.

        Raises
        ------
        TypeError, ValueError, UnsupportedError, BufferClosedError
            The entry is invalid now; the plan is left unchanged.
        """
        return self._add(obj, None, None, target, _op(discard), "PrefetchPlan.add")

    def add_range(self, obj: Any, start: int, stop: int, target: Target, *, discard: bool = False) -> PrefetchPlan:
        """Add elements ``[start, stop)`` of ``obj`` to go to ``target`` (checked like :meth:`add`)."""
        return self._add(obj, start, stop, target, _op(discard), "PrefetchPlan.add_range")

    def add_discard(self, obj: Any) -> PrefetchPlan:
        """Add a discard of all of ``obj`` (see :func:`discard`; checked like :meth:`add`)."""
        return self._add(obj, None, None, None, _DISCARD, "PrefetchPlan.add_discard")

    def add_discard_range(self, obj: Any, start: int, stop: int) -> PrefetchPlan:
        """Add a discard of elements ``[start, stop)`` of ``obj``."""
        return self._add(obj, start, stop, None, _DISCARD, "PrefetchPlan.add_discard_range")

    def _add(self, obj: Any, start: Any, stop: Any, target: Target | None, op: str, name: str) -> PrefetchPlan:
        what = f"{name} (entry {len(self._entries)})"
        if op != _DISCARD:
            _require_target(target, what)
        lo, hi = check_range(start, stop, element_count(obj, what), what, whole_may_be_empty=True)
        loc = None if op == _DISCARD else as_location(target, check=False, what=what)
        managed_span(obj, lo, hi, what)  # asks the driver whether a foreign array is managed
        if loc is not None:
            as_location(loc, require_concurrent=True, what=what)
        if op != _PREFETCH:
            _require_discard(what)
        self._entries.append(_Entry(obj, lo, hi, loc, op))
        return self

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> tuple[tuple[Any, int, int, Location | None], ...]:
        """``(array, start, stop, target)`` of every entry, in order (``target`` is ``None`` for a discard)."""
        return tuple((e.obj, e.start, e.stop, e.target) for e in self._entries)

    @property
    def operations(self) -> tuple[str, ...]:
        """What each entry does: ``"prefetch"``, ``"discard"`` or ``"discard_prefetch"``, in order."""
        return tuple(e.op for e in self._entries)

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
        prepared: list[tuple[ManagedSpan, Location | None, str]] = []
        for i, e in enumerate(self._entries):
            dest = "discard" if e.target is None else f"to {e.target}"
            what = f"PrefetchPlan.execute: entry {i} (elements [{e.start}, {e.stop}) {dest})"
            size = element_count(e.obj, what)
            if e.stop > size:  # a foreign array shrank since it was added
                raise IndexError(f"{what}: out of bounds for {size} element(s)")
            loc = None if e.target is None else as_location(e.target, require_concurrent=True, what=what)
            span = managed_span(e.obj, e.start, e.stop, what)
            if span.nbytes:  # a zero-size buffer's entry issues nothing
                prepared.append((span, loc, e.op))
        if not prepared:
            return
        refuse_capture(handle, "PrefetchPlan.execute")  # before cuStreamGetDevice, which a capture forbids
        device = stream_device(handle)
        as_location(device, require_concurrent=True, what="PrefetchPlan.execute (device of the stream)")
        if any(op != _PREFETCH for _, _, op in prepared):
            _require_discard("PrefetchPlan.execute")
        uses = [(s.tracker, op != _PREFETCH) for s, _, op in prepared if s.tracker is not None]
        with _driver.device_context(device):
            discarded = [s for s, _, op in prepared if op != _PREFETCH]
            if discarded:
                _settle_before_discard(discarded, handle, "PrefetchPlan.execute")
        with _driver.device_context(device), DeviceUse(uses, handle, "PrefetchPlan.execute"):
            for op, run in _runs(prepared):
                if op != _PREFETCH:
                    with _batch_stream(handle, device) as h:
                        _issue_discards(run, h, "PrefetchPlan.execute")
                    continue
                targets = [(span, loc) for span, loc in run if loc is not None]
                if _batch_possible(handle, len(targets)):
                    _issue_batch(targets, handle)
                else:
                    for span, loc in targets:
                        _issue_one(span, loc, handle, "PrefetchPlan.execute")
        _placed(s for s, _, _ in prepared)

    def __repr__(self) -> str:
        shown = [
            f"{type(e.obj).__name__}[{e.start}:{e.stop}] "
            + ("discarded" if e.target is None else f"-> {e.target}" + (" (discarded)" if e.op != _PREFETCH else ""))
            for e in self._entries[:8]
        ]
        if len(self._entries) > 8:
            shown.append(f"... {len(self._entries) - 8} more")
        n = len(self._entries)
        return f"PrefetchPlan({n} entr{'y' if n == 1 else 'ies'}" + (": " + ", ".join(shown) if shown else "") + ")"


def _op(discard: Any) -> str:
    if not isinstance(discard, bool):
        raise TypeError(f"discard must be True or False, got {discard!r}")
    return _DISCARD_PREFETCH if discard else _PREFETCH


def _runs(
    prepared: list[tuple[ManagedSpan, Location | None, str]],
) -> Iterator[tuple[str, list[tuple[ManagedSpan, Location | None]]]]:
    """Consecutive entries of one kind, in plan order: one batch (or run of single calls) each."""
    run: list[tuple[ManagedSpan, Location | None]] = []
    current = ""
    for span, loc, op in prepared:
        if run and op != current:
            yield current, run
            run = []
        current = op
        run.append((span, loc))
    if run:
        yield current, run
