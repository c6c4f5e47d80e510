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
    """Set ``out[0] = 0`` (used under the simulator; on a GPU a memset does it)."""
    if cuda.grid(1) == 0:
        out[0] = 0


def _device_address(out: Any) -> int:
    """Device address of ``out``'s first element, without exporting a umem_numba buffer to numba."""
    if hasattr(out, "_coherence_tracker"):  # umem_numba buffer: ``ptr`` is what kernels see
        return int(out.ptr)
    dcp = getattr(out, "device_ctypes_pointer", None)  # numba DeviceNDArray
    if dcp is not None:
        return int(dcp.value or 0)
    cai = getattr(out, "__cuda_array_interface__", None)  # CuPy, PyTorch, ...
    if cai is not None:
        return int(cai["data"][0])
    raise TypeError(f"out must be device memory (a umem_numba buffer or a CUDA array), got {type(out).__name__}")


def _zero_first(out: Any, stream: Any) -> None:
    """``out[0] = 0`` in stream order, with one memset (0.0 is all zero bits)."""
    if simulating():
        from umem_numba import launch

        launch(reset_kernel, 1, 1, out, stream=stream)
        return
    from umem_numba import driver_call, ensure_context, stream_handle

    ensure_context()  # numba's context, as a launch from this thread would make current
    driver_call(
        "cuMemsetD8Async",
        _device_address(out),
        0,
        out.dtype.itemsize,
        stream_handle(stream),
        detail="resetting the max_abs_diff result",
    )


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
        Stream of the reset (a ``cuMemsetD8Async``) and of the reduction, in order.

    Notes
    -----
    The reduction launch goes through :func:`umem_numba.launch`, and comes
    after the reset on the same stream, so ``out.host`` waits for both.  For
    empty grids there is no reduction: the stream is synchronised after the
    reset instead.  Grids with few columns get more row chunks, so the
    reduction still has :data:`MIN_BLOCKS` blocks where the grid has the rows.
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
        if not simulating():  # nothing launched after the memset for .host to wait for
            from umem_numba import driver_call, stream_handle

            driver_call("cuStreamSynchronize", stream_handle(stream), detail="max_abs_diff of empty grids")
        return
    columns = ceil_div(m, REDUCE_BLOCK)
    chunks = ceil_div(n, _ROWS_PER_BLOCK)
    if not simulating():  # occupancy means nothing to the simulator, which runs every block in turn
        chunks = max(chunks, ceil_div(MIN_BLOCKS, columns))
    grid = (columns, max(1, min(chunks, n, 65535)))
    launch(max_abs_diff_kernel, grid, REDUCE_BLOCK, a, b, out, stream=stream)
