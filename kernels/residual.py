"""Convergence check for iterative solvers: ``max |a - b|`` over two 2-D grids, on the device.

The result lands in a one-element array (a managed buffer, typically), so the
host can read it without copying the grids back; with umem_numba's coherence
checks, reading ``out.host[0]`` waits for exactly the reduction's launch.
"""

from __future__ import annotations

from typing import Any

from numba import cuda

from ._common import MIN_BLOCKS, ceil_div, check_pair, simulating

__all__ = ["REDUCE_BLOCK", "max_abs_diff", "max_abs_diff_kernel", "reset_kernel"]

#: Threads per block of the reduction (a power of two: the tree halves it).
REDUCE_BLOCK = 256
#: Rows each block column reduces before combining: enough work per block that
#: the one atomic per block is negligible.
_ROWS_PER_BLOCK = 64


@cuda.jit
def reset_kernel(out):
    """Set ``out[0] = 0`` (the reset before a reduction into ``out``)."""
    if cuda.grid(1) == 0:
        out[0] = 0


def _zero_first(out: Any, stream: Any) -> None:
    """``out[0] = 0`` in stream order: a one-thread tracked launch, so ``out.host`` waits for it.

    A memset through the raw address would be work the coherence tracker
    cannot see (and ``out.ptr`` would make the buffer escape).
    """
    from umem_numba import launch

    launch(reset_kernel, 1, 1, out, stream=stream)


@cuda.jit
def max_abs_diff_kernel(a, b, out):
    """Fold ``max |a - b|`` into ``out[0]`` (``out`` must start at 0 or below the answer).

    Launch with 1-D blocks of :data:`REDUCE_BLOCK` threads and a 2-D grid:
    ``grid[0]`` covers the columns, ``grid[1]`` the rows in chunks.
    """
    n, m = a.shape
    tid = cuda.threadIdx.x
    j = cuda.blockIdx.x * REDUCE_BLOCK + tid
    acc = abs(a[0, 0] - a[0, 0])  # zero of the array's dtype
    if j < m:
        for i in range(cuda.blockIdx.y, n, cuda.gridDim.y):
            d = abs(a[i, j] - b[i, j])
            # the same comparison as the tree reduction below (a NaN never replaces acc),
            # not max(), whose lowering on the device is numba-cuda's to choose
            if d > acc:  # noqa: PLR1730
                acc = d
    # Tree reduction in shared memory, then one atomic per block.
    partial = cuda.shared.array(REDUCE_BLOCK, a.dtype)
    partial[tid] = acc
    cuda.syncthreads()
    width = REDUCE_BLOCK // 2
    while width > 0:
        if tid < width and partial[tid + width] > partial[tid]:
            partial[tid] = partial[tid + width]
        cuda.syncthreads()
        width //= 2
    if tid == 0:
        cuda.atomic.max(out, 0, partial[0])


def max_abs_diff(a: Any, b: Any, out: Any, *, stream: Any = 0) -> None:
    """Launch ``out[0] = max |a - b|`` (asynchronous; resets ``out`` first, on the device).

    Parameters
    ----------
    a, b : 2-D float32 or float64 arrays
        Same shape and dtype (device arrays, umem_numba buffers, or numpy
        arrays under the simulator).
    out : 1-element array of the same dtype
        Receives the maximum; a :class:`umem_numba.ManagedBuffer` lets the host
        read it with ``out.host[0]``, which waits for this launch only.
    stream : numba stream or 0
        Stream of the reset (a one-thread launch) and of the reduction, in order.

    Notes
    -----
    The reset and the reduction go through :func:`umem_numba.launch`, in
    that order on the same stream, so ``out.host`` waits for both.  For
    empty grids there is no reduction: ``out`` holds the reset's 0.  Grids
    with few columns get more row chunks, so the reduction still has
    :data:`MIN_BLOCKS` blocks where the grid has the rows.
    """
    from umem_numba import launch

    dtype = check_pair(a, b, 2, distinct=False)
    if tuple(getattr(out, "shape", ())) != (1,) or out.dtype != dtype:
        raise ValueError(
            f"out must be a 1-element {dtype} array, got {getattr(out, 'shape', None)} {getattr(out, 'dtype', None)}"
        )
    n, m = (int(d) for d in a.shape)
    _zero_first(out, stream)
    if n == 0 or m == 0:
        return  # out holds the reset's 0, which host access waits for
    columns = ceil_div(m, REDUCE_BLOCK)
    chunks = ceil_div(n, _ROWS_PER_BLOCK)
    if not simulating():  # occupancy means nothing to the simulator, which runs every block in turn
        chunks = max(chunks, ceil_div(MIN_BLOCKS, columns))
    grid = (columns, max(1, min(chunks, n, 65535)))
    launch(max_abs_diff_kernel, grid, REDUCE_BLOCK, a, b, out, stream=stream)
