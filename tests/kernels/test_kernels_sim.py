"""The stencil and residual kernels under numba's CUDA simulator: their logic, without a GPU.

``NUMBA_ENABLE_CUDASIM`` must be set before ``numba.cuda`` is first imported,
so the kernels run in a subprocess: this process makes random inputs, the
subprocess runs the real launchers (``heat2d_step`` ...) on numpy arrays and
saves the results, and this process compares every element with the NumPy
references.  ``dst`` starts as NaN, so an element a kernel forgets to write
shows up.  The simulator evaluates in the same order and precision as the
references, so the results must agree bit for bit (the GPU may fuse
multiply-adds; the GPU tests allow for that).
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

_WORKER = textwrap.dedent("""
    import json, sys
    import numpy as np
    from umem_numba import kernels

    src, dst = sys.argv[1], sys.argv[2]
    data = np.load(src)
    cases = json.loads(str(data["cases"]))
    out = {}
    for c in cases:
        name = c["name"]
        if c["kind"] == "residual":
            res = np.full(1, np.nan, data[name + "_a"].dtype)
            kernels.max_abs_diff(data[name + "_a"], data[name + "_b"], res)
            out[name] = res
            continue
        u = data[name].copy()
        v = np.full_like(u, np.nan)
        step = kernels.heat2d_step if c["kind"] == "2d" else kernels.heat3d_step
        opts = {}
        if c["tiling"] is not None:
            key = "rows_per_thread" if c["kind"] == "2d" else "planes_per_thread"
            opts = {key: c["tiling"], "block": tuple(c["block"])}
        if c.get("variant"):
            opts["variant"] = c["variant"]
        for _ in range(c["steps"]):
            step(u, v, c["alpha"], **opts)
            u, v = v, u
        out[name] = u
    np.savez(dst, **out)
""")


def _run_in_simulator(tmp_path: Path, cases: list[dict], arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
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


def _assert_same(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype, what
    assert not np.isnan(got).any(), f"{what}: elements left unwritten (NaN)"
    mismatched = np.flatnonzero(got != expected)
    assert mismatched.size == 0, (
        f"{what}: {mismatched.size} of {got.size} elements differ, first at "
        f"{np.unravel_index(mismatched[0], got.shape)}: {got.flat[mismatched[0]]!r} vs {expected.flat[mismatched[0]]!r}"
    )


# Shapes smaller than a strip, exactly one strip, not multiples of the block, single rows/columns.
SHAPES_2D = [(1, 1), (1, 7), (6, 1), (2, 2), (3, 3), (4, 9), (5, 4), (9, 13), (19, 40), (40, 9), (33, 70)]
# (rows_per_thread, block); None means the tuned defaults of heat2d_step.
TILINGS_2D = [(1, (8, 2)), (3, (5, 3)), (4, (16, 1)), (16, (4, 4)), (None, None)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_heat2d_matches_reference_in_simulator(tmp_path, rng, dtype):
    cases, arrays = [], {}
    for tiling, block in TILINGS_2D:
        for shape in SHAPES_2D:
            if tiling is None and shape[0] * shape[1] > 400:
                continue  # 256-thread blocks are slow in the simulator; small grids cover the logic
            name = f"c{len(cases)}"
            arrays[name] = random_array(rng, shape, dtype)
            cases.append(
                {
                    "kind": "2d",
                    "name": name,
                    "steps": int(rng.integers(1, 5)),
                    "alpha": float(rng.choice([0.25, rng.uniform(0.0, 0.25)])),
                    "tiling": tiling,
                    "block": block,
                }
            )
    out = _run_in_simulator(tmp_path, cases, arrays)
    for c in cases:
        expected = kernels.heat2d_reference(arrays[c["name"]], c["steps"], c["alpha"])
        _assert_same(out[c["name"]], expected, f"2-D {arrays[c['name']].shape} {c}")


SHAPES_3D = [(1, 1, 1), (3, 3, 3), (2, 5, 4), (5, 4, 7), (11, 6, 9), (4, 13, 3), (14, 5, 17)]
TILINGS_3D = [(1, (4, 2)), (3, (5, 3)), (8, (8, 1)), (None, None)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_heat3d_matches_reference_in_simulator(tmp_path, rng, dtype):
    cases, arrays = [], {}
    for tiling, block in TILINGS_3D:
        for shape in SHAPES_3D:
            name = f"c{len(cases)}"
            arrays[name] = random_array(rng, shape, dtype)
            cases.append(
                {
                    "kind": "3d",
                    "name": name,
                    "steps": int(rng.integers(1, 4)),
                    "alpha": float(rng.choice([1 / 6, rng.uniform(0.0, 1 / 6)])),
                    "tiling": tiling,
                    "block": block,
                }
            )
    out = _run_in_simulator(tmp_path, cases, arrays)
    for c in cases:
        expected = kernels.heat3d_reference(arrays[c["name"]], c["steps"], c["alpha"])
        _assert_same(out[c["name"]], expected, f"3-D {arrays[c['name']].shape} {c}")


# Blocks of one thread, one row, odd sizes, and tiles that overhang the grid in x and y.
TILINGS_3D_VARIANTS = [(1, (4, 2)), (2, (1, 1)), (3, (5, 3)), (4, (3, 1)), (2, (1, 4))]


@pytest.mark.parametrize("variant", kernels.VARIANTS_3D)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_heat3d_variants_match_reference_in_simulator(tmp_path, rng, dtype, variant):
    """Every 3-D kernel design gives the reference's bits (same expression, same order)."""
    cases, arrays = [], {}
    for tiling, block in TILINGS_3D_VARIANTS:
        for shape in [(1, 1, 1), (3, 3, 3), (2, 5, 4), (9, 6, 7), (7, 11, 5), (13, 4, 9)]:
            name = f"c{len(cases)}"
            arrays[name] = random_array(rng, shape, dtype)
            cases.append(
                {
                    "kind": "3d",
                    "name": name,
                    "steps": int(rng.integers(1, 4)),
                    "alpha": float(rng.choice([1 / 6, rng.uniform(0.0, 1 / 6)])),
                    "tiling": tiling,
                    "block": block,
                    "variant": variant,
                }
            )
    out = _run_in_simulator(tmp_path, cases, arrays)
    for c in cases:
        expected = kernels.heat3d_reference(arrays[c["name"]], c["steps"], c["alpha"])
        assert not np.array_equal(expected, arrays[c["name"]]) or min(arrays[c["name"]].shape) < 3
        _assert_same(out[c["name"]], expected, f"3-D {variant} {arrays[c['name']].shape} {c}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_max_abs_diff_matches_reference_in_simulator(tmp_path, rng, dtype):
    # Wider than one reduction block and taller than one row chunk, plus tiny ones.
    shapes = [(1, 1), (3, 5), (70, 300), (130, 257)]
    cases, arrays = [], {}
    for shape in shapes:
        name = f"r{len(cases)}"
        arrays[name + "_a"] = random_array(rng, shape, dtype)
        arrays[name + "_b"] = random_array(rng, shape, dtype)
        cases.append({"kind": "residual", "name": name})
    out = _run_in_simulator(tmp_path, cases, arrays)
    for c in cases:
        a, b = arrays[c["name"] + "_a"], arrays[c["name"] + "_b"]
        expected = kernels.max_abs_diff_reference(a, b)
        got = out[c["name"]]
        assert got.shape == (1,) and got.dtype == a.dtype
        assert got[0] == expected, f"{a.shape}: {got[0]!r} vs {expected!r}"


@pytest.mark.parametrize("ndim", [2, 3])
def test_edge_band_rows_read_only_the_rows_the_plan_fills_in_simulator(tmp_path, rng, ndim):
    """The tuned kernels' edge row over a band whose other rows are NaN is the full launch's row.

    This is what lets the MPI path compute its sent rows from a small band input
    (``Decomposition.edge_bands``): every strip kind (hot, edge, copied-through
    boundary) reads only the row itself and its two neighbours.
    """
    cases, arrays, checks = [], {}, []
    shape = (41, 13) if ndim == 2 else (23, 5, 7)
    block = (8, 2) if ndim == 2 else (4, 2)
    u = random_array(rng, shape, np.float32)
    alpha = float(rng.uniform(0.05, 0.25 if ndim == 2 else 1 / 6))
    ref = kernels.heat2d_reference if ndim == 2 else kernels.heat3d_reference
    expected = ref(u, 1, alpha)
    for align in (1, 4, 8):
        d = kernels.decomp.Decomposition(shape, 3, align)
        for s in d.slabs:
            for e in d.edge_bands(s.index):
                band = np.full((e.stop - e.start, *shape[1:]), np.nan, np.float32)
                band[e.band_index(e.copy_start) : e.band_index(e.copy_stop - 1) + 1] = u[
                    s.start + e.copy_start : s.start + e.copy_stop
                ]
                for h in e.halos:
                    band[e.band_index(h)] = u[s.start + h]
                name = f"b{len(cases)}"
                arrays[name] = band
                cases.append(
                    {"kind": f"{ndim}d", "name": name, "steps": 1, "alpha": alpha, "tiling": align, "block": block}
                )
                checks.append((name, e.band_row, s.start + e.row))
    out = _run_in_simulator(tmp_path, cases, arrays)
    for name, band_row, row in checks:
        got = out[name][band_row]
        assert not np.isnan(got).any(), (name, row)
        assert np.array_equal(got, expected[row]), (name, row)
