"""The stencil kernels on a real GPU, on every memory kind, against the NumPy references.

Random initial data, several steps (buffers swapped in between), every element
compared: float32 within 1e-5 relative, float64 within 1e-12 (the GPU may fuse
a multiply and an add where NumPy rounds twice); the fixed boundary exactly.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from numba import cuda
from support.helpers import random_array

import umem_numba as um
from umem_numba import _sim, kernels

pytestmark = pytest.mark.gpu

MEMORY = ["device", "managed", "managed-prefetch", "managed-advice", "vmm"]
TOLERANCE = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}


def _pair(memory: str, u0: np.ndarray):
    """Two buffers of ``u0``'s shape in ``memory`` (the first holding ``u0``) and a reader."""

    device = cuda.get_current_device().id
    if memory == "device":
        return cuda.to_device(u0), cuda.device_array(u0.shape, u0.dtype), lambda x: x.copy_to_host()
    if memory == "vmm":
        a, b = um.VMMBuffer.empty(u0.shape, u0.dtype), um.VMMBuffer.empty(u0.shape, u0.dtype)
        a.copy_from_host(u0)
        return a, b, lambda x: x.copy_to_host()
    a, b = um.ManagedBuffer.from_array(u0), um.ManagedBuffer.empty(u0.shape, u0.dtype)
    if memory in ("managed-prefetch", "managed-advice"):
        for buf in (a, b):
            if memory == "managed-advice":
                buf.apply_policy(um.MigrationPolicy.PREFER_DEVICE(device))
            buf.prefetch(device)
    return a, b, lambda x: np.array(x.host)  # .host waits for the launches (coherence)


def _close(*bufs) -> None:
    for b in bufs:
        if hasattr(b, "close"):
            b.close()


def _assert_close(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype, what
    rel = np.abs(got.astype(np.float64) - expected) / np.abs(expected.astype(np.float64))
    worst = np.unravel_index(np.argmax(rel), rel.shape)
    assert rel[worst] < TOLERANCE[got.dtype], (
        f"{what}: relative error {rel[worst]:.3e} at {worst}: {got[worst]!r} vs {expected[worst]!r}"
    )


def _assert_boundary_exact(got: np.ndarray, u0: np.ndarray, what: str) -> None:
    for axis in range(got.ndim):
        for end in (0, -1):
            index = [slice(None)] * got.ndim
            index[axis] = end
            np.testing.assert_array_equal(got[tuple(index)], u0[tuple(index)], err_msg=what)


# Smaller than a strip, one strip plus a bit, not multiples of the 256-wide block, tall and wide.
SHAPES_2D = [(1, 1), (2, 5), (5, 2), (3, 3), (17, 3), (18, 300), (34, 258), (33, 257), (300, 259), (1031, 517)]
SHAPES_3D = [(1, 1, 1), (3, 3, 3), (4, 5, 6), (10, 20, 70), (18, 7, 65), (37, 45, 130)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("memory", MEMORY)
def test_heat2d_matches_reference(rng, memory, dtype):
    for shape in SHAPES_2D:
        u0 = random_array(rng, shape, dtype)
        steps, alpha = int(rng.integers(1, 8)), float(rng.choice([0.25, rng.uniform(0, 0.25)]))
        a, b, read = _pair(memory, u0)
        try:
            for _ in range(steps):
                kernels.heat2d_step(a, b, alpha)
                a, b = b, a
            got = read(a)
        finally:
            _close(a, b)
        what = f"{memory} {shape} {np.dtype(dtype)} steps={steps} alpha={alpha}"
        _assert_close(got, kernels.heat2d_reference(u0, steps, alpha), what)
        _assert_boundary_exact(got, u0, what)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("memory", MEMORY)
def test_heat3d_matches_reference(rng, memory, dtype):
    for shape in SHAPES_3D:
        u0 = random_array(rng, shape, dtype)
        steps, alpha = int(rng.integers(1, 6)), float(rng.choice([1 / 6, rng.uniform(0, 1 / 6)]))
        a, b, read = _pair(memory, u0)
        try:
            for _ in range(steps):
                kernels.heat3d_step(a, b, alpha)
                a, b = b, a
            got = read(a)
        finally:
            _close(a, b)
        what = f"{memory} {shape} {np.dtype(dtype)} steps={steps} alpha={alpha}"
        _assert_close(got, kernels.heat3d_reference(u0, steps, alpha), what)
        _assert_boundary_exact(got, u0, what)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_other_tilings_match_reference(rng, dtype):
    """Register-blocking factors and blocks other than the tuned ones (the kernels are factories)."""

    for rows, block in [(1, (32, 4)), (3, (64, 2)), (8, (128, 2)), (32, (32, 1))]:
        u0 = random_array(rng, (203, 301), dtype)
        a, b = cuda.to_device(u0), cuda.device_array(u0.shape, u0.dtype)
        for _ in range(3):
            kernels.heat2d_step(a, b, 0.2, rows_per_thread=rows, block=block)
            a, b = b, a
        _assert_close(a.copy_to_host(), kernels.heat2d_reference(u0, 3, 0.2), f"2-D rows={rows} block={block}")
    for planes, block in [(1, (32, 2)), (5, (16, 8)), (16, (128, 1))]:
        u0 = random_array(rng, (41, 23, 67), dtype)
        a, b = cuda.to_device(u0), cuda.device_array(u0.shape, u0.dtype)
        for _ in range(3):
            kernels.heat3d_step(a, b, 0.1, planes_per_thread=planes, block=block)
            a, b = b, a
        _assert_close(a.copy_to_host(), kernels.heat3d_reference(u0, 3, 0.1), f"3-D planes={planes} block={block}")


@pytest.mark.parametrize("memory", ["device", "managed"])
def test_heat2d_on_strided_views(rng, memory):
    """A sub-rectangle view is a valid grid: only it changes, its own edges stay fixed."""
    u0 = random_array(rng, (90, 300), np.float32)
    a, b, read = _pair(memory, u0)
    try:
        va, vb = a[5:-7, 3:-11], b[5:-7, 3:-11]
        for _ in range(2):
            kernels.heat2d_step(va, vb, 0.2)
            va, vb = vb, va
        got_a = read(a)
    finally:
        _close(a, b)
    inner = u0[5:-7, 3:-11]
    _assert_close(got_a[5:-7, 3:-11], kernels.heat2d_reference(inner, 2, 0.2), f"{memory} view")
    outside = np.ones(u0.shape, bool)
    outside[5:-7, 3:-11] = False
    np.testing.assert_array_equal(got_a[outside], u0[outside])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_max_abs_diff_on_managed_memory_reads_without_synchronize(rng, dtype):
    # numba's simulator runs a Python thread per CUDA thread of this shared-memory reduction:
    # there, a grid of 2 x 2 blocks (more than one column and row chunk).
    shape = (70, 300) if _sim.active() else (700, 1300)
    a = um.ManagedBuffer.from_array(random_array(rng, shape, dtype))
    b = um.ManagedBuffer.from_array(random_array(rng, shape, dtype))
    res = um.ManagedBuffer.from_array(np.full(1, 123.0, dtype))
    try:
        expected = kernels.max_abs_diff_reference(a.host, b.host)
        kernels.max_abs_diff(a, b, res)
        assert res.host[0] == expected  # .host waits for exactly the reduction
        # Twice in a row: the reset on the device must drop the previous maximum.
        kernels.max_abs_diff(a, a[...], res)
        assert res.host[0] == 0
    finally:
        _close(a, b, res)


def test_bench_stencil_quick_run(tmp_path):
    from umem_numba._bench import stencil

    jpath, ppath = tmp_path / "s.json", tmp_path / "s.png"
    rc = stencil.main(["--size", "1030", "--steps", "3", "--trials", "2", "--json", str(jpath), "--png", str(ppath)])
    assert rc == 0
    data = json.loads(jpath.read_text())
    assert data["size"] == 1030 and data["bytes_per_step"] == 2 * 1030 * 1030 * 4
    assert data["copy"]["gbps"] > 0 and data["all_kinds_identical"] is True
    rows = {r["kind"]: r for r in data["results"]}
    assert list(rows) == list(stencil.KINDS)
    base = rows["device_array"]["gbps"]
    for kind, r in rows.items():
        if "skipped" in r:
            assert kind == "vmm", f"{kind} skipped: {r['skipped']}"
            continue
        assert r["gbps"] > 0 and r["identical_to_first_kind"] is True
        assert r["vs_device_array"] == pytest.approx(r["gbps"] / base)
        assert r["vs_copy"] == pytest.approx(r["gbps"] / data["copy"]["gbps"])
        assert len(r["gbps_trials"]) == 2
    assert rows["managed"]["first_sweep_gbps"] > 0
    assert rows["managed+prefetch"]["prefetch_gbps"] > 0
    assert "PREFER_DEVICE" in rows["managed+prefetch+advice"]["advice"]
    assert set(data["goals"]) == {"managed+prefetch / device_array", "stencil (device_array) / DtoD copy"}
    assert {f["name"] for f in data["figures"]} >= {
        "stencil on managed+prefetch / device_array",
        "stencil on device_array / device-to-device copy (float32)",
    }
    image = pytest.importorskip("matplotlib.image", reason="matplotlib (the plot extra) is not installed")
    chart = image.imread(ppath)
    # One coloured bar per kind plus the first sweep: the chart is not blank.
    assert chart.shape[0] > 50 and (np.abs(chart[..., :3] - 1.0).sum(axis=-1) > 0.3).mean() > 0.02


def test_bench_stencil_refuses_to_oversubscribe(capsys):
    from umem_numba._bench import stencil

    assert stencil.main(["--size", "400000"]) == 2
    err = capsys.readouterr().err
    assert "--allow-oversubscribe" in err and "free" in err
