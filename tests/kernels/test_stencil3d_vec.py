"""The ``vec2`` / ``vec4`` 3-D kernels under numba's CUDA simulator, and their PTX.

These variants load ``width`` consecutive x points with one vector access when
the rows are aligned to the vector, and take a per-element path otherwise, so
besides matching the NumPy reference bit for bit the tests check WHICH path ran:
the worker counts the vector loads and stores (the simulator's stand-ins for
``ld.global.v2/v4``), so an aligned grid must use them and a misaligned one
(a view one element into its buffer, or a strided x-window) must not.  The
PTX test (CPU only: numba compiles to PTX without a GPU) checks that the GPU
build really issues vector loads and keeps its arrays out of local memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from support.helpers import random_array

from umem_numba import kernels
from umem_numba.kernels import stencil3d

_WORKER = textwrap.dedent("""
    import json, sys
    import numpy as np
    from numba import cuda
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    from umem_numba.kernels import stencil3d

    counts = {"load": 0, "store": 0}
    real = stencil3d._vector_io

    def counting(width):
        load, store, address = real(width)

        def load_c(*a):
            counts["load"] += 1
            load(*a)

        def store_c(*a):
            counts["store"] += 1
            store(*a)

        return load_c, store_c, address

    stencil3d._vector_io = counting

    def aligned_empty(n, dtype, offset, pad):
        # n elements starting `offset` elements past a 64-byte boundary, `pad` spare after.
        dt = np.dtype(dtype)
        raw = np.empty((n + offset + pad) * dt.itemsize + 64, np.uint8)
        start = (-raw.ctypes.data) % 64 + offset * dt.itemsize
        return raw[start:start + (n + pad) * dt.itemsize].view(dt)[:n]

    src, dst = sys.argv[1], sys.argv[2]
    data = np.load(src)
    cases = json.loads(str(data["cases"]))
    out = {}
    for c in cases:
        u0 = data[c["name"]]
        nz, ny, nx = u0.shape
        xpad = c["xpad"]
        bufs = []
        for _ in range(2):
            flat = aligned_empty(nz * ny * (nx + xpad), u0.dtype, c["offset"], 0)
            wide = flat.reshape(nz, ny, nx + xpad)
            bufs.append(wide[:, :, xpad // 2: xpad // 2 + nx])
        bufs[0][...] = u0
        bufs[1][...] = np.nan
        # The simulator's own device arrays, wrapping these views: a numpy argument would be
        # copied into a fresh (aligned, contiguous) array for the launch.
        a, b = (FakeCUDAArray(v) for v in bufs)
        counts["load"] = counts["store"] = 0
        for _ in range(c["steps"]):
            stencil3d.heat3d_step(a, b, c["alpha"], planes_per_thread=c["planes"], block=tuple(c["block"]),
                                  variant=c["variant"])
            a, b = b, a
        cuda.synchronize()  # the launches are queued on the simulated driver's stream, as on a GPU
        out[c["name"]] = np.ascontiguousarray(a._ary)
        out[c["name"] + "_counts"] = np.array([counts["load"], counts["store"]])
    np.savez(dst, **out)
""")


def _run(tmp_path: Path, cases: list[dict], arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    src, dst = tmp_path / "in.npz", tmp_path / "out.npz"
    np.savez(src, cases=np.array(json.dumps(cases)), **arrays)
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER, str(src), str(dst)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"simulator run failed:\n{proc.stdout}\n{proc.stderr}"
    with np.load(dst) as out:
        return {k: out[k] for k in out.files}


# (shape, planes, block): multiples of the width with interior strips; odd nx (a partial last
# chunk); nx smaller than the width; blocks of one thread; grids too thin for any interior strip.
SHAPES = [
    ((10, 6, 16), 2, (2, 3)),
    ((21, 5, 16), 9, (2, 2)),
    ((26, 3, 8), 64, (1, 2)),
    ((9, 5, 8), 3, (1, 1)),
    ((12, 7, 13), 2, (2, 2)),
    ((11, 4, 18), 4, (3, 1)),
    ((8, 5, 3), 2, (1, 2)),
    ((3, 3, 3), 1, (1, 1)),
    ((2, 5, 8), 1, (2, 1)),
    ((1, 1, 1), 1, (1, 1)),
    ((6, 1, 8), 1, (1, 1)),
]


@pytest.mark.parametrize("variant", ["vec2", "vec4", "march2", "march4"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_vec_variants_match_reference_and_take_the_vector_path_when_aligned(tmp_path, rng, dtype, variant):
    width = stencil3d.VECTOR_WIDTH_3D[variant]
    cases, arrays = [], {}
    # (offset in elements, x padding): aligned and contiguous; one element in (misaligned
    # rows); an x-window of a wider array (strided rows, aligned only if its start is).
    layouts = [(0, 0), (1, 0), (0, 2 * width), (0, 2)]
    for shape, planes, block in SHAPES:
        for offset, xpad in layouts:
            name = f"c{len(cases)}"
            arrays[name] = random_array(rng, shape, dtype)
            cases.append(
                {
                    "name": name,
                    "variant": variant,
                    "planes": planes,
                    "block": list(block),
                    "offset": offset,
                    "xpad": xpad,
                    "steps": int(rng.integers(1, 4)),
                    "alpha": float(rng.choice([1 / 6, rng.uniform(0.0, 1 / 6)])),
                }
            )
    out = _run(tmp_path, cases, arrays)
    itemsize = np.dtype(dtype).itemsize
    for c in cases:
        u0 = arrays[c["name"]]
        what = f"{variant} {np.dtype(dtype)} {u0.shape} {c}"
        expected = kernels.heat3d_reference(u0, c["steps"], c["alpha"])
        got = out[c["name"]]
        assert not np.isnan(got).any(), f"{what}: elements left unwritten"
        bad = np.flatnonzero(got != expected)
        assert bad.size == 0, f"{what}: {bad.size} elements differ, first at {np.unravel_index(bad[0], got.shape)}"
        loads, stores = (int(v) for v in out[c["name"] + "_counts"])
        nz, _, nx = u0.shape
        row_bytes = (nx + c["xpad"]) * itemsize
        start_bytes = (c["offset"] + c["xpad"] // 2) * itemsize
        aligned = row_bytes % (width * itemsize) == 0 and start_bytes % (width * itemsize) == 0
        if variant.startswith("march"):
            # A march kernel runs every strip on vectors once the grid has a chunk of interior planes.
            interior_strip = nx >= width and nz - 2 >= stencil3d.MARCH_CHUNK_3D[variant]
        else:
            interior_strip = nz >= c["planes"] + 2 and nx >= width
        if aligned and interior_strip:
            assert loads > 0 and stores > 0, f"{what}: aligned rows but no vector access"
        else:
            assert loads == 0 and stores == 0, f"{what}: {loads} vector loads on misaligned or thin grid"


def test_vec_variant_launch_covers_x_in_chunks():
    _, grid, block = kernels.heat3d_launch((64, 32, 130), np.float32, 8, (32, 4), "vec4")
    assert block == (32, 4, 1) and grid == (2, 8, 8)  # ceil(ceil(130 / 4) / 32) = 2
    _, grid, _ = kernels.heat3d_launch((64, 32, 130), np.float32, 8, (32, 4), "vec2")
    assert grid == (3, 8, 8)  # ceil(65 / 32)
    assert kernels.heat3d_kernel(8, "vec4") is kernels.heat3d_kernel(8, "vec4", (64, 2))  # block ignored
    assert kernels.heat3d_kernel(8, "vec2") is not kernels.heat3d_kernel(8, "vec4")


def _nvvm_missing() -> str | None:
    """Why numba cannot compile PTX on this machine (libNVVM missing), or None when it can."""
    from numba.cuda.cudadrv import nvvm
    from numba.cuda.cudadrv.error import NvvmSupportError

    try:
        if not nvvm.is_available():
            return "libNVVM is not available"
        nvvm.NVVM()
    except NvvmSupportError as exc:
        return str(exc) or type(exc).__name__
    return None


_BROKEN_COMPILE = """
import pytest


@pytest.fixture(autouse=True)
def _numpy_without_row_stack(monkeypatch):
    from numba import cuda

    def compile_ptx(*args, **kwargs):
        raise AttributeError("module 'numpy' has no attribute 'row_stack'")

    monkeypatch.setattr(cuda, "compile_ptx", compile_ptx)
"""


def test_ptx_check_fails_rather_than_skips_when_the_compile_breaks(tmp_path):
    """Issue #19 (small): a compile that breaks for any reason but a missing libNVVM fails the PTX test.

    Before the fix the test caught ``Exception`` and skipped, so under numpy 2.5
    (numba-cuda's ``np.row_stack`` gone) it skipped instead of failing.  Here
    the compile raises that AttributeError in a child pytest: all three cases
    must fail.
    """
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("the simulator compiles nothing")
    missing = _nvvm_missing()
    if missing:
        pytest.skip(f"no libNVVM here ({missing}): the PTX test skips for that reason alone")
    (tmp_path / "broken_compile_plugin.py").write_text(_BROKEN_COMPILE)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "broken_compile_plugin",
            "-rs",
            str(Path(__file__)),
            "-k",
            "compile_to_vector_loads",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
        cwd=root,
    )
    out = proc.stdout + proc.stderr
    assert "3 failed" in out and "skipped" not in out, out
    assert "row_stack" in out, out


def _ptx(variant: str, planes: int, dtype: type) -> str:
    """The kernel's PTX for sm_90, compiled here without a GPU (skipped only without libNVVM)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("the simulator compiles nothing")
    missing = _nvvm_missing()
    if missing:
        pytest.skip(f"cannot compile PTX here: no libNVVM ({missing})")
    from numba import cuda
    from numba.core import types
    from numba.np.numpy_support import from_dtype

    scalar = from_dtype(np.dtype(dtype))
    array = types.Array(scalar, 3, "C")
    ptx, _ = cuda.compile_ptx(kernels.heat3d_kernel(planes, variant).py_func, (array, array, scalar, scalar), cc=(9, 0))
    return ptx


@pytest.mark.parametrize(
    ("variant", "planes", "dtype", "vector"),
    [
        ("vec4", 8, np.float32, "v4.f32"),
        ("vec2", 16, np.float32, "v2.f32"),
        ("vec2", 4, np.float64, "v2.f64"),
    ],
)
def test_vec_variants_compile_to_vector_loads_without_local_memory(variant, planes, dtype, vector):
    """The GPU build (PTX, compiled here without a GPU) issues the wide accesses the design relies on.

    Skipped only where numba has no libNVVM to compile with; any other failure of the compile fails.
    """
    ptx = _ptx(variant, planes, dtype)
    halo = planes + 2
    # The hot path: the column (planes + 2) and the y neighbours (2 per plane) as vector loads,
    # one vector store per plane; x neighbours are two scalar loads per plane.
    assert ptx.count(f"ld.global.{vector}") == halo + 2 * planes
    assert ptx.count(f"st.global.{vector}") == planes
    assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.parametrize(
    ("variant", "planes", "dtype", "vector"),
    [
        ("march4", 64, np.float32, "v4.f32"),
        ("march4", 128, np.float32, "v4.f32"),
        ("march2", 32, np.float64, "v2.f64"),
    ],
)
def test_march_variants_compile_to_one_chunk_of_vector_loads_without_local_memory(variant, planes, dtype, vector):
    """The march loop is rolled: its vector accesses do not grow with the strip, and nothing spills.

    Per thread: the two boundary planes' copies (a load and a store each), the two planes
    below the first chunk, one chunk (column plane and y +- 1 rows per plane, one store per
    plane) and the two planes the overlapping last chunk reloads.
    """
    ptx = _ptx(variant, planes, dtype)
    chunk = stencil3d.MARCH_CHUNK_3D[variant]
    assert ptx.count(f"ld.global.{vector}") == 2 + 2 + 3 * chunk + 2
    assert ptx.count(f"st.global.{vector}") == 2 + chunk
    assert "ld.local" not in ptx and "st.local" not in ptx


_GPU_TOLERANCE = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", kernels.VARIANTS_3D)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_variant_on_the_gpu_aligned_misaligned_and_windowed(rng, dtype, variant):
    """Real kernels on fresh random data: a contiguous grid, one a single element into its
    allocation (misaligned rows: the ``vec`` variants must fall back, not fault), and an x-window
    of a wider grid (strided rows; everything outside the window must stay as it was)."""
    from numba import cuda

    dt = np.dtype(dtype)
    shape = (37, 29, 132)
    n = int(np.prod(shape))
    u0 = random_array(rng, shape, dt)
    expected = kernels.heat3d_reference(u0, 3, 0.15)
    tol = _GPU_TOLERANCE[dt] * float(np.max(np.abs(u0)))
    # march: 16-plane strips hold full chunks, an overlapping last chunk and a one-chunk tail.
    planes = {"vec4": 4, "march2": 16, "march4": 16}.get(variant, 8)
    block = (32, 4)

    def run(a, b):
        for _ in range(3):
            kernels.heat3d_step(a, b, 0.15, planes_per_thread=planes, block=block, variant=variant)
            a, b = b, a
        return a

    seven = np.full(n + 1, 7, dt)
    seven[1:] = u0.ravel()
    flat_a, flat_b = cuda.to_device(seven), cuda.to_device(np.full(n + 1, 7, dt))
    for what, a, b in [
        ("contiguous", cuda.to_device(u0), cuda.device_array(shape, dt)),
        ("one element in", flat_a[1:].reshape(shape), flat_b[1:].reshape(shape)),
    ]:
        got = run(a, b).copy_to_host()
        np.testing.assert_array_equal(got[0], u0[0], err_msg=f"{variant} {what}: boundary")
        assert np.max(np.abs(got - expected)) <= tol, f"{variant} {dt} {what}: differs from the reference"
    assert flat_a.copy_to_host()[0] == 7 and flat_b.copy_to_host()[0] == 7, "wrote before the view"
    wide0 = random_array(rng, (shape[0], shape[1], shape[2] + 8), dt)
    wide0[:, :, 2:-6] = u0
    wa, wb = cuda.to_device(wide0), cuda.to_device(wide0)
    run(wa[:, :, 2:-6], wb[:, :, 2:-6])  # 3 steps: the result is in wb
    host = wb.copy_to_host()
    assert np.max(np.abs(host[:, :, 2:-6] - expected)) <= tol, f"{variant} {dt} window: differs from the reference"
    for buf in (host, wa.copy_to_host()):
        np.testing.assert_array_equal(buf[:, :, :2], wide0[:, :, :2])
        np.testing.assert_array_equal(buf[:, :, -6:], wide0[:, :, -6:])
