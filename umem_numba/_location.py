"""Where memory lives and where work runs: locations and streams.

This is the one place that interprets what users pass as a *target* (a numba
device, an ordinal, ``"cpu"``/``"host"`` or a :class:`Location`) and as a
*stream* (a numba stream, ``cuda.default_stream()``, ``0``/``None``, a raw
handle, or any object with ``__cuda_stream__``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Union

from . import _driver

__all__ = ["Location", "HOST", "as_location", "stream_handle", "Target", "StreamLike"]

#: The driver's legacy id for the host in range attributes (``CU_DEVICE_CPU``).
_CU_DEVICE_CPU = -1
_HOST_NAMES = frozenset({"cpu", "host"})


@dataclass(frozen=True)
class Location:
    """A memory location: a device by ordinal, or the host.

    Parameters
    ----------
    kind : {"device", "host"}
        What the location is.
    id : int
        The device ordinal; ``-1`` for the host.

    Notes
    -----
    Build one with :func:`as_location`; ``Location.device(n)`` and
    :data:`HOST` are shortcuts.  Unlike a bare integer, a location cannot
    confuse "device 0" with "no device".
    """

    kind: str
    id: int

    def __post_init__(self) -> None:
        if self.kind == "host":
            if self.id != _CU_DEVICE_CPU:
                raise ValueError(f"the host location has id -1, not {self.id}")
        elif self.kind == "device":
            if self.id < 0:
                raise ValueError(f"device ordinal must be >= 0, got {self.id}")
        else:
            raise ValueError(f"Location kind must be 'device' or 'host', got {self.kind!r}")

    @classmethod
    def device(cls, ordinal: int) -> "Location":
        """The location of device ``ordinal``."""
        return cls("device", operator.index(ordinal))

    @property
    def is_host(self) -> bool:
        """True for the host (CPU) location."""
        return self.kind == "host"

    @property
    def legacy_id(self) -> int:
        """The id as the driver's legacy interfaces spell it (``-1`` = CPU)."""
        return self.id

    def to_cu(self) -> Any:
        """This location as a ``CUmemLocation`` (cached per location)."""
        cu = _CU_CACHE.get(self)
        if cu is None:
            drv = _driver.api().drv
            cu = drv.CUmemLocation()
            if self.is_host:
                cu.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
                cu.id = 0
            else:
                cu.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                cu.id = self.id
            _CU_CACHE[self] = cu
        return cu

    @classmethod
    def from_legacy_id(cls, value: int) -> "Location | None":
        """Decode a legacy range-attribute id; ``None`` for 'no location' (-2)."""
        if value == _CU_DEVICE_CPU:
            return HOST
        if value < 0:
            return None
        return cls.device(value)

    def __str__(self) -> str:
        return "host" if self.is_host else f"device {self.id}"


_CU_CACHE: dict[Location, Any] = {}

#: The host (CPU) location.
HOST = Location("host", _CU_DEVICE_CPU)

Target = Union[Location, int, str, Any]
StreamLike = Any


def as_location(target: Target, *, check: bool = True) -> Location:
    """Normalise a target to a :class:`Location`.

    Parameters
    ----------
    target : Location, int, str, numba device or None
        ``None`` is the current device; an ``int`` is a device ordinal;
        ``"cpu"`` or ``"host"`` is the host; a numba ``Device`` (or
        ``cuda.gpus[n]``) is that device.
    check : bool
        Verify that a device ordinal exists (asks the driver).

    Raises
    ------
    TypeError
        For anything else (a bool, a float, an unknown string).
    ValueError
        For a device ordinal the driver does not have.
    """
    if isinstance(target, Location):
        loc = target
    elif target is None:
        return Location.device(_driver.ensure_context())
    elif isinstance(target, bool):
        raise TypeError("a target must be a device, an ordinal or 'cpu', not a bool")
    elif isinstance(target, int):
        if target < 0:
            raise ValueError(f"device ordinal must be >= 0, got {target} (use 'cpu' for the host)")
        loc = Location.device(target)
    elif isinstance(target, str):
        if target.lower() in _HOST_NAMES:
            return HOST
        raise TypeError(f"unknown target {target!r}: expected 'cpu', 'host', a device or an ordinal")
    elif isinstance(getattr(target, "id", None), int):
        loc = Location.device(target.id)  # numba Device or gpus[n] proxy
    else:
        raise TypeError(f"cannot use {type(target).__name__} as a memory location; "
                        "expected a numba device, an ordinal, 'cpu' or a Location")
    if check and not loc.is_host:
        count = _driver.device_count()
        if loc.id >= count:
            raise ValueError(f"device {loc.id} does not exist: this machine has {count} CUDA device(s)")
    return loc


def stream_handle(stream: StreamLike) -> int:
    """The raw ``CUstream`` handle of a stream-like value, as an ``int``.

    ``None`` and ``0`` are the legacy default stream; a numba ``Stream``
    (including ``cuda.default_stream()``) gives its handle; an ``int`` is
    taken as a raw handle; objects with ``__cuda_stream__`` (cuda.core, CuPy)
    are understood too.
    """
    if stream is None:
        return 0
    handle = getattr(stream, "handle", None)
    if handle is not None:
        return int(handle)
    if isinstance(stream, bool):
        raise TypeError("a stream cannot be a bool")
    if isinstance(stream, int):
        if stream < 0:
            raise ValueError(f"a stream handle cannot be negative ({stream})")
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        return int((proto() if callable(proto) else proto)[1])
    raise TypeError(f"cannot use {type(stream).__name__} as a CUDA stream; "
                    "pass a numba stream, 0 or None")
