"""Every numba internal umem_numba touches, in one place, each use guarded.

numba-cuda's public surface (``cuda.jit``, streams, events, device arrays,
``cuda.current_context``, the External Memory Management classes it exports)
is used where it is needed.  Everything else umem_numba relies on is reached
through this module only: the rest of the package imports no private numba
module (``tests/interop/test_numba_internals.py`` checks it) and reads no
private attribute of a numba object.  What each piece is for, which
numba-cuda versions have it and what numba-cuda-mlir offers instead is in
``docs/concepts/numba-internals.md``; the sections below follow that page.

A missing internal raises :class:`NumbaInternalsError` (an
:class:`~umem_numba.UnsupportedError`) naming the feature, what is missing
and the numba-cuda versions that have it, instead of an ``AttributeError``
deep inside a launch.  Optional fast paths ask first (the ``*_supported``
and ``*_allowed`` functions) and take numba's own path where the answer is no.

Nothing here imports ``numba.cuda`` at import time: each function imports
what it needs on first use (and keeps it), so that importing umem_numba
stays free of the driver, and the simulator switch is read by numba first.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ._errors import UnsupportedError

__all__ = [
    "SUPPORTED",
    "NumbaInternalsError",
    "arg_hint_base",
    "array_param_count",
    "array_type",
    "compiled_kernel",
    "direct_launch_allowed",
    "emm_api",
    "fast_scalar_type_classes",
    "forall_block_size",
    "is_array_type",
    "is_scalar_type",
    "kernel_array_params",
    "kernel_function_handle",
    "launch_dims",
    "missing",
    "numba_cuda_version",
    "pre_launch_callbacks",
    "python_scalar_types",
    "scalar_type",
    "set_pre_launch_callbacks",
    "sim_array_data",
    "sim_in_kernel",
    "sim_kernel_debug",
    "sim_kernel_is_device",
    "sim_push_kernel_context",
    "simulator_api",
    "simulator_arg_hint",
    "stream_classes",
    "stream_owns_handle",
    "strided_view_launch_supported",
]

#: The numba-cuda versions umem_numba is built against (pyproject's dependency).
SUPPORTED = ">= 0.22, < 0.31"


class NumbaInternalsError(UnsupportedError):
    """An internal of numba-cuda that umem_numba needs is missing from the installed version.

    The message names the feature, the missing module or attribute, and the
    numba-cuda versions that have it (``docs/concepts/numba-internals.md``).
    """


def numba_cuda_version() -> str:
    """The installed numba-cuda's version (``"unknown"`` where its metadata cannot be read)."""
    try:
        from importlib.metadata import version

        return version("numba-cuda")
    except Exception:
        return "unknown"


def missing(feature: str, what: str, needed: str = SUPPORTED) -> NumbaInternalsError:
    """The error for ``what`` (a module or attribute) missing, needed for ``feature``."""
    return NumbaInternalsError(
        f"umem_numba's {feature} needs {what}, which the installed numba-cuda ({numba_cuda_version()}) "
        f"does not have; it needs numba-cuda {needed} (see docs/concepts/numba-internals.md)"
    )


def _module(name: str, feature: str, needed: str = SUPPORTED) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise missing(feature, f"the module {name}", needed) from exc


def _attr(obj: Any, name: str, feature: str, needed: str = SUPPORTED, *, owner: str | None = None) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        where = owner or getattr(obj, "__name__", None) or type(obj).__name__
        raise missing(feature, f"{where}.{name}", needed) from None


def _require(module: str, name: str, feature: str, needed: str = SUPPORTED) -> Any:
    return _attr(_module(module, feature, needed), name, feature, needed, owner=module)


# ---------------------------------------------------------------------------
# Types: what a buffer is to numba's typing, and the scalar types of a direct launch
#
# numba.core.types and numba.np.numpy_support belong to numba (the CPU
# package); numba-cuda types kernels with them.

_TYPES = "numba typing of buffers (numba.core.types)"
_NUMBA = "numba >= 0.60 with numba-cuda " + SUPPORTED
_types: Any = None
_from_dtype: Callable[[Any], Any] | None = None


def _numba_types() -> tuple[Any, Callable[[Any], Any]]:
    global _types, _from_dtype
    if _types is None or _from_dtype is None:
        types = _module("numba.core.types", _TYPES, _NUMBA)
        for name in ("Array", "boolean", "int64", "float64", "Number", "Boolean", "Integer", "Float", "Complex"):
            _attr(types, name, _TYPES, _NUMBA, owner="numba.core.types")
        _from_dtype = _require("numba.np.numpy_support", "from_dtype", _TYPES, _NUMBA)
        _types = types
    return _types, _from_dtype


def array_type(dtype: Any, ndim: int, layout: str) -> Any:
    """numba's ``types.Array`` of ``dtype`` (a numpy dtype), ``ndim`` and ``layout`` (``"C"``, ``"F"``, ``"A"``)."""
    types, from_dtype = _numba_types()
    return types.Array(from_dtype(dtype), ndim, layout)


def scalar_type(dtype: Any) -> Any:
    """numba's type of a scalar of numpy ``dtype`` (``bool`` is numba's ``boolean``)."""
    types, from_dtype = _numba_types()
    return types.boolean if dtype.kind == "b" else from_dtype(dtype)


def python_scalar_types() -> dict[type, Any]:
    """What numba's ``typeof`` gives plain Python scalars: ``int`` int64, ``float`` float64, ``bool`` boolean."""
    types, _ = _numba_types()
    return {int: types.int64, float: types.float64, bool: types.boolean}


def is_array_type(t: Any) -> bool:
    """Whether ``t`` is a numba array type."""
    types, _ = _numba_types()
    return isinstance(t, types.Array)


def is_scalar_type(obj: Any) -> bool:
    """Whether ``obj`` is a numba number or boolean type (calling one, ``numba.uint64(x)``, is a cast)."""
    try:
        types, _ = _numba_types()
    except NumbaInternalsError:
        return False  # nothing is known to be a cast: the call counts as a device function's
    return isinstance(obj, (types.Number, types.Boolean))


def fast_scalar_type_classes() -> tuple[type, ...]:
    """numba's scalar type classes whose instances cast a number when called (Integer, Float, Complex)."""
    types, _ = _numba_types()
    return (types.Integer, types.Float, types.Complex)


# ---------------------------------------------------------------------------
# The dispatcher and numba's kernel parameter layout: launching a compiled kernel directly

_DIRECT = "direct kernel launch (cuLaunchKernel with numba's parameter layout)"

#: Leading 8-byte parameters of an array argument in numba-cuda's layout (``_Kernel._prepare_args``):
#: meminfo, parent, nitems, itemsize, data; then the shape and the strides (in bytes).
_ARRAY_HEAD = 5


def array_param_count(t: Any) -> int:
    """How many 8-byte kernel parameters numba-cuda passes for an argument of array type ``t``."""
    return _ARRAY_HEAD + 2 * int(t.ndim)


def kernel_array_params(ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """An array's kernel parameters in numba-cuda's order: meminfo, parent, nitems, itemsize, data, shape, strides.

    meminfo and parent are null for device memory; strides are in bytes.
    """
    size = 1
    for d in shape:
        size *= d
    return (0, 0, size, itemsize, ptr if size else 0, *shape, *strides)


def direct_launch_allowed(dispatcher: Any, kernel: Any) -> bool:
    """Whether numba launches ``kernel`` (compiled by ``dispatcher``) with nothing beyond packing its parameters.

    Not for launch extensions (``prepare_args`` hooks), debug kernels
    (exception read-back), cooperative launches, or kernels compiled per
    launch configuration; nor where numba-cuda cannot say (an attribute it
    lacks counts against: numba-cuda below 0.30 has no
    ``launch_config_sensitive``, and every launch goes through numba).
    """
    return not (
        getattr(kernel, "debug", True)
        or getattr(kernel, "cooperative", True)
        or getattr(kernel, "launch_config_sensitive", True)
        or getattr(dispatcher, "_launch_config_sensitive", False)
        or (getattr(dispatcher, "targetoptions", None) or {}).get("extensions")
        or not hasattr(kernel, "bind")
        or not hasattr(kernel, "_codelibrary")
    )


def compiled_kernel(dispatcher: Any, argtypes: tuple[Any, ...]) -> Any:
    """The kernel ``dispatcher`` compiled for ``argtypes`` (numba's ``_Kernel``), or ``None``."""
    overloads = getattr(dispatcher, "overloads", None)
    return None if overloads is None else overloads.get(argtypes)


def arg_hint_base(simulated: bool) -> type | None:
    """numba's ``ArgHint``, whose ``to_device(retr, stream)`` a plain launch calls with its stream, or ``None``.

    numba's launch passes an argument that is an ``ArgHint`` through
    ``wrap_arg`` unchanged and calls its ``to_device(retr, stream)`` with the
    launch stream, then each function appended to ``retr`` once the kernel
    is queued: buffers are such hints, so a plain ``kernel[g, b, s](buf)``
    is ordered and recorded on ``s``.  Under numba's simulator, its own
    ``ArgHint`` (the simulated driver's plain launch calls ``to_device``
    alike).  ``None`` where numba-cuda has neither (the buffers' typing then
    marks a plain launch as work on an unknown stream).  ``simulated``: whether
    numba's simulator is active (this module sits below the driver layer that knows).
    """
    if simulated:
        try:
            return simulator_arg_hint()[0]
        except NumbaInternalsError:
            return None
    try:
        module = importlib.import_module("numba.cuda.args")
    except ImportError:
        return None
    hint, wrap = getattr(module, "ArgHint", None), getattr(module, "wrap_arg", None)
    if not isinstance(hint, type) or not callable(wrap) or not hasattr(hint, "to_device"):
        return None
    return hint


_FORALL = "forall launches of um.jit kernels (numba's ForAll block size)"


def forall_block_size(dispatcher: Any, argtypes: tuple[Any, ...], sharedmem: int) -> int:
    """The block size numba's ``forall`` picks for ``dispatcher`` compiled for ``argtypes`` (compiling it).

    As numba's ``ForAll._compute_thread_per_block``: the occupancy API's
    largest potential block (``cuOccupancyMaxPotentialBlockSize``), at most
    1024, with ``sharedmem`` bytes of dynamic shared memory per block.  A
    dispatcher compiled for one signature (``specialized``) uses it whatever
    ``argtypes`` say, as numba's ``forall`` does.
    """
    if getattr(dispatcher, "specialized", False):
        kernel = next(iter(_attr(dispatcher, "overloads", _FORALL).values()))
    else:
        kernel = compiled_kernel(dispatcher, argtypes)
        if kernel is None:
            kernel = _attr(dispatcher, "compile", _FORALL)(argtypes)
    library = _attr(kernel, "_codelibrary", _FORALL, owner="numba's _Kernel")
    cufunc = _attr(library, "get_cufunc", _FORALL, owner="numba's CUDACodeLibrary")()
    from numba import cuda

    ctx = cuda.current_context()
    size = _attr(ctx, "get_max_potential_block_size", _FORALL, owner="numba's Context")
    _, tpb = size(func=cufunc, b2d_func=0, memsize=sharedmem, blocksizelimit=1024)
    return int(tpb)


_FREES = "numba's deferred frees (bench e2e times what an example allocates, frees included)"


def flush_deferred_frees() -> None:
    """Free now what numba's deferred-free queues hold: its memory manager's and its context's.

    numba frees a dropped device array late (its ``_PendingDeallocs``: ten at a time, or when an
    allocation fails), where umem_numba's buffers free when they are dropped; a benchmark that
    times what an example allocates flushes numba's queues inside the timing, so that both pay
    their frees.  The simulator has no queues: nothing to do there.
    """
    from numba import cuda

    ctx = cuda.current_context()
    if not hasattr(ctx, "memory_manager"):  # numba's simulator: frees nothing late
        return
    manager = _attr(ctx, "memory_manager", _FREES, owner="numba's Context")
    for owner in (manager, ctx):
        _attr(_attr(owner, "deallocations", _FREES, owner=type(owner).__name__), "clear", _FREES)()


def kernel_function_handle(kernel: Any) -> int:
    """``kernel``'s function handle on the current device (a ``CUkernel``/``CUfunction`` as an int).

    Loads the module on this device and runs its set-up first, as numba's
    compile does (``_Kernel.bind``).
    """
    _attr(kernel, "bind", _DIRECT, owner="numba's _Kernel")()
    library = _attr(kernel, "_codelibrary", _DIRECT, owner="numba's _Kernel")
    cufunc = _attr(library, "get_cufunc", _DIRECT, owner="numba's CUDACodeLibrary")()
    return int(_attr(cufunc, "handle", _DIRECT, owner="numba's CUDA function"))


def launch_dims(configured: Any) -> tuple[Any, Any, int]:
    """``(griddim, blockdim, sharedmem)`` of numba's configured launch (``kernel[grid, block, ...]``)."""
    owner = "numba's _LaunchConfiguration"
    return (
        _attr(configured, "griddim", _DIRECT, owner=owner),
        _attr(configured, "blockdim", _DIRECT, owner=owner),
        int(_attr(configured, "sharedmem", _DIRECT, owner=owner)),
    )


_CALLBACKS = "numba's pre-launch callbacks"


def pre_launch_callbacks(configured: Any) -> list[Any] | None:
    """numba's ``pre_launch_callbacks`` of a configured launch (``None``: this numba-cuda has none, below 0.30)."""
    callbacks: list[Any] | None = getattr(configured, "pre_launch_callbacks", None)
    return callbacks


def set_pre_launch_callbacks(configured: Any, callbacks: list[Any]) -> None:
    """Replace numba's ``pre_launch_callbacks`` of a configured launch."""
    if not hasattr(configured, "pre_launch_callbacks"):
        raise missing(_CALLBACKS, "_LaunchConfiguration.pre_launch_callbacks", ">= 0.30")
    configured.pre_launch_callbacks = callbacks


# ---------------------------------------------------------------------------
# Launch marshalling: numba-cuda's fast path for objects that say __cuda_memory__


def strided_view_launch_supported() -> bool:
    """Whether numba-cuda's launch reads ``_strided_memory_view_shim`` from ``__cuda_memory__`` objects (>= 0.25)."""
    global _STRIDED
    if _STRIDED is None:
        try:
            from numba.cuda.cudadrv import devicearray

            _STRIDED = hasattr(devicearray, "_to_strided_memory_view")
        except Exception:
            _STRIDED = False
    return _STRIDED


_STRIDED: bool | None = None


# ---------------------------------------------------------------------------
# Streams: which stream objects numba's launch takes, and which own their handle


def stream_classes() -> tuple[tuple[type, ...], type | None]:
    """(the stream kinds numba's launch takes, numba's own ``Stream`` class).

    ``Stream`` (every supported version), ``ExperimentalStream`` (cuda.core's,
    as numba-cuda names it) and ``GraphBuilder`` (>= 0.29).  Where
    numba-cuda's driver module cannot be read, none: every stream is then
    wrapped as an external stream and no stream's identity is kept.
    """
    try:
        from numba.cuda.cudadrv import driver

        found = [getattr(driver, n, None) for n in ("Stream", "ExperimentalStream", "GraphBuilder")]
    except Exception:
        return (), None
    native = tuple(t for t in found if isinstance(t, type))
    own = found[0] if isinstance(found[0], type) else None
    return native, own


def stream_owns_handle(stream: Any, own: type | None) -> bool:
    """Whether ``stream``, of numba's ``Stream`` class ``own``, created its handle (``external`` False)."""
    return own is not None and isinstance(stream, own) and getattr(stream, "external", True) is False


# ---------------------------------------------------------------------------
# The External Memory Management plugin's base classes and numba's driver state
#
# numba-cuda documents BaseCUDAMemoryManager, HostOnlyCUDAMemoryManager,
# GetIpcHandleMixin, MemoryPointer, AutoFreePointer, MemoryInfo and IpcHandle
# for plugins; the rest below is its driver module's own.

_EMM = "memory-manager plugin (NUMBA_CUDA_MEMORY_MANAGER=umem_numba)"


class EmmApi:
    """What the memory-manager plugin uses of numba-cuda's driver module, resolved and checked once."""

    __slots__ = (
        "AutoFreePointer",
        "CudaAPIError",
        "GetIpcHandleMixin",
        "HostOnlyCUDAMemoryManager",
        "IpcHandle",
        "ManagedMemory",
        "MemoryInfo",
        "MemoryPointer",
        "_driver",
        "device_extents",
        "device_pointer",
        "shutting_down",
        "size_not_set",
    )

    AutoFreePointer: Any
    CudaAPIError: Any
    GetIpcHandleMixin: Any
    HostOnlyCUDAMemoryManager: Any
    IpcHandle: Any
    ManagedMemory: Any
    MemoryInfo: Any
    MemoryPointer: Any
    device_extents: Any

    def __init__(self) -> None:
        driver = _module("numba.cuda.cudadrv.driver", _EMM)
        if driver.__name__.startswith("numba.cuda.simulator"):
            # numba's simulator has no memory managers (nor NUMBA_CUDA_MEMORY_MANAGER): its driver
            # module is a stand-in without the classes a plugin derives from.
            raise NumbaInternalsError(
                f"umem_numba's {_EMM} needs a GPU: numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) has no "
                "External Memory Management (its driver module has no memory-manager classes, and it ignores "
                "NUMBA_CUDA_MEMORY_MANAGER); umem_numba's own buffers and pools run on the simulator unchanged"
            )
        for name in (
            "AutoFreePointer",
            "CudaAPIError",
            "GetIpcHandleMixin",
            "HostOnlyCUDAMemoryManager",
            "IpcHandle",
            "ManagedMemory",
            "MemoryInfo",
            "MemoryPointer",
            "device_extents",
        ):
            setattr(self, name, _attr(driver, name, _EMM, owner="numba.cuda.cudadrv.driver"))
        #: The sentinel of a deferred-free queue whose capacity is not yet known.
        self.size_not_set = _attr(driver, "_SizeNotSet", _EMM, owner="numba.cuda.cudadrv.driver")
        binding = _attr(driver, "binding", _EMM, owner="numba.cuda.cudadrv.driver")
        #: ``CUdeviceptr(int)``: the pointer type numba's memory objects hold.
        self.device_pointer = _attr(binding, "CUdeviceptr", _EMM, owner="cuda.bindings.driver")
        pending = _attr(driver, "_PendingDeallocs", _EMM, owner="numba.cuda.cudadrv.driver")
        for name in ("add_item", "clear", "is_disabled"):  # the inherited deferred-free queue's interface
            _attr(pending, name, _EMM, owner="numba.cuda.cudadrv.driver._PendingDeallocs")
        # Bound now: called from finalizers at exit, when importing may fail.
        self.shutting_down = _require("numba.core.utils", "shutting_down", _EMM, _NUMBA)
        self._driver = driver

    def context_device(self) -> int | None:
        """A device on which numba already has a context (``None``: none, or numba's driver not initialised)."""
        drv = getattr(self._driver, "driver", None)
        if not getattr(drv, "is_initialized", False):
            return None
        for dev in list(getattr(drv, "devices", {}).values()):
            if getattr(dev, "primary_context", None) is not None:
                return int(dev.id)
        return None

    def capacity_unset(self, deallocations: Any) -> bool:
        """Whether numba's deferred-free queue of a manager has no capacity yet (``_SizeNotSet``)."""
        return bool(deallocations.memory_capacity == self.size_not_set)


_emm: EmmApi | None = None


def emm_api() -> EmmApi:
    """numba-cuda's memory-manager classes and driver state, checked once (:class:`NumbaInternalsError` if any lack)."""
    global _emm
    if _emm is None:
        _emm = EmmApi()
    return _emm


# ---------------------------------------------------------------------------
# numba's CUDA simulator: the classes and modules the simulated driver hooks into
#
# Only under NUMBA_ENABLE_CUDASIM=1, where ``numba.cuda`` is the simulator's.

_SIM = "simulated driver (NUMBA_ENABLE_CUDASIM=1)"


def simulator_arg_hint() -> tuple[type, type]:
    """numba's simulator ``(ArgHint, InOut)``: ``numba.cuda.simulator.args`` (>= 0.25), else ``numba.cuda.args``."""
    for name in ("numba.cuda.simulator.args", "numba.cuda.args"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        hint, inout = getattr(module, "ArgHint", None), getattr(module, "InOut", None)
        if isinstance(hint, type) and isinstance(inout, type):
            return hint, inout
    raise missing(_SIM, "ArgHint and InOut in numba.cuda.simulator.args (or numba.cuda.args before 0.25)")


class SimulatorApi:
    """numba's simulator internals the simulated driver uses, resolved and checked once."""

    __slots__ = (
        "ArgHint",
        "Dim3",
        "FakeCUDAArray",
        "FakeCUDADevice",
        "FakeCUDAKernel",
        "FakeCUDAModule",
        "FakeWithinKernelCUDAArray",
        "InOut",
        "api",
        "device_array",
        "driver",
        "kernel",
        "normalize_kernel_dimensions",
        "swapped_cuda_module",
        "to_device",
    )

    ArgHint: Any
    InOut: Any
    FakeCUDAArray: Any
    FakeWithinKernelCUDAArray: Any
    FakeCUDADevice: Any
    FakeCUDAKernel: Any
    FakeCUDAModule: Any
    Dim3: Any
    swapped_cuda_module: Any
    device_array: Any
    to_device: Any
    kernel: Any
    api: Any
    driver: Any
    normalize_kernel_dimensions: Any

    def __init__(self) -> None:
        sim = "numba.cuda.simulator"
        self.ArgHint, self.InOut = simulator_arg_hint()
        arrays = _module(f"{sim}.cudadrv.devicearray", _SIM)
        for name in ("FakeCUDAArray", "FakeWithinKernelCUDAArray"):
            setattr(self, name, _attr(arrays, name, _SIM, owner=f"{sim}.cudadrv.devicearray"))
        #: numba's own simulated ``device_array`` / ``to_device`` (host memory), before umem_numba's replace them.
        self.device_array = _attr(arrays, "device_array", _SIM, owner=f"{sim}.cudadrv.devicearray")
        self.to_device = _attr(arrays, "to_device", _SIM, owner=f"{sim}.cudadrv.devicearray")
        self.FakeCUDADevice = _require(f"{sim}.cudadrv.devices", "FakeCUDADevice", _SIM)
        kernelapi = _module(f"{sim}.kernelapi", _SIM)
        for name in ("Dim3", "FakeCUDAModule", "swapped_cuda_module"):
            setattr(self, name, _attr(kernelapi, name, _SIM, owner=f"{sim}.kernelapi"))
        #: The simulator's kernel module: ``FakeCUDAKernel``, and the running kernel's context.
        self.kernel = _module(f"{sim}.kernel", _SIM)
        self.FakeCUDAKernel = _attr(self.kernel, "FakeCUDAKernel", _SIM, owner=f"{sim}.kernel")
        for name in ("_kernel_context", "_push_kernel_context"):
            _attr(self.kernel, name, _SIM, owner=f"{sim}.kernel")
        self.api = _module(f"{sim}.api", _SIM)
        #: ``numba.cuda.cudadrv.driver`` (the simulator's under the simulator): where numba names ``Stream``.
        self.driver = _module("numba.cuda.cudadrv.driver", _SIM)
        self.normalize_kernel_dimensions = _require("numba.cuda.errors", "normalize_kernel_dimensions", _SIM)
        array = self.FakeCUDAArray
        for name in ("copy_to_host", "copy_to_device", "__getitem__", "__setitem__"):
            _attr(array, name, _SIM, owner="FakeCUDAArray")
        for name in ("__call__", "__getitem__"):
            _attr(self.FakeCUDAKernel, name, _SIM, owner="FakeCUDAKernel")


_simulator: SimulatorApi | None = None


def simulator_api() -> SimulatorApi:
    """numba's simulator classes and modules, checked once (:class:`NumbaInternalsError` if any lack)."""
    global _simulator
    if _simulator is None:
        _simulator = SimulatorApi()
    return _simulator


def sim_array_data(array: Any) -> Any:
    """The numpy array a simulator device array (``FakeCUDAArray``) is over (its ``_ary``)."""
    return _attr(array, "_ary", _SIM, owner="FakeCUDAArray")


def sim_in_kernel() -> bool:
    """Whether this thread runs a simulated kernel's code (numba's simulator kernel context is set)."""
    return simulator_api().kernel._kernel_context is not None


def sim_push_kernel_context(module: Any) -> Any:
    """numba's simulator context manager that makes ``module`` the running kernel's fake ``cuda``."""
    return simulator_api().kernel._push_kernel_context(module)


def sim_kernel_is_device(kernel: Any) -> bool:
    """Whether a simulator kernel object is a device function (its ``_device``)."""
    return bool(_attr(kernel, "_device", _SIM, owner="FakeCUDAKernel"))


def sim_kernel_debug(kernel: Any) -> bool:
    """Whether a simulator kernel was compiled with ``debug=True`` (its ``_debug``)."""
    return bool(_attr(kernel, "_debug", _SIM, owner="FakeCUDAKernel"))
