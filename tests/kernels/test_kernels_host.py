"""Host-side parts of umem_numba.kernels: references, weights, launch shapes, validation, sizing.

Nothing here needs a GPU or compiles a kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.helpers import random_array

from umem_numba import kernels


def _loop_step_2d(u: np.ndarray, alpha: float) -> np.ndarray:
    """The five-point step written the obvious way, element by element (checks the vectorised reference)."""
    wc, wn = kernels.stencil_weights(alpha, 2, u.dtype)
    out = u.copy()
    n, m = u.shape
    for i in range(1, n - 1):
        for j in range(1, m - 1):
            out[i, j] = wc * u[i, j] + wn * ((u[i - 1, j] + u[i + 1, j]) + (u[i, j - 1] + u[i, j + 1]))
    return out


def _loop_step_3d(u: np.ndarray, alpha: float) -> np.ndarray:
    wc, wn = kernels.stencil_weights(alpha, 3, u.dtype)
    out = u.copy()
    nz, ny, nx = u.shape
    for z in range(1, nz - 1):
        for y in range(1, ny - 1):
            for x in range(1, nx - 1):
                out[z, y, x] = wc * u[z, y, x] + wn * (
                    ((u[z - 1, y, x] + u[z + 1, y, x]) + (u[z, y - 1, x] + u[z, y + 1, x]))
                    + (u[z, y, x - 1] + u[z, y, x + 1])
                )
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 1), (2, 7), (3, 3), (8, 5), (17, 23)])
def test_reference_2d_matches_element_loop(rng, dtype, shape):
    u = random_array(rng, shape, dtype)
    alpha = float(rng.uniform(0, 0.25))
    got = kernels.heat2d_step_reference(u, alpha)
    expected = _loop_step_2d(u, alpha)
    assert got.dtype == u.dtype
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 4, 3), (3, 3, 3), (6, 5, 7)])
def test_reference_3d_matches_element_loop(rng, dtype, shape):
    u = random_array(rng, shape, dtype)
    alpha = float(rng.uniform(0, 1 / 6))
    np.testing.assert_array_equal(kernels.heat3d_step_reference(u, alpha), _loop_step_3d(u, alpha))


def test_reference_keeps_boundary_and_input(rng):
    u0 = random_array(rng, (12, 9), np.float64)
    keep = u0.copy()
    out = kernels.heat2d_reference(u0, 5, 0.25)
    np.testing.assert_array_equal(u0, keep)  # the input is not modified
    for edge in (np.s_[0, :], np.s_[-1, :], np.s_[:, 0], np.s_[:, -1]):
        np.testing.assert_array_equal(out[edge], u0[edge])
    assert not np.array_equal(out[1:-1, 1:-1], u0[1:-1, 1:-1])


def test_reference_jacobi_is_the_neighbour_mean(rng):
    u = random_array(rng, (6, 7), np.float64)
    out = kernels.heat2d_step_reference(u, 0.25)
    mean = 0.25 * ((u[:-2, 1:-1] + u[2:, 1:-1]) + (u[1:-1, :-2] + u[1:-1, 2:]))
    np.testing.assert_array_equal(out[1:-1, 1:-1], mean)


def test_max_abs_diff_reference(rng):
    a, b = random_array(rng, (5, 6), np.float32), random_array(rng, (5, 6), np.float32)
    assert kernels.max_abs_diff_reference(a, b) == np.float32(np.abs(a - b).max())
    assert kernels.max_abs_diff_reference(np.empty((0, 3), np.float32), np.empty((0, 3), np.float32)) == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_stencil_weights(dtype):
    wc, wn = kernels.stencil_weights(0.1, 2, dtype)
    assert type(wc) is np.dtype(dtype).type and type(wn) is np.dtype(dtype).type
    assert wc == np.dtype(dtype).type(1 - 4 * 0.1) and wn == np.dtype(dtype).type(0.1)
    # The Jacobi limits give an exact zero centre weight.
    assert kernels.stencil_weights(0.25, 2, dtype)[0] == 0
    assert kernels.stencil_weights(1 / 6, 3, dtype)[0] == 0


@pytest.mark.parametrize("alpha, ndim", [(-0.01, 2), (0.26, 2), (0.2, 3), (float("nan"), 2)])
def test_stencil_weights_refuses_unstable_alpha(alpha, ndim):
    with pytest.raises(ValueError, match="alpha must be in"):
        kernels.stencil_weights(alpha, ndim, np.float32)


def test_stencil_weights_refuses_other_dtypes():
    with pytest.raises(TypeError, match="float32 and float64"):
        kernels.stencil_weights(0.1, 2, np.int32)
    with pytest.raises(ValueError, match="ndim"):
        kernels.stencil_weights(0.1, 4, np.float32)


@pytest.mark.parametrize(
    "shape, rows, block",
    [((1, 1), 16, (256, 1)), ((100, 300), 7, (32, 4)), ((16384, 16384), 16, (256, 1)), ((5, 1000), 3, (128, 2))],
)
def test_launch_config_2d_covers_the_grid(shape, rows, block):
    grid, blk = kernels.launch_config_2d(shape, rows, block)
    assert blk == block
    assert grid[0] * block[0] >= shape[1] > (grid[0] - 1) * block[0]
    assert grid[1] * block[1] * rows >= shape[0] > (grid[1] - 1) * block[1] * rows or shape[0] <= rows


def test_launch_config_refuses_bad_shapes():
    with pytest.raises(ValueError, match="65535"):
        kernels.launch_config_2d((65536 * 2 + 1, 8), 1, (32, 2))
    with pytest.raises(ValueError, match="1024 threads"):
        kernels.launch_config_2d((8, 8), 4, (64, 32))
    with pytest.raises(ValueError, match="rows_per_thread"):
        kernels.launch_config_2d((8, 8), 0, (32, 1))
    with pytest.raises(ValueError, match="65535"):
        kernels.launch_config_3d((8, 70000, 8), 4, (8, 1))
    with pytest.raises(ValueError, match="planes_per_thread"):
        kernels.launch_config_3d((8, 8, 8), 0, (8, 1))


def test_launch_config_3d_covers_the_grid():
    grid, blk = kernels.launch_config_3d((37, 45, 130), 8, (64, 2))
    assert blk == (64, 2, 1)
    assert grid == (3, 23, 5)


def test_tuned_launches_exist_for_both_dtypes():
    for dtype in (np.float32, np.float64):
        _, grid, block = kernels.heat2d_launch((1000, 1000), dtype)
        rows, tuned_block = kernels.TUNED_2D[np.dtype(dtype)]
        assert block == tuned_block and grid == kernels.launch_config_2d((1000, 1000), rows, tuned_block)[0]
        shape3 = (300, 240, 280)  # enough blocks: the tuned shape stays
        _, grid3, block3 = kernels.heat3d_launch(shape3, dtype)
        planes, tuned3 = kernels.TUNED_3D[np.dtype(dtype)]
        variant = kernels.DEFAULT_VARIANT_3D[np.dtype(dtype)]
        expected = kernels.launch_config_3d(shape3, planes, tuned3, variant)[0]
        assert block3 == (*tuned3, 1) and grid3 == expected


def test_vector_variants_cover_x_with_fewer_threads():
    grid1, _ = kernels.launch_config_3d((40, 40, 130), 4, (32, 2))
    grid4, _ = kernels.launch_config_3d((40, 40, 130), 4, (32, 2), "vec4")
    grid2, _ = kernels.launch_config_3d((40, 40, 130), 4, (32, 2), "vec2")
    assert (grid1[0], grid2[0], grid4[0]) == (5, 3, 2)  # ceil(130 / 32), ceil(65 / 32), ceil(33 / 32)
    assert grid1[1:] == grid2[1:] == grid4[1:]
    with pytest.raises(ValueError, match="variant must be one of"):
        kernels.launch_config_3d((4, 4, 4), 1, (32, 1), "vec8")


def test_heat3d_variants_are_checked_before_compiling():
    with pytest.raises(ValueError, match="variant must be one of"):
        kernels.heat3d_kernel(4, "shuffle")
    with pytest.raises(ValueError, match="needs the block shape"):
        kernels.heat3d_kernel(4, "tile")
    with pytest.raises(ValueError, match="1024 threads"):
        kernels.heat3d_kernel(4, "tile", (64, 32))
    # 16 planes of a (64, 8) float64 tile with its ring: 16 * 10 * 66 * 8 bytes > 48 KiB.
    with pytest.raises(ValueError, match="shared memory"):
        kernels.heat3d_launch((64, 64, 64), np.float64, 16, (64, 8), "tile")
    _, grid, block = kernels.heat3d_launch((64, 64, 64), np.float32, 16, (64, 8), "tile")
    assert block == (64, 8, 1) and grid == (1, 8, 4)
    assert kernels.heat3d_kernel(4, "tile", (32, 4)) is kernels.heat3d_kernel(4, "tile", (32, 4))  # cached per shape
    assert set(kernels.DEFAULT_VARIANT_3D.values()) <= set(kernels.VARIANTS_3D)


def test_step_validates_before_launching(rng):
    a = random_array(rng, (8, 8), np.float32)
    with pytest.raises(ValueError, match="shapes differ"):
        kernels.heat2d_step(a, np.empty((8, 9), np.float32))
    with pytest.raises(TypeError, match="dtypes differ"):
        kernels.heat2d_step(a, np.empty((8, 8), np.float64))
    with pytest.raises(ValueError, match="different arrays"):
        kernels.heat2d_step(a, a)
    with pytest.raises(ValueError, match="different arrays"):
        kernels.heat2d_step(a, a[:, :])  # a view of the same memory
    with pytest.raises(ValueError, match="must be 2-D"):
        kernels.heat2d_step(a.reshape(2, 4, 8), a.reshape(2, 4, 8).copy())
    with pytest.raises(TypeError, match="float32 and float64"):
        kernels.heat2d_step(np.ones((4, 4), np.int32), np.ones((4, 4), np.int32))
    with pytest.raises(TypeError, match="must be an array"):
        kernels.heat2d_step([[1.0]], [[1.0]])
    with pytest.raises(ValueError, match="alpha"):
        kernels.heat2d_step(a, a.copy(), alpha=0.3)
    with pytest.raises(ValueError, match="must be 3-D"):
        kernels.heat3d_step(a, a.copy())
    with pytest.raises(ValueError, match="1-element"):
        kernels.max_abs_diff(a, a.copy(), np.zeros(2, np.float32))


def test_require_free_memory_refuses_with_a_clear_message():
    gib = 1 << 30
    with pytest.raises(kernels.MemoryBudgetError) as err:
        kernels.require_free_memory(10 * gib, "2 grids of 40000x40000 float32", free=8 * gib, total=16 * gib)
    text = str(err.value)
    assert "2 grids of 40000x40000 float32" in text and "8.00 GiB free" in text and "--allow-oversubscribe" in text
    # The reserve counts: exactly `free` bytes is refused too.
    with pytest.raises(kernels.MemoryBudgetError):
        kernels.require_free_memory(8 * gib, "x", free=8 * gib, total=16 * gib)
    assert kernels.require_free_memory(10 * gib, "x", allow_oversubscribe=True, free=8 * gib, total=16 * gib) == (
        8 * gib,
        16 * gib,
    )
    assert kernels.require_free_memory(7 * gib, "x", free=8 * gib, total=16 * gib) == (8 * gib, 16 * gib)


def test_bench_cli_rejects_bad_arguments(capsys):
    from umem_numba._bench import stencil

    for argv, message in [
        (["--size", "2"], "--size must be at least 3"),
        (["--steps", "0"], "must be >= 1"),
        (["--block", "3"], "--block must be two integers"),
        (["--block", "64,32"], "at most 1024 threads"),
        (["--kinds", "device_array,bogus"], "unknown kind"),
        (["--dtype", "float16"], "invalid choice"),
    ]:
        with pytest.raises(SystemExit) as exc:
            stencil.main(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


def test_bench_help_lists_options(capsys):
    from umem_numba._bench import stencil

    with pytest.raises(SystemExit) as exc:
        stencil.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for option in ("--json", "--png", "--size", "--steps", "--quick", "--allow-oversubscribe"):
        assert option in out


def test_check_output_path_refuses_what_could_not_be_written(tmp_path):
    """Issue #30 item 7: the examples check ``--out`` before any work (heat2d.py ran the whole plate first)."""
    kernels.check_output_path(tmp_path / "plate.png")  # a new file in a writable folder
    (tmp_path / "old.png").write_bytes(b"x")
    kernels.check_output_path(str(tmp_path / "old.png"))  # an existing file is replaced
    missing = tmp_path / "missing" / "plate.png"
    with pytest.raises(ValueError, match=f"--out {missing}: folder {missing.parent} does not exist"):
        kernels.check_output_path(missing)
    with pytest.raises(ValueError, match=f"--picture {tmp_path}/old.png/p.png: {tmp_path}/old.png is not a folder"):
        kernels.check_output_path(f"{tmp_path}/old.png/p.png", option="--picture")
    with pytest.raises(ValueError, match="is a folder; give a file name"):
        kernels.check_output_path(tmp_path)


def test_check_output_path_refuses_a_read_only_folder(tmp_path):
    import os

    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="cannot write there"):
            kernels.check_output_path(folder / "plate.png")
    finally:
        folder.chmod(0o700)


def test_slabs_align_to_the_march_chunk_and_to_the_strip_otherwise():
    """A march kernel's code path does not depend on its strips: slabs align to its chunk."""
    from umem_numba.kernels.stencil3d import MARCH_CHUNK_3D

    assert kernels.slab_align_3d("march4", 64) == MARCH_CHUNK_3D["march4"] == 4
    assert kernels.slab_align_3d("march2", 32) == MARCH_CHUNK_3D["march2"]
    for variant in ("column", "tile", "vec2", "vec4"):
        assert kernels.slab_align_3d(variant, 8) == 8
    with pytest.raises(ValueError, match="variant must be one of"):
        kernels.slab_align_3d("vec8", 8)
    # A 3-D float32 decomposition of the default kernel carries a few planes of alignment, not a strip.
    d = kernels.Decomposition((512, 64, 64), 4, kernels.slab_align_3d("march4", 64))
    assert all(s.stored <= s.hi - s.lo + 2 * 4 + 1 for s in d.slabs)
