# numba's examples as numba documents them: its argument names (A, B, C), its upper-case locals
# (N, TPB, X, Y, Z) and its zip() stay.
# ruff: noqa: N803, N806, B905
"""numba-cuda's documented examples, with numba's allocation calls mapped to one kind of memory.

One copy of each example, shared by ``python -m umem_numba bench e2e`` (which times them end to
end) and ``tests/examples/test_numba_doc_examples.py`` (which checks every kind bitwise against
numba's own results).

The examples are numba-cuda's (0.30.4: ``numba/cuda/tests/doc_examples/test_*.py``, the source of
its documentation), with their kernels, launches and reads as numba documents them.  Only the
allocation lines change: ``cuda.to_device(x)`` becomes ``mem.to_device(x)``,
``cuda.device_array(...)`` ``mem.device_array(...)``, ``cuda.device_array_like(a)``
``mem.device_array_like(a)`` and ``create_xoroshiro128p_states(n, seed)``
``mem.create_xoroshiro128p_states(n, seed)``, where ``mem`` is a :class:`Mem`: :data:`NUMBA`
(numba's own calls), or one of :data:`MEMS` (managed, device, pinned-mapped, VMM), or
:func:`pooled_mem` (managed or device from a :class:`~umem_numba.MemoryPool`).

Three more changes, none to a kernel:

* each example takes its size as an argument whose default is numba's documented size (the
  simulator needs small ones; the benchmark uses larger ones where the documented size is
  trivially short, such as matmul's 4 x 4 matrices);
* the kernels of the examples the benchmark times (vecadd, matmul, laplace, montecarlo,
  random_3d) are made once per process (:func:`functools.cache`d factories), as a program that
  defines them at module level has them: numba compiles a kernel per ``@cuda.jit`` object, so
  redefining it inside the example would time numba's compiler on every run;
* each example returns what it read on the host (a dict of numpy arrays or values), and a few
  read one more array than numba's text does (``a`` of reduction, ``buf_0`` of laplace, the RNG
  states of random_3d), so that the comparison covers every buffer the kernels wrote.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from numba import cuda

import umem_numba as um

__all__ = [
    "EXAMPLES",
    "MEMS",
    "NUMBA",
    "Mem",
    "bitwise_equal",
    "compare_results",
    "cpu_gpu_compat",
    "globals_constant_capture",
    "globals_device_array_capture",
    "laplace",
    "matmul",
    "montecarlo",
    "pooled_mem",
    "random_3d",
    "reduction",
    "vecadd",
]


class Mem:
    """numba's allocation calls, onto one kind of memory.

    Parameters
    ----------
    to_device, device_array, device_array_like : callable
        What ``cuda.to_device``, ``cuda.device_array`` and ``cuda.device_array_like`` become.
    create_xoroshiro128p_states : callable, optional
        What numba's ``create_xoroshiro128p_states(n, seed)`` becomes; default:
        ``device_array(n, xoroshiro128p_dtype)`` then numba's ``init_xoroshiro128p_states``
        (what numba's own does with ``cuda.device_array``).
    """

    def __init__(
        self,
        to_device: Callable[..., Any],
        device_array: Callable[..., Any],
        device_array_like: Callable[..., Any],
        create_xoroshiro128p_states: Callable[..., Any] | None = None,
    ) -> None:
        self.to_device = to_device
        self.device_array = device_array
        self.device_array_like = device_array_like
        if create_xoroshiro128p_states is not None:
            self.create_xoroshiro128p_states = create_xoroshiro128p_states  # type: ignore[method-assign]

    def create_xoroshiro128p_states(self, n: int, seed: int) -> Any:
        """``n`` xoroshiro128+ states seeded with ``seed`` in this kind of memory (numba's initialiser)."""
        # numba.cuda.random is imported where it is used, as numba's examples do (importing it
        # compiles its CPU initialiser, with numba's warnings under the simulator)
        from numba.cuda.random import init_xoroshiro128p_states, xoroshiro128p_dtype

        states = self.device_array(n, dtype=xoroshiro128p_dtype)
        init_xoroshiro128p_states(states, seed)
        return states


def _numbas_create_xoroshiro128p_states(n: int, seed: int) -> Any:
    from numba.cuda.random import create_xoroshiro128p_states

    return create_xoroshiro128p_states(n, seed=seed)


def _pinned_empty(shape: Any, dtype: Any = np.float64) -> um.PinnedBuffer:
    return um.PinnedBuffer.empty(shape, dtype, um.HostAllocFlags.DEVICEMAP)


#: numba's own calls: the reference every other kind is compared with.
NUMBA = Mem(cuda.to_device, cuda.device_array, cuda.device_array_like, _numbas_create_xoroshiro128p_states)

#: One :class:`Mem` per umem_numba memory kind.  ``"managed"`` (``um.managed_from``,
#: ``um.managed_empty``, ``um.managed_like``) is umem_numba's default for numba users.
MEMS = {
    "managed": Mem(um.managed_from, um.managed_empty, um.managed_like),
    "device": Mem(um.device_from, um.device_empty, um.device_like),
    "pinned-mapped": Mem(
        lambda a: um.PinnedBuffer.from_array(a, um.HostAllocFlags.DEVICEMAP),
        _pinned_empty,
        lambda a: _pinned_empty(a.shape, a.dtype),
    ),
    "vmm": Mem(um.VMMBuffer.from_array, um.VMMBuffer.empty, lambda a: um.VMMBuffer.empty(a.shape, a.dtype)),
}


def pooled_mem(kind: str, pool: um.MemoryPool) -> Mem:
    """The managed or device shortcuts of :data:`MEMS`, each allocating from ``pool`` (``pool=pool``).

    Parameters
    ----------
    kind : {"managed", "device"}
        The shortcuts: ``um.managed_from`` / ``managed_empty`` / ``managed_like`` or
        ``um.device_from`` / ``device_empty`` / ``device_like``.
    pool : MemoryPool
        A pool of that kind.

    Raises
    ------
    ValueError
        ``kind`` is neither ``"managed"`` nor ``"device"``.
    """
    shortcuts: dict[str, tuple[Callable[..., Any], ...]] = {
        "managed": (um.managed_from, um.managed_empty, um.managed_like),
        "device": (um.device_from, um.device_empty, um.device_like),
    }
    if kind not in shortcuts:
        raise ValueError(f"pooled_mem: kind must be 'managed' or 'device', got {kind!r}")
    return Mem(*(functools.partial(call, pool=pool) for call in shortcuts[kind]))


def bitwise_equal(ours: Any, theirs: Any, what: str) -> None:
    """Same dtype, shape and bytes (NaNs and signed zeros included), compared in chunks (1.8 GB arrays).

    Raises
    ------
    AssertionError
        Naming ``what`` and the first element that differs (raised, not asserted: it holds under
        ``python -O`` too, where a benchmark must not time a wrong answer).
    """
    a, b = np.ascontiguousarray(ours), np.ascontiguousarray(theirs)
    if (a.dtype, a.shape) != (b.dtype, b.shape):
        raise AssertionError(f"{what}: {a.dtype} {a.shape} vs numba's {b.dtype} {b.shape}")
    word = f"u{a.itemsize}" if a.itemsize in (1, 2, 4, 8) and not a.dtype.fields else "u1"
    x, y = a.reshape(-1).view(word), b.reshape(-1).view(word)
    step = 1 << 24
    for start in range(0, x.size, step):
        differ = np.flatnonzero(x[start : start + step] != y[start : start + step])
        if differ.size:
            raise AssertionError(
                f"{what}: not bitwise equal to numba's result at flat element {start + differ[0]} "
                f"({a.reshape(-1)[start + differ[0]]!r} vs {b.reshape(-1)[start + differ[0]]!r})"
            )


def compare_results(ours: dict[str, Any], theirs: dict[str, Any], what: str) -> None:
    """Every result of an example bitwise equal to numba's (:func:`bitwise_equal`), the same keys.

    Raises
    ------
    AssertionError
        Naming ``what`` (the example and the memory) and the result that differs.
    """
    if ours.keys() != theirs.keys():
        raise AssertionError(f"{what}: results {sorted(ours)} vs numba's {sorted(theirs)}")
    for key, value in theirs.items():
        bitwise_equal(ours[key], value, f"{what}, {key}")


# -- the examples -----------------------------------------------------------------------------


@functools.cache
def _vecadd_kernel() -> Any:
    @cuda.jit
    def f(a, b, c):
        # like threadIdx.x + (blockIdx.x * blockDim.x)
        tid = cuda.grid(1)
        size = len(c)

        if tid < size:
            c[tid] = a[tid] + b[tid]

    return f


def vecadd(mem: Mem, N: int = 100000) -> dict[str, Any]:
    """numba-cuda docs: "A simple example: vector addition" (test_vecadd.py); ``N`` elements."""
    f = _vecadd_kernel()

    # Seed RNG for test repeatability
    np.random.seed(1)

    a = mem.to_device(np.random.random(N))
    b = mem.to_device(np.random.random(N))
    c = mem.device_array_like(a)

    f.forall(len(a))(a, b, c)
    forall = c.copy_to_host()
    print(forall)

    # Enough threads per block for several warps per block
    nthreads = 256
    # Enough blocks to cover the entire vector depending on its length
    nblocks = (len(a) // nthreads) + 1
    f[nblocks, nthreads](a, b, c)
    launched = c.copy_to_host()
    print(launched)

    np.testing.assert_equal(c.copy_to_host(), a.copy_to_host() + b.copy_to_host())
    return {"forall": forall, "launch": launched}


@functools.cache
def _matmul_kernels() -> tuple[Any, Any, int]:
    from numba.cuda import float32

    @cuda.jit
    def matmul(A, B, C):
        """Perform square matrix multiplication of C = A * B."""
        i, j = cuda.grid(2)
        if i < C.shape[0] and j < C.shape[1]:
            tmp = 0.0
            for k in range(A.shape[1]):
                tmp += A[i, k] * B[k, j]
            C[i, j] = tmp

    # Controls threads per block and shared memory usage.
    # The computation will be done on blocks of TPBxTPB elements.
    # TPB should not be larger than 32 in this example
    TPB = 16

    @cuda.jit
    def fast_matmul(A, B, C):
        """
        Perform matrix multiplication of C = A * B using CUDA shared memory.

        Reference: https://stackoverflow.com/a/64198479/13697228 by @RobertCrovella
        """
        # Define an array in the shared memory
        # The size and type of the arrays must be known at compile time
        sA = cuda.shared.array(shape=(TPB, TPB), dtype=float32)
        sB = cuda.shared.array(shape=(TPB, TPB), dtype=float32)

        x, y = cuda.grid(2)

        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        bpg = cuda.gridDim.x  # blocks per grid

        # Each thread computes one element in the result matrix.
        # The dot product is chunked into dot products of TPB-long vectors.
        tmp = float32(0.0)
        for i in range(bpg):
            # Preload data into shared memory
            sA[ty, tx] = 0
            sB[ty, tx] = 0
            if y < A.shape[0] and (tx + i * TPB) < A.shape[1]:
                sA[ty, tx] = A[y, tx + i * TPB]
            if x < B.shape[1] and (ty + i * TPB) < B.shape[0]:
                sB[ty, tx] = B[ty + i * TPB, x]

            # Wait until all threads finish preloading
            cuda.syncthreads()

            # Computes partial product on the shared memory
            for j in range(TPB):
                tmp += sA[ty, j] * sB[j, tx]

            # Wait until all threads finish computing
            cuda.syncthreads()
        if y < C.shape[0] and x < C.shape[1]:
            C[y, x] = tmp

    return matmul, fast_matmul, TPB


def matmul(mem: Mem, n: int = 4, nonsquare: tuple[int, int, int] = (5, 23, 7)) -> dict[str, Any]:
    """numba-cuda docs: "Matrix multiplication" (test_matmul.py), the plain and the shared-memory kernels.

    ``n``: the square matrices' size (numba's 4); ``nonsquare``: ``(M, K, N)`` of the non-square
    case, an ``M x K`` times a ``K x N`` matrix (numba's 5 x 23 times 23 x 7).  The example checks
    ``fast_matmul``'s float32 sums exactly: they are exact while every sum stays below 2**24
    (``n`` <= 256, ``M * K * K`` < 2**24).
    """
    matmul, fast_matmul, TPB = _matmul_kernels()

    results = {}
    x_h = np.arange(n * n).reshape([n, n])
    y_h = np.ones([n, n])
    z_h = np.zeros([n, n])

    x_d = mem.to_device(x_h)
    y_d = mem.to_device(y_h)
    z_d = mem.to_device(z_h)

    threadsperblock = (16, 16)
    blockspergrid_x = math.ceil(z_h.shape[0] / threadsperblock[0])
    blockspergrid_y = math.ceil(z_h.shape[1] / threadsperblock[1])
    blockspergrid = (blockspergrid_x, blockspergrid_y)

    matmul[blockspergrid, threadsperblock](x_d, y_d, z_d)
    z_h = z_d.copy_to_host()
    print(z_h)
    print(x_h @ y_h)
    results["matmul"] = z_h

    x_h = np.arange(n * n).reshape([n, n])
    y_h = np.ones([n, n])
    z_h = np.zeros([n, n])

    x_d = mem.to_device(x_h)
    y_d = mem.to_device(y_h)
    z_d = mem.to_device(z_h)

    threadsperblock = (TPB, TPB)
    blockspergrid_x = math.ceil(z_h.shape[0] / threadsperblock[0])
    blockspergrid_y = math.ceil(z_h.shape[1] / threadsperblock[1])
    blockspergrid = (blockspergrid_x, blockspergrid_y)

    fast_matmul[blockspergrid, threadsperblock](x_d, y_d, z_d)
    z_h = z_d.copy_to_host()
    print(z_h)
    print(x_h @ y_h)
    assert np.all(z_h == x_h @ y_h), "fast_matmul incorrect for shared memory, square case."
    results["fast_matmul"] = z_h

    M, K, N = nonsquare
    x_h = np.arange(M * K).reshape([M, K])
    y_h = np.ones([K, N])
    z_h = np.zeros([M, N])

    x_d = mem.to_device(x_h)
    y_d = mem.to_device(y_h)
    z_d = mem.to_device(z_h)

    threadsperblock = (TPB, TPB)
    # (mypy: numpy's stubs give x_h, the first time reshaped, a 0-d shape)
    grid_y_max = max(x_h.shape[0], y_h.shape[0])  # type: ignore[misc]
    grid_x_max = max(x_h.shape[1], y_h.shape[1])  # type: ignore[misc]
    blockspergrid_x = math.ceil(grid_x_max / threadsperblock[0])
    blockspergrid_y = math.ceil(grid_y_max / threadsperblock[1])
    blockspergrid = (blockspergrid_x, blockspergrid_y)

    fast_matmul[blockspergrid, threadsperblock](x_d, y_d, z_d)
    z_h = z_d.copy_to_host()
    print(z_h)
    print(x_h @ y_h)
    assert np.all(z_h == x_h @ y_h), "fast_matmul incorrect for shared memory, non-square case."
    results["fast_matmul_nonsquare"] = z_h
    return results


def reduction(mem: Mem, n: int = 1024) -> dict[str, Any]:
    """numba-cuda docs: "Shared memory reduction" (test_reduction.py); ``a[0]`` is a value.

    ``n`` <= 1024 elements (one block); the kernel is made per call, as its shared array's size
    is ``len(a)``.
    """
    from numba.cuda.types import int32

    # generate data
    a = mem.to_device(np.arange(n))
    nelem = len(a)

    @cuda.jit
    def array_sum(data):
        tid = cuda.threadIdx.x
        size = len(data)
        if tid < size:
            i = cuda.grid(1)

            # Declare an array in shared memory
            shr = cuda.shared.array(nelem, int32)
            shr[tid] = data[i]

            # Ensure writes to shared memory are visible
            # to all threads before reducing
            cuda.syncthreads()

            s = 1
            while s < cuda.blockDim.x:
                if tid % (2 * s) == 0:
                    # Stride by `s` and add
                    shr[tid] += shr[tid + s]
                s *= 2
                cuda.syncthreads()

            # After the loop, the zeroth  element contains the sum
            if tid == 0:
                data[tid] = shr[tid]

    array_sum[1, nelem](a)
    print(a[0])  # 523776
    print(sum(np.arange(nelem)))  # 523776

    np.testing.assert_equal(a[0], sum(np.arange(nelem)))
    return {"a[0]": a[0], "a": a.copy_to_host()}


@functools.cache
def _laplace_kernel() -> Any:
    @cuda.jit
    def solve_heat_equation(buf_0, buf_1, timesteps, k):
        i = cuda.grid(1)

        # Don't continue if our index is outside the domain
        if i >= len(buf_0):
            return

        # Prepare to do a grid-wide synchronization later
        grid = cuda.cg.this_grid()

        for step in range(timesteps):
            # Select the buffer from the previous timestep
            if (step % 2) == 0:
                data = buf_0
                next_data = buf_1
            else:
                data = buf_1
                next_data = buf_0

            # Get the current temperature associated with this point
            curr_temp = data[i]

            # Apply formula from finite difference equation
            if i == 0:
                # Left wall is held at T = 0
                next_temp = curr_temp + k * (data[i + 1] - (2 * curr_temp))
            elif i == len(data) - 1:
                # Right wall is held at T = 0
                next_temp = curr_temp + k * (data[i - 1] - (2 * curr_temp))
            else:
                # Interior points are a weighted average of their neighbors
                next_temp = curr_temp + k * (data[i - 1] - (2 * curr_temp) + data[i + 1])

            # Write new value to the next buffer
            next_data[i] = next_temp

            # Wait for every thread to write before moving on
            grid.sync()

    return solve_heat_equation


def laplace(mem: Mem, size: int = 1001, niter: int = 10000) -> dict[str, Any]:
    """numba-cuda docs: "1D heat equation" with a grid-wide sync (test_laplace.py); ``size`` points
    (odd, numba's 1001), ``niter`` steps (numba's 10000)."""
    solve_heat_equation = _laplace_kernel()

    # Use an odd problem size.
    # This is so there can be an element truly in the "middle" for symmetry.
    data = np.zeros(size)

    # Middle element is made very hot
    data[size // 2] = 10000
    buf_0 = mem.to_device(data)

    # This extra array is used for synchronization purposes
    buf_1 = mem.device_array_like(buf_0)

    solve_heat_equation.forall(len(data))(buf_0, buf_1, niter, 0.25)

    results = buf_1.copy_to_host()
    np.testing.assert_allclose(results.sum(), 10000)
    return {"buf_1": results, "buf_0": buf_0.copy_to_host()}


@functools.cache
def _montecarlo_kernels() -> tuple[Any, Any]:
    from numba.cuda.random import xoroshiro128p_uniform_float32

    @cuda.jit
    def mc_integrator_kernel(out, rng_states, lower_lim, upper_lim):
        """
        kernel to draw random samples and evaluate the function to
        be integrated at those sample values
        """
        size = len(out)

        gid = cuda.grid(1)
        if gid < size:
            # draw a sample between 0 and 1 on this thread
            samp = xoroshiro128p_uniform_float32(rng_states, gid)

            # normalize this sample to the limit range
            samp = samp * (upper_lim - lower_lim) + lower_lim

            # evaluate the function to be
            # integrated at the normalized
            # value of the sample
            y = func(samp)
            out[gid] = y

    @cuda.reduce
    def sum_reduce(a, b):
        return a + b

    # define a function to integrate
    @numba.jit
    def func(x):
        return 1.0 / x

    return mc_integrator_kernel, sum_reduce


def montecarlo(mem: Mem, nsamps: int = 1000000) -> dict[str, Any]:
    """numba-cuda docs: "Monte Carlo integration" (test_montecarlo.py): numba's RNG states and
    ``cuda.reduce`` on the buffers; ``nsamps`` samples (numba's 1000000: "number of samples,
    higher will lead to a more accurate answer")."""
    mc_integrator_kernel, sum_reduce = _montecarlo_kernels()

    def mc_integrate(lower_lim, upper_lim, nsamps):
        """
        approximate the definite integral of `func` from
        `lower_lim` to `upper_lim`
        """
        out = mem.to_device(np.zeros(nsamps, dtype="float32"))
        rng_states = mem.create_xoroshiro128p_states(nsamps, seed=42)

        # jit the function for use in CUDA kernels

        mc_integrator_kernel.forall(nsamps)(out, rng_states, lower_lim, upper_lim)
        # normalization factor to convert
        # to the average: (b - a)/(N - 1)
        factor = (upper_lim - lower_lim) / (nsamps - 1)

        return sum_reduce(out) * factor

    first = mc_integrate(1, 2, nsamps)  # array(0.6929643, dtype=float32)
    second = mc_integrate(2, 3, nsamps)  # array(0.4054021, dtype=float32)

    if nsamps >= 1000000:  # the documented accuracy needs the documented number of samples
        np.testing.assert_allclose(mc_integrate(1, 2, nsamps), 0.69315, atol=0.001)
        np.testing.assert_allclose(mc_integrate(2, 3, nsamps), 0.4055, atol=0.001)
    return {"[1, 2]": first, "[2, 3]": second}


@functools.cache
def _random_3d_kernel() -> Any:
    from numba.cuda.random import xoroshiro128p_uniform_float32

    @cuda.jit
    def random_3d(arr, rng_states):
        # Per-dimension thread indices and strides
        startx, starty, startz = cuda.grid(3)
        stridex, stridey, stridez = cuda.gridsize(3)

        # Linearized thread index
        tid = (startz * stridey * stridex) + (starty * stridex) + startx

        # Use strided loops over the array to assign a random value to each entry
        for i in range(startz, arr.shape[0], stridez):
            for j in range(starty, arr.shape[1], stridey):
                for k in range(startx, arr.shape[2], stridex):
                    arr[i, j, k] = xoroshiro128p_uniform_float32(rng_states, tid)

    return random_3d


def random_3d(
    mem: Mem,
    shape: tuple[int, int, int] = (701, 900, 719),
    block: tuple[int, int, int] = (8, 8, 8),
    grid: tuple[int, int, int] = (16, 16, 16),
) -> dict[str, Any]:
    """numba-cuda docs: "Random number generation", the 3-D grid example (test_random.py); the
    array's ``shape`` and the launch's ``block`` and ``grid`` (numba's 701 x 900 x 719, 8**3, 16**3)."""
    random_3d = _random_3d_kernel()

    # Array dimensions
    X, Y, Z = shape

    # Block and grid dimensions
    bx, by, bz = block
    gx, gy, gz = grid

    # Total number of threads
    nthreads = bx * by * bz * gx * gy * gz

    # Initialize a state for each thread
    rng_states = mem.create_xoroshiro128p_states(nthreads, seed=1)

    # Generate random numbers
    arr = mem.device_array((X, Y, Z), dtype=np.float32)
    random_3d[(gx, gy, gz), (bx, by, bz)](arr, rng_states)

    # Some basic tests of the randomly-generated numbers
    host_arr = arr.copy_to_host()
    if host_arr.size >= 1000000:  # a mean near 0.5 needs a large array (numba's has 454 million)
        assert 0.49 < np.mean(host_arr) < 0.51
    assert np.all(host_arr <= 1.0)
    assert np.all(host_arr >= 0.0)
    return {"arr": host_arr, "rng_states": rng_states.copy_to_host()}


def globals_constant_capture(mem: Mem) -> dict[str, Any]:
    """numba-cuda docs: global variables are captured as constants (test_globals.py, first example)."""
    TAX_RATE = 0.08
    PRICES = np.array([10.0, 25.0, 5.0, 15.0, 30.0], dtype=np.float64)

    @cuda.jit
    def compute_totals(quantities, totals):
        i = cuda.grid(1)
        if i < totals.size:
            totals[i] = quantities[i] * PRICES[i] * (1 + TAX_RATE)

    d_quantities = mem.to_device(np.array([1, 2, 3, 4, 5], dtype=np.float64))
    d_totals = mem.device_array(5, dtype=np.float64)

    # First kernel call - compiles and captures values
    compute_totals[1, 32](d_quantities, d_totals)
    first = d_totals.copy_to_host()
    print("Value of d_totals:", first)

    # These modifications have no effect on subsequent kernel calls
    TAX_RATE = 0.10
    PRICES[:] = [20.0, 50.0, 10.0, 30.0, 60.0]

    # Second kernel call still uses the original values
    compute_totals[1, 32](d_quantities, d_totals)
    second = d_totals.copy_to_host()
    print("Value of d_totals:", second)

    # Verify the values are the same (original values were captured)
    expected = np.array([10.8, 54.0, 16.2, 64.8, 162.0])
    np.testing.assert_allclose(d_totals.copy_to_host(), expected)
    return {"first": first, "second": second}


def globals_device_array_capture(mem: Mem) -> dict[str, Any]:
    """numba-cuda docs: a global device array is captured by pointer, and ``copy_to_device`` on it is
    seen by later launches (test_globals.py, second example)."""
    # Global device array - pointer is captured, not data
    PRICES = mem.to_device(np.array([10.0, 25.0, 5.0, 15.0, 30.0], dtype=np.float32))

    @cuda.jit
    def compute_totals(quantities, totals):
        i = cuda.grid(1)
        if i < totals.size:
            totals[i] = quantities[i] * PRICES[i]

    d_quantities = mem.to_device(np.array([1.0, 1.0, 1.0, 1.0, 1.0], dtype=np.float32))
    d_totals = mem.device_array(5, dtype=np.float32)

    # First kernel call
    compute_totals[1, 32](d_quantities, d_totals)
    first = d_totals.copy_to_host()
    print(first)  # [10. 25.  5. 15. 30.]

    # Mutate the device array in-place
    PRICES.copy_to_device(np.array([20.0, 50.0, 10.0, 30.0, 60.0], dtype=np.float32))

    # Second kernel call sees the updated values
    compute_totals[1, 32](d_quantities, d_totals)
    second = d_totals.copy_to_host()
    print(second)  # [20. 50. 10. 30. 60.]

    # Verify the second call sees updated values
    expected = np.array([20.0, 50.0, 10.0, 30.0, 60.0], dtype=np.float32)
    np.testing.assert_allclose(d_totals.copy_to_host(), expected)
    return {"first": first, "second": second}


def cpu_gpu_compat(mem: Mem) -> dict[str, Any]:
    """numba-cuda docs: "CPU and GPU compatible functions" (test_cpu_gpu_compat.py): iterating over
    the arrays on the host, element by element."""
    from math import pi

    X = mem.to_device([1, 10, 234])
    Y = mem.to_device([2, 2, 4014])
    Z = mem.to_device([3, 14, 2211])
    results = mem.to_device([0.0, 0.0, 0.0])

    @numba.jit
    def business_logic(x, y, z):
        return 4 * z * (2 * x - (4 * y) / 2 * pi)

    print(business_logic(1, 2, 3))  # -126.79644737231007

    @cuda.jit
    def f(res, xarr, yarr, zarr):
        tid = cuda.grid(1)
        if tid < len(xarr):
            # The function decorated with numba.jit may be directly reused
            res[tid] = business_logic(xarr[tid], yarr[tid], zarr[tid])

    f.forall(len(X))(results, X, Y, Z)
    print(results)
    # [-126.79644737231007, 416.28324559588634, -218912930.2987788]

    expect = [business_logic(x, y, z) for x, y, z in zip(X, Y, Z)]

    np.testing.assert_equal(expect, results.copy_to_host())
    return {"results": results.copy_to_host(), "expect": np.array(expect)}


#: The examples by name, in the order of numba's documentation.
EXAMPLES: dict[str, Callable[..., dict[str, Any]]] = {
    f.__name__: f
    for f in (
        vecadd,
        matmul,
        reduction,
        laplace,
        montecarlo,
        random_3d,
        globals_constant_capture,
        globals_device_array_capture,
        cpu_gpu_compat,
    )
}
