"""2-D five-point stencil: one explicit heat-equation (or Jacobi) step per launch.

``dst = w_center * u + w_neighbour * ((north + south) + (west + east))`` on
every interior point; the outermost rows and columns are *copied through*
from ``src`` to ``dst`` unchanged (fixed, Dirichlet boundary values).
Because every element of ``dst`` is written, two buffers can simply be
swapped between steps, and neither needs its boundary set up beforehand
except the first ``src``.

Design
------
A stencil step reads and writes every element once, so it is bound by memory
bandwidth; the aim is the device-to-device copy rate.  The kernel is
register-blocked: each thread owns a column strip of ``rows_per_thread``
consecutive rows at one column ``j``.

* ``threadIdx.x`` runs along the contiguous axis, so each row access of a
  warp is one coalesced 128-byte (float32) transaction.
* All loads of a strip are issued before the first store.  numba cannot tell
  the compiler that ``src`` and ``dst`` do not alias, so in a
  load-compute-store loop every load waits behind the previous store; issuing
  the ``rows + 2`` column values and the ``2 * rows`` west/east values first
  keeps that many loads in flight per thread.  The north/south neighbours come
  from the thread's own registers (each row is loaded once, plus a one-row
  halo above and below the strip); west/east hit L1, since the neighbouring
  lanes load the same lines.
* Index arithmetic is unsigned in the hot path: numba adds a negative-index
  wraparound fix-up to every signed index, and the compiler cannot prove the
  indices non-negative.  Strips that touch the first or last row take a
  plain per-element path instead, so the hot path needs no clamping.
* ``rows_per_thread`` is a compile-time constant (one kernel per value), so
  the loops unroll and the strip lives in registers, not local memory.

Grids too small to give :data:`MIN_BLOCKS` blocks with the tuned shape get
fewer rows per thread, then narrower blocks, so that small problems still
spread over the GPU.  How fast each design step made it:
``docs/stencil-performance.md`` and ``python -m umem_numba bench stencil``.
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
    "TUNED_2D",
    "heat2d_compile",
    "heat2d_kernel",
    "heat2d_launch",
    "heat2d_step",
    "launch_config_2d",
]

#: Rows per thread and block shape per dtype, tuned on an H200 (docs/stencil-performance.md).
#: Both keep 64 bytes of each thread's column in flight: 16 float32 or 8 float64.
TUNED_2D = {
    np.dtype(np.float32): (16, (256, 1)),
    np.dtype(np.float64): (8, (256, 1)),
}


@functools.cache
def heat2d_kernel(rows_per_thread: int = 16) -> Any:
    """The ``@cuda.jit`` five-point kernel for one register-blocking factor.

    Parameters
    ----------
    rows_per_thread : int
        Rows each thread computes; a compile-time constant of the kernel (the
        kernels are cached per value).

    Returns
    -------
    numba CUDA dispatcher
        ``kernel[grid, block, stream](src, dst, w_center, w_neighbour)`` with
        2-D float arrays ``src`` and ``dst`` of equal shape and dtype and the
        weights as scalars of that dtype (see :func:`stencil_weights`).  Use
        :func:`launch_config_2d` for ``grid`` and ``block``; ``block[0]`` may
        be any size, the kernel assumes nothing about how it divides the grid.
    """
    rows = int(rows_per_thread)
    if rows < 1:
        raise ValueError(f"rows_per_thread must be >= 1, got {rows_per_thread}")
    halo = rows + 2  # the strip plus one row above and one below

    @cuda.jit
    def heat2d(src, dst, w_center, w_neighbour):
        n, m = src.shape
        j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        i0 = (cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y) * rows
        if j >= m or i0 >= n:
            return
        edge_col = j == 0 or j == m - 1
        if i0 > 0 and i0 + rows < n:
            # Hot path: the strip and its halo rows are all inside the grid.
            # Edge columns read themselves as west/east (always in bounds) and keep u.
            ju = uint64(j)
            jw = uint64(j - 1 if j > 0 else j)
            je = uint64(j + 1 if j < m - 1 else j)
            top = uint64(i0 - 1)
            col = cuda.local.array(halo, src.dtype)
            west = cuda.local.array(rows, src.dtype)
            east = cuda.local.array(rows, src.dtype)
            for r in range(halo):
                col[r] = src[top + uint64(r), ju]
            for r in range(rows):
                west[r] = src[top + uint64(r + 1), jw]
                east[r] = src[top + uint64(r + 1), je]
            for r in range(rows):
                u = col[r + 1]
                v = w_center * u + w_neighbour * ((col[r] + col[r + 2]) + (west[r] + east[r]))
                dst[top + uint64(r + 1), ju] = u if edge_col else v
        else:
            # First/last strip (or a grid shorter than a strip): per element,
            # with the boundary rows copied through.
            for i in range(i0, min(i0 + rows, n)):
                u = src[i, j]
                if edge_col or i == 0 or i == n - 1:
                    dst[i, j] = u
                else:
                    dst[i, j] = w_center * u + w_neighbour * (
                        (src[i - 1, j] + src[i + 1, j]) + (src[i, j - 1] + src[i, j + 1])
                    )

    return heat2d


def launch_config_2d(
    shape: tuple[int, int], rows_per_thread: int, block: tuple[int, int]
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Grid and block for :func:`heat2d_kernel` on a grid of ``shape``.

    Parameters
    ----------
    shape : (rows, columns)
    rows_per_thread : int
        The kernel's register-blocking factor.
    block : (int, int)
        Threads per block along columns and row strips.

    Returns
    -------
    (grid, block) : tuple of 2-tuples
        ``grid[0]`` covers the columns, ``grid[1]`` the strips of
        ``rows_per_thread`` rows.

    Raises
    ------
    ValueError
        A bad block, or a grid taller than CUDA's 65535 blocks in y allows
        (use more rows per thread or a taller block).
    """
    n, m = (int(d) for d in shape)
    bx, by = (int(b) for b in block)
    if int(rows_per_thread) < 1:
        raise ValueError(f"rows_per_thread must be >= 1, got {rows_per_thread}")
    if bx < 1 or by < 1 or bx * by > 1024:
        raise ValueError(f"block must be two positive sizes with at most 1024 threads, got {block}")
    grid = (max(ceil_div(m, bx), 1), max(ceil_div(ceil_div(n, rows_per_thread), by), 1))
    if grid[1] > MAX_GRID_Y_Z:
        raise ValueError(
            f"{n} rows need {grid[1]} blocks in y, more than CUDA's {MAX_GRID_Y_Z}; raise rows_per_thread or block[1]"
        )
    return grid, (bx, by)


def heat2d_launch(
    shape: tuple[int, int], dtype: Any, rows_per_thread: int | None = None, block: tuple[int, int] | None = None
) -> tuple[Any, tuple[int, int], tuple[int, int]]:
    """The kernel, grid and block that :func:`heat2d_step` uses.

    For code that launches the kernel itself (plain numba launches, benchmarks):
    ``kernel[grid, block, stream](src, dst, *stencil_weights(alpha, 2, dtype))``.

    Parameters
    ----------
    shape : (rows, columns)
        The grid.
    dtype : float32 or float64
        Its element type.
    rows_per_thread, block : optional
        Override the tuned values of :data:`TUNED_2D`.  When both are
        omitted and the tuned shape gives fewer than :data:`MIN_BLOCKS`
        blocks, rows per thread are halved (down to 1), then the block
        width (down to 32), until there are enough blocks.

    Returns
    -------
    (kernel, grid, block)
        The kernel for the chosen rows per thread, and its launch shape.
    """
    dt = np.dtype(dtype)
    if dt not in TUNED_2D:
        raise TypeError(f"the stencils support float32 and float64, not {dt}")
    rows, blk = TUNED_2D[dt]
    rows = rows if rows_per_thread is None else int(rows_per_thread)
    blk = blk if block is None else block
    grid, blk = launch_config_2d(shape, rows, blk)
    if rows_per_thread is None and block is None and not simulating():
        while grid[0] * grid[1] < MIN_BLOCKS and (rows > 1 or blk[0] > 32):
            if rows > 1:
                rows //= 2
            else:
                blk = (blk[0] // 2, blk[1])
            grid, blk = launch_config_2d(shape, rows, blk)
    return heat2d_kernel(rows), grid, blk


def heat2d_compile(
    shape: tuple[int, int], dtype: Any, rows_per_thread: int | None = None, block: tuple[int, int] | None = None
) -> Any:
    """Compile the kernel :func:`heat2d_step` will launch on this grid, without launching anything.

    numba compiles on the first launch; call this before timing a run.  It
    covers C-contiguous arrays in any memory (device arrays, managed, VMM).

    Parameters
    ----------
    shape : (rows, columns)
        The grid the steps will run on (the launch shape depends on it).
    dtype : float32 or float64
        Its element type.
    rows_per_thread, block : optional
        As for :func:`heat2d_step`.

    Returns
    -------
    numba CUDA dispatcher
        The compiled kernel.
    """
    kernel, _, _ = heat2d_launch(shape, dtype, rows_per_thread, block)
    return compile_for_arrays(kernel, 2, dtype)


def heat2d_step(
    src: Any,
    dst: Any,
    alpha: float = 0.25,
    *,
    stream: Any = 0,
    rows_per_thread: int | None = None,
    block: tuple[int, int] | None = None,
) -> None:
    """Launch one explicit heat step ``src -> dst`` (asynchronous).

    Parameters
    ----------
    src, dst : 2-D float32 or float64 arrays
        Device arrays, umem_numba buffers (managed, VMM, mapped pinned) or,
        under numba's simulator, numpy arrays.  Same shape and dtype, not the
        same memory.  The boundary of ``src`` is copied to ``dst``.
    alpha : float
        Diffusion number in ``[0, 0.25]``; ``0.25`` is the Jacobi sweep for
        Laplace's equation (every interior point becomes the mean of its four
        neighbours).
    stream : numba stream or 0
        Launch stream.
    rows_per_thread, block : int, tuple of int, optional
        Launch shape (see :func:`heat2d_kernel`, :func:`launch_config_2d`);
        the tuned values for the dtype (:data:`TUNED_2D`) when omitted.

    Notes
    -----
    Launched through :func:`umem_numba.launch`: host access to a umem_numba
    buffer argument afterwards (``buf.host``) waits for exactly this launch.
    """
    from umem_numba import launch

    dtype = check_pair(src, dst, 2)
    w_center, w_neighbour = stencil_weights(alpha, 2, dtype)
    if 0 in tuple(src.shape):
        return
    kernel, grid, blk = heat2d_launch(tuple(src.shape), dtype, rows_per_thread, block)
    launch(kernel, grid, blk, src, dst, w_center, w_neighbour, stream=stream)
