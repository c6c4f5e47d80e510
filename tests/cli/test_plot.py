"""Pictures and progress bars (matplotlib, tqdm: the ``plot`` extra), and the helpers the examples share.

The pictures are read back with matplotlib and checked for what they must
show: where the hot and the cold parts of a field are drawn, which bars are
green (goal met) and red (goal missed).  No GPU needed.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from umem_numba import kernels
from umem_numba.kernels import _plot

mpl_image = pytest.importorskip("matplotlib.image", reason="matplotlib (the plot extra) is not installed")


def _inferno(value: float) -> np.ndarray:
    from matplotlib import colormaps

    return np.array(colormaps["inferno"](value)[:3])


def _mask(rgb: np.ndarray, colour: np.ndarray, tol: float = 1.5 / 255) -> np.ndarray:
    return np.all(np.abs(rgb - colour) < tol, axis=-1)


def test_importing_the_package_loads_neither_matplotlib_nor_tqdm():
    code = (
        "import sys, umem_numba, umem_numba.kernels, umem_numba.__main__; "
        "print('matplotlib' in sys.modules, 'tqdm' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("origin", ["upper", "lower"])
def test_save_field_draws_hot_and_cold_where_they_are(tmp_path, rng, origin):
    n, m = int(rng.integers(60, 200)), int(rng.integers(60, 200))
    split = int(rng.integers(n // 4, 3 * n // 4))
    field = np.zeros((n, m), np.float32)
    field[:split] = 1.0  # rows 0..split-1 hot, the rest cold
    path = tmp_path / "f.png"
    assert _plot.save_field(path, field, vmin=0.0, vmax=1.0, title="t", label="temperature", origin=origin) == (n, m)
    rgb = mpl_image.imread(path)[..., :3]
    hot, cold = _mask(rgb, _inferno(1.0)), _mask(rgb, _inferno(0.0))
    # Columns that hold both colours cross the field (the colorbar holds both too, but
    # there the hot end is on top, so look at the field's columns: the widest such run).
    both = np.flatnonzero(hot.any(axis=0) & cold.any(axis=0))
    assert both.size > 20
    col = both[both.size // 4]  # inside the field, left of the colorbar
    hot_rows, cold_rows = np.flatnonzero(hot[:, col]), np.flatnonzero(cold[:, col])
    if origin == "upper":  # row 0 on top: hot above cold
        assert hot_rows.mean() < cold_rows.mean()
    else:
        assert hot_rows.mean() > cold_rows.mean()
    # The areas follow the split, give or take the pixels of one cell.
    frac = hot_rows.size / (hot_rows.size + cold_rows.size)
    assert abs(frac - split / n) < 0.05


def test_save_field_shrinks_big_fields_by_block_means(tmp_path, rng):
    field = rng.random((2050, 999))
    assert _plot.save_field(tmp_path / "g.png", field, max_pixels=500) == (410, 499)
    small = _plot._shrink(field, 500)
    np.testing.assert_allclose(small[3, 7], field[15:20, 14:16].mean())
    assert _plot._shrink(field[:40, :30], 500).shape == (40, 30)


def test_save_field_refuses_bad_fields(tmp_path):
    for bad in (np.zeros(5), np.zeros((0, 4)), np.zeros((2, 2, 2))):
        with pytest.raises(ValueError, match="non-empty 2-D field"):
            _plot.save_field(tmp_path / "x.png", bad)
    with pytest.raises(ValueError, match="max_pixels"):
        _plot.save_field(tmp_path / "x.png", np.zeros((2, 2)), max_pixels=0)
    with pytest.raises(ValueError, match="origin"):
        _plot.save_field(tmp_path / "x.png", np.zeros((2, 2)), origin="left")


def test_goal_chart_colours_met_green_and_missed_red(tmp_path, rng):
    from matplotlib.colors import to_rgb

    from umem_numba._bench._common import goal_row

    value = float(rng.uniform(0.5, 0.9))
    rows = [
        goal_row("met, higher is better", value + 0.2, value),
        goal_row("missed, lower is better", value + 0.3, value, higher_is_better=False, unit="µs"),
        goal_row("no goal", value),
        goal_row("not a number", float("nan"), 1.0),
    ]
    path = tmp_path / "goals.png"
    assert _plot.save_goal_chart(path, rows, title="goals") == 3  # the NaN row is left out
    rgb = mpl_image.imread(path)[..., :3]
    green, red, grey = (_mask(rgb, np.array(to_rgb(c)), 2 / 255) for c in ("tab:green", "tab:red", "tab:gray"))
    assert green.sum() > 200 and red.sum() > 200 and grey.sum() > 200
    # Panels top to bottom in row order: green bar above the red one, the grey one last.
    g, r, y = (np.flatnonzero(m.any(axis=1)).mean() for m in (green, red, grey))
    assert g < r < y


def test_bar_chart_checks_its_inputs_and_draws(tmp_path, rng):
    values = rng.uniform(10, 100, 3)
    path = tmp_path / "bars.png"
    _plot.save_bar_chart(
        path,
        ["a", "b", "c"],
        values,
        reference=float(values.max() * 1.1),
        reference_label="copy",
        xlabel="GB/s",
        title="t",
    )
    rgb = mpl_image.imread(path)[..., :3]
    from matplotlib.colors import to_rgb

    widths = [_mask(rgb, np.array(to_rgb(f"C{i}")), 2 / 255).sum(axis=1).max() for i in range(3)]
    # Bar lengths in pixels follow the values.
    assert np.argsort(widths).tolist() == np.argsort(values).tolist()
    with pytest.raises(ValueError, match="must match"):
        _plot.save_bar_chart(path, ["a"], [1.0, 2.0])


def test_missing_extra_names_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    monkeypatch.delitem(sys.modules, "matplotlib", raising=False)
    with pytest.raises(_plot.MissingExtraError, match=r"umem-numba\[plot\]") as err:
        _plot.require_plot_extra()
    assert "matplotlib" in str(err.value)
    assert isinstance(err.value, ImportError)


def test_progress_counts_with_tqdm():
    pytest.importorskip("tqdm", reason="tqdm (the plot extra) is not installed")
    with _plot.progress(total=7, desc="x", disable=False) as bar:
        for _ in range(5):
            bar.update(1)
        assert bar.n == 5 and bar.total == 7
    assert list(_plot.progress(range(4), desc="y")) == [0, 1, 2, 3]


def test_human_bytes():
    assert kernels.human_bytes(512) == "512 B"
    assert kernels.human_bytes(268435456) == "256 MiB"
    assert kernels.human_bytes(3 * 2**30 // 2) == "1.50 GiB"
    assert kernels.human_bytes(2048) == "2 KiB"


@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-5), (np.float64, 1e-12)])
def test_report_check_reports_rounding_and_mismatch(rng, capsys, dtype, tol):
    expected = (rng.random((30, 40)) + 0.5).astype(dtype)
    close = expected.copy()
    close[3, 4] += dtype(tol * 0.1 * float(np.abs(expected).max()))
    assert kernels.report_check(close, expected, 9) == 0
    out = capsys.readouterr().out
    assert "check against NumPy (9 steps)" in out and ": OK" in out
    far = expected.copy()
    far[7, 8] += dtype(tol * 10 * float(np.abs(expected).max()))
    assert kernels.report_check(far, expected, 9) == 1
    assert "MISMATCH" in capsys.readouterr().out
    with pytest.raises(ValueError, match="shape"):
        kernels.report_check(expected[:2], expected, 1)
