"""Default launch shapes: small grids still get enough blocks to spread over the GPU (host-side, no GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from umem_numba import kernels


def _blocks(grid) -> int:
    return int(np.prod(grid))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_heat2d_small_grids_get_min_blocks_and_stay_covered(rng, dtype):
    for _ in range(20):
        n, m = (int(v) for v in rng.integers(3, 2000, 2))
        kernel, grid, block = kernels.heat2d_launch((n, m), dtype)
        rows = next(r for r in (16, 8, 4, 2, 1) if kernel is kernels.heat2d_kernel(r))
        assert grid[0] * block[0] >= m and grid[1] * block[1] * rows >= n  # every cell has a thread
        tuned_rows, tuned_block = kernels.TUNED_2D[np.dtype(dtype)]
        tuned_grid, _ = kernels.launch_config_2d((n, m), tuned_rows, tuned_block)
        if _blocks(tuned_grid) >= kernels.MIN_BLOCKS:
            assert (rows, block, grid) == (tuned_rows, tuned_block, tuned_grid)  # big grids: as tuned
        else:
            # fewer rows per thread first, then narrower blocks, until enough blocks or nothing left to give
            assert _blocks(grid) >= kernels.MIN_BLOCKS or (rows == 1 and block[0] == 32)
            assert rows == 1 or block == tuned_block


def test_heat2d_examples_sizes():
    # heat2d.py --size 512 and residual.py's default 256: enough blocks now.
    for n in (256, 512):
        _, grid, _ = kernels.heat2d_launch((n, n), np.float32)
        assert _blocks(grid) >= kernels.MIN_BLOCKS
    # An explicit launch shape is taken as given.
    _, grid, block = kernels.heat2d_launch((256, 256), np.float32, rows_per_thread=16)
    assert block == kernels.TUNED_2D[np.dtype(np.float32)][1] and _blocks(grid) < kernels.MIN_BLOCKS


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_heat3d_small_grids_get_min_blocks_and_stay_covered(rng, dtype):
    for _ in range(20):
        nz, ny, nx = (int(v) for v in rng.integers(3, 200, 3))
        kernel, grid, block = kernels.heat3d_launch((nz, ny, nx), dtype)
        variant = kernels.DEFAULT_VARIANT_3D[np.dtype(dtype)]
        width = kernels.stencil3d.VECTOR_WIDTH_3D[variant]
        planes = next(
            p for p in (128, 64, 32, 16, 8, 4, 2, 1) if kernel is kernels.heat3d_kernel(p, variant, block[:2])
        )
        assert grid[0] * block[0] * width >= nx and grid[1] * block[1] >= ny and grid[2] * planes >= nz
        tuned_planes, tuned_block = kernels.TUNED_3D[np.dtype(dtype)]
        tuned_grid, _ = kernels.launch_config_3d((nz, ny, nx), tuned_planes, tuned_block, variant)
        if _blocks(tuned_grid) >= kernels.MIN_BLOCKS:
            assert (planes, block[:2], grid) == (tuned_planes, tuned_block, tuned_grid)
        else:
            fewest = kernels.stencil3d.MARCH_CHUNK_3D.get(variant, 1)  # a march thread computes a chunk at least
            assert _blocks(grid) >= kernels.MIN_BLOCKS or (planes == fewest and block[0] <= 32 and block[1] == 1)
