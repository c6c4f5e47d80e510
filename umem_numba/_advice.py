"""Memory advice for managed memory: hints, their live driver state, and migration policies.

Ranges
------
Every range in umem_numba's advice and prefetch API is ``[start, stop)`` in
*elements* of the buffer seen as a flat, C-ordered array: element ``i`` is the
bytes ``[i * itemsize, (i + 1) * itemsize)`` after the buffer's first element.
Bounds work like a Python slice without the wrap-around: ``0 <= start < stop
<= size``; a negative bound is an :class:`IndexError`, never "from the end",
and an empty range is a :class:`ValueError` (there is nothing to advise or
prefetch).  Views must be C-contiguous; a view's range counts from the view's
first element.

The driver applies advice and prefetches to whole CPU pages (4 KiB on x86-64,
up to 64 KiB elsewhere): a range that starts or ends inside a page affects,
and reads back, that whole page, so neighbouring elements in the same page
share its hints.

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
import functools
import operator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from . import _driver
from ._buffer import Buffer
from ._errors import BufferClosedError, CudaError, UnsupportedError
from ._location import HOST, Location, StreamLike, Target, as_location

if TYPE_CHECKING:
    from ._coherence import Tracker

__all__ = ["MemAdvice", "MigrationPolicy", "ManagedMemoryHints", "HintState"]


# ---------------------------------------------------------------------------
# Driver constants, resolved once.

@functools.lru_cache(maxsize=1)
def _consts() -> SimpleNamespace:
    drv = _driver.api().drv
    attr = drv.CUmem_range_attribute
    # The legacy (int-valued) range attributes: cuda-bindings 13.3 rejects the
    # *_TYPE/*_ID forms in cuMemRangeGetAttribute.
    return SimpleNamespace(
        advice={a: drv.CUmem_advise(int(a)) for a in MemAdvice},
        read_mostly=attr.CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY,
        preferred=attr.CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION,
        accessed_by=attr.CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY,
        last_prefetch=attr.CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION,
        is_managed=drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_MANAGED,
    )


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


_WITH_LOCATION = frozenset({MemAdvice.SET_PREFERRED_LOCATION, MemAdvice.SET_ACCESSED_BY,
                            MemAdvice.UNSET_ACCESSED_BY})
#: Advice that makes the driver act for a device: it needs concurrentManagedAccess there.
_NEEDS_CONCURRENT = frozenset({MemAdvice.SET_PREFERRED_LOCATION, MemAdvice.SET_ACCESSED_BY})


# ---------------------------------------------------------------------------
# Regions: what a buffer (or a range of it) is in driver terms.

@dataclass(frozen=True)
class _Region:
    """A validated byte range of managed memory, valid until the buffer is closed."""

    ptr: int
    nbytes: int
    device_id: int
    tracker: "Tracker | None"
    label: str


def _index(value: Any, name: str, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what}: {name} must be an integer element index, not a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what}: {name} must be an integer element index, "
                        f"got {type(value).__name__} {value!r}") from None


def _check_range(start: Any, stop: Any, size: int, what: str) -> tuple[int, int]:
    """Validate ``[start, stop)`` against ``size`` elements (``None`` = that end)."""
    lo = 0 if start is None else _index(start, "start", what)
    hi = size if stop is None else _index(stop, "stop", what)
    if lo < 0 or hi < 0:
        raise IndexError(f"{what}: range [{lo}, {hi}) has a negative bound; element ranges "
                         "count from the start of the buffer (no wrap-around)")
    if hi > size:
        raise IndexError(f"{what}: range [{lo}, {hi}) is out of bounds for {size} element(s)")
    if lo >= hi:
        if lo > hi:
            raise ValueError(f"{what}: range [{lo}, {hi}) has start > stop")
        raise ValueError(f"{what}: range [{lo}, {hi}) is empty: nothing to advise or prefetch")
    return lo, hi


def _extent(obj: Any, what: str) -> tuple[int, int]:
    """``(size, itemsize)`` of a supported object, checking everything that needs no driver."""
    if isinstance(obj, Buffer):
        if obj.closed:
            raise BufferClosedError(f"{what}: this {type(obj).__name__} is closed")
        alloc = obj._live()
        if alloc.kind != "managed":
            raise UnsupportedError(f"{what}: {type(obj).__name__} memory is {alloc.kind} memory, not managed "
                                   "memory; advice and prefetch need a ManagedBuffer")
        if not obj.is_c_contiguous:
            raise ValueError(f"{what}: the buffer view is strided; advice and prefetch need a "
                             "C-contiguous buffer or view")
        return obj.size, obj.itemsize
    iface = getattr(obj, "__cuda_array_interface__", None)
    if not isinstance(iface, dict):
        raise TypeError(f"{what}: expected a ManagedBuffer or a managed array with "
                        f"__cuda_array_interface__ (e.g. numba's cuda.managed_array), got {type(obj).__name__}")
    shape = tuple(iface["shape"])
    dtype = np.dtype(iface["typestr"])
    strides = iface.get("strides")
    if strides is not None:
        from ._layout import c_strides
        if tuple(strides) != c_strides(shape, dtype.itemsize):
            raise ValueError(f"{what}: the array is not C-contiguous")
    size = 1
    for d in shape:
        size *= d
    return size, dtype.itemsize


def _region(obj: Any, lo: int, hi: int, what: str) -> _Region:
    """The live byte range of elements ``[lo, hi)`` of ``obj`` (bounds already checked)."""
    if isinstance(obj, Buffer):
        alloc = obj._live()
        itemsize = obj.itemsize
        return _Region(obj.ptr + lo * itemsize, (hi - lo) * itemsize, alloc.device_id, alloc.tracker,
                       f"{type(obj).__name__} elements [{lo}, {hi})")
    iface = obj.__cuda_array_interface__
    itemsize = np.dtype(iface["typestr"]).itemsize
    base = int(iface["data"][0])
    device_id = _driver.ensure_context()
    _require_managed(base, what)
    return _Region(base + lo * itemsize, (hi - lo) * itemsize, device_id, None,
                   f"{type(obj).__name__} elements [{lo}, {hi})")


def _require_managed(ptr: int, what: str) -> None:
    res = _driver.api().drv.cuPointerGetAttribute(_consts().is_managed, ptr)
    # An address the driver does not know at all (plain host memory) fails the query.
    if res[0] != 0 or not int(res[1]):
        raise UnsupportedError(f"{what}: the memory at {ptr:#x} is not managed memory "
                               "(cuPointerGetAttribute IS_MANAGED); advice and prefetch need "
                               "cuMemAllocManaged memory")


def _parse_target(target: Target, what: str) -> Location:
    """A target as a :class:`Location`, checking its type only (no driver call unless ``None``)."""
    try:
        return as_location(target, check=False)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{what}: {exc}") from None


def _check_target(loc: Location, what: str, *, concurrent: bool = True) -> Location:
    """Check that a device location exists and (if asked) supports concurrent managed access."""
    if not loc.is_host:
        try:
            as_location(loc, check=True)
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None
        if concurrent:
            _require_concurrent(loc.id, what)
    return loc


def _require_concurrent(device_id: int, what: str) -> None:
    """Raise :class:`UnsupportedError` unless the device has concurrentManagedAccess."""
    if not _driver.device_attribute("CONCURRENT_MANAGED_ACCESS", device_id):
        raise UnsupportedError(
            f"{what}: device {device_id} has no concurrentManagedAccess (e.g. Windows/WDDM or an old "
            "GPU): the driver cannot prefetch to it, prefer it or map managed memory for it")


def _not_supported(exc: CudaError, what: str) -> Exception:
    if exc.name == "CUDA_ERROR_NOT_SUPPORTED":
        return UnsupportedError(f"{what}: the driver does not support this here ({exc})")
    return exc


# ---------------------------------------------------------------------------
# Reading and writing advice.

def _advise(region: _Region, advice: MemAdvice, loc: Location | None) -> None:
    what = f"{advice.name} on {region.label}"
    # The driver ignores the location of location-less advice, but the call needs one.
    cu = (loc or Location.device(region.device_id)).to_cu()
    api = _driver.api()
    with _driver.device_context(region.device_id):
        try:
            _driver.check(api.mem_advise(region.ptr, region.nbytes, _consts().advice[advice], cu),
                          "cuMemAdvise", what + (f" for {loc}" if loc else ""))
        except CudaError as exc:
            raise _not_supported(exc, what) from exc


def _range_attr(region: _Region, attr: Any, size: int = 4) -> list[int]:
    """A range attribute as a list of 32-bit values (one for the scalar attributes)."""
    with _driver.device_context(region.device_id):
        raw = _driver.call("cuMemRangeGetAttribute", size, attr, region.ptr, region.nbytes,
                           detail=f"reading hints of {region.label}")
    return [int(v) for v in raw] if isinstance(raw, (list, tuple)) else [int(raw)]


def _read_flag(region: _Region, attr: Any) -> bool:
    return bool(_range_attr(region, attr)[0])


def _read_location(region: _Region, attr: Any) -> Location | None:
    return Location.from_legacy_id(_range_attr(region, attr)[0])


def _read_accessed_by(region: _Region) -> frozenset[Location]:
    # One slot per device plus the host; the driver pads unused slots with -2.
    slots = _driver.device_count() + 1
    ids = _range_attr(region, _consts().accessed_by, 4 * slots)
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
_NAMES = {"default": "DEFAULT", "read_mostly": "READ_MOSTLY", "prefer_host": "PREFER_HOST",
          "host_mapped": "HOST_MAPPED", "prefer_device": "PREFER_DEVICE"}


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
        loc = _parse_target(device, f"MigrationPolicy {_NAMES[self.kind]}")
        if loc.is_host:
            raise ValueError(f"MigrationPolicy {_NAMES[self.kind]} needs a device, not the host "
                             "(use PREFER_HOST for host memory)")
        object.__setattr__(self, "device", loc.id)

    @staticmethod
    def PREFER_DEVICE(device: Any) -> "MigrationPolicy":  # noqa: N802 - reads like the constants
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
            return ((MemAdvice.SET_PREFERRED_LOCATION, Location.device(self.device)),)
        if self.kind == "prefer_host":
            return ((MemAdvice.SET_PREFERRED_LOCATION, HOST),)
        if self.kind == "host_mapped":
            dev = device_id if self.device is None else self.device
            return ((MemAdvice.SET_PREFERRED_LOCATION, HOST),
                    (MemAdvice.SET_ACCESSED_BY, Location.device(dev)))
        return ()

    def __repr__(self) -> str:
        if self.kind == "prefer_device":
            return f"MigrationPolicy.PREFER_DEVICE({self.device})"
        if self.device is not None:
            return f"MigrationPolicy({self.kind!r}, device={self.device})"
        return f"MigrationPolicy.{_NAMES[self.kind]}"


MigrationPolicy.DEFAULT = MigrationPolicy("default")  # type: ignore[attr-defined]
MigrationPolicy.READ_MOSTLY = MigrationPolicy("read_mostly")  # type: ignore[attr-defined]
MigrationPolicy.PREFER_HOST = MigrationPolicy("prefer_host")  # type: ignore[attr-defined]
MigrationPolicy.HOST_MAPPED = MigrationPolicy("host_mapped")  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------
# The hints object.

class ManagedMemoryHints:
    """Advice, and its live driver state, for a managed buffer or a range of it.

    Get one with ``buf.hints`` (the whole buffer) and ``buf.hints.range(a, b)``,
    or build one for any managed array (e.g. numba's ``cuda.managed_array``).

    Parameters
    ----------
    obj : ManagedBuffer or managed array
        A C-contiguous :class:`~umem_numba.ManagedBuffer` (or view), or an
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
        size, _ = _extent(obj, "ManagedMemoryHints")
        self._obj = obj
        self._start, self._stop = _check_range(start, stop, size, "ManagedMemoryHints")

    def _region(self, what: str) -> _Region:
        size, _ = _extent(self._obj, what)
        if self._stop > size:  # cannot happen for our buffers; guards a resized foreign array
            raise IndexError(f"{what}: range [{self._start}, {self._stop}) no longer fits {size} element(s)")
        return _region(self._obj, self._start, self._stop, what)

    # -- range ------------------------------------------------------------------
    @property
    def start(self) -> int:
        """First element of the range."""
        return self._start

    @property
    def stop(self) -> int:
        """One past the last element of the range."""
        return self._stop

    def range(self, start: int, stop: int) -> "ManagedMemoryHints":
        """Hints for elements ``[start, stop)`` of *this* range (like slicing a slice)."""
        lo, hi = _check_range(start, stop, self._stop - self._start, "ManagedMemoryHints.range")
        return ManagedMemoryHints(self._obj, self._start + lo, self._start + hi)

    # -- live state ---------------------------------------------------------------
    @property
    def read_mostly(self) -> bool:
        """Whether every page of the range is read-mostly (driver state)."""
        return _read_flag(self._region("read_mostly"), _consts().read_mostly)

    @property
    def preferred_location(self) -> Location | None:
        """The preferred location of every page, or ``None`` (none, or pages disagree)."""
        return _read_location(self._region("preferred_location"), _consts().preferred)

    @property
    def accessed_by(self) -> frozenset[Location]:
        """Devices (and the host) with accessed-by advice on the whole range."""
        return _read_accessed_by(self._region("accessed_by"))

    @property
    def last_prefetch_location(self) -> Location | None:
        """Where every page was last prefetched, or ``None`` (never, or to different places)."""
        return _read_location(self._region("last_prefetch_location"), _consts().last_prefetch)

    def state(self) -> HintState:
        """All four hints at once, read from the driver."""
        region = self._region("state")
        c = _consts()
        return HintState(_read_flag(region, c.read_mostly), _read_location(region, c.preferred),
                         _read_accessed_by(region), _read_location(region, c.last_prefetch))

    # -- advice ---------------------------------------------------------------------
    def advise(self, advice: MemAdvice, target: Target | None = None) -> None:
        """Give one piece of advice for the range.

        Parameters
        ----------
        advice : MemAdvice
        target : numba device, int, "cpu"/"host" or Location
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
            loc: Location | None = _parse_target(target, what)
        elif target is not None:
            raise ValueError(f"{what} takes no target (the driver ignores it); got {target!r}")
        else:
            loc = None
        region = self._region(what)
        if loc is not None:
            _check_target(loc, what, concurrent=advice in _NEEDS_CONCURRENT)
        _advise(region, advice, loc)

    def set_read_mostly(self) -> None:
        """Mark the range read-mostly: readers get read-only copies until someone writes."""
        self.advise(MemAdvice.SET_READ_MOSTLY)

    def unset_read_mostly(self) -> None:
        """Undo read-mostly; read copies collapse into one."""
        self.advise(MemAdvice.UNSET_READ_MOSTLY)

    def set_preferred_location(self, target: Target) -> None:
        """Prefer ``target`` (a device or ``"cpu"``) as where the range's pages live."""
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
        region = self._region(what)
        wanted = policy.advice_for(region.device_id)
        for advice, loc in wanted:
            if loc is not None:
                _check_target(loc, what, concurrent=advice in _NEEDS_CONCURRENT)
        want_accessed = {loc for a, loc in wanted if a is MemAdvice.SET_ACCESSED_BY}
        have_accessed = _read_accessed_by(region)
        undo: list[tuple[MemAdvice, Location | None]] = []
        if not any(a is MemAdvice.SET_READ_MOSTLY for a, _ in wanted):
            undo.append((MemAdvice.UNSET_READ_MOSTLY, None))
        if not any(a is MemAdvice.SET_PREFERRED_LOCATION for a, _ in wanted):
            undo.append((MemAdvice.UNSET_PREFERRED_LOCATION, None))
        undo += [(MemAdvice.UNSET_ACCESSED_BY, loc) for loc in sorted(have_accessed - want_accessed, key=str)]
        todo = [(a, loc) for a, loc in wanted if not (a is MemAdvice.SET_ACCESSED_BY and loc in have_accessed)]
        for advice, loc in undo + todo:
            _advise(region, advice, loc)

    # -- prefetch ---------------------------------------------------------------------
    def prefetch(self, target: Target, stream: StreamLike = None) -> None:
        """Prefetch the range to ``target`` asynchronously on ``stream`` (see ManagedBuffer.prefetch)."""
        from ._prefetch import prefetch

        prefetch(self._obj, target, stream, self._start, self._stop)

    def __repr__(self) -> str:
        return f"ManagedMemoryHints({type(self._obj).__name__}, elements [{self._start}, {self._stop}))"
