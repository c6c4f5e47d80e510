"""numba's simulator API over the simulated driver: its streams, events, arrays and plain launches.

The simulator's classes and modules, and their private attributes, come from
:mod:`umem_numba._numba_compat` (checked there: a clear error where a numba-cuda lacks one).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ... import _numba_compat as _nc
from ..._errors import UnsupportedError
from ._common import (
    _DEVICE_ATTRIBUTES,
    _SUCCESS,
)
from ._kernels import _nanosleep
from ._sim_driver import SimDriver


class SimStream:
    """What ``numba.cuda.stream()`` gives under the simulated driver: a stream of its own, with a handle.

    numba's simulator runs everything at the call and its streams are empty
    objects; umem_numba's simulated driver queues work per stream, so the
    stream objects of numba's API must name real (simulated) streams.  It is
    numba's ``Stream`` under the simulator (:func:`install_numba` names it so in
    numba's driver module) and, like numba's, says whether it owns its handle:
    ``external`` is False for a stream it created (``cuda.stream()``), which is
    destroyed only when the object is collected, and for the default streams
    (numba's own objects over the handles 0, 1 and 2, as on a GPU); True for
    ``cuda.external_stream()``.
    """

    def __init__(self, drv: SimDriver, handle: int | None = None, *, flags: int = 0) -> None:
        self._drv = drv
        self._owned = handle is None
        self.external = not self._owned and int(handle or 0) > 2
        if handle is None:
            _, handle = drv.cuStreamCreate(flags)
        self.handle = int(handle)
        if self._owned:
            import weakref

            weakref.finalize(self, drv.cuStreamDestroy, self.handle).atexit = False

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)

    def __int__(self) -> int:
        return self.handle

    def synchronize(self) -> None:
        """Run the stream's queued work (``cuStreamSynchronize``)."""
        self._drv.cuStreamSynchronize(self.handle)

    def query(self) -> bool:
        """Whether the stream's work has run (``cuStreamQuery``: each poll lets one operation run)."""
        return self._drv.cuStreamQuery(self.handle)[0] == _SUCCESS

    @contextlib.contextmanager
    def auto_synchronize(self) -> Iterator[SimStream]:
        yield self
        self.synchronize()

    def __repr__(self) -> str:
        return f"<simulated CUDA stream {self.handle:#x}>"


class _Holder:
    """numpy's array interface over another library's memory, keeping that library's object alive."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, interface: dict[str, Any], owner: Any) -> None:
        self.__array_interface__ = interface
        self.owner = owner


class SimEvent:
    """What ``numba.cuda.event()`` gives under the simulated driver: an event of it."""

    def __init__(self, drv: SimDriver, timing: bool = True) -> None:
        self._drv = drv
        self.handle = int(drv.cuEventCreate(0 if timing else 2)[1])
        import weakref

        weakref.finalize(self, drv.cuEventDestroy, self.handle).atexit = False

    def record(self, stream: Any = 0) -> None:
        self._drv.cuEventRecord(self.handle, _stream_int(stream))

    def wait(self, stream: Any = 0) -> None:
        self._drv.cuStreamWaitEvent(_stream_int(stream), self.handle, 0)

    def query(self) -> bool:
        """Whether the recorded work has run (``cuEventQuery``: each poll lets one operation run)."""
        return self._drv.cuEventQuery(self.handle)[0] == _SUCCESS

    def synchronize(self) -> None:
        self._drv.cuEventSynchronize(self.handle)

    def elapsed_time(self, other: Any) -> float:
        raise UnsupportedError(
            "event timing: the simulated driver (NUMBA_ENABLE_CUDASIM=1) has no device clock; it needs a real GPU"
        )


def _stream_int(stream: Any) -> int:
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    return int(getattr(stream, "handle", 0) or 0)


def _plain_argument(arg: Any, retr: list[Callable[[], None]], stream: Any) -> Any:
    """A plain launch's argument as a queued launch takes it: a numpy array over the memory the kernel uses.

    As numba's launch does, at the call: a buffer (numba's ``ArgHint``) gives its device array, a
    host numpy array is copied in (and back after the kernel, through ``retr``), and numba's
    arrays (``cuda.as_cuda_array``, ``cuda.to_device``) give the memory they are over.
    """
    sim = _nc.simulator_api()
    if isinstance(arg, np.ndarray) and arg.ndim > 0:
        arg = sim.InOut(arg).to_device(retr)
    elif isinstance(arg, sim.ArgHint):
        arg = arg.to_device(retr, stream)  # numba's stream object, as numba's launch passes it
    if isinstance(arg, sim.FakeCUDAArray):
        data = _nc.sim_array_data(arg)
        if isinstance(data, np.ndarray):
            return data
    return arg


def install_numba(drv: SimDriver) -> None:
    """Give numba's simulator API streams of ``drv`` (``cuda.stream()``, the default streams, ``synchronize``).

    The one place where umem_numba changes numba: only under the simulator,
    only the stream constructors and ``cuda.synchronize`` of its fake API.
    """
    from numba import cuda

    sim = _nc.simulator_api()  # every internal below, checked at once
    api_modules = [cuda, sim.api]

    def stream() -> SimStream:
        return SimStream(drv)

    def default_stream() -> SimStream:
        return SimStream(drv, 0)

    def legacy_default_stream() -> SimStream:
        return SimStream(drv, 1)

    def per_thread_default_stream() -> SimStream:
        return SimStream(drv, 2)

    def external_stream(ptr: int) -> SimStream:
        return SimStream(drv, int(ptr))

    def synchronize() -> None:
        drv.cuCtxSynchronize()

    # numba's driver module names its stream class ``Stream``; the simulator's module has none, and
    # its streams are SimStreams now: what code that recognises numba's own streams looks for
    # (umem_numba's ``owns_stream``: an owned stream's cuStreamGetId may be kept while it lives).
    numba_driver = sim.driver  # numba.cuda.cudadrv.driver: the simulator's, under the simulator
    if getattr(numba_driver, "Stream", SimStream) is SimStream:
        numba_driver.Stream = SimStream

    array_class = sim.FakeCUDAArray
    data = _nc.sim_array_data

    def interface(self: Any) -> dict[str, Any]:
        a = data(self)
        return {
            "shape": a.shape,
            "typestr": a.dtype.str,
            "descr": a.dtype.descr if a.dtype.fields else [("", a.dtype.str)],
            "data": (a.ctypes.data if a.size else 0, False),
            "strides": None if a.flags.c_contiguous else a.strides,
            "version": 3,
            "stream": None,
        }

    # numba's simulated device arrays are host numpy arrays: they offer the CUDA Array
    # Interface over that memory (which the simulated driver treats as pageable host memory).
    device_class = sim.FakeCUDADevice

    def device_attribute(self: Any, name: str) -> Any:
        if name == "id":
            return 0
        if name in _DEVICE_ATTRIBUTES:
            return _DEVICE_ATTRIBUTES[name]
        raise AttributeError(name)

    device_class.__getattr__ = device_attribute  # numba's device attributes, as the driver has them

    array_class.__cuda_array_interface__ = property(interface)

    # numba's own device arrays are host memory that numba's simulator copies at the call; on a GPU
    # their host copies wait for the work queued before them (a plain launch is queued now).
    if not getattr(array_class.copy_to_host, "_umem", False):
        numba_copy_to_host, numba_copy_to_device = array_class.copy_to_host, array_class.copy_to_device
        get, put = array_class.__getitem__, array_class.__setitem__

        def wait(stream: Any) -> None:
            # Not from inside a simulated kernel (its threads index these arrays): device code.
            if not _nc.sim_in_kernel() and not drv._running:
                drv.synchronous_copy_sync(_stream_int(stream))

        def copy_to_host(self: Any, ary: Any = None, stream: Any = 0) -> Any:
            wait(stream)
            return numba_copy_to_host(self, ary, stream)

        def copy_to_device(self: Any, ary: Any, stream: Any = 0) -> Any:
            wait(stream)
            return numba_copy_to_device(self, ary, stream)

        def read_item(self: Any, idx: Any) -> Any:
            item = get(self, idx)
            if not isinstance(item, array_class):  # an element read on the host: a copy
                wait(0)
                item = get(self, idx)
            return item

        def write_item(self: Any, idx: Any, value: Any) -> None:
            wait(0)
            put(self, idx, value)

        copy_to_host._umem = True  # type: ignore[attr-defined]
        array_class.copy_to_host = copy_to_host
        array_class.copy_to_device = copy_to_device
        array_class.__getitem__ = read_item
        array_class.__setitem__ = write_item
    array_class.device_ctypes_pointer = property(
        lambda self: ctypes.c_void_p(data(self).ctypes.data if data(self).size else 0)
    )

    def from_cuda_array_interface(desc: dict[str, Any], owner: Any = None, sync: bool = True) -> Any:
        shape = tuple(desc["shape"])
        descr = desc.get("descr") or []
        named = any(name for name, *_ in descr)
        dtype = np.dtype([tuple(d) for d in descr]) if named else np.dtype(desc["typestr"])
        ptr = desc["data"][0]
        if not ptr or 0 in shape:
            return array_class(np.empty(shape, dtype))
        iface = {
            "shape": shape,
            "typestr": dtype.str,
            "data": (ptr, False),
            "strides": desc.get("strides"),
            "version": 3,
        }
        return array_class(np.asarray(_Holder(iface, owner)))

    def as_cuda_array(obj: Any, sync: bool = True) -> Any:
        if not hasattr(obj, "__cuda_array_interface__"):
            raise TypeError("*obj* doesn't implement the cuda array interface.")
        return from_cuda_array_interface(obj.__cuda_array_interface__, owner=obj, sync=sync)

    def is_cuda_array(obj: Any) -> bool:
        return hasattr(obj, "__cuda_array_interface__")

    def managed_array(
        shape: Any,
        dtype: Any = np.float64,
        strides: Any = None,
        order: str = "C",
        stream: Any = 0,
        attach_global: bool = True,
    ) -> Any:
        dt = np.dtype(dtype)
        shp = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = int(np.prod(shp, dtype=np.int64)) * dt.itemsize
        if not nbytes:
            return array_class(np.empty(shp, dt))
        ptr = drv.cuMemAllocManaged(nbytes, 1 if attach_global else 2)[1]
        raw = (ctypes.c_byte * nbytes).from_address(ptr)
        arr = np.ndarray(shp, dt, buffer=raw, strides=strides, order=order)  # type: ignore[arg-type]
        out = array_class(arr)
        import weakref

        weakref.finalize(raw, drv.cuMemFree, ptr).atexit = False
        return out

    numba_device_array, numba_to_device = sim.device_array, sim.to_device

    def device_array(
        shape: Any = None, dtype: Any = np.float64, strides: Any = None, order: str = "C", stream: Any = 0
    ) -> Any:
        # numba's simulator gives host memory, which the simulated driver would take for pageable
        # memory (copies from it read at the call); a GPU's is device memory, read when the work
        # runs, after the kernels queued before it: the simulated driver's device memory.
        dt = np.dtype(dtype)
        shp = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        count = int(np.prod(shp, dtype=np.int64))
        if not count or dt.char in "Mm" or dt.hasobject:
            return numba_device_array(shape=shp, dtype=dt, strides=strides, order=order)
        if strides is None:
            nbytes = count * dt.itemsize
        else:
            nbytes = sum((n - 1) * abs(s) for n, s in zip(shp, strides, strict=True)) + dt.itemsize
        ptr = drv.cuMemAlloc(nbytes)[1]
        raw = (ctypes.c_byte * nbytes).from_address(ptr)
        arr = np.ndarray(shp, dt, buffer=raw, strides=strides, order=order)  # type: ignore[arg-type]
        import weakref

        weakref.finalize(raw, drv.cuMemFree, ptr).atexit = False
        return array_class(arr)

    def to_device(ary: Any, stream: Any = 0, copy: bool = True, to: Any = None) -> Any:
        if to is not None:
            return numba_to_device(ary, stream=stream, copy=copy, to=to)
        host = np.asarray(ary)
        if (
            not host.size
            or host.dtype.char in "Mm"
            or host.dtype.hasobject
            or not (host.flags.c_contiguous or host.flags.f_contiguous)
        ):
            return numba_to_device(ary, stream=stream, copy=copy, to=to)
        order = "F" if host.flags.f_contiguous and not host.flags.c_contiguous else "C"
        out = device_array(host.shape, host.dtype, order=order)
        data(out)[...] = host  # new memory: no queued work uses it yet
        return out

    def device_array_like(ary: Any, stream: Any = 0) -> Any:
        host = data(ary) if isinstance(ary, array_class) else np.asarray(ary)
        order = "F" if host.flags.f_contiguous and not host.flags.c_contiguous else "C"
        return device_array(host.shape, host.dtype, order=order)

    def pinned_array(shape: Any, dtype: Any = np.float64, strides: Any = None, order: str = "C") -> np.ndarray:
        # numba's simulator gives pageable memory, which the driver reads before a copy returns;
        # a GPU's is page-locked, read when the copy runs: the simulated driver's pinned memory.
        dt = np.dtype(dtype)
        shp = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = int(np.prod(shp, dtype=np.int64)) * dt.itemsize
        if not nbytes:
            return np.ndarray(shp, dt, strides=strides, order=order)  # type: ignore[arg-type]
        ptr = drv.cuMemHostAlloc(nbytes, 0)[1]
        raw = (ctypes.c_byte * nbytes).from_address(ptr)
        arr = np.ndarray(shp, dt, buffer=raw, strides=strides, order=order)  # type: ignore[arg-type]
        import weakref

        weakref.finalize(raw, drv.cuMemFreeHost, ptr).atexit = False
        return arr

    # Inside a simulated kernel numba swaps the kernel module's `cuda` for a fake module of
    # the thread-level API; other threads of the program may meanwhile use the same global:
    # the rest of the API stays reachable through it.  nanosleep (absent there) takes time:
    # a simulated kernel lasts as long as its longest-sleeping thread (see run_kernel).
    module_class = sim.FakeCUDAModule

    def fallback(self: Any, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(cuda, name)

    module_class.__getattr__ = fallback
    module_class.nanosleep = staticmethod(_nanosleep)

    # A plain launch (kernel[g, b, s](...)) is queued on its stream like the toolkit's launches,
    # and runs (one by one where it can) when that stream's work is needed, as on a GPU.
    kernel_class = sim.FakeCUDAKernel
    normalize_kernel_dimensions = sim.normalize_kernel_dimensions

    numba_call = kernel_class.__call__
    if not getattr(numba_call, "_umem", False):

        def call(self: Any, *args: Any) -> Any:
            if _nc.sim_kernel_is_device(self) or _nc.sim_in_kernel() or self.grid_dim is None:
                return numba_call(self, *args)
            handle = getattr(self, "_umem_stream", 0)
            drv.refuse_plain_launch_in_capture(handle, any(isinstance(a, np.ndarray) and a.ndim for a in args))
            configured = copy.copy(self)
            configured.grid_dim, configured.block_dim = normalize_kernel_dimensions(self.grid_dim, self.block_dim)
            retr: list[Callable[[], None]] = []
            owner = getattr(self, "_umem_stream_owner", 0)
            queued = [_plain_argument(a, retr, owner) for a in args]
            drv.queue_plain_kernel(handle, configured, tuple(queued))
            # As numba's launch does once the kernel is queued: umem_numba's records at once (an
            # event on the stream); numba's copies of host arrays back wait for the kernel.
            copies = [wb for wb in retr if not getattr(wb, "after_launch", False)]
            for wb in retr:
                if getattr(wb, "after_launch", False):
                    wb()
            if copies:
                drv.cuStreamSynchronize(handle)
                for wb in copies:
                    wb()
            return None

        call._umem = True  # type: ignore[attr-defined]
        call._numba = numba_call  # type: ignore[attr-defined]
        kernel_class.__call__ = call

        # numba's simulator configures a launch by setting the kernel object's own grid: two
        # threads launching one kernel race, and a queued launch must keep its grid.  A
        # configured launch is a configured copy instead.
        numba_getitem = kernel_class.__getitem__

        def getitem(self: Any, configuration: Any) -> Any:
            configured = copy.copy(self)
            numba_getitem(configured, configuration)
            # numba's simulator ignores the stream: the launch is queued on it
            stream = configuration[2] if len(configuration) > 2 else 0
            configured._umem_stream = _stream_int(stream)
            configured._umem_stream_owner = stream  # alive until the launch, as numba's launch keeps it
            return configured

        kernel_class.__getitem__ = getitem

    def event(timing: bool = True) -> SimEvent:
        return SimEvent(drv, timing)

    for mod in api_modules:
        mod.event = event
        mod.managed_array = managed_array
        mod.device_array = device_array
        mod.device_array_like = device_array_like
        mod.to_device = to_device
        mod.pinned_array = pinned_array
        mod.from_cuda_array_interface = from_cuda_array_interface
        mod.as_cuda_array = as_cuda_array
        mod.is_cuda_array = is_cuda_array
        mod.stream = stream
        mod.default_stream = default_stream
        mod.legacy_default_stream = legacy_default_stream
        mod.per_thread_default_stream = per_thread_default_stream
        mod.external_stream = external_stream
        mod.synchronize = synchronize
    cuda._umem_sim_driver = drv
