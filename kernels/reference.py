"""NumPy references for the kernels: same formulas, same evaluation order, same dtype.

The GPU kernels may fuse a multiply and an add (FMA), so they agree with
these to rounding (relative 1e-6 for float32 after tens of steps), not
bitwise; the boundary handling matches exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._common import stencil_weights

__all__ = [
    "heat2d_reference",
    "heat2d_step_reference",
    "heat3d_reference",
    "heat3d_step_reference",
    "max_abs_diff_reference",
]


def heat2d_step_reference(src: np.ndarray, alpha: float = 0.25, out: np.ndarray | None = None) -> np.ndarray:
    """One five-point heat step on the host, boundary copied through.

    Parameters
    ----------
    src : 2-D float32 or float64 ndarray
    alpha : float
        Diffusion number in ``[0, 0.25]``.
    out : ndarray, optional
        Where to write (same shape and dtype, not ``src``).

    Returns
    -------
    ndarray
        ``out`` (or a new array).
    """
    src = np.asarray(src)
    if src.ndim != 2:
        raise ValueError(f"src must be 2-D, got shape {src.shape}")
    wc, wn = stencil_weights(alpha, 2, src.dtype)
    out = np.empty_like(src) if out is None else out
    out[...] = src  # boundary (and, for grids under 3 wide, everything)
    if src.shape[0] >= 3 and src.shape[1] >= 3:
        u = src[1:-1, 1:-1]
        out[1:-1, 1:-1] = wc * u + wn * ((src[:-2, 1:-1] + src[2:, 1:-1]) + (src[1:-1, :-2] + src[1:-1, 2:]))
    return out


def heat2d_reference(u0: Any, steps: int, alpha: float = 0.25) -> np.ndarray:
    """``steps`` five-point heat steps from ``u0`` (a new array; ``u0`` is not modified)."""
    a = np.array(u0, copy=True)
    b = np.empty_like(a)
    for _ in range(int(steps)):
        heat2d_step_reference(a, alpha, out=b)
        a, b = b, a
    return a


def heat3d_step_reference(src: np.ndarray, alpha: float = 1.0 / 6.0, out: np.ndarray | None = None) -> np.ndarray:
    """One seven-point heat step on the host for a ``(nz, ny, nx)`` grid, faces copied through."""
    src = np.asarray(src)
    if src.ndim != 3:
        raise ValueError(f"src must be 3-D, got shape {src.shape}")
    wc, wn = stencil_weights(alpha, 3, src.dtype)
    out = np.empty_like(src) if out is None else out
    out[...] = src
    if min(src.shape) >= 3:
        c = (slice(1, -1),) * 3
        u = src[c]
        below, above = src[:-2, 1:-1, 1:-1], src[2:, 1:-1, 1:-1]
        south, north = src[1:-1, :-2, 1:-1], src[1:-1, 2:, 1:-1]
        west, east = src[1:-1, 1:-1, :-2], src[1:-1, 1:-1, 2:]
        out[c] = wc * u + wn * (((below + above) + (south + north)) + (west + east))
    return out


def heat3d_reference(u0: Any, steps: int, alpha: float = 1.0 / 6.0) -> np.ndarray:
    """``steps`` seven-point heat steps from ``u0`` (a new array)."""
    a = np.array(u0, copy=True)
    b = np.empty_like(a)
    for _ in range(int(steps)):
        heat3d_step_reference(a, alpha, out=b)
        a, b = b, a
    return a


def max_abs_diff_reference(a: Any, b: Any) -> np.floating:
    """``max |a - b|`` in the arrays' dtype (0 for empty arrays)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.size == 0:
        return a.dtype.type(0)
    return np.max(np.abs(a - b))
