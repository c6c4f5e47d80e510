"""Launching kernels with coherence: one event per launch, filed under every buffer argument.

:func:`launch`, :func:`coherent` and :func:`jit` record one CUDA event on the
launch stream after the kernel and file it under the tracker of every
umem_numba buffer among the arguments (views included), with no host
synchronisation on the launch path.  Host access later waits for exactly
those events (see :mod:`umem_numba._tracker`).
"""

from __future__ import annotations

from typing import Any

from . import _driver, _events
from ._buffer import Buffer
from ._errors import CoherenceError
from ._location import stream_handle
from ._tracker import Tracker, _launching

__all__ = ["CoherentKernel", "coherent", "jit", "launch"]


def _trackers_of(args: tuple[Any, ...]) -> list[Tracker]:
    out: list[Tracker] = []
    for a in args:
        if isinstance(a, Buffer):
            alloc = a._alloc
            if alloc is not None:  # a closed buffer fails in numba's typing with a clear error
                out.append(alloc.tracker)
        elif isinstance(a, (tuple, list)):
            out.extend(_trackers_of(tuple(a)))
    return out


def _launch(configured: Any, stream: Any, args: tuple) -> None:
    trackers = _trackers_of(args)
    for t in trackers:
        if t.holds:
            raise CoherenceError("cannot launch: an argument is held by the host "
                                 "(inside `with buf.on_host()`); leave the block first")
    flag = _launching
    flag.active = True
    try:
        configured(*args)
    finally:
        flag.active = False
    if trackers:
        handle = stream_handle(stream)
        event = _events.record(handle, _driver.current_device())
        for t in trackers:
            t.pending[handle] = event  # one dict store: atomic under the GIL


def launch(kernel: Any, griddim: Any, blockdim: Any, *args: Any, stream: Any = 0,
           sharedmem: int = 0) -> None:
    """Launch a numba CUDA kernel and record its completion on every buffer argument.

    Parameters
    ----------
    kernel : numba CUDA dispatcher
        A ``@cuda.jit`` kernel.
    griddim, blockdim : int or tuple
        Launch configuration, as in ``kernel[griddim, blockdim]``.
    *args
        Kernel arguments; umem_numba buffers (and views) among them are tracked.
    stream : numba stream, 0 or None
        The launch stream.
    sharedmem : int
        Dynamic shared memory in bytes.

    Raises
    ------
    CoherenceError
        If a buffer argument is held by the host (:meth:`ManagedBuffer.on_host`).

    Notes
    -----
    Nothing is synchronised here: the launch records one CUDA event, and host
    access to an argument later waits for exactly that event.
    """
    _launch(kernel[griddim, blockdim, stream, sharedmem], stream, args)


class _ConfiguredLaunch:
    __slots__ = ("_configured", "_stream")

    def __init__(self, configured: Any, stream: Any) -> None:
        self._configured = configured
        self._stream = stream

    def __call__(self, *args: Any) -> None:
        _launch(self._configured, self._stream, args)


class CoherentKernel:
    """A numba kernel whose launches are tracked by umem_numba's coherence checks.

    Use it exactly like the kernel: ``k[grid, block, stream, sharedmem](*args)``.
    Other attributes (``py_func``, ``overloads``, ``inspect_*``...) are the
    wrapped kernel's.

    Parameters
    ----------
    kernel : numba CUDA dispatcher
        The ``@cuda.jit`` kernel to wrap.
    """

    __slots__ = ("kernel",)

    def __init__(self, kernel: Any) -> None:
        if not hasattr(kernel, "__getitem__") or not hasattr(kernel, "py_func"):
            raise TypeError(f"coherent() needs a numba @cuda.jit kernel, got {type(kernel).__name__}")
        self.kernel = kernel

    def __getitem__(self, config: Any) -> _ConfiguredLaunch:
        if not isinstance(config, tuple) or not 2 <= len(config) <= 4:
            raise ValueError("launch configuration must be [griddim, blockdim[, stream[, sharedmem]]]")
        stream = config[2] if len(config) > 2 else 0
        return _ConfiguredLaunch(self.kernel[config], stream)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.kernel(*args, **kwargs)  # numba raises its own "missing launch config" error

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)

    def __repr__(self) -> str:
        return f"CoherentKernel({self.kernel!r})"


def coherent(kernel: Any) -> CoherentKernel:
    """Wrap a numba kernel so that its launches are tracked (see :class:`CoherentKernel`)."""
    return kernel if isinstance(kernel, CoherentKernel) else CoherentKernel(kernel)


def jit(func_or_sig: Any = None, **options: Any) -> Any:
    """``numba.cuda.jit`` whose kernels are :func:`coherent`.

    Use as ``@umem_numba.jit`` or ``@umem_numba.jit(signature, **options)``;
    options are numba's.  Device functions (``device=True``) are returned
    unwrapped: they are not launched.
    """
    from numba import cuda as nbcuda

    def wrap(obj: Any) -> Any:
        return obj if options.get("device") else CoherentKernel(obj)

    if func_or_sig is None:
        return lambda f: wrap(nbcuda.jit(**options)(f))
    if callable(func_or_sig) and not isinstance(func_or_sig, (str, list, tuple)):
        return wrap(nbcuda.jit(func_or_sig, **options))
    inner = nbcuda.jit(func_or_sig, **options)
    return lambda f: wrap(inner(f))
