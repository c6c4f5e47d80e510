"""Helpers shared by the stencil kernels, their launchers and the examples."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = [
    "MAX_GRID_Y_Z",
    "MIN_BLOCKS",
    "SUPPORTED_DTYPES",
    "MemoryBudgetError",
    "ceil_div",
    "check_pair",
    "compile_for_arrays",
    "require_free_memory",
    "simulating",
    "stencil_weights",
]

#: Element types the stencils are written and tested for.
SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

#: CUDA's limit on gridDim.y and gridDim.z.
MAX_GRID_Y_Z = 65535

#: Fewest blocks a default launch aims for: fewer leave most SMs of a large GPU
#: idle (numba-cuda warns below this count, with a NumbaPerformanceWarning).
MIN_BLOCKS = 128

#: Memory left free for the CUDA context, numba's modules and the driver's
#: own bookkeeping when sizing a run against ``cuMemGetInfo``.
_HEADROOM = 256 << 20


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative integers."""
    return -(-a // b)


def simulating() -> bool:
    """True under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``)."""
    from numba import config

    return bool(getattr(config, "ENABLE_CUDASIM", False))


def compile_for_arrays(kernel: Any, ndim: int, dtype: Any) -> Any:
    """Compile a stencil kernel for two C-contiguous arrays and two scalars, without launching it.

    numba compiles a kernel on its first launch; compiling ahead keeps that
    out of a timed run, and needs no throw-away launch on a tiny grid.  A
    C-contiguous array is the same numba type in device, managed or VMM
    memory, so this covers every memory kind.  Under the simulator there is
    nothing to compile.

    Parameters
    ----------
    kernel : numba CUDA dispatcher
        ``kernel(src, dst, w_center, w_neighbour)``.
    ndim : int
        Dimensions of ``src`` and ``dst``.
    dtype : float32 or float64
        Their element type (the weights have the same type).

    Returns
    -------
    numba CUDA dispatcher
        ``kernel``, now holding the compiled overload.
    """
    if simulating() or not hasattr(kernel, "compile"):
        return kernel
    from numba import from_dtype, types  # numba's public names (not numba.core / numba.np)

    scalar = from_dtype(_as_float_dtype(dtype))
    array = types.Array(scalar, ndim, "C")
    kernel.compile((array, array, scalar, scalar))
    return kernel


def _as_float_dtype(dtype: Any) -> np.dtype:
    dt = np.dtype(dtype)
    if dt not in SUPPORTED_DTYPES:
        raise TypeError(f"the stencils support float32 and float64, not {dt}")
    return dt


def stencil_weights(alpha: float, ndim: int, dtype: Any) -> tuple[np.floating, np.floating]:
    """The two weights of one explicit heat step: ``(1 - 2*ndim*alpha, alpha)``.

    A step computes ``w_center * u + w_neighbour * (sum of the 2*ndim neighbours)``.

    Parameters
    ----------
    alpha : float
        Diffusion number ``D * dt / dx**2``.  The explicit scheme is stable for
        ``0 <= alpha <= 1 / (2 * ndim)``; the upper limit is the Jacobi sweep
        (``w_center == 0``: each point becomes the mean of its neighbours).
    ndim : {2, 3}
        Dimensions of the grid.
    dtype : float32 or float64
        The weights are returned as scalars of this type, so that kernels do
        all their arithmetic in the grid's precision.

    Returns
    -------
    (w_center, w_neighbour) : tuple of numpy scalars of ``dtype``

    Raises
    ------
    ValueError
        ``alpha`` outside the stable range, or ``ndim`` not 2 or 3.
    TypeError
        ``dtype`` is not float32 or float64.
    """
    if ndim not in (2, 3):
        raise ValueError(f"ndim must be 2 or 3, got {ndim}")
    dt = _as_float_dtype(dtype)
    limit = 1.0 / (2 * ndim)
    alpha = float(alpha)
    if not (0.0 <= alpha <= limit) or math.isnan(alpha):
        raise ValueError(f"alpha must be in [0, {limit:g}] for a stable {ndim}-D explicit step, got {alpha}")
    # Exactly 0 at the Jacobi limit, where 1 - 2*ndim*alpha would round to a tiny non-zero.
    w_center = 0.0 if alpha == limit else 1.0 - 2 * ndim * alpha
    return dt.type(w_center), dt.type(alpha)


def check_pair(src: Any, dst: Any, ndim: int, *, distinct: bool = True) -> np.dtype:
    """Validate a ``(src, dst)`` pair for a stencil step; return their dtype.

    Works on anything with ``shape`` and ``dtype`` (numpy arrays, numba device
    arrays, umem_numba buffers) and never touches the device.  ``distinct``
    requires different memory (a step must not overwrite what it still reads).
    """
    for name, a in (("src", src), ("dst", dst)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(
                f"{name} must be an array (numpy, numba device array or umem_numba buffer), got {type(a).__name__}"
            )
        if len(a.shape) != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(a.shape)}")
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"src and dst shapes differ: {tuple(src.shape)} vs {tuple(dst.shape)}")
    if np.dtype(src.dtype) != np.dtype(dst.dtype):
        raise TypeError(f"src and dst dtypes differ: {src.dtype} vs {dst.dtype}")
    if distinct and (src is dst or _same_memory(src, dst)):
        raise ValueError(
            "src and dst must be different arrays: a step reads every neighbour of "
            "the old field while writing the new one (swap two buffers instead)"
        )
    return _as_float_dtype(src.dtype)


def _same_memory(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.shares_memory(a, b))
    pa, pb = _address(a), _address(b)
    return pa is not None and pa == pb and pa != 0


def raw_address(buf: Any) -> int:
    """The device address of a umem_numba buffer, for work the caller orders itself (the one untracked read).

    ``buf.ptr`` marks the buffer as shared (it escapes: every later host
    access and launch on it synchronises the devices), which is right for an
    address handed to work umem_numba cannot see, and wrong for the stencils'
    own uses: an identity check, and halo copies ordered by events of their
    own around tracked launches.
    """
    return int(buf._address)


def raw_view(buf: Any) -> Any:
    """A numba device array over a C-contiguous umem_numba buffer's memory, for work the caller orders itself.

    Kernels launched with it are not tracked (the buffer's coherence sees none
    of them): for the stencils' own scratch arrays whose every use is ordered by
    events of their own, such as a band array written on a branch of a CUDA
    graph (a tracked buffer there would be refused).  The view keeps ``buf``
    alive.
    """
    from numba import cuda

    desc = {
        "shape": tuple(buf.shape),
        "strides": None,
        "typestr": np.dtype(buf.dtype).str,
        "data": (raw_address(buf), False),
        "version": 3,
    }
    return cuda.from_cuda_array_interface(desc, owner=buf, sync=False)


def _address(a: Any) -> int | None:
    # umem_numba buffers: the untracked address (an identity check is no device use).
    if hasattr(a, "_coherence_tracker"):
        try:
            return raw_address(a)
        except Exception:
            return None
    dcp = getattr(a, "device_ctypes_pointer", None)  # numba DeviceNDArray
    value = getattr(dcp, "value", None)
    return int(value) if value is not None else None


class MemoryBudgetError(ValueError):
    """A run would need more GPU memory than is free (see :func:`require_free_memory`)."""


def require_free_memory(
    nbytes: int, what: str, *, allow_oversubscribe: bool = False, free: int | None = None, total: int | None = None
) -> tuple[int, int]:
    """Refuse to allocate more than the GPU has free.

    Managed memory can be oversubscribed (the driver evicts pages to the host),
    but a stencil sweeping an oversubscribed grid thrashes the page fault
    engine and can stall the GPU for a very long time, so the examples and the
    benchmark check first.

    Parameters
    ----------
    nbytes : int
        Bytes the run will allocate in total.
    what : str
        What is being sized, for the message (``"2 grids of 8192x8192 float32"``).
    allow_oversubscribe : bool
        Skip the refusal (the caller's ``--allow-oversubscribe`` flag).
    free, total : int, optional
        ``cuMemGetInfo`` numbers; queried from the current device when omitted.

    Returns
    -------
    (free, total) : tuple of int

    Raises
    ------
    MemoryBudgetError
        ``nbytes`` does not fit in free memory less a 256 MiB reserve, and
        oversubscription was not allowed.
    """
    if free is None or total is None:
        from umem_numba import mem_info

        free, total = mem_info()
    budget = max(free - _HEADROOM, 0)
    if nbytes > budget and not allow_oversubscribe:
        raise MemoryBudgetError(
            f"{what} need {_gib(nbytes)} but the GPU has {_gib(free)} free of {_gib(total)} "
            f"(keeping {_gib(_HEADROOM)} in reserve). Use a smaller --size, or pass "
            "--allow-oversubscribe to run anyway (managed memory then pages to the host and the run "
            "can take very long or stall the GPU)."
        )
    return free, total


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
