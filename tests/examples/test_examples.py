"""The examples: ``--help`` and argument errors anywhere; end to end on a small grid with a GPU.

The end-to-end runs use each example's ``--check``/``--verify``, which
compares the GPU's result with the NumPy reference and fails the run (exit 1)
on a mismatch; the tests also read back the PNG the example wrote (matplotlib)
and check that the hot and the cold parts of the field are drawn in the
colormap's hot and cold colours where they should be.  The examples' output
must be their own: no library warnings on stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], check=False, capture_output=True, text=True, timeout=timeout
    )


def _colours(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The field's columns of the PNG as RGB floats, and inferno's hottest and coldest colours.

    The colorbar holds both colours too, so it is cut off: across the middle
    of the picture, the widest run of non-white columns is the field (the
    others are tick labels, the axis label and the narrow colorbar).
    """
    image = pytest.importorskip("matplotlib.image", reason="matplotlib (the plot extra) is not installed")
    from matplotlib import colormaps

    rgb = image.imread(path)[..., :3]
    h = rgb.shape[0]
    inked = np.flatnonzero((rgb[int(0.3 * h) : int(0.7 * h)] < 0.97).any(axis=-1).any(axis=0))
    runs = np.split(inked, np.flatnonzero(np.diff(inked) > 1) + 1)
    field = max(runs, key=len)
    cmap = colormaps["inferno"]
    return rgb[:, field[0] : field[-1] + 1], np.array(cmap(1.0)[:3]), np.array(cmap(0.0)[:3])


def _where(rgb: np.ndarray, colour: np.ndarray) -> np.ndarray:
    # 1.5/255: the PNG rounds to 8 bits; near-black antialiased text (grey) cannot match inferno(0).
    return np.all(np.abs(rgb - colour) < 1.5 / 255, axis=-1)


def _no_library_warnings(stderr: str) -> None:
    assert "Warning" not in stderr, f"the example printed a library warning:\n{stderr}"


@pytest.mark.parametrize(
    "script, options",
    [
        (
            "heat2d.py",
            ["--memory", "managed-prefetch", "vmm", "--size", "--steps", "--out", "--check", "--allow-oversubscribe"],
        ),
        ("heat3d.py", ["--memory", "--size", "--steps", "--out", "--check", "--allow-oversubscribe"]),
        ("residual.py", ["--size", "--check-every", "--tol", "--max-steps", "--verify", "--out"]),
    ],
)
def test_help_runs_anywhere(script, options):
    proc = _run(script, "--help", timeout=120)
    assert proc.returncode == 0, proc.stderr
    for option in options:
        assert option in proc.stdout, f"{script} --help does not mention {option}"


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("heat2d.py", ["--size", "2"], "--size must be at least 3"),
        ("heat2d.py", ["--steps", "0"], "--steps must be at least 1"),
        ("heat2d.py", ["--alpha", "0.3"], "--alpha must be in [0, 0.25]"),
        ("heat2d.py", ["--graph", "3"], "--graph must be an even number of steps"),
        ("heat2d.py", ["--memory", "texture"], "invalid choice"),
        ("heat2d.py", ["--size", "big"], "invalid int value"),
        ("heat3d.py", ["--alpha", "0.2"], "--alpha must be in [0, 1/6]"),
        ("heat3d.py", ["--memory", "vmm"], "invalid choice"),
        ("residual.py", ["--tol", "0"], "--tol must be positive"),
        ("residual.py", ["--check-every", "0"], "must be at least 1"),
        # issue #30 item 7: a picture that cannot be written is refused before any work
        ("heat2d.py", ["--out", "/missing/dir/h.png"], "--out /missing/dir/h.png: folder /missing/dir does not exist"),
        ("heat2d.py", ["--out", __file__ + "/h.png"], f"--out {__file__}/h.png: {__file__} is not a folder"),
        ("heat3d.py", ["--out", "/missing/dir/c.png"], "--out /missing/dir/c.png: folder /missing/dir does not exist"),
        ("residual.py", ["--out", "/missing/r.png"], "--out /missing/r.png: folder /missing does not exist"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(script, args, message):
    proc = _run(script, *args, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and not proc.stdout  # refused before any work


@pytest.mark.gpu
@pytest.mark.parametrize(
    "memory, dtype",
    [
        ("device", "float32"),
        ("managed", "float32"),
        ("managed-prefetch", "float32"),
        ("managed-prefetch", "float64"),
        ("vmm", "float32"),
    ],
)
def test_heat2d_end_to_end(tmp_path, memory, dtype):
    out = tmp_path / "plate.png"
    proc = _run(
        "heat2d.py",
        "--memory",
        memory,
        "--dtype",
        dtype,
        "--size",
        "300",
        "--steps",
        "25",
        "--check",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "GB/s achieved" in proc.stdout
    assert "check against NumPy (25 steps)" in proc.stdout and ": OK" in proc.stdout
    _no_library_warnings(proc.stderr)
    rgb, hot, cold = _colours(out)
    # Row by row through the middle of the plate: the hot left edge is drawn (hot colour)
    # left of the cold interior between the discs (cold colour), both over many pixels.
    hot_px, cold_px = _where(rgb, hot), _where(rgb, cold)
    assert hot_px.sum() > 50 and cold_px.sum() > 1000
    mid = rgb.shape[0] // 2
    # The hot edge is one cell of 300 wide (a pixel or two, blended), so it is not
    # located here; the field's values are checked against NumPy by --check.
    assert np.flatnonzero(cold_px[mid]).size > 50


@pytest.mark.gpu
@pytest.mark.parametrize("memory", ["device", "managed-prefetch", "vmm"])
def test_heat2d_with_graphs_end_to_end(tmp_path, memory):
    """``--graph 6`` over 25 steps: four graph launches and one plain step, checked against NumPy."""
    if memory == "device" and os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("the simulated driver refuses numba's own launches inside a capture (a GPU captures them)")
    out = tmp_path / "plate.png"
    proc = _run(
        "heat2d.py", "--memory", memory, "--size", "300", "--steps", "25", "--graph", "6", "--check", "--out", str(out)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "check against NumPy (25 steps)" in proc.stdout and ": OK" in proc.stdout
    _no_library_warnings(proc.stderr)


@pytest.mark.gpu
@pytest.mark.parametrize("memory", ["device", "managed", "managed-prefetch"])
def test_heat3d_end_to_end(tmp_path, memory):
    out = tmp_path / "cube.png"
    proc = _run("heat3d.py", "--memory", memory, "--size", "40", "--steps", "12", "--check", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "GB/s achieved" in proc.stdout and ": OK" in proc.stdout
    _no_library_warnings(proc.stderr)
    rgb, hot, cold = _colours(out)
    # The slice is drawn with the hot bottom face at the bottom: the lowest rows holding
    # the hot colour lie below the lowest rows holding the cold colour.
    hot_rows = np.flatnonzero(_where(rgb, hot).any(axis=1))
    cold_rows = np.flatnonzero(_where(rgb, cold).any(axis=1))
    assert hot_rows.size and cold_rows.size and hot_rows.max() > cold_rows.max()


@pytest.mark.gpu
def test_residual_end_to_end(tmp_path):
    out = tmp_path / "laplace.png"
    proc = _run("residual.py", "--size", "48", "--check-every", "300", "--tol", "1e-4", "--verify", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "converged after" in proc.stdout and "MISMATCH" not in proc.stderr
    rgb, hot, cold = _colours(out)
    # Laplace with a hot top edge: hot at the top of the plate, cold towards the bottom.
    hot_rows = np.flatnonzero(_where(rgb, hot).any(axis=1))
    cold_rows = np.flatnonzero(_where(rgb, cold).any(axis=1))
    assert hot_rows.size and cold_rows.size and hot_rows.min() < cold_rows.min()


@pytest.mark.gpu
@pytest.mark.parametrize("script", ["heat2d.py", "heat3d.py"])
def test_examples_refuse_to_oversubscribe(script):
    size = "400000" if script == "heat2d.py" else "20000"
    proc = _run(script, "--size", size, timeout=120)
    assert proc.returncode == 2
    assert "--allow-oversubscribe" in proc.stderr and "free" in proc.stderr


# Runs an example with matplotlib's Figure.savefig wrapped: before each picture is written, every
# visible text of the figure (title, labels, ticks, colorbar) is measured against the figure's edges.
_TEXT_MEASURE = """
import json, runpy, sys
from matplotlib.figure import Figure
from matplotlib.text import Text

save = Figure.savefig

def savefig(fig, *args, **kwargs):
    fig.draw_without_rendering()  # lays the texts out as the picture will
    edge = fig.bbox
    outside = []
    for text in fig.findobj(Text):
        if text.get_visible() and text.get_text():
            box = text.get_window_extent()
            if box.x0 < edge.x0 - 0.5 or box.y0 < edge.y0 - 0.5 or box.x1 > edge.x1 + 0.5 or box.y1 > edge.y1 + 0.5:
                outside.append([text.get_text(), [round(v, 1) for v in box.extents], [edge.width, edge.height]])
    print("TEXT OUTSIDE THE PICTURE " + json.dumps(outside))
    return save(fig, *args, **kwargs)

Figure.savefig = savefig
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("memory", ["managed-prefetch", "vmm"])
def test_heat2d_picture_shows_its_whole_title(tmp_path, memory):
    """Issue #19 (small): the main job's picture cut its title off at the right edge; every text now fits.

    The example runs on numba's simulator (CPU, a small plate); its title names the size, the steps,
    the memory kind and the simulator, so it is at least as long as a GPU run's of the same kind.
    """
    pytest.importorskip("matplotlib", reason="matplotlib (the plot extra) is not installed")
    script = tmp_path / "measure.py"
    script.write_text(_TEXT_MEASURE)
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            str(EXAMPLES / "heat2d.py"),
            "--memory",
            memory,
            "--dtype",
            "float64",
            "--size",
            "1000",
            "--steps",
            "1",
            "--out",
            str(tmp_path / "plate.png"),
        ],
        env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    measured = [ln for ln in proc.stdout.splitlines() if ln.startswith("TEXT OUTSIDE THE PICTURE ")]
    assert len(measured) == 1, proc.stdout
    assert json.loads(measured[0].removeprefix("TEXT OUTSIDE THE PICTURE ")) == []
