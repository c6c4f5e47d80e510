"""Devices as users and the example kernels see them: count, attributes, free memory, peers, checked calls.

Thin public faces of :mod:`umem_numba._driver`: each makes numba's context
current where the driver needs one, and each raises
:class:`~umem_numba.CudaUnavailableError` on a machine without a usable GPU.
Over numba's simulator they answer from the simulated driver.
"""

from __future__ import annotations

from typing import Any

from .. import _driver
from .._checks import as_nonnegative_int

__all__ = [
    "can_access_peer",
    "device_attribute",
    "device_count",
    "driver_call",
    "ensure_context",
    "gpu_unavailable_reason",
    "mem_info",
]


def _device(device: Any, what: str) -> int | None:
    return None if device is None else as_nonnegative_int(device, what, "an int device ordinal")


def device_count() -> int:
    """The number of CUDA devices the driver sees.

    Returns
    -------
    int
        ``cuDeviceGetCount``; it does not change within a process.

    Raises
    ------
    CudaUnavailableError
        No driver or no GPU.
    """
    return _driver.device_count()


def device_attribute(name: str, device: int | None = None) -> int:
    """A device attribute, by the name after ``CU_DEVICE_ATTRIBUTE_``.

    Parameters
    ----------
    name : str
        E.g. ``"VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"``, ``"MULTIPROCESSOR_COUNT"``.
    device : int, optional
        Device ordinal; the current device by default.

    Returns
    -------
    int
        The attribute's value (read once per device: attributes do not change).

    Raises
    ------
    AttributeError
        ``name`` is not an attribute the driver binding knows.
    CudaUnavailableError
        No driver or no GPU.
    """
    dev = _device(device, "device_attribute: device")
    return _driver.device_attribute(name, _driver.ensure_context() if dev is None else dev)


def mem_info(device: int | None = None) -> tuple[int, int]:
    """Free and total memory of a device, in bytes (``cuMemGetInfo``).

    Parameters
    ----------
    device : int, optional
        Device ordinal; the current device by default.

    Returns
    -------
    (free, total) : tuple of int
        Bytes free now and in all.

    Raises
    ------
    CudaUnavailableError
        No driver or no GPU.
    """
    dev = _device(device, "mem_info: device")
    with _driver.device_context(dev):
        return _driver.mem_get_info()


def can_access_peer(device: int, peer: int) -> bool:
    """Whether ``device`` can access ``peer``'s memory directly (``cuDeviceCanAccessPeer``).

    Parameters
    ----------
    device, peer : int
        Device ordinals.

    Returns
    -------
    bool
        ``True`` if peer access can be enabled between them (always ``False`` for one device and itself).

    Raises
    ------
    CudaUnavailableError
        No driver or no GPU.
    """
    dev = as_nonnegative_int(device, "can_access_peer: device", "an int device ordinal")
    other = as_nonnegative_int(peer, "can_access_peer: peer", "an int device ordinal")
    return bool(int(_driver.call("cuDeviceCanAccessPeer", dev, other)))


def ensure_context() -> int:
    """Make numba's context of the current device current in this thread.

    Returns
    -------
    int
        The device ordinal.

    Raises
    ------
    CudaUnavailableError
        No driver or no GPU.
    """
    return _driver.ensure_context()


def driver_call(name: str, *args: Any, detail: str = "") -> Any:
    """Call a CUDA driver function through umem_numba's checked layer.

    For what the rest of the API does not cover (raw asynchronous copies
    between addresses, peer access, UUIDs): the binding is ``cuda.bindings``'
    driver (or the simulated driver under ``NUMBA_ENABLE_CUDASIM=1``),
    loaded on first use, with the names the binding spells.  The caller makes
    the right context current (:func:`ensure_context`, ``cuda.gpus[i]``).

    Parameters
    ----------
    name : str
        The driver function, e.g. ``"cuMemcpyDtoDAsync"``.
    *args
        Its arguments, as the binding takes them.
    detail : str
        Added to the error message: what the call was for.

    Returns
    -------
    object
        The call's values after the ``CUresult``: ``None``, one value, or a tuple.

    Raises
    ------
    CudaError
        The call failed; the error names it and its result (``exc.name``).
    CudaUnavailableError
        No driver or no GPU.
    UnsupportedError
        The simulated driver does not implement ``name``.
    """
    return _driver.call(name, *args, detail=detail)


def gpu_unavailable_reason() -> str:
    """Why no real GPU can be used here: ``""`` when one can.

    Returns
    -------
    str
        The reason :func:`gpu_available` is false (no driver, no device, a
        forked child), or the note on numba's simulator when it is on.
    """
    return _driver.unavailable_reason()
