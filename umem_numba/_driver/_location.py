"""Where memory lives and where work runs: locations and streams.

This is the one place that interprets what users pass as a *target* (a numba
device, an ordinal, ``"cpu"``/``"host"`` or a :class:`Location`) and as a
*stream* (a numba stream, ``cuda.default_stream()``, ``0``/``None``, a raw
handle, or any object with ``__cuda_stream__``).
"""

from __future__ import annotations

import operator
import os
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _driver, _numba_compat
from .._errors import UnsupportedError

__all__ = [
    "HOST",
    "Host",
    "Location",
    "StreamLike",
    "Target",
    "as_device",
    "as_location",
    "numa_nodes",
    "stream_device",
    "stream_handle",
]

#: The driver's legacy id for the host in range attributes (``CU_DEVICE_CPU``; a
#: test checks it against the binding: it is needed before the driver loads).
_CU_DEVICE_CPU = -1
_HOST_NAMES = frozenset({"cpu", "host"})
_KINDS = ("device", "host", "host_numa")


@dataclass(frozen=True)
class Location:
    """A memory location: a device by ordinal, the host, or one host NUMA node.

    Parameters
    ----------
    kind : {"device", "host", "host_numa"}
        What the location is.
    id : int
        The device ordinal; ``-1`` for the host; the node number of a host
        NUMA node.

    Notes
    -----
    Build one with :func:`as_location`; ``Location.device(n)``, :data:`HOST`
    and :func:`Host` are shortcuts.  Unlike a bare integer, a location cannot
    confuse "device 0" with "no device" (or with NUMA node 0).  A host NUMA
    node is host memory: :attr:`is_host` is True for it too, and
    :attr:`numa` says which node.
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
        elif self.kind == "host_numa":
            if self.id < 0:
                raise ValueError(f"a host NUMA node number must be >= 0, got {self.id}")
        else:
            raise ValueError(f"Location kind must be 'device', 'host' or 'host_numa', got {self.kind!r}")

    @classmethod
    def device(cls, ordinal: int) -> Location:
        """The location of device ``ordinal``."""
        return cls("device", operator.index(ordinal))

    @classmethod
    def host(cls, numa: int | None = None) -> Location:
        """The host (``numa=None``) or host NUMA node ``numa`` (see :func:`Host`)."""
        if numa is None:
            return HOST
        n = _ordinal(numa, "Host: ")
        if n is None:
            raise TypeError(f"Host: numa must be an int (a host NUMA node number) or None, got {type(numa).__name__}")
        return cls("host_numa", n)

    @property
    def is_host(self) -> bool:
        """True for the host (CPU) location and for a host NUMA node."""
        return self.kind != "device"

    @property
    def numa(self) -> int | None:
        """The host NUMA node of a ``"host_numa"`` location; ``None`` otherwise."""
        return self.id if self.kind == "host_numa" else None

    @property
    def legacy_id(self) -> int:
        """The id as the driver's legacy interfaces spell it (``-1`` = CPU, any host NUMA node too)."""
        return _CU_DEVICE_CPU if self.kind == "host_numa" else self.id

    def to_cu(self) -> Any:
        """This location as a ``CUmemLocation`` (cached per location)."""
        cu = _CU_CACHE.get(self)
        if cu is None:
            api = _driver.api()
            cu = api.drv.CUmemLocation()
            if self.kind == "host":
                cu.type = api.c.location_host
                cu.id = 0
            elif self.kind == "host_numa":
                cu.type = api.c.location_host_numa
                cu.id = self.id
            else:
                cu.type = api.c.location_device
                cu.id = self.id
            _CU_CACHE[self] = cu
        return cu

    @classmethod
    def from_typed(cls, loc_type: int, loc_id: int) -> Location | None:
        """Decode a typed range attribute (``*_LOCATION_TYPE`` and ``*_ID``); ``None`` for 'no location'."""
        c = _driver.consts()
        if loc_type == int(c.location_device):
            return cls.device(loc_id)
        if loc_type == int(c.location_host):
            return HOST
        if loc_type == int(c.location_host_numa):
            return cls("host_numa", loc_id)
        return None

    @classmethod
    def from_legacy_id(cls, value: int) -> Location | None:
        """Decode a legacy range-attribute id; ``None`` for 'no location' (-2)."""
        if value == _CU_DEVICE_CPU:
            return HOST
        if value < 0:
            return None
        return cls.device(value)

    def __str__(self) -> str:
        if self.kind == "host_numa":
            return f"host NUMA node {self.id}"
        return "host" if self.is_host else f"device {self.id}"


_CU_CACHE: dict[Location, Any] = {}

#: The host (CPU) location.
HOST = Location("host", _CU_DEVICE_CPU)


def Host(numa: int | None = None) -> Location:
    """The host as a memory location, or one of its NUMA nodes.

    Parameters
    ----------
    numa : int, optional
        A host NUMA node number (``info()["numa_nodes"]`` lists them);
        ``None`` is the host as a whole (:data:`HOST`, the same as ``"cpu"``).

    Returns
    -------
    Location
        ``HOST``, or ``Location("host_numa", numa)``; the string ``"cpu:N"``
        means the same.

    Notes
    -----
    A node number is checked against the machine's nodes where a location
    is used (advice, prefetch): a node that does not exist is a
    ``ValueError`` before any driver call.
    """
    return Location.host(numa)


def numa_nodes() -> list[int] | None:
    """The host's online NUMA nodes (``/sys/devices/system/node/online``); ``None`` where unknown."""
    global _numa_nodes
    if _numa_nodes is None:
        _numa_nodes = _read_numa_nodes(_NODE_DIR)
    return list(_numa_nodes) if _numa_nodes else None


_NODE_DIR = "/sys/devices/system/node"
_numa_nodes: tuple[int, ...] | None = None


def _read_numa_nodes(node_dir: str) -> tuple[int, ...]:
    """Parse the kernel's node list (``"0"``, ``"0-3,5"``); ``()`` where there is none."""
    try:
        with open(os.path.join(node_dir, "online")) as f:
            text = f.read().strip()
    except OSError:
        try:
            names = os.listdir(node_dir)
        except OSError:
            return ()
        return tuple(sorted(int(n[4:]) for n in names if n.startswith("node") and n[4:].isdigit()))
    nodes: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        try:
            nodes.extend(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            return ()
    return tuple(nodes)


def _check_numa(node: int, prefix: str) -> None:
    nodes = numa_nodes()
    if nodes is not None and node not in nodes:
        raise ValueError(
            f"{prefix}host NUMA node {node} does not exist: this machine's online NUMA node(s) are "
            f"{', '.join(map(str, nodes))} (/sys/devices/system/node/online)"
        )


def _parse_host_name(target: str, prefix: str) -> Location:
    name, sep, node = target.lower().partition(":")
    if name not in _HOST_NAMES:
        raise TypeError(
            f"{prefix}unknown target {target!r}: expected 'cpu', 'host', 'cpu:N' (host NUMA node N), "
            "a device or an ordinal"
        )
    if not sep:
        return HOST
    if not node.strip().isdigit():
        raise ValueError(f"{prefix}bad host NUMA node in {target!r}: expected 'cpu:N' with N a node number >= 0")
    return Location("host_numa", int(node))


Target = Location | int | str | Any | None
StreamLike = Any


def _ordinal(value: Any, what: str) -> int | None:
    """``value`` as an int (Python or numpy integer), ``None`` if it is not one; bools refused."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what}a bool is not a device, an ordinal or 'cpu'")
    try:
        return operator.index(value)
    except TypeError:
        return None


def as_location(
    target: Target,
    *,
    check: bool = True,
    allow_host: bool = True,
    require_concurrent: bool = False,
    what: str = "",
) -> Location:
    """Normalise a target to a :class:`Location`: the one parser of devices and the host.

    Parameters
    ----------
    target : Location, int, numpy integer, str, numba device or None
        ``None`` is the current device; an integer is a device ordinal;
        ``"cpu"`` or ``"host"`` is the host; ``"cpu:N"`` (or ``"host:N"``,
        or ``Host(numa=N)``) is host NUMA node ``N``; a numba ``Device`` (or
        ``cuda.gpus[n]``) is that device.
    check : bool
        Verify that a device ordinal exists (asks the driver).  A host NUMA
        node is always checked (``/sys/devices/system/node``, no driver call).
    allow_host : bool
        ``False`` refuses the host (for device-only memory such as VMM).
    require_concurrent : bool
        Refuse a device without concurrentManagedAccess
        (:class:`~umem_numba.UnsupportedError`); implies ``check``.
    what : str
        The caller's name for the operation, put at the front of messages.

    Returns
    -------
    Location

    Raises
    ------
    TypeError
        For anything else (a bool, a float, an unknown string).
    ValueError
        A negative ordinal, a device the driver does not have, a host NUMA
        node the machine does not have, or the host where ``allow_host`` is
        ``False``.
    UnsupportedError
        ``require_concurrent`` and the device lacks concurrentManagedAccess.
    """
    prefix = f"{what}: " if what else ""
    if isinstance(target, Location):
        loc = target
    elif target is None:
        loc = Location.device(_driver.ensure_context())
    elif isinstance(target, str):
        loc = _parse_host_name(target, prefix)
    else:
        n = _ordinal(target, prefix)
        if n is None:
            n = _ordinal(getattr(target, "id", None), prefix)  # numba Device or gpus[n] proxy
            if n is None:
                raise TypeError(
                    f"{prefix}cannot use {type(target).__name__} as a memory location; "
                    "expected a numba device, an ordinal, 'cpu' or a Location"
                )
        if n < 0:
            raise ValueError(f"{prefix}device ordinal must be >= 0, got {n} (use 'cpu' for the host)")
        loc = Location.device(n)
    if loc.is_host:
        if not allow_host:
            raise ValueError(f"{prefix}this needs a device (an ordinal or a numba device), not the host")
        if loc.kind == "host_numa":  # no driver call: always checked
            _check_numa(loc.id, prefix)
        return loc
    if check or require_concurrent:
        count = _driver.device_count()
        if loc.id >= count:
            raise ValueError(f"{prefix}device {loc.id} does not exist: this machine has {count} CUDA device(s)")
    if require_concurrent and not _driver.concurrent_managed_access(loc.id):
        raise UnsupportedError(
            f"{prefix}device {loc.id} has no concurrentManagedAccess (e.g. Windows/WDDM or an old GPU): "
            "the driver cannot prefetch to it, prefer it or map managed memory for it"
        )
    return loc


def as_device(target: Target, *, what: str = "", require_concurrent: bool = False) -> int:
    """The ordinal of an existing device (:func:`as_location` without the host)."""
    return as_location(target, allow_host=False, require_concurrent=require_concurrent, what=what).id


_MAX_HANDLE = 1 << 64


def stream_handle(stream: StreamLike, *, what: str = "") -> int:
    """The raw ``CUstream`` handle of a stream-like value, as an ``int``: the one stream parser.

    Parameters
    ----------
    stream : numba stream, CuPy/PyTorch/cuda.core stream, int, numpy integer or None
        ``None`` and ``0`` are the legacy default stream; objects with
        ``__cuda_stream__`` (cuda.core, CuPy, PyTorch) give their handle, as
        do a numba ``Stream`` (``.handle``), a PyTorch stream
        (``.cuda_stream``) and an older CuPy stream (``.ptr``); an integer
        is taken as a raw handle.
    what : str
        The caller's name for the operation, put at the front of messages.

    Returns
    -------
    int

    Notes
    -----
    Given a stream numba created (``cuda.stream()``), umem_numba also learns
    that the handle is that stream's while the object lives: plain
    ``kernel[g, b, s](buf)`` launches on it then record no event per launch
    (numba's launch hands buffers only the handle).

    Raises
    ------
    TypeError
        Not a stream (a bool, a string, ...).
    ValueError
        A negative handle or one wider than 64 bits.
    """
    if stream is None:
        return 0
    if type(stream) is int and 0 <= stream < _MAX_HANDLE:
        return stream
    known = _handles.get(id(stream))
    if known is not None and known[0]() is stream:
        return known[1]
    handle = _parse_stream(stream, what)
    owned = owns_stream(stream)
    if not owned:
        _driver.exit_hook_first()  # another library's stream: that library exits after umem_numba's hook
    try:
        ref = weakref.ref(stream)
    except TypeError:  # no weak references (a numpy integer): nothing to remember
        return handle
    if owned:
        _driver.note_owned_stream(handle, stream)  # its id can be kept while it lives
    if len(_handles) >= _HANDLES_KEPT:
        _handles.clear()
    _handles[id(stream)] = (ref, handle)
    return handle


#: Handles of recently used stream objects, by id, with a weak reference that
#: proves the id still names the same object: a stream's handle never changes,
#: and asking a numba or CuPy stream for it costs as much as a pool allocation.
_handles: dict[int, tuple[weakref.ref[Any], int]] = {}
_HANDLES_KEPT = 256


def _parse_stream(stream: Any, what: str) -> int:
    """:func:`stream_handle` for an object that is not a plain int."""
    prefix = f"{what}: " if what else ""
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        value: Any = (proto() if callable(proto) else proto)[1]
        if type(value) is int and 0 <= value < _MAX_HANDLE:  # numba, CuPy, PyTorch: the common case
            return value
    elif getattr(stream, "handle", None) is not None:
        value = stream.handle
        value = getattr(value, "value", value)  # a ctypes c_void_p: None means 0
        value = 0 if value is None else value
    elif getattr(stream, "cuda_stream", None) is not None:
        value = stream.cuda_stream
    elif type(stream).__module__.startswith("cupy.") and getattr(stream, "ptr", None) is not None:
        value = stream.ptr  # a CuPy stream from before __cuda_stream__ (``ptr`` means memory elsewhere)
    else:
        value = stream
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{prefix}a stream cannot be a bool")
    try:
        handle = operator.index(value) if not hasattr(value, "getPtr") else int(value)
    except TypeError:
        raise TypeError(
            f"{prefix}cannot use {type(stream).__name__} as a CUDA stream; pass a numba stream, a stream "
            "with __cuda_stream__ (CuPy, PyTorch, cuda.core), 0 or None"
        ) from None
    if not 0 <= handle < _MAX_HANDLE:
        raise ValueError(f"{prefix}a CUDA stream handle is a 64-bit address; {handle} is not one")
    return handle


def stream_device(handle: int) -> int:
    """Ordinal of the device a stream belongs to (events must be recorded in its context)."""
    c = _driver.consts()
    if handle in (0, c.stream_legacy, c.stream_per_thread):
        return _driver.ensure_context()
    get = _driver.api().stream_get_device
    if get is None:  # cuda-bindings older than 12.8: assume the current device's stream
        return _driver.ensure_context()
    return int(_driver.check(get(handle), "cuStreamGetDevice", f"finding the device of stream {handle:#x}"))


def stream_classes() -> tuple[tuple[type, ...], type | None]:
    """(the stream kinds numba's launch takes, numba's own ``Stream`` class); found once."""
    global _STREAM_CLASSES
    if _STREAM_CLASSES is None:
        _STREAM_CLASSES = _numba_compat.stream_classes()  # none where numba-cuda's driver cannot be read
    return _STREAM_CLASSES


def owns_stream(stream: Any) -> bool:
    """Whether ``stream`` owns its handle: a stream numba created, destroyed only when it is collected."""
    return _numba_compat.stream_owns_handle(stream, stream_classes()[1])


_STREAM_CLASSES: tuple[tuple[type, ...], type | None] | None = None
