"""Pictures (matplotlib) and progress bars (tqdm) for the examples and benchmarks.

Both libraries come with the ``plot`` extra (``pip install "umem-numba[plot]"``)
and are imported only when a picture or a progress bar is asked for, so
``import umem_numba`` never needs them.  Figures are drawn on
:class:`matplotlib.figure.Figure` objects with the Agg canvas, never through
``pyplot``, so nothing here changes the caller's matplotlib backend or state.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "EXTRA",
    "MissingExtraError",
    "progress",
    "require",
    "require_plot_extra",
    "save_bar_chart",
    "save_field",
    "save_goal_chart",
]

#: The extra that installs what this module needs.
EXTRA = "plot"


class MissingExtraError(ImportError):
    """A picture or progress bar was asked for without the ``plot`` extra installed."""


def require(module: str) -> Any:
    """Import ``module`` (``"matplotlib"`` or ``"tqdm"``), or say which extra installs it.

    Parameters
    ----------
    module : str
        Top-level module name.

    Returns
    -------
    module
        The imported module.

    Raises
    ------
    MissingExtraError
        The module is not installed; the message names the extra to install.
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{module} is not installed; umem_numba draws pictures with matplotlib and shows progress "
            f"with tqdm, both in the '{EXTRA}' extra: pip install \"umem-numba[{EXTRA}]\" "
            f'(from a checkout: pip install -e ".[{EXTRA}]")'
        ) from exc


def require_plot_extra() -> None:
    """Check, before any long work, that matplotlib and tqdm are both installed.

    Raises
    ------
    MissingExtraError
        One of them is missing; the message names the extra to install.
    """
    require("matplotlib")
    require("tqdm")


def progress(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    leave: bool = True,
    disable: bool | None = None,
) -> Any:
    """A tqdm progress bar on stderr (``tqdm.auto``: a widget in notebooks).

    Parameters
    ----------
    iterable : iterable, optional
        Wrapped and iterated over; or ``None`` to call ``update`` by hand.
    total : int, optional
        The count that means 100% (default ``len(iterable)``).
    desc : str
        Label in front of the bar.
    unit : str
        What is counted.
    leave : bool
        Keep the finished bar on screen.
    disable : bool, optional
        ``True`` hides it; ``None`` hides it when stderr is not a terminal.

    Returns
    -------
    tqdm.tqdm
    """
    require("tqdm")
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, disable=disable)


def _figure(width: float, height: float) -> Any:
    require("matplotlib")
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _shrink(field: np.ndarray, max_pixels: int) -> np.ndarray:
    """Block means so that neither side exceeds ``max_pixels`` (trailing partial blocks dropped)."""
    h, w = field.shape
    fy, fx = -(-h // max_pixels), -(-w // max_pixels)
    if fy == 1 and fx == 1:
        return field
    hh, ww = h // fy * fy, w // fx * fx
    return field[:hh, :ww].reshape(hh // fy, fy, ww // fx, fx).mean(axis=(1, 3))


def save_field(
    path: str | os.PathLike,
    field: Any,
    *,
    title: str = "",
    vmin: float | None = None,
    vmax: float | None = None,
    cmap: str = "inferno",
    label: str = "",
    xlabel: str = "x (cell)",
    ylabel: str = "y (cell)",
    origin: str = "upper",
    max_pixels: int = 1024,
    dpi: int = 110,
) -> tuple[int, int]:
    """Write a 2-D field as a PNG heat map with axes, a colorbar and a title.

    Fields larger than ``max_pixels`` a side are drawn from block means (so a
    16384 x 16384 grid does not become a 4 GiB RGBA image); the axes still
    count cells of the full field.

    Parameters
    ----------
    path : str or path-like
        Output file; the format follows the suffix (``.png``).
    field : 2-D array_like of numbers
        Row 0 is drawn at the top (``origin="upper"``) or bottom (``"lower"``).
    title : str
        Figure title.
    vmin, vmax : float, optional
        Colour limits (default: the field's range).
    cmap : str
        A matplotlib colormap name.
    label : str
        Colorbar label.
    xlabel, ylabel : str
        Axis labels.
    origin : {"upper", "lower"}
        Where row 0 goes.
    max_pixels : int
        Largest side drawn at full resolution.
    dpi : int
        Resolution of the written image.

    Returns
    -------
    (rows, columns) : tuple of int
        The shape of the field as drawn (after block means).

    Raises
    ------
    ValueError
        Not a non-empty 2-D field, or ``max_pixels < 1``.
    MissingExtraError
        matplotlib is not installed.
    """
    f = np.asarray(field)
    if f.ndim != 2 or 0 in f.shape:
        raise ValueError(f"save_field needs a non-empty 2-D field, got shape {f.shape}")
    if max_pixels < 1:
        raise ValueError(f"max_pixels must be >= 1, got {max_pixels}")
    if origin not in ("upper", "lower"):
        raise ValueError(f"origin must be 'upper' or 'lower', got {origin!r}")
    n, m = f.shape
    drawn = _shrink(f.astype(np.float64, copy=False), max_pixels)
    fig = _figure(7.0, 6.0 * n / m + 0.8 if m >= n else 6.0)
    ax = fig.add_subplot()
    extent = (0, m, n, 0) if origin == "upper" else (0, m, 0, n)
    image = ax.imshow(drawn, cmap=cmap, vmin=vmin, vmax=vmax, origin=origin, extent=extent, interpolation="nearest")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    fig.colorbar(image, ax=ax, label=label, shrink=0.9)
    fig.savefig(path, dpi=dpi)
    return drawn.shape


def _fmt(value: float, unit: str) -> str:
    if unit == "x":
        return f"{value:.3g}x"
    return f"{value:.3g} {unit}".rstrip()


def save_goal_chart(path: str | os.PathLike, rows: Sequence[dict], *, title: str = "", dpi: int = 110) -> int:
    """Draw each benchmark figure against its goal: one small panel per figure.

    Every row gets its own horizontal bar on its own scale (a ratio and a
    time in microseconds do not share an axis), a dashed line at the goal,
    green when the goal is met and red when it is missed (grey without a goal).

    Parameters
    ----------
    path : str or path-like
        Output PNG.
    rows : sequence of dict
        Rows as the benchmarks' ``goal_row`` makes them: keys
        ``name``, ``value``, ``goal`` (or ``None``), ``higher_is_better`` and
        ``unit``.  Rows whose value is not a finite number are left out.
    title : str
        Figure title.
    dpi : int
        Resolution.

    Returns
    -------
    int
        The number of panels drawn.

    Raises
    ------
    MissingExtraError
        matplotlib is not installed.
    """
    drawn = [r for r in rows if isinstance(r.get("value"), (int, float)) and np.isfinite(r["value"])]
    # Long figure names are wrapped, so the bars keep their width whatever the labels.
    labels = [textwrap.fill(str(r["name"]), 44) for r in drawn]
    lines = sum(label.count("\n") + 1 for label in labels)
    fig = _figure(10.0, 0.55 * max(len(drawn), 1) + 0.3 * lines + (0.6 if title else 0.2))
    if title:
        fig.suptitle(title)
    if not drawn:
        fig.text(0.5, 0.5, "no figures", ha="center", va="center")
        fig.savefig(path, dpi=dpi)
        return 0
    axes = fig.subplots(len(drawn), 1, squeeze=False)[:, 0]
    for ax, r, label in zip(axes, drawn, labels, strict=True):  # one axis per drawn row
        value, goal, unit = float(r["value"]), r.get("goal"), r.get("unit", "x")
        met = r.get("met")
        color = "tab:gray" if goal is None else ("tab:green" if met else "tab:red")
        ax.barh([0], [value], color=color, height=0.6)
        top = max(value, float(goal) if goal is not None else 0.0, 1e-12) * 1.3
        ax.set_xlim(0, top)
        text = _fmt(value, unit)
        if goal is not None:
            ax.axvline(float(goal), color="k", ls="--", lw=1.2)
            sign = "\u2265" if r.get("higher_is_better", True) else "\u2264"
            text += f"  (goal {sign} {_fmt(float(goal), unit)}: {'met' if met else 'MISSED'})"
        ax.text(  # inside the panel's right edge: text past the axes would squeeze the layout
            0.99,
            0.5,
            text,
            transform=ax.transAxes,
            ha="right",
            va="center",
            fontsize=8,
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1.0},
            in_layout=False,
        )
        ax.set_yticks([0], [label], fontsize=8)
        ax.set_ylim(-0.6, 0.6)
        ax.tick_params(axis="x", labelsize=7)
    fig.savefig(path, dpi=dpi)
    return len(drawn)


def save_bar_chart(
    path: str | os.PathLike,
    labels: Sequence[str],
    values: Sequence[float],
    *,
    texts: Sequence[str] | None = None,
    reference: float | None = None,
    reference_label: str = "",
    xlabel: str = "",
    title: str = "",
    dpi: int = 110,
) -> None:
    """Horizontal bar chart with a value text per bar and an optional dashed reference line.

    Parameters
    ----------
    path : str or path-like
        Output PNG.
    labels : sequence of str
        One label per bar, top to bottom.
    values : sequence of float
        Bar lengths.
    texts : sequence of str, optional
        Written after each bar (default: the value).
    reference : float, optional
        Where to draw the reference line (a copy's bandwidth, say).
    reference_label : str
        Legend entry of the reference line.
    xlabel, title : str
        Axis label and title.
    dpi : int
        Resolution.

    Raises
    ------
    ValueError
        ``labels``, ``values`` and ``texts`` differ in length.
    MissingExtraError
        matplotlib is not installed.
    """
    vals = [float(v) for v in values]
    texts = [f"{v:.4g}" for v in vals] if texts is None else list(texts)
    if not (len(labels) == len(vals) == len(texts)):
        raise ValueError(f"{len(labels)} labels, {len(vals)} values and {len(texts)} texts: they must match")
    fig = _figure(10.0, 0.5 * len(vals) + 1.5)
    ax = fig.add_subplot()
    y = np.arange(len(vals))[::-1]
    ax.barh(y, vals, color=[f"C{i % 10}" for i in range(len(vals))])
    ax.set_yticks(y, list(labels))
    for yi, v, t in zip(y, vals, texts, strict=True):  # lengths checked above
        ax.text(v, yi, " " + t, va="center", fontsize=8)
    if reference is not None:
        ax.axvline(reference, color="k", ls="--", lw=1, label=reference_label or None)
        if reference_label:
            ax.legend(loc="lower right", fontsize=8)
    ax.set_xlim(0, max([*vals, reference or 0.0, 1e-12]) * 1.5)
    ax.set_xlabel(xlabel)
    if title:
        ax.set_title(title)
    fig.savefig(path, dpi=dpi)
