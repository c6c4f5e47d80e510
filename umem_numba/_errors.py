"""Exception hierarchy of umem_numba.

Every failure of a driver call raises a :class:`CudaError` subclass that names
the call and the ``CUresult``; misuse that can be detected before the driver is
asked raises the ordinary Python exception for it (``TypeError``,
``ValueError``, ``IndexError``) with a message naming the culprit.
"""

from __future__ import annotations

__all__ = [
    "BufferClosedError",
    "CoherenceError",
    "CudaError",
    "CudaUnavailableError",
    "NotDeviceAccessibleError",
    "OutOfMemoryError",
    "UmemError",
    "UnsupportedError",
]


class UmemError(Exception):
    """Base class of every exception that umem_numba defines."""


class CudaError(UmemError, RuntimeError):
    """A CUDA driver call failed.

    Parameters
    ----------
    call : str
        Name of the driver function, e.g. ``"cuMemAllocManaged"``.
    code : int
        The ``CUresult`` value returned.
    name : str
        Symbolic name of the result, e.g. ``"CUDA_ERROR_OUT_OF_MEMORY"``.
    detail : str, optional
        What was being done, in the caller's terms.
    """

    def __init__(self, call: str, code: int, name: str, detail: str = "") -> None:
        self.call = call
        self.code = int(code)
        self.name = name
        self.detail = detail
        msg = f"{call} failed with {name} ({self.code})"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)

    def __reduce__(self) -> tuple[type[CudaError], tuple[str, int, str, str]]:  # pickling (multiprocessing)
        return (type(self), (self.call, self.code, self.name, self.detail))


class OutOfMemoryError(CudaError, MemoryError):
    """The driver could not satisfy an allocation (``CUDA_ERROR_OUT_OF_MEMORY``)."""


class CudaUnavailableError(UmemError, RuntimeError):
    """No usable CUDA driver or GPU: raised by the first call that needs one."""


class UnsupportedError(UmemError, RuntimeError):
    """The device or the memory does not support the requested operation."""


class NotDeviceAccessibleError(UnsupportedError, AttributeError):
    """The buffer's memory cannot be reached from the device, so it has no device view.

    Raised where a device view of such a buffer is asked for: its
    ``__cuda_array_interface__``, :meth:`~umem_numba.PinnedBuffer.lend`, a
    launch through :func:`~umem_numba.launch` or :func:`~umem_numba.jit`
    (a plain numba launch raises :class:`UnsupportedError`, its base).  The
    case today is a :class:`~umem_numba.PinnedBuffer` allocated without
    ``HostAllocFlags.DEVICEMAP``.  Also an ``AttributeError``, so that
    ``hasattr(buf, "__cuda_array_interface__")`` is ``False`` for it, as
    numba and other libraries expect of an object with no device view.

    Examples
    --------
    >>> buf = um.PinnedBuffer.empty(16)                  # doctest: +SKIP
    >>> hasattr(buf, "__cuda_array_interface__")         # doctest: +SKIP
    False
    >>> mapped = um.PinnedBuffer.empty(16, np.float32, um.HostAllocFlags.DEVICEMAP)  # doctest: +SKIP
    """


class CoherenceError(UmemError, RuntimeError):
    """Host access to memory that device work may still be using.

    Raised under the ``"raise"`` coherence policy, or when a kernel launch is
    attempted while the host holds a buffer (:meth:`ManagedBuffer.on_host`).
    """


class BufferClosedError(UmemError, ValueError):
    """The buffer (or the allocation behind a view) was closed."""


# Shown as umem_numba.CudaUnavailableError (the name users import and catch) in tracebacks, reprs and
# pickles, rather than the private module that defines them.
for _cls in (
    BufferClosedError,
    CoherenceError,
    CudaError,
    CudaUnavailableError,
    NotDeviceAccessibleError,
    OutOfMemoryError,
    UmemError,
    UnsupportedError,
):
    _cls.__module__ = "umem_numba"
del _cls
