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

Variants
--------
:func:`heat3d_kernel` builds one of :data:`VARIANTS_3D`:

``"column"``
    The design above (the default until a measurement says otherwise).
``"tile"``
    2.5-D blocking: each thread still walks ``planes_per_thread`` planes
    with its own column (and the planes above and below) in registers, but
    the block also stores its ``x``/``y`` tile of every plane, with a
    one-cell ring, in shared memory; the four in-plane neighbours then come
    from shared memory, so each element is loaded from global memory about
    once (plus the ring and the two halo planes) instead of five times.
    One ``__syncthreads`` per strip.  The block shape is a compile-time
    constant of this variant (the tile's size).
``"vec2"``, ``"vec4"``
    The ``column`` design with each thread computing 2 (4) consecutive
    ``x`` points: its column and the ``y +- 1`` rows are loaded as one 8- or
    16-byte vector per plane (``ld.global.v2/v4``, numba intrinsics in
    :func:`_vector_io`), the ``x`` neighbours of the chunk come from the
    chunk itself plus one scalar load on each side, and each plane is stored
    as one vector.  That is ``(planes + 2) / planes + 4`` load instructions
    per ``width`` points instead of ``(planes + 2) / planes + 4`` per point:
    the load/store units, not HBM, limit ``column`` in float32.  Vector
    accesses need every row aligned to the vector (data pointer and
    strides, checked once per thread, uniform over the grid) and the whole
    chunk inside the grid; otherwise (odd ``nx``'s last chunk, a view one
    element into its allocation, the first and last strips) a thread takes
    a per-element path.  Keep ``planes * width <= 32``: beyond that numba's
    nested loops stay rolled and the arrays spill to local memory.
``"march2"``, ``"march4"``
    The ``vec`` design marching up a long strip (``planes_per_thread`` of 32
    to 128) in a runtime loop, :data:`MARCH_CHUNK_3D` planes at a time: all
    loads of a chunk before its first store, the two planes below the next
    chunk carried in registers.  A strip then reads its two halo planes once
    per strip instead of once per 8 planes, so the L2, which the ``y +- 1``
    rows and the halo planes go through, carries a sixth less, and the
    loop's registers do not grow with the strip.  On an H200 the L2, not HBM,
    limited ``vec4`` (``ncu``: L2 throughput 90 % of peak, DRAM 69 %); see
    ``docs/stencil-performance.md``.  The grid's first and last planes are
    copied through by the strips that hold them.  Which path a point takes
    does not depend on the strips: every plane runs on vectors once the grid
    has :data:`MARCH_CHUNK_3D` interior planes (a strip's last chunk, and
    the one chunk of a strip shorter than that, start low enough to be
    whole, rewriting planes below with the values they get anyway), so a
    slab decomposition aligns to the chunk, not to the strip
    (:func:`slab_align_3d`).

Every variant evaluates the same expression in the same order, takes the
same strips along ``z`` (so :class:`~umem_numba.kernels.decomp.Decomposition`
aligns to ``planes_per_thread`` alike) and matches the NumPy reference bit
for bit under numba's simulator.  ``python -m umem_numba bench stencil
--variants`` times them all against the device-to-device copy in one run.
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
    "DEFAULT_VARIANT_3D",
    "MARCH_CHUNK_3D",
    "TUNED_3D",
    "VARIANTS_3D",
    "VECTOR_WIDTH_3D",
    "heat3d_compile",
    "heat3d_kernel",
    "heat3d_launch",
    "heat3d_step",
    "launch_config_3d",
    "slab_align_3d",
]

#: Planes per thread (the register-blocking factor along z) and (x, y) block
#: shape per dtype, for the :data:`DEFAULT_VARIANT_3D` of the dtype, chosen by
#: ``bench stencil --variants`` (docs/stencil-performance.md).
TUNED_3D = {
    np.dtype(np.float32): (64, (32, 8)),
    np.dtype(np.float64): (4, (32, 4)),
}

#: The kernel designs :func:`heat3d_kernel` can build (see the module notes).
VARIANTS_3D = ("column", "tile", "vec2", "vec4", "march2", "march4")

#: Points along x each thread of a variant computes (its vector width; 1 for the scalar designs).
VECTOR_WIDTH_3D = {"column": 1, "tile": 1, "vec2": 2, "vec4": 4, "march2": 2, "march4": 4}

#: Planes a ``"march"`` thread loads before it stores (its unrolled chunk; ``chunk * width <= 16``
#: keeps the chunk's arrays in registers at a high occupancy).
MARCH_CHUNK_3D = {"march2": 8, "march4": 4}

#: The variant :func:`heat3d_step` uses per dtype (measure with ``bench stencil --variants``).
DEFAULT_VARIANT_3D = {
    np.dtype(np.float32): "march4",
    np.dtype(np.float64): "column",
}

#: Static shared memory a block may use (the tile variant's tile must fit).
_MAX_SHARED_BYTES = 48 * 1024


def slab_align_3d(variant: str, planes_per_thread: int) -> int:
    """The ``align`` a :class:`~umem_numba.kernels.decomp.Decomposition` needs for this 3-D kernel.

    A slab's launch must take the same code path for every owned plane as the
    one-domain launch (the paths may round differently).  For the strip
    kernels (``column``, ``tile``, ``vec``) the path depends on the strip, so
    slabs align to ``planes_per_thread``; for the ``march`` kernels it only
    needs a chunk of interior planes (:data:`MARCH_CHUNK_3D`), so slabs align
    to the chunk and carry a few planes of alignment instead of a strip of 64.

    Parameters
    ----------
    variant : str
        One of :data:`VARIANTS_3D`.
    planes_per_thread : int
        The launch's planes per thread.

    Returns
    -------
    int
    """
    return MARCH_CHUNK_3D.get(_check_variant(variant), int(planes_per_thread))


def _check_variant(variant: str) -> str:
    if variant not in VARIANTS_3D:
        raise ValueError(f"variant must be one of {VARIANTS_3D}, got {variant!r}")
    return variant


def tile_shared_bytes(planes_per_thread: int, block: tuple[int, int], itemsize: int) -> int:
    """Shared memory of one block of the ``"tile"`` variant: ``planes * (by + 2) * (bx + 2)`` elements."""
    bx, by = (int(b) for b in block)
    return int(planes_per_thread) * (by + 2) * (bx + 2) * int(itemsize)


def heat3d_kernel(planes_per_thread: int = 8, variant: str = "column", block: tuple[int, int] | None = None) -> Any:
    """The ``@cuda.jit`` seven-point kernel for one register-blocking factor and design.

    Parameters
    ----------
    planes_per_thread : int
        Planes each thread computes; a compile-time constant (cached per value).
    variant : {'column', 'tile', 'vec2', 'vec4', 'march2', 'march4'}
        The design (see the module notes and :data:`VARIANTS_3D`).
    block : (int, int), optional
        The ``(x, y)`` block shape; required by ``"tile"`` (its shared tile is
        sized at compile time; launch it with exactly this block), ignored by
        the others.

    Returns
    -------
    numba CUDA dispatcher
        ``kernel[grid, block, stream](src, dst, w_center, w_neighbour)`` with
        3-D float arrays of equal shape and dtype and weights of that dtype.
        Use :func:`heat3d_launch` for ``grid`` and ``block`` (the ``"vec"``
        variants cover ``width`` points along x per thread, so their grid
        is :func:`launch_config_3d` of ``(nz, ny, ceil(nx / width))``).

    Raises
    ------
    ValueError
        ``planes_per_thread < 1``, an unknown variant, or ``"tile"`` without a
        valid block.
    """
    planes = int(planes_per_thread)
    if planes < 1:
        raise ValueError(f"planes_per_thread must be >= 1, got {planes_per_thread}")
    _check_variant(variant)
    if variant == "column":
        return _column_kernel(planes)
    if variant in ("vec2", "vec4"):
        return _vec_kernel(planes, VECTOR_WIDTH_3D[variant])
    if variant in ("march2", "march4"):
        return _march_kernel(planes, VECTOR_WIDTH_3D[variant], MARCH_CHUNK_3D[variant])
    if block is None:
        raise ValueError("the 'tile' variant needs the block shape at compile time: pass block=(bx, by)")
    bx, by = (int(b) for b in block)
    if bx < 1 or by < 1 or bx * by > 1024:
        raise ValueError(f"block must be two positive sizes with at most 1024 threads, got {block}")
    return _tile_kernel(planes, bx, by)


@functools.cache
def _column_kernel(planes: int) -> Any:
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
        if z0 > 0 and z0 + planes < nz:
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
                v = w_center * u + w_neighbour * (((col[r] + col[r + 2]) + (south[r] + north[r])) + (west[r] + east[r]))
                dst[top + uint64(r + 1), yu, xu] = u if edge else v
        else:
            for z in range(z0, min(z0 + planes, nz)):
                u = src[z, y, x]
                if edge or z == 0 or z == nz - 1:
                    dst[z, y, x] = u
                else:
                    dst[z, y, x] = w_center * u + w_neighbour * (
                        ((src[z - 1, y, x] + src[z + 1, y, x]) + (src[z, y - 1, x] + src[z, y + 1, x]))
                        + (src[z, y, x - 1] + src[z, y, x + 1])
                    )

    return heat3d


@functools.cache
def _vector_io(width: int) -> tuple[Any, Any, Any]:
    """``(load, store, address)`` helpers for the ``"vec"`` variants, ``width`` elements per access.

    ``load(a, (z, y, x), buf, r)`` sets ``buf[r, 0:width] = a[z, y, x:x + width]``
    and ``store(a, (z, y, x), buf, r)`` sets ``a[z, y, x:x + width] = buf[r,
    0:width]``, each with ONE vector access of ``width * itemsize`` bytes
    (``ld.global.v2/v4``), so ``a[z, y, x]`` must be aligned to that size and
    ``a``'s x stride must be the item size; ``address(a)`` is the data
    pointer, for the kernel's check.  On the GPU they are numba intrinsics; under
    the simulator plain element copies (the same values).
    """
    if simulating():

        def load_sim(a: Any, idx: Any, buf: Any, r: Any) -> None:
            z, y, x = idx
            for i in range(width):
                buf[r, i] = a[z, y, x + i]

        def store_sim(a: Any, idx: Any, buf: Any, r: Any) -> None:
            z, y, x = idx
            for i in range(width):
                a[z, y, x + i] = buf[r, i]

        def address_sim(a: Any) -> int:
            return int(a.__array_interface__["data"][0])  # numpy arrays and the simulator's wrappers

        return load_sim, store_sim, address_sim

    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    def element_pointers(context: Any, builder: Any, sig: Any, args: Any) -> tuple[Any, Any, Any]:
        aty, ity, bty = sig.args[0], sig.args[1], sig.args[2]
        arr = context.make_array(aty)(context, builder, value=args[0])
        idx = [
            context.cast(builder, v, t, types.intp)
            for v, t in zip(cgutils.unpack_tuple(builder, args[1], count=aty.ndim), ity, strict=True)
        ]
        ptr = cgutils.get_item_pointer(context, builder, aty, arr, idx, wraparound=False)
        vty = ir.VectorType(context.get_value_type(aty.dtype), width)
        vptr = builder.bitcast(ptr, vty.as_pointer())
        buf = context.make_array(bty)(context, builder, value=args[2])
        row = context.cast(builder, args[3], sig.args[3], types.intp)
        slots = [
            cgutils.get_item_pointer(context, builder, bty, buf, [row, context.get_constant(types.intp, i)])
            for i in range(width)
        ]
        return vptr, vty, slots

    def check(a: Any, idx: Any, buf: Any, r: Any) -> None:
        ok = (
            isinstance(a, types.Array)
            and a.ndim == 3
            and isinstance(idx, types.BaseTuple)
            and len(idx) == 3
            and all(isinstance(t, types.Integer) for t in idx)
            and isinstance(buf, types.Array)
            and buf.ndim == 2
            and buf.dtype == a.dtype
            and isinstance(r, types.Integer)
        )
        if not ok:
            raise TypeError(f"vector access wants (3-D array, (z, y, x), 2-D buffer, row), got {(a, idx, buf, r)}")

    @intrinsic
    def load(typingctx: Any, a: Any, idx: Any, buf: Any, r: Any) -> Any:
        check(a, idx, buf, r)

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            vptr, _, slots = element_pointers(context, builder, sig, args)
            vec = builder.load(vptr, align=width * sig.args[0].dtype.bitwidth // 8)
            for i, slot in enumerate(slots):
                builder.store(builder.extract_element(vec, ir.Constant(ir.IntType(32), i)), slot)
            return context.get_dummy_value()

        return types.none(a, idx, buf, r), codegen

    @intrinsic
    def store(typingctx: Any, a: Any, idx: Any, buf: Any, r: Any) -> Any:
        check(a, idx, buf, r)

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            vptr, vty, slots = element_pointers(context, builder, sig, args)
            vec = ir.Constant(vty, ir.Undefined)
            for i, slot in enumerate(slots):
                vec = builder.insert_element(vec, builder.load(slot), ir.Constant(ir.IntType(32), i))
            builder.store(vec, vptr, align=width * sig.args[0].dtype.bitwidth // 8)
            return context.get_dummy_value()

        return types.none(a, idx, buf, r), codegen

    @intrinsic
    def address(typingctx: Any, a: Any) -> Any:
        if not isinstance(a, types.Array):
            raise TypeError(f"address wants an array, got {a}")

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            arr = context.make_array(sig.args[0])(context, builder, value=args[0])
            return builder.ptrtoint(arr.data, ir.IntType(64))

        return types.uint64(a), codegen

    return load, store, address


@functools.cache
def _vec_kernel(planes: int, width: int) -> Any:
    halo = planes + 2
    last = width - 1
    load, store, address = _vector_io(width)

    @cuda.jit
    def heat3d_vec(src, dst, w_center, w_neighbour):
        nz, ny, nx = src.shape
        x0 = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) * width
        y = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y
        z0 = cuda.blockIdx.z * planes
        if x0 >= nx or y >= ny or z0 >= nz:
            return
        # Vector accesses need every row start aligned to the vector (same for the whole grid).
        vb = width * src.itemsize
        aligned = (
            src.strides[2] == src.itemsize
            and dst.strides[2] == dst.itemsize
            and src.strides[1] % vb == 0
            and src.strides[0] % vb == 0
            and dst.strides[1] % vb == 0
            and dst.strides[0] % vb == 0
            and address(src) % uint64(vb) == uint64(0)
            and address(dst) % uint64(vb) == uint64(0)
        )
        if aligned and z0 > 0 and z0 + planes < nz and x0 + width <= nx:
            # Hot path: the strip, its halo planes and the thread's `width` points are inside.
            # Edge points read clamped (in-bounds) neighbours and keep u.
            yu = uint64(y)
            xu = uint64(x0)
            ys = uint64(y - 1 if y > 0 else y)
            yn = uint64(y + 1 if y < ny - 1 else y)
            xw = uint64(x0 - 1 if x0 > 0 else x0)
            xe = uint64(x0 + width if x0 + width < nx else x0 + last)
            top = uint64(z0 - 1)
            yedge = y == 0 or y == ny - 1
            col = cuda.local.array((halo, width), src.dtype)
            south = cuda.local.array((planes, width), src.dtype)
            north = cuda.local.array((planes, width), src.dtype)
            out = cuda.local.array((1, width), src.dtype)
            west = cuda.local.array(planes, src.dtype)
            east = cuda.local.array(planes, src.dtype)
            for r in range(halo):
                load(src, (top + uint64(r), yu, xu), col, r)
            for r in range(planes):
                z = top + uint64(r + 1)
                load(src, (z, ys, xu), south, r)
                load(src, (z, yn, xu), north, r)
                west[r] = src[z, yu, xw]
                east[r] = src[z, yu, xe]
            for r in range(planes):
                for i in range(width):
                    u = col[r + 1, i]
                    left = col[r + 1, i - 1] if i > 0 else west[r]
                    right = col[r + 1, i + 1] if i < last else east[r]
                    v = w_center * u + w_neighbour * (
                        ((col[r, i] + col[r + 2, i]) + (south[r, i] + north[r, i])) + (left + right)
                    )
                    x = x0 + i
                    out[0, i] = u if (yedge or x == 0 or x == nx - 1) else v
                store(dst, (top + uint64(r + 1), yu, xu), out, 0)
        else:
            for x in range(x0, min(x0 + width, nx)):
                edge = x == 0 or x == nx - 1 or y == 0 or y == ny - 1
                for z in range(z0, min(z0 + planes, nz)):
                    u = src[z, y, x]
                    if edge or z == 0 or z == nz - 1:
                        dst[z, y, x] = u
                    else:
                        dst[z, y, x] = w_center * u + w_neighbour * (
                            ((src[z - 1, y, x] + src[z + 1, y, x]) + (src[z, y - 1, x] + src[z, y + 1, x]))
                            + (src[z, y, x - 1] + src[z, y, x + 1])
                        )

    return heat3d_vec


# The march kernel repeats the vec kernel's alignment check, the computation of a vector of
# points and the per-element path.  They are written out in each kernel on purpose: as
# device functions (``cuda.jit(device=True)`` or ``register_jitable``, inlined or not) numba-cuda
# 0.30 compiles them for the current device's compute capability, so the kernels' PTX could
# no longer be built without a GPU, and the PTX checks of the vector loads
# (tests/kernels/test_stencil3d_vec.py) run in CI, which has none.
@functools.cache
def _march_kernel(planes: int, width: int, chunk: int) -> Any:
    last = width - 1
    rows = chunk + 2
    load, store, address = _vector_io(width)

    @cuda.jit
    def heat3d_march(src, dst, w_center, w_neighbour):
        nz, ny, nx = src.shape
        x0 = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) * width
        y = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y
        z0 = cuda.blockIdx.z * planes
        if x0 >= nx or y >= ny or z0 >= nz:
            return
        z1 = min(z0 + planes, nz)
        # The strip's interior planes (the first and last plane of the grid are copied through).
        zs = max(z0, 1)
        ze = min(z1, nz - 1)
        vb = width * src.itemsize
        aligned = (
            src.strides[2] == src.itemsize
            and dst.strides[2] == dst.itemsize
            and src.strides[1] % vb == 0
            and src.strides[0] % vb == 0
            and dst.strides[1] % vb == 0
            and dst.strides[0] % vb == 0
            and address(src) % uint64(vb) == uint64(0)
            and address(dst) % uint64(vb) == uint64(0)
        )
        if aligned and x0 + width <= nx and nz - 2 >= chunk:
            # Hot path: march up the strip `chunk` planes at a time, every load of a chunk before
            # its first store, the two planes below the next chunk carried in registers.  Every
            # plane of a grid with a chunk of interior planes takes it, whatever the strips: a
            # strip's last chunk, and the only chunk of a strip shorter than one, start low
            # enough to be whole (rewriting planes below with the values they already get).
            yu = uint64(y)
            xu = uint64(x0)
            ys = uint64(y - 1 if y > 0 else y)
            yn = uint64(y + 1 if y < ny - 1 else y)
            xw = uint64(x0 - 1 if x0 > 0 else x0)
            xe = uint64(x0 + width if x0 + width < nx else x0 + last)
            yedge = y == 0 or y == ny - 1
            col = cuda.local.array((rows, width), src.dtype)
            south = cuda.local.array((chunk, width), src.dtype)
            north = cuda.local.array((chunk, width), src.dtype)
            out = cuda.local.array((1, width), src.dtype)
            west = cuda.local.array(chunk, src.dtype)
            east = cuda.local.array(chunk, src.dtype)
            if z0 == 0:
                load(src, (uint64(0), yu, xu), out, 0)
                store(dst, (uint64(0), yu, xu), out, 0)
            if z1 == nz:
                load(src, (uint64(nz - 1), yu, xu), out, 0)
                store(dst, (uint64(nz - 1), yu, xu), out, 0)
            if zs >= ze:
                return
            z = max(min(zs, ze - chunk), 1)
            load(src, (uint64(z - 1), yu, xu), col, 0)
            load(src, (uint64(z), yu, xu), col, 1)
            while True:
                zu = uint64(z)
                for r in range(chunk):
                    zr = zu + uint64(r)
                    load(src, (zr + uint64(1), yu, xu), col, r + 2)
                    load(src, (zr, ys, xu), south, r)
                    load(src, (zr, yn, xu), north, r)
                    west[r] = src[zr, yu, xw]
                    east[r] = src[zr, yu, xe]
                for r in range(chunk):
                    for i in range(width):
                        u = col[r + 1, i]
                        left = col[r + 1, i - 1] if i > 0 else west[r]
                        right = col[r + 1, i + 1] if i < last else east[r]
                        v = w_center * u + w_neighbour * (
                            ((col[r, i] + col[r + 2, i]) + (south[r, i] + north[r, i])) + (left + right)
                        )
                        x = x0 + i
                        out[0, i] = u if (yedge or x == 0 or x == nx - 1) else v
                    store(dst, (zu + uint64(r), yu, xu), out, 0)
                z += chunk
                if z >= ze:
                    break
                if z + chunk <= ze:
                    for i in range(width):
                        col[0, i] = col[chunk, i]
                        col[1, i] = col[chunk + 1, i]
                else:
                    # The last chunk overlaps the one before (it rewrites the same values).
                    z = ze - chunk
                    load(src, (uint64(z - 1), yu, xu), col, 0)
                    load(src, (uint64(z), yu, xu), col, 1)
        else:
            for x in range(x0, min(x0 + width, nx)):
                edge = x == 0 or x == nx - 1 or y == 0 or y == ny - 1
                for z in range(z0, z1):
                    u = src[z, y, x]
                    if edge or z == 0 or z == nz - 1:
                        dst[z, y, x] = u
                    else:
                        dst[z, y, x] = w_center * u + w_neighbour * (
                            ((src[z - 1, y, x] + src[z + 1, y, x]) + (src[z, y - 1, x] + src[z, y + 1, x]))
                            + (src[z, y, x - 1] + src[z, y, x + 1])
                        )

    return heat3d_march


@functools.cache
def _tile_kernel(planes: int, bx: int, by: int) -> Any:
    halo = planes + 2
    tile_shape = (planes, by + 2, bx + 2)
    last_x = bx - 1
    last_y = by - 1

    @cuda.jit
    def heat3d_tile(src, dst, w_center, w_neighbour):
        nz, ny, nx = src.shape
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        x = cuda.blockIdx.x * bx + tx
        y = cuda.blockIdx.y * by + ty
        z0 = cuda.blockIdx.z * planes
        if z0 >= nz:
            return  # the whole block (z0 is the block's)
        if z0 > 0 and z0 + planes < nz:
            # Hot path, taken by the whole block (it has a barrier): threads past the
            # grid's x/y end load clamped cells into the tile and store nothing.
            inside = x < nx and y < ny
            xc = x if x < nx else nx - 1
            yc = y if y < ny else ny - 1
            edge = xc == 0 or xc == nx - 1 or yc == 0 or yc == ny - 1
            xu = uint64(xc)
            yu = uint64(yc)
            top = uint64(z0 - 1)
            # Tile coordinates of this thread's cell (ring of one cell around the block).
            tc = uint64(tx + 1)
            tr = uint64(ty + 1)
            tile = cuda.shared.array(tile_shape, src.dtype)
            col = cuda.local.array(halo, src.dtype)
            for r in range(halo):
                col[r] = src[top + uint64(r), yu, xu]
            if tx == 0:
                xw = uint64(xc - 1 if xc > 0 else xc)
                for r in range(planes):
                    tile[r, tr, 0] = src[top + uint64(r + 1), yu, xw]
            if tx == last_x:
                xe = uint64(xc + 1 if xc < nx - 1 else xc)
                for r in range(planes):
                    tile[r, tr, tc + uint64(1)] = src[top + uint64(r + 1), yu, xe]
            if ty == 0:
                ys = uint64(yc - 1 if yc > 0 else yc)
                for r in range(planes):
                    tile[r, 0, tc] = src[top + uint64(r + 1), ys, xu]
            if ty == last_y:
                yn = uint64(yc + 1 if yc < ny - 1 else yc)
                for r in range(planes):
                    tile[r, tr + uint64(1), tc] = src[top + uint64(r + 1), yn, xu]
            for r in range(planes):
                tile[r, tr, tc] = col[r + 1]
            cuda.syncthreads()
            if inside:
                for r in range(planes):
                    u = col[r + 1]
                    v = w_center * u + w_neighbour * (
                        ((col[r] + col[r + 2]) + (tile[r, tr - uint64(1), tc] + tile[r, tr + uint64(1), tc]))
                        + (tile[r, tr, tc - uint64(1)] + tile[r, tr, tc + uint64(1)])
                    )
                    dst[top + uint64(r + 1), yu, xu] = u if edge else v
        else:
            if x >= nx or y >= ny:
                return
            edge = x == 0 or x == nx - 1 or y == 0 or y == ny - 1
            for z in range(z0, min(z0 + planes, nz)):
                u = src[z, y, x]
                if edge or z == 0 or z == nz - 1:
                    dst[z, y, x] = u
                else:
                    dst[z, y, x] = w_center * u + w_neighbour * (
                        ((src[z - 1, y, x] + src[z + 1, y, x]) + (src[z, y - 1, x] + src[z, y + 1, x]))
                        + (src[z, y, x - 1] + src[z, y, x + 1])
                    )

    return heat3d_tile


def launch_config_3d(
    shape: tuple[int, int, int], planes_per_thread: int, block: tuple[int, int], variant: str = "column"
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Grid and block for :func:`heat3d_kernel` on a grid of ``shape`` ``(nz, ny, nx)``.

    Parameters
    ----------
    shape : tuple of 3 ints
        The grid ``(nz, ny, nx)``.
    planes_per_thread : int
        Planes each thread steps along z.
    block : tuple of 2 ints
        Threads per block in x and y.
    variant : str
        The kernel design (:data:`VARIANTS_3D`): a thread of a ``"vec"``
        variant covers :data:`VECTOR_WIDTH_3D` points along x.

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
    nx = ceil_div(nx, VECTOR_WIDTH_3D[_check_variant(variant)])
    bx, by = (int(b) for b in block)
    if int(planes_per_thread) < 1:
        raise ValueError(f"planes_per_thread must be >= 1, got {planes_per_thread}")
    if bx < 1 or by < 1 or bx * by > 1024:
        raise ValueError(f"block must be two positive sizes with at most 1024 threads, got {block}")
    grid = (max(ceil_div(nx, bx), 1), max(ceil_div(ny, by), 1), max(ceil_div(nz, planes_per_thread), 1))
    if grid[1] > MAX_GRID_Y_Z or grid[2] > MAX_GRID_Y_Z:
        raise ValueError(
            f"shape {tuple(shape)} needs a grid of {grid} blocks, more than CUDA's "
            f"{MAX_GRID_Y_Z} in y or z; use a larger block or more planes per thread"
        )
    return grid, (bx, by, 1)


def heat3d_launch(
    shape: tuple[int, int, int],
    dtype: Any,
    planes_per_thread: int | None = None,
    block: tuple[int, int] | None = None,
    variant: str | None = None,
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
        are halved (down to 1, or a ``march`` kernel's chunk), then the block
        width (down to 32), then its height (down to 1).
    variant : {'column', 'tile', 'vec2', 'vec4', 'march2', 'march4'}, optional
        Override :data:`DEFAULT_VARIANT_3D`.

    Returns
    -------
    (kernel, grid, block)
        The kernel for the chosen planes per thread, and its launch shape.

    Raises
    ------
    TypeError
        A dtype other than float32/float64.
    ValueError
        A bad launch shape, an unknown variant, or a ``"tile"`` block whose
        tile does not fit in 48 KiB of shared memory.
    """
    dt = np.dtype(dtype)
    if dt not in TUNED_3D:
        raise TypeError(f"the stencils support float32 and float64, not {dt}")
    planes, blk = TUNED_3D[dt]
    planes = planes if planes_per_thread is None else int(planes_per_thread)
    blk = blk if block is None else (int(block[0]), int(block[1]))
    var = _check_variant(DEFAULT_VARIANT_3D[dt] if variant is None else variant)
    grid, blk3 = launch_config_3d(shape, planes, blk, var)
    if planes_per_thread is None and block is None and not simulating():
        # A march thread computes at least a chunk (a shorter strip would redo planes).
        fewest = MARCH_CHUNK_3D.get(var, 1)
        while grid[0] * grid[1] * grid[2] < MIN_BLOCKS and (planes > fewest or blk[0] > 32 or blk[1] > 1):
            if planes > fewest:
                planes = max(planes // 2, fewest)
            elif blk[0] > 32:
                blk = (blk[0] // 2, blk[1])
            else:
                blk = (blk[0], blk[1] // 2)
            grid, blk3 = launch_config_3d(shape, planes, blk, var)
    if var == "tile" and tile_shared_bytes(planes, blk, dt.itemsize) > _MAX_SHARED_BYTES:
        raise ValueError(
            f"the 'tile' variant with {planes} planes and block {blk} needs "
            f"{tile_shared_bytes(planes, blk, dt.itemsize)} bytes of shared memory per block "
            f"for {dt}, more than {_MAX_SHARED_BYTES}; use fewer planes or a smaller block"
        )
    return heat3d_kernel(planes, var, blk), grid, blk3


def heat3d_compile(
    shape: tuple[int, int, int], dtype: Any, planes_per_thread: int | None = None, block: tuple[int, int] | None = None
) -> Any:
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


def heat3d_step(
    src: Any,
    dst: Any,
    alpha: float = 1.0 / 6.0,
    *,
    stream: Any = 0,
    planes_per_thread: int | None = None,
    block: tuple[int, int] | None = None,
    variant: str | None = None,
) -> None:
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
    variant : {'column', 'tile', 'vec2', 'vec4', 'march2', 'march4'}, optional
        Kernel design; :data:`DEFAULT_VARIANT_3D` for the dtype when omitted.

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
    kernel, grid, blk = heat3d_launch(tuple(src.shape), dtype, planes_per_thread, block, variant)
    launch(kernel, grid, blk, src, dst, w_center, w_neighbour, stream=stream)
