"""VMM building blocks that need no object of their own: access flags, validation,
the driver structures (allocation properties, access descriptors) and the granularity.

Sizes and offsets must be multiples of :func:`allocation_granularity` (2 MiB on
current GPUs); every check runs before the driver is asked, and the message
names the bad value and the nearest valid ones.
"""

from __future__ import annotations

import enum
from typing import Any

from .. import _driver
from .._checks import as_int, as_nonnegative_int, as_positive_int
from .._driver._location import Location, Target, as_device

__all__ = ["AccessFlags", "allocation_granularity"]


class AccessFlags(enum.IntFlag):
    """What a device may do through a mapping (``CUmemAccess_flags``).

    Attributes
    ----------
    NONE
        No access: a kernel touching the range faults.
    READ
        Loads only; a store faults.
    READ_WRITE
        Loads and stores.

    Notes
    -----
    The values are the driver's (0, 1, 3), so ``READ in READ_WRITE`` is true,
    ``READ | READ_WRITE`` is ``READ_WRITE`` and ``READ_WRITE & READ`` is
    ``READ``.  There is no write-only access: the value 2 is refused.
    """

    NONE = 0
    READ = 1
    READ_WRITE = 3


_VALID_ACCESS = frozenset({0, 1, 3})


def as_access(flags: Any) -> AccessFlags:
    """Validate an access value (an :class:`AccessFlags` or the ints 0, 1, 3)."""
    value = as_int(flags, "access flags", "AccessFlags (NONE, READ, READ_WRITE)")
    if value not in _VALID_ACCESS:
        raise ValueError(
            f"invalid access flags {value}: use AccessFlags.NONE (0), READ (1) or "
            "READ_WRITE (3); the driver has no write-only access"
        )
    return AccessFlags(value)


def check_size(size: Any, what: str) -> int:
    """A positive byte count, or ``TypeError``/``ValueError`` naming it."""
    return as_positive_int(size, what, "an int number of bytes")


def check_nonnegative(value: Any, what: str) -> int:
    """A count or offset >= 0, or ``TypeError``/``ValueError`` naming it."""
    return as_nonnegative_int(value, what)


def check_alignment(alignment: Any) -> int:
    n = check_nonnegative(alignment, "alignment")
    if n & (n - 1):
        raise ValueError(f"alignment must be 0 or a power of two, got {n}")
    return n


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def check_multiple(n: int, granularity: int, what: str) -> None:
    if n % granularity:
        lower = n - n % granularity
        hint = f"{lower} or {lower + granularity}" if lower else f"{granularity}"
        raise ValueError(
            f"{what} ({n} bytes) must be a multiple of the allocation granularity "
            f"({granularity} bytes); nearest valid: {hint}"
        )


# The driver only reads these structures: build each one once (grow is a hot path).
_prop_cache: dict[tuple[int, bool], Any] = {}
_desc_cache: dict[tuple[tuple[int, int], ...], list[Any]] = {}


def alloc_prop(device_id: int, exportable: bool) -> Any:
    """``CUmemAllocationProp`` for pinned device memory (optionally fd-exportable)."""
    prop = _prop_cache.get((device_id, exportable))
    if prop is None:
        api = _driver.api()
        c = api.c
        prop = api.drv.CUmemAllocationProp()
        prop.type = c.vmm_pinned
        prop.location.type = c.location_device
        prop.location.id = device_id
        # An fd can only be exported if it was requested at cuMemCreate.
        prop.requestedHandleTypes = c.vmm_posix_fd if exportable else c.vmm_no_handle
        _prop_cache[(device_id, exportable)] = prop
    return prop


def _access_descs(grants: dict[int, AccessFlags]) -> list[Any]:
    key = tuple(sorted((d, int(f)) for d, f in grants.items()))
    descs = _desc_cache.get(key)
    if descs is None:
        api = _driver.api()
        descs = []
        for device_id, flags in key:
            desc = api.drv.CUmemAccessDesc()
            desc.location.type = api.c.location_device
            desc.location.id = device_id
            desc.flags = api.c.access(flags)
            descs.append(desc)
        _desc_cache[key] = descs
    return descs


def set_access(ptr: int, size: int, grants: dict[int, AccessFlags], detail: str) -> None:
    """One ``cuMemSetAccess`` for every device in ``grants`` over a fully mapped span."""
    descs = _access_descs(grants)
    if descs:
        _driver.call("cuMemSetAccess", ptr, size, descs, len(descs), detail=detail)


def get_access(ptr: int, device_id: int) -> AccessFlags:
    flags = _driver.call(
        "cuMemGetAccess",
        Location.device(device_id).to_cu(),
        ptr,
        detail=f"reading device {device_id}'s access to {ptr:#x}",
    )
    return AccessFlags(int(flags))


_gran_cache: dict[tuple[int, bool, bool], int] = {}


def granularity(device_id: int, recommended: bool = False, exportable: bool = False) -> int:
    key = (device_id, recommended, exportable)
    g = _gran_cache.get(key)
    if g is None:
        c = _driver.consts()
        g = int(
            _driver.call(
                "cuMemGetAllocationGranularity",
                alloc_prop(device_id, exportable),
                c.granularity_recommended if recommended else c.granularity_minimum,
                detail=f"VMM granularity of device {device_id}",
            )
        )
        _gran_cache[key] = g
    return g


def allocation_granularity(device: Target = None, recommended: bool = False, *, exportable: bool = False) -> int:
    """Granularity of VMM sizes, offsets and addresses on a device.

    Parameters
    ----------
    device : int, numba device, Location or None
        The device (``None``: the current one).
    recommended : bool
        ``False``: the minimum the driver accepts; ``True``: the size it
        recommends for performance (a multiple of the minimum).
    exportable : bool
        For allocations that can be exported as a POSIX file descriptor.

    Returns
    -------
    int
        Bytes; every :class:`PhysicalMemory` size and :class:`Mapping` offset
        must be a multiple of the minimum.

    Raises
    ------
    ValueError, TypeError
        Not a device.
    CudaError
        The device does not support VMM.
    """
    device_id = as_device(device, what="allocation_granularity")
    return granularity(device_id, bool(recommended), bool(exportable))
