"""Calling a compiled numba kernel straight through ``cuLaunchKernel``.

numba-cuda's launch types every argument, marshals each through Python and
hands the list to cuda.core: tens of microseconds per launch, and more per
array argument.  For a kernel already compiled for the argument types at
hand, everything but the values is fixed: the function handle on the current
device, the parameter layout, and each buffer's ``(pointer, shape, strides)``
block (:func:`umem_numba._numba_compat.kernel_array_params`, cached on the
buffer).  A :class:`KernelCall` keeps those per (launch configuration,
argument types, device) and packs the values into one preallocated block
with a single ``struct.pack_into`` per launch.

The parameter layout is numba-cuda's (``_Kernel._prepare_args``): an array
argument is ``meminfo, parent, nitems, itemsize, data, *shape, *strides``,
each one 8-byte kernel parameter; a scalar is one parameter of its own size.
Only what that layout covers takes this path (umem_numba buffers and real or
integer scalars); everything else goes through numba, as do kernels with
launch extensions, debug or cooperative launches, or a launch-configuration
sensitive compilation (:func:`supports`).  The layout, the compiled kernel's
function handle and those flags are numba internals, read through
:mod:`umem_numba._numba_compat` only.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from typing import Any

import numpy as np

from .. import _driver, _numba_compat

__all__ = ["KernelCall", "scalar_type", "supports"]

#: struct codes of the scalar kernel parameters numba passes by value.
_SCALAR_CODES = {
    "int8": "b",
    "uint8": "B",
    "int16": "h",
    "uint16": "H",
    "int32": "i",
    "uint32": "I",
    "int64": "q",
    "uint64": "Q",
    "float16": "e",
    "float32": "f",
    "float64": "d",
    "bool": "?",
}

#: Python type -> numba type of a scalar argument (filled on first use).
_SCALAR_TYPES: dict[type, Any] = {}
#: numba type -> struct code, for the scalar types above.
_CODES: dict[Any, str] = {}


def _load_scalar_types() -> None:
    for name, code in _SCALAR_CODES.items():
        nbtype = _numba_compat.scalar_type(np.dtype(name))
        _CODES[nbtype] = code
        _SCALAR_TYPES[np.dtype(name).type] = nbtype
    # What numba's typeof gives plain Python scalars (an int beyond int64
    # fails to pack and the launch goes through numba instead).
    _SCALAR_TYPES.update(_numba_compat.python_scalar_types())


def scalar_type(value: Any) -> Any:
    """The numba type a scalar argument is passed as, or ``None`` (not on this path)."""
    if not _SCALAR_TYPES:
        _load_scalar_types()
    return _SCALAR_TYPES.get(type(value))


def supports(dispatcher: Any, kernel: Any) -> bool:
    """Whether launches of ``kernel`` (compiled by ``dispatcher``) can bypass numba's launch.

    Kernels that numba launches with extra work are left to numba: launch
    extensions (``prepare_args`` hooks), debug kernels (exception read-back),
    cooperative launches, and kernels compiled per launch configuration
    (:func:`umem_numba._numba_compat.direct_launch_allowed`).
    """
    return _numba_compat.direct_launch_allowed(dispatcher, kernel)


class KernelCall:
    """One compiled kernel, launch configuration and device: packed parameters, one driver call.

    Parameters
    ----------
    kernel : numba ``_Kernel``
        The overload compiled for ``argtypes``.
    argtypes : tuple of numba types
        The argument types, arrays and scalars only.
    griddim, blockdim : tuple of 3 ints
        numba's normalised launch dimensions.
    sharedmem : int
        Dynamic shared memory in bytes.
    """

    __slots__ = ("_addr", "_dims", "_func", "_launch", "_lock", "_pointers", "_struct", "_values")

    def __init__(
        self,
        kernel: Any,
        argtypes: tuple[Any, ...],
        griddim: tuple[int, int, int],
        blockdim: tuple[int, int, int],
        sharedmem: int,
    ) -> None:
        codes = []
        for t in argtypes:
            if _numba_compat.is_array_type(t):
                codes += ["q"] * _numba_compat.array_param_count(t)
            else:
                codes.append(_CODES[t])
        # Every parameter in its own 8-byte slot: the driver copies each from its pointer.
        fmt = "<" + "".join(f"{c}{8 - struct.calcsize('<' + c)}x" if c != "q" else c for c in codes)
        self._struct = struct.Struct(fmt)
        self._values = (ctypes.c_char * max(self._struct.size, 8))()
        base = ctypes.addressof(self._values)
        self._pointers = (ctypes.c_void_p * max(len(codes), 1))(*[base + 8 * i for i in range(len(codes))])
        self._addr = ctypes.addressof(self._pointers)
        handle = _numba_compat.kernel_function_handle(kernel)  # loaded on this device, set up
        # A CUkernel handle is accepted wherever a CUfunction is (CUDA 12+).
        drv = _driver.api().drv
        self._func = drv.CUfunction(int(handle))
        self._launch = drv.cuLaunchKernel
        self._dims = (*griddim, *blockdim, int(sharedmem))
        self._lock = threading.Lock()  # the value block is shared: pack and launch as one step

    def launch(self, values: list[Any], stream: int) -> int:
        """Pack ``values`` (flattened parameters) and launch on ``stream``; the driver's error code.

        Raises
        ------
        struct.error
            A value does not fit its parameter (the caller then lets numba launch).
        """
        gx, gy, gz, bx, by, bz, shm = self._dims
        with self._lock:
            self._struct.pack_into(self._values, 0, *values)
            return int(self._launch(self._func, gx, gy, gz, bx, by, bz, shm, stream, self._addr, 0)[0])
