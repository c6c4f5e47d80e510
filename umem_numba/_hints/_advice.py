"""Memory advice for managed memory: hints, their live driver state, and migration policies.

Ranges are element ranges ``[start, stop)`` of the flat buffer in memory order
(:mod:`umem_numba._hints._managed_span` says exactly how they are checked).

What the driver reports
-----------------------
The properties of :class:`ManagedMemoryHints` ask the driver every time
(``cuMemRangeGetAttribute``): they show what is in effect, not what this
process remembers setting.  A range attribute is reported only when it holds
for *every* page of the range: ``preferred_location`` is ``None`` both when no
page has one and when pages disagree.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from .. import _driver
from .._driver._location import HOST, Location, StreamLike, Target, as_location
from .._errors import CudaError, UnsupportedError
from ._managed_span import ManagedSpan, check_range, element_count, managed_span, unsupported_from
from ._prefetch import discard, discard_prefetch, prefetch

__all__ = ["HintState", "ManagedMemoryHints", "MemAdvice", "MigrationPolicy"]


class MemAdvice(enum.IntEnum):
    """The advice ``cuMemAdvise`` takes (values are the driver's ``CUmem_advise``).

    Attributes
    ----------
    SET_READ_MOSTLY, UNSET_READ_MOSTLY
        Reads create read-only copies where they happen (the data is mostly read).
    SET_PREFERRED_LOCATION, UNSET_PREFERRED_LOCATION
        Where faulting pages should live (a device or the host).
    SET_ACCESSED_BY, UNSET_ACCESSED_BY
        Keep the data mapped for a device (or the host) wherever it lives, so
        that processor reads it over the bus instead of faulting it over.
    """

    SET_READ_MOSTLY = 1
    UNSET_READ_MOSTLY = 2
    SET_PREFERRED_LOCATION = 3
    UNSET_PREFERRED_LOCATION = 4
    SET_ACCESSED_BY = 5
    UNSET_ACCESSED_BY = 6

    @property
    def takes_location(self) -> bool:
        """Whether the driver uses the location given with this advice."""
        return self in _WITH_LOCATION


_WITH_LOCATION = frozenset({MemAdvice.SET_PREFERRED_LOCATION, MemAdvice.SET_ACCESSED_BY, MemAdvice.UNSET_ACCESSED_BY})
#: Advice that makes the driver act for a device: it needs concurrentManagedAccess there.
_NEEDS_CONCURRENT = frozenset({MemAdvice.SET_PREFERRED_LOCATION, MemAdvice.SET_ACCESSED_BY})


# ---------------------------------------------------------------------------
# Reading and writing advice.


def _advise(span: ManagedSpan, advice: MemAdvice, loc: Location | None) -> None:
    what = f"{advice.name} on {span.label}"
    # The driver ignores the location of location-less advice, but the call needs one.
    cu = (loc or Location.device(span.device_id)).to_cu()
    api = _driver.api()
    with _driver.device_context(span.device_id):
        try:
            _driver.check(
                api.mem_advise(span.ptr, span.nbytes, api.c.advise(int(advice)), cu),
                "cuMemAdvise",
                what + (f" for {loc}" if loc else ""),
            )
        except CudaError as exc:
            unsupported = unsupported_from(exc, what)
            if unsupported is None:
                raise
            raise unsupported from exc
    if span.memory is not None:
        span.memory.note_advice()
    if loc is not None and loc.kind == "host_numa" and advice is MemAdvice.SET_PREFERRED_LOCATION:
        _check_numa_preference_applied(span, loc, what)


def _check_numa_preference_applied(span: ManagedSpan, loc: Location, what: str) -> None:
    """Read a host NUMA preference back: some systems' drivers accept it and keep the old one.

    Seen on an H100 virtual machine with a CUDA 13.0 driver (one NUMA node):
    ``cuMemAdvise`` returned success and the range still preferred its earlier
    location, while a prefetch to the same node landed there.  A silent no-op
    is worse than an error, so it is reported as unsupported.
    """
    c = _driver.consts()
    got = _read_location(span, c.range_preferred, (c.range_preferred_type, c.range_preferred_id))
    if got != loc:
        raise UnsupportedError(
            f"{what} for {loc}: the driver accepted the advice but the range's preferred location reads back "
            f"as {got if got is not None else 'none'}; this system's driver does not apply host NUMA preferences "
            "(prefetching to the node still works)"
        )


def _range_attr(span: ManagedSpan, attr: Any, size: int = 4) -> list[int]:
    """A range attribute as a list of 32-bit values (one for the scalar attributes)."""
    with _driver.device_context(span.device_id):
        raw = _driver.call(
            "cuMemRangeGetAttribute", size, attr, span.ptr, span.nbytes, detail=f"reading hints of {span.label}"
        )
    return [int(v) for v in raw] if isinstance(raw, (list, tuple)) else [int(raw)]


def _read_flag(span: ManagedSpan, attr: Any) -> bool:
    return bool(_range_attr(span, attr)[0])


def _read_location(span: ManagedSpan, attr: Any, typed: tuple[Any, Any]) -> Location | None:
    """A location attribute: the typed pair (``*_TYPE``, ``*_ID``) where the driver has it, else the legacy id.

    Only the typed pair tells a host NUMA node from the host (the legacy id
    says ``CU_DEVICE_CPU`` for both); it needs a CUDA 12.2 driver.
    """
    if _driver.api().driver_version < _TYPED_LOCATIONS:
        return Location.from_legacy_id(_range_attr(span, attr)[0])
    detail = f"reading hints of {span.label}"
    with _driver.device_context(span.device_id):
        loc_type = _driver.range_attribute_int(typed[0], span.ptr, span.nbytes, detail)
        loc_id = _driver.range_attribute_int(typed[1], span.ptr, span.nbytes, detail)
    return Location.from_typed(loc_type, loc_id)


#: The driver version with the typed range attributes (CUDA 12.2).
_TYPED_LOCATIONS = 12020


def _preferred(span: ManagedSpan) -> Location | None:
    c = _driver.consts()
    return _read_location(span, c.range_preferred, (c.range_preferred_type, c.range_preferred_id))


def _last_prefetch(span: ManagedSpan) -> Location | None:
    c = _driver.consts()
    return _read_location(span, c.range_last_prefetch, (c.range_last_prefetch_type, c.range_last_prefetch_id))


def _read_accessed_by(span: ManagedSpan) -> frozenset[Location]:
    # One slot per device plus the host; the driver pads unused slots with -2.
    slots = _driver.device_count() + 1
    ids = _range_attr(span, _driver.consts().range_accessed_by, 4 * slots)
    return frozenset(loc for loc in map(Location.from_legacy_id, ids) if loc is not None)


class HintState(NamedTuple):
    """The advice in effect on a range, as the driver reports it.

    Attributes
    ----------
    read_mostly : bool
    preferred_location : Location or None
    accessed_by : frozenset of Location
    last_prefetch_location : Location or None
    """

    read_mostly: bool
    preferred_location: Location | None
    accessed_by: frozenset[Location]
    last_prefetch_location: Location | None


# ---------------------------------------------------------------------------
# Policies.

_KINDS = ("default", "read_mostly", "prefer_device", "prefer_host", "host_mapped")
_NAMES = {
    "default": "DEFAULT",
    "read_mostly": "READ_MOSTLY",
    "prefer_host": "PREFER_HOST",
    "host_mapped": "HOST_MAPPED",
    "prefer_device": "PREFER_DEVICE",
}


@dataclass(frozen=True)
class MigrationPolicy:
    """A named set of advice for a common access pattern.

    Use the constants and the one constructor function:

    ``MigrationPolicy.DEFAULT``
        No advice: pages migrate to whoever touches them.
    ``MigrationPolicy.READ_MOSTLY``
        Read-mostly: every reader gets its own read-only copy.
    ``MigrationPolicy.PREFER_DEVICE(device)``
        Preferred location ``device`` (a numba device or an ordinal).
    ``MigrationPolicy.PREFER_HOST``
        Preferred location the host.
    ``MigrationPolicy.HOST_MAPPED``
        Preferred location the host *and* accessed-by the buffer's device: the
        data stays in host memory and the device reads it over the bus.  For
        another device write ``MigrationPolicy("host_mapped", device=n)``.

    Parameters
    ----------
    kind : {"default", "read_mostly", "prefer_device", "prefer_host", "host_mapped"}
    device : int, numba device or None
        The device of ``"prefer_device"`` (required) or ``"host_mapped"``
        (optional: ``None`` is the buffer's own device); not allowed otherwise.

    Notes
    -----
    Applying a policy (:meth:`ManagedMemoryHints.apply_policy`) removes the
    advice that is in effect and not part of the new policy, so switching
    policies leaves no stray hints.  A policy is advice only: it moves no data
    (prefetch for that).
    """

    DEFAULT: ClassVar[MigrationPolicy]
    READ_MOSTLY: ClassVar[MigrationPolicy]
    PREFER_HOST: ClassVar[MigrationPolicy]
    HOST_MAPPED: ClassVar[MigrationPolicy]

    kind: str
    device: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown migration policy {self.kind!r}; choose one of {', '.join(_KINDS)}")
        device = self.device
        if device is None:
            if self.kind == "prefer_device":
                raise ValueError("PREFER_DEVICE needs a device (a numba device or an ordinal)")
            return
        if self.kind not in ("prefer_device", "host_mapped"):
            raise ValueError(f"the {_NAMES[self.kind]} policy takes no device (got {device!r})")
        loc = as_location(device, check=False, what=f"MigrationPolicy {_NAMES[self.kind]}")
        if loc.is_host:
            raise ValueError(
                f"MigrationPolicy {_NAMES[self.kind]} needs a device, not the host (use PREFER_HOST for host memory)"
            )
        object.__setattr__(self, "device", loc.id)

    @staticmethod
    def PREFER_DEVICE(device: Any) -> MigrationPolicy:
        """Preferred location ``device`` (a numba device or an ordinal; not the host)."""
        return MigrationPolicy("prefer_device", device)

    def advice_for(self, device_id: int) -> tuple[tuple[MemAdvice, Location | None], ...]:
        """The advice this policy sets on memory of device ``device_id``.

        Parameters
        ----------
        device_id : int
            The buffer's device: the accessed-by device of ``HOST_MAPPED``
            when the policy names none.

        Returns
        -------
        tuple of (MemAdvice, Location or None)
            Empty for ``DEFAULT``.
        """
        if self.kind == "read_mostly":
            return ((MemAdvice.SET_READ_MOSTLY, None),)
        if self.kind == "prefer_device":
            assert self.device is not None  # PREFER_DEVICE always names one
            return ((MemAdvice.SET_PREFERRED_LOCATION, Location.device(self.device)),)
        if self.kind == "prefer_host":
            return ((MemAdvice.SET_PREFERRED_LOCATION, HOST),)
        if self.kind == "host_mapped":
            dev = device_id if self.device is None else self.device
            return ((MemAdvice.SET_PREFERRED_LOCATION, HOST), (MemAdvice.SET_ACCESSED_BY, Location.device(dev)))
        return ()

    def __repr__(self) -> str:
        if self.kind == "prefer_device":
            return f"MigrationPolicy.PREFER_DEVICE({self.device})"
        if self.device is not None:
            return f"MigrationPolicy({self.kind!r}, device={self.device})"
        return f"MigrationPolicy.{_NAMES[self.kind]}"


MigrationPolicy.DEFAULT = MigrationPolicy("default")
MigrationPolicy.READ_MOSTLY = MigrationPolicy("read_mostly")
MigrationPolicy.PREFER_HOST = MigrationPolicy("prefer_host")
MigrationPolicy.HOST_MAPPED = MigrationPolicy("host_mapped")


# ---------------------------------------------------------------------------
# The hints object.


class ManagedMemoryHints:
    """Advice, and its live driver state, for a managed buffer or a range of it.

    Get one with ``buf.hints`` (the whole buffer) and ``buf.hints.range(a, b)``,
    or build one for any managed array (e.g. numba's ``cuda.managed_array``).

    Parameters
    ----------
    obj : ManagedBuffer or managed array
        A contiguous (C or F) :class:`~umem_numba.ManagedBuffer` (or view), or an
        object with ``__cuda_array_interface__`` pointing at managed memory.
    start, stop : int, optional
        Element range ``[start, stop)`` (see the module notes); the whole
        array by default.

    Raises
    ------
    TypeError
        ``obj`` is not an array, or a bound is not an integer.
    IndexError, ValueError
        The range is out of bounds or empty.
    UnsupportedError
        The memory is not managed (a PinnedBuffer, a VMMBuffer, device memory).

    Notes
    -----
    Properties ask the driver each time; nothing is cached.  Setting advice
    for a device needs its concurrentManagedAccess (else
    :class:`~umem_numba.UnsupportedError`); read-mostly and host advice work
    everywhere, though read copies are only made on such devices.
    """

    __slots__ = ("_obj", "_start", "_stop")

    def __init__(self, obj: Any, start: int | None = None, stop: int | None = None) -> None:
        size = element_count(obj, "ManagedMemoryHints")
        self._obj = obj
        self._start, self._stop = check_range(start, stop, size, "ManagedMemoryHints")

    def _span(self, what: str) -> ManagedSpan:
        size = element_count(self._obj, what)
        if self._stop > size:  # cannot happen for our buffers; guards a resized foreign array
            raise IndexError(f"{what}: range [{self._start}, {self._stop}) no longer fits {size} element(s)")
        return managed_span(self._obj, self._start, self._stop, what)

    # -- range ------------------------------------------------------------------
    @property
    def start(self) -> int:
        """First element of the range."""
        return self._start

    @property
    def stop(self) -> int:
        """One past the last element of the range."""
        return self._stop

    def range(self, start: int, stop: int) -> ManagedMemoryHints:
        """Hints for elements ``[start, stop)`` of *this* range (like slicing a slice)."""
        lo, hi = check_range(start, stop, self._stop - self._start, "ManagedMemoryHints.range")
        return ManagedMemoryHints(self._obj, self._start + lo, self._start + hi)

    # -- live state ---------------------------------------------------------------
    @property
    def read_mostly(self) -> bool:
        """Whether every page of the range is read-mostly (driver state)."""
        return _read_flag(self._span("read_mostly"), _driver.consts().range_read_mostly)

    @property
    def preferred_location(self) -> Location | None:
        """The preferred location of every page, or ``None`` (none, or pages disagree)."""
        return _preferred(self._span("preferred_location"))

    @property
    def accessed_by(self) -> frozenset[Location]:
        """Devices (and the host) with accessed-by advice on the whole range."""
        return _read_accessed_by(self._span("accessed_by"))

    @property
    def last_prefetch_location(self) -> Location | None:
        """Where every page was last prefetched, or ``None`` (never, or to different places)."""
        return _last_prefetch(self._span("last_prefetch_location"))

    def state(self) -> HintState:
        """All four hints at once, read from the driver."""
        span = self._span("state")
        return HintState(
            _read_flag(span, _driver.consts().range_read_mostly),
            _preferred(span),
            _read_accessed_by(span),
            _last_prefetch(span),
        )

    # -- advice ---------------------------------------------------------------------
    def advise(self, advice: MemAdvice, target: Target | None = None) -> None:
        """Give one piece of advice for the range.

        Parameters
        ----------
        advice : MemAdvice
        target : numba device, int, "cpu"/"host", "cpu:N" (host NUMA node N) or Location
            Required for ``SET_PREFERRED_LOCATION`` and ``(UN)SET_ACCESSED_BY``;
            must be omitted for the others (the driver would ignore it).

        Raises
        ------
        TypeError, ValueError
            Bad advice or target (before any driver call).
        UnsupportedError
            A device target without concurrentManagedAccess.
        """
        if not isinstance(advice, MemAdvice):
            raise TypeError(f"advice must be a MemAdvice, got {type(advice).__name__} {advice!r}")
        what = f"{advice.name}"
        if advice.takes_location:
            if target is None:
                raise ValueError(f"{what} needs a target: a device, an ordinal or 'cpu'")
            loc: Location | None = as_location(target, check=False, what=what)
            if loc is not None and loc.numa is not None and advice is not MemAdvice.SET_PREFERRED_LOCATION:
                raise ValueError(
                    f"{what} takes a device or the host ('cpu'), not {loc}: the driver keeps accessed-by "
                    "mappings per processor, not per NUMA node"
                )
        elif target is not None:
            raise ValueError(f"{what} takes no target (the driver ignores it); got {target!r}")
        else:
            loc = None
        span = self._span(what)
        if loc is not None:
            as_location(loc, require_concurrent=advice in _NEEDS_CONCURRENT, what=what)
        _advise(span, advice, loc)

    def set_read_mostly(self) -> None:
        """Mark the range read-mostly: readers get read-only copies until someone writes."""
        self.advise(MemAdvice.SET_READ_MOSTLY)

    def unset_read_mostly(self) -> None:
        """Undo read-mostly; read copies collapse into one."""
        self.advise(MemAdvice.UNSET_READ_MOSTLY)

    def set_preferred_location(self, target: Target) -> None:
        """Prefer ``target`` (a device, ``"cpu"`` or a host NUMA node ``"cpu:N"``) as where the range's pages live."""
        self.advise(MemAdvice.SET_PREFERRED_LOCATION, target)

    def unset_preferred_location(self) -> None:
        """Remove the preferred location."""
        self.advise(MemAdvice.UNSET_PREFERRED_LOCATION)

    def set_accessed_by(self, target: Target) -> None:
        """Keep the range mapped for ``target`` (a device or ``"cpu"``) wherever it lives."""
        self.advise(MemAdvice.SET_ACCESSED_BY, target)

    def unset_accessed_by(self, target: Target) -> None:
        """Remove accessed-by advice for ``target``."""
        self.advise(MemAdvice.UNSET_ACCESSED_BY, target)

    def clear(self) -> None:
        """Remove all advice in effect (same as applying ``MigrationPolicy.DEFAULT``)."""
        self.apply_policy(MigrationPolicy.DEFAULT)

    def apply_policy(self, policy: MigrationPolicy) -> None:
        """Make ``policy``'s advice, and only it, be in effect on the range.

        Read-mostly and the preferred location are reset when the policy does
        not set them (the reset is exact even for advice given to part of the
        range); every accessed-by location the driver reports and the policy
        does not want is unset.  Every target is checked before any advice
        changes.

        Raises
        ------
        TypeError
            ``policy`` is not a :class:`MigrationPolicy`.
        ValueError
            The policy's device does not exist.
        UnsupportedError
            The policy's device has no concurrentManagedAccess.
        """
        if not isinstance(policy, MigrationPolicy):
            raise TypeError(f"policy must be a MigrationPolicy, got {type(policy).__name__} {policy!r}")
        what = f"apply_policy({policy!r})"
        span = self._span(what)
        wanted = policy.advice_for(span.device_id)
        for advice, loc in wanted:
            if loc is not None:
                as_location(loc, require_concurrent=advice in _NEEDS_CONCURRENT, what=what)
        want_accessed = {loc for a, loc in wanted if a is MemAdvice.SET_ACCESSED_BY}
        have_accessed = _read_accessed_by(span)
        undo: list[tuple[MemAdvice, Location | None]] = []
        if not any(a is MemAdvice.SET_READ_MOSTLY for a, _ in wanted):
            undo.append((MemAdvice.UNSET_READ_MOSTLY, None))
        if not any(a is MemAdvice.SET_PREFERRED_LOCATION for a, _ in wanted):
            undo.append((MemAdvice.UNSET_PREFERRED_LOCATION, None))
        undo += [(MemAdvice.UNSET_ACCESSED_BY, loc) for loc in sorted(have_accessed - want_accessed, key=str)]
        todo = [(a, loc) for a, loc in wanted if not (a is MemAdvice.SET_ACCESSED_BY and loc in have_accessed)]
        for advice, loc in undo:
            try:
                _advise(span, advice, loc)
            except UnsupportedError:
                pass  # memory that cannot take this advice (pool memory and read-mostly) has none to undo
        for advice, loc in todo:
            _advise(span, advice, loc)

    # -- prefetch ---------------------------------------------------------------------
    def prefetch(self, target: Target, stream: StreamLike = None) -> None:
        """Prefetch the range to ``target`` asynchronously on ``stream`` (see ManagedBuffer.prefetch)."""
        prefetch(self._obj, target, stream, self._start, self._stop)

    def discard(self, stream: StreamLike = None) -> None:
        """Discard the range's contents on ``stream`` (see ManagedBuffer.discard)."""
        discard(self._obj, stream, self._start, self._stop)

    def discard_prefetch(self, target: Target, stream: StreamLike = None) -> None:
        """Discard the range and prefetch it to ``target`` on ``stream`` (see ManagedBuffer.discard_prefetch)."""
        discard_prefetch(self._obj, target, stream, self._start, self._stop)

    def __repr__(self) -> str:
        return f"ManagedMemoryHints({type(self._obj).__name__}, elements [{self._start}, {self._stop}))"
