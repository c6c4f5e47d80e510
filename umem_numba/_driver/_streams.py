"""Streams numba's ``cuda.stream()`` cannot make: a non-blocking stream with a scheduling priority."""

from __future__ import annotations

import weakref
from typing import Any

from .. import _driver

__all__ = ["PriorityStream"]


class PriorityStream:
    """A non-blocking CUDA stream with a scheduling priority, for numba launches and copies.

    numba's ``cuda.stream()`` takes no priority.  The halo paths need one: a
    small band launch queued beside a slab kernel that fills the GPU is
    otherwise scheduled only as the big kernel drains, and everything waiting
    for the band (the messages) waits a whole kernel.  With the greatest
    priority, the band's blocks take the next free slots.

    Parameters
    ----------
    highest : bool
        The greatest priority of the context (``cuCtxGetStreamPriorityRange``);
        ``False`` gives the least (the default priority).

    Attributes
    ----------
    stream : numba stream
        ``cuda.external_stream`` over the handle: pass it to launches, events
        and copies.  Valid until :meth:`close`.
    priority : int
        The priority it was created with (lower numbers are higher priorities).

    Notes
    -----
    Created with ``cuStreamCreateWithPriority(CU_STREAM_NON_BLOCKING, p)`` in
    numba's context of the current device; :meth:`close` (or garbage
    collection) destroys it, after the work queued on it.
    """

    def __init__(self, highest: bool = True) -> None:
        from numba import cuda

        device = _driver.ensure_context()  # numba's context current (CudaUnavailableError without a GPU)
        least, greatest = _driver.call("cuCtxGetStreamPriorityRange")
        self.priority = int(greatest if highest else least)
        flags = int(_driver.api().drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
        handle = _driver.call("cuStreamCreateWithPriority", flags, self.priority)
        self.handle = int(handle)
        self.stream = cuda.external_stream(self.handle)
        self._finalizer = weakref.finalize(self, _destroy_stream, handle, device, _driver)
        # Not at exit: the driver destroys the stream with its context, and a destroy
        # issued while numba, PyTorch or CuPy tear down may meet a context being destroyed.
        self._finalizer.atexit = False

    def close(self) -> None:
        """Destroy the stream (the driver lets the queued work finish first)."""
        self._finalizer()


def _destroy_stream(handle: Any, device: int, _driver: Any) -> None:
    # ``_driver`` (umem_numba._driver) comes bound: importing from a finalizer can fail at exit.
    if _driver.shutting_down():  # the process is exiting (atexit included): the driver reclaims it
        return
    try:
        # In the stream's own context: a collection may run this in any thread, with any context current.
        _driver.call_on(device, "cuStreamDestroy", handle)
    except Exception as exc:
        if not _driver.context_gone(exc):
            raise
