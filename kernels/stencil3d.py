"""3-D seven-point stencil: one explicit heat-equation (or Jacobi) step per launch.

For a grid of shape ``(nz, ny, nx)`` (``x`` contiguous), every interior point
becomes ``w_center * u + w_neighbour * (((below + above) + (south + north)) +
(west + east))``; the six boundary faces are *copied through* from ``src`` to
``dst`` unchanged (fixed boundary values), so buffers can be swapped.

Design
------
The 2-D kernel's register blocking (see :mod:`umem_numba.kernels.stencil2d`)
applied along ``z``: a 2-D block of threads covers an ``x``/``y`` tile, each
thread owns ``planes_per_thread`` consecutive planes at one ``(y, x)`` and
keeps the column above and below it in registers, so every element is loaded
once from DRAM (plus one halo plane per strip).  The ``y`` and ``x``
neighbours are separate loads that hit L1/L2: rows ``y +- 1`` are loaded by
the neighbouring warps of the block.  All loads are issued before the first
store; the hot path uses unsigned indices; strips touching the first or last
plane take a simple per-element path.

The extra neighbour loads, not DRAM, limit it; small grids get fewer planes
per thread and narrower blocks, as in 2-D.  How fast each design step made
it: ``docs/stencil-performance.md``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numba import cuda, uint64

from ._common import (
    MAX_GRID_Y_Z,
    MIN_BLOCKS,
    ceil_div,
    check_pair,
    compile_for_arrays,
    simulating,
    stencil_weights,
)

__all__ = [
    "TUNED_3D",
    "heat3d_kernel",
    "launch_config_3d",
    "heat3d_launch",
    "heat3d_step",
    "heat3d_compile",
]

#: Planes per thread (the register-blocking factor along z) and (x, y) block
#: shape per dtype, tuned on an H200 (docs/stencil-performance.md).
TUNED_3D = {
    np.dtype(np.float32): (8, (64, 2)),
    np.dtype(np.float64): (4, (32, 4)),
}


@functools.lru_cache(maxsize=None)
def heat3d_kernel(planes_per_thread: int = 8) -> Any:
    """The ``@cuda.jit`` seven-point kernel for one register-blocking factor.

    Parameters
    ----------
    planes_per_thread : int
        Planes each thread computes; a compile-time constant (cached per value).

    Returns
    -------
    numba CUDA dispatcher
        ``kernel[grid, block, stream](src, dst, w_center, w_neighbour)`` with
        3-D float arrays of equal shape and dtype and weights of that dtype.
        Use :func:`launch_config_3d` for ``grid`` and ``block``.
    """
    planes = int(planes_per_thread)
    if planes < 1:
        raise ValueError(f"planes_per_thread must be >= 1, got {planes_per_thread}")
    halo = planes + 2

    @cuda.jit
    def heat3d(src, dst, w_center, w_neighbour):
        nz, ny, nx = src.shape
        x = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        y = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y
        z0 = cuda.blockIdx.z * planes
        if x >= nx or y >= ny or z0 >= nz:
            return
        edge = x == 0 or x == nx - 1 or y == 0 or y == ny - 1
        if 0 < z0 and z0 + planes < nz:
            # Hot path: the strip and its halo planes are inside the grid.
            # Edge points read themselves as neighbours (in bounds) and keep u.
            xu = uint64(x)
            yu = uint64(y)
            xw = uint64(x - 1 if x > 0 else x)
            xe = uint64(x + 1 if x < nx - 1 else x)
            ys = uint64(y - 1 if y > 0 else y)
            yn = uint64(y + 1 if y < ny - 1 else y)
            top = uint64(z0 - 1)
            col = cuda.local.array(halo, src.dtype)
            west = cuda.local.array(planes, src.dtype)
            east = cuda.local.array(planes, src.dtype)
            south = cuda.local.array(planes, src.dtype)
            north = cuda.local.array(planes, src.dtype)
            for r in range(halo):
                col[r] = src[top + uint64(r), yu, xu]
            for r in range(planes):
                z = top + uint64(r + 1)
                south[r] = src[z, ys, xu]
                north[r] = src[z, yn, xu]
                west[r] = src[z, yu, xw]
                east[r] = src[z, yu, xe]
            for r in range(planes):
                u = col[r + 1]
                v = w_center * u + w_neighbour * (((col[r] + col[r + 2]) + (south[r] + north[r]))
                                                  + (west[r] + east[r]))
                dst[top + uint64(r + 1), yu, xu] = u if edge else v
        else:
            for z in range(z0, min(z0 + planes, nz)):
                u = src[z, y, x]
                if edge or z == 0 or z == nz - 1:
                    dst[z, y, x] = u
                else:
                    dst[z, y, x] = w_center * u + w_neighbour * (
                        ((src[z - 1, y, x] + src[z + 1, y, x]) + (src[z, y - 1, x] + src[z, y + 1, x]))
                        + (src[z, y, x - 1] + src[z, y, x + 1]))

    return heat3d


def launch_config_3d(shape: tuple[int, int, int], planes_per_thread: int, block: tuple[int, int]
                     ) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Grid and block for :func:`heat3d_kernel` on a grid of ``shape`` ``(nz, ny, nx)``.

    Returns
    -------
    (grid, block) : tuple of 3-tuples
        ``grid`` covers x, y and the strips of ``planes_per_thread`` planes;
        ``block`` is ``(block[0], block[1], 1)``.

    Raises
    ------
    ValueError
        A bad block, or more blocks in y or z than CUDA allows.
    """
    nz, ny, nx = (int(d) for d in shape)
    bx, by = (int(b) for b in block)
    if int(planes_per_thread) < 1:
        raise ValueError(f"planes_per_thread must be >= 1, got {planes_per_thread}")
    if bx < 1 or by < 1 or bx * by > 1024:
        raise ValueError(f"block must be two positive sizes with at most 1024 threads, got {block}")
    grid = (max(ceil_div(nx, bx), 1), max(ceil_div(ny, by), 1), max(ceil_div(nz, planes_per_thread), 1))
    if grid[1] > MAX_GRID_Y_Z or grid[2] > MAX_GRID_Y_Z:
        raise ValueError(f"shape {tuple(shape)} needs a grid of {grid} blocks, more than CUDA's "
                         f"{MAX_GRID_Y_Z} in y or z; use a larger block or more planes per thread")
    return grid, (bx, by, 1)


def heat3d_launch(shape: tuple[int, int, int], dtype: Any, planes_per_thread: int | None = None,
                  block: tuple[int, int] | None = None
                  ) -> tuple[Any, tuple[int, int, int], tuple[int, int, int]]:
    """The kernel, grid and block that :func:`heat3d_step` uses (tuned per dtype, see :data:`TUNED_3D`).

    Parameters
    ----------
    shape : (nz, ny, nx)
        The grid.
    dtype : float32 or float64
        Its element type.
    planes_per_thread, block : optional
        Override the tuned values.  When both are omitted and the tuned
        shape gives fewer than :data:`MIN_BLOCKS` blocks, planes per thread
        are halved (down to 1), then the block width (down to 32).

    Returns
    -------
    (kernel, grid, block)
        The kernel for the chosen planes per thread, and its launch shape.
    """
    dt = np.dtype(dtype)
    if dt not in TUNED_3D:
        raise TypeError(f"the stencils support float32 and float64, not {dt}")
    planes, blk = TUNED_3D[dt]
    planes = planes if planes_per_thread is None else int(planes_per_thread)
    blk = blk if block is None else block
    grid, blk3 = launch_config_3d(shape, planes, blk)
    if planes_per_thread is None and block is None and not simulating():
        while grid[0] * grid[1] * grid[2] < MIN_BLOCKS and (planes > 1 or blk[0] > 32):
            if planes > 1:
                planes //= 2
            else:
                blk = (blk[0] // 2, blk[1])
            grid, blk3 = launch_config_3d(shape, planes, blk)
    return heat3d_kernel(planes), grid, blk3


def heat3d_compile(shape: tuple[int, int, int], dtype: Any, planes_per_thread: int | None = None,
                   block: tuple[int, int] | None = None) -> Any:
    """Compile the kernel :func:`heat3d_step` will launch on this grid, without launching anything.

    Parameters
    ----------
    shape : (nz, ny, nx)
        The grid the steps will run on.
    dtype : float32 or float64
        Its element type.
    planes_per_thread, block : optional
        As for :func:`heat3d_step`.

    Returns
    -------
    numba CUDA dispatcher
        The compiled kernel.
    """
    kernel, _, _ = heat3d_launch(shape, dtype, planes_per_thread, block)
    return compile_for_arrays(kernel, 3, dtype)


def heat3d_step(src: Any, dst: Any, alpha: float = 1.0 / 6.0, *, stream: Any = 0,
                planes_per_thread: int | None = None, block: tuple[int, int] | None = None) -> None:
    """Launch one explicit 3-D heat step ``src -> dst`` (asynchronous).

    Parameters
    ----------
    src, dst : 3-D float32 or float64 arrays
        Same shape and dtype, different memory (device arrays, umem_numba
        buffers, or numpy arrays under the simulator).  The six faces of
        ``src`` are copied to ``dst``.
    alpha : float
        Diffusion number in ``[0, 1/6]``; ``1/6`` is the Jacobi sweep.
    stream : numba stream or 0
        Launch stream.
    planes_per_thread, block : int, tuple of int, optional
        Launch shape (see :func:`heat3d_kernel`); the tuned values for the
        dtype (:data:`TUNED_3D`) when omitted.

    Notes
    -----
    Launched through :func:`umem_numba.launch`, so host access to a buffer
    argument afterwards waits for exactly this launch.
    """
    from umem_numba import launch

    dtype = check_pair(src, dst, 3)
    w_center, w_neighbour = stencil_weights(alpha, 3, dtype)
    if 0 in tuple(src.shape):
        return
    kernel, grid, blk = heat3d_launch(tuple(src.shape), dtype, planes_per_thread, block)
    launch(kernel, grid, blk, src, dst, w_center, w_neighbour, stream=stream)
