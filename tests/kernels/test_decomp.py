"""Slab decomposition on the host: layout rules, strip-path equivalence, bitwise slab runs vs one domain."""

from __future__ import annotations

import numpy as np
import pytest
from support.helpers import random_array

from umem_numba import kernels
from umem_numba.kernels import decomp


def _path(i: int, n: int, r: int) -> str:
    """Which code path of heat2d_kernel/heat3d_kernel computes row i of an n-row launch with strips of r rows."""
    i0 = (i // r) * r
    if i0 > 0 and i0 + r < n:
        return "hot"
    return "copy" if i in (0, n - 1) else "edge"


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 33, 64, 100, 257])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("align", [1, 4, 8, 16])
def test_layout_covers_and_matches_kernel_paths(n: int, parts: int, align: int) -> None:
    if n < parts:
        with pytest.raises(ValueError, match="cannot be cut into"):
            decomp.Decomposition((n, 8), parts, align)
        return
    d = decomp.Decomposition((n, 8), parts, align)
    owned = np.zeros(n, int)
    for s in d.slabs:
        assert 0 <= s.start <= s.lo < s.hi <= s.stop <= n
        assert s.start % align == 0
        owned[s.lo : s.hi] += 1
        if s.lo > 0:
            assert s.start <= s.lo - 1
        if s.hi < n:
            assert s.stop >= s.hi + 1
        # Every owned row takes the same kernel path in the slab launch as in the global one.
        for i in range(s.lo, s.hi):
            assert _path(i - s.start, s.stored, align) == _path(i, n, align), (s, i)
            b0, b1 = d.band(s.index, i)
            assert _path(i - s.start - b0, b1 - b0, align) == _path(i, n, align), (s, i, b0, b1)
            assert b1 - b0 <= 2 * align + 1
    assert (owned == 1).all()


def test_split_prefers_aligned_cuts() -> None:
    assert decomp.split_rows(1024, 4, 16) == [(0, 256), (256, 512), (512, 768), (768, 1024)]
    cuts = decomp.split_rows(1000, 3, 16)
    assert [lo % 16 for lo, _ in cuts] == [0, 0, 0]
    assert decomp.split_rows(5, 4, 16) == [(0, 1), (1, 2), (2, 3), (3, 5)]  # aligning would empty a slab


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        decomp.split_rows(10, 0)
    with pytest.raises(ValueError, match="2-D or 3-D"):
        decomp.Decomposition((10,), 2)
    with pytest.raises(ValueError, match="cannot be cut into 4 slabs"):
        decomp.Decomposition((3, 100), 4)


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_scatter_gather_roundtrip(rng: np.random.Generator, parts: int) -> None:
    u = random_array(rng, (37, 11), np.float32)
    d = decomp.Decomposition(u.shape, parts, align=8)
    fields = d.scatter(u)
    assert [f.shape for f in fields] == [d.local_shape(k) for k in range(parts)]
    np.testing.assert_array_equal(d.gather(fields), u)


def test_moves_fill_halos_from_neighbours(rng: np.random.Generator) -> None:
    u = random_array(rng, (40, 6), np.float64)
    d = decomp.Decomposition(u.shape, 3, align=4)
    fields = [np.full(d.local_shape(k), np.nan) for k in range(3)]
    for s, f in zip(d.slabs, fields, strict=True):
        f[s.owned] = u[s.lo : s.hi]
    decomp.LocalExchange(d).exchange(fields)
    for s, f in zip(d.slabs, fields, strict=True):
        for r in s.halo_rows:
            np.testing.assert_array_equal(f[r], u[s.start + r])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("align", [1, 16])
def test_slab_run_bitwise_2d(rng: np.random.Generator, dtype, parts: int, align: int) -> None:
    u0 = random_array(rng, (71, 29), dtype)
    alpha = float(rng.uniform(0.05, 0.25))
    expected = kernels.heat2d_reference(u0, 23, alpha)
    got = decomp.heat_slabs_reference(u0, 23, parts, alpha, align=align)
    assert got.dtype == expected.dtype
    assert np.array_equal(got, expected)
    assert not np.array_equal(got, u0)


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("align", [1, 8])
def test_slab_run_bitwise_3d(rng: np.random.Generator, parts: int, align: int) -> None:
    u0 = random_array(rng, (30, 9, 12), np.float32)
    expected = kernels.heat3d_reference(u0, 11)
    got = decomp.heat_slabs_reference(u0, 11, parts, align=align)
    assert np.array_equal(got, expected)
    assert not np.array_equal(got, u0)


def test_slab_run_keeps_global_boundary(rng: np.random.Generator) -> None:
    u0 = random_array(rng, (20, 10), np.float64)
    got = decomp.heat_slabs_reference(u0, 7, 4)
    for edge in (np.s_[0], np.s_[-1], np.s_[:, 0], np.s_[:, -1]):
        np.testing.assert_array_equal(got[edge], u0[edge])


# -- the overlapped schedule: edge bands ------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 33, 64, 100])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("align", [1, 4, 16])
def test_edge_bands_compute_the_edge_rows_from_the_copied_and_halo_rows(
    rng: np.random.Generator, n: int, parts: int, align: int
) -> None:
    """Each edge row, computed over its band from only the rows the plan fills (the rest NaN), is the global one."""
    if n < parts:
        return
    u = random_array(rng, (n, 9), np.float64)
    d = decomp.Decomposition(u.shape, parts, align)
    alpha = float(rng.uniform(0.05, 0.25))
    expected = kernels.heat2d_reference(u, 1, alpha)
    for s in d.slabs:
        bands = d.edge_bands(s.index)
        assert [e.peer for e in bands] == [k for k in (s.index - 1, s.index + 1) if 0 <= k < parts]
        for e in bands:
            assert (e.start, e.stop) == d.band(s.index, s.start + e.row)
            assert e.row in (s.owned.start, s.owned.stop - 1) and e.halo in s.halo_rows
            assert e.start <= e.copy_start <= e.row < e.copy_stop <= e.stop
            assert all(h in s.halo_rows for h in e.halos)
            assert e.copy_stop - e.copy_start + len(e.halos) <= 3
            bi = np.full((e.stop - e.start, 9), np.nan)
            bi[e.copy_start - e.start : e.copy_stop - e.start] = u[s.start + e.copy_start : s.start + e.copy_stop]
            for h in e.halos:
                bi[e.band_index(h)] = u[s.start + h]
            with np.errstate(invalid="ignore"):
                got = kernels.heat2d_reference(bi, 1, alpha)[e.band_row]
            np.testing.assert_array_equal(got, expected[s.start + e.row])
        if bands:
            with pytest.raises(IndexError, match="not in the band"):
                bands[0].band_index(bands[0].stop)


def test_edge_bands_single_row_slab_reads_both_halos() -> None:
    d = decomp.Decomposition((5, 4), 4)  # slabs [0,1) [1,2) [2,3) [3,5)
    top, bottom = d.edge_bands(1)
    assert top.row == bottom.row == d.slabs[1].local(1)
    assert top.halos == bottom.halos == (d.slabs[1].local(0), d.slabs[1].local(2))
    assert (top.copy_start, top.copy_stop) == (top.row, top.row + 1)
    (only,) = d.edge_bands(0)  # row 0 is the global boundary: copied through, reads only itself
    assert only.halos == () and (only.copy_start, only.copy_stop) == (0, 1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("align", [1, 4, 16])
def test_overlapped_schedule_bitwise_2d(rng: np.random.Generator, dtype, parts: int, align: int) -> None:
    u0 = random_array(rng, (71, 29), dtype)
    alpha = float(rng.uniform(0.05, 0.25))
    expected = kernels.heat2d_reference(u0, 23, alpha)
    got = decomp.heat_slabs_overlapped(u0, 23, parts, alpha, align=align, band_fill=np.nan)
    assert got.dtype == expected.dtype
    assert np.array_equal(got, expected)
    assert not np.array_equal(got, u0)


@pytest.mark.parametrize("parts", [2, 3, 5])
def test_overlapped_schedule_bitwise_3d_and_thin_slabs(rng: np.random.Generator, parts: int) -> None:
    u0 = random_array(rng, (7, 9, 12), np.float32)  # 5 slabs of 7 planes: slabs of one plane
    expected = kernels.heat3d_reference(u0, 9)
    got = decomp.heat_slabs_overlapped(u0, 9, parts, align=1)
    assert np.array_equal(got, expected)
    got = decomp.heat_slabs_overlapped(random_array(rng, (30, 9, 12), np.float32), 9, parts, align=8)
    assert got.shape == (30, 9, 12)


def test_overlapped_schedule_needs_the_fixups(rng: np.random.Generator) -> None:
    """Without the received rows the edge rows go wrong: the exchange is really exercised."""
    u0 = random_array(rng, (40, 12), np.float64)
    expected = kernels.heat2d_reference(u0, 6)
    d = decomp.Decomposition(u0.shape, 2, 4)
    stale = [f.copy() for f in d.scatter(u0)]
    for _ in range(6):  # slab steps with stale halos only
        stale = [kernels.heat2d_reference(f, 1) for f in stale]
    assert not np.array_equal(d.gather(stale), expected)
    assert np.array_equal(decomp.heat_slabs_overlapped(u0, 6, 2, align=4), expected)
