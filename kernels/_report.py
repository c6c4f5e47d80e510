"""What the examples share: byte counts, the NumPy check, pictures, progress bars, the simulator fallback.

Pictures and progress bars come from matplotlib and tqdm (the ``plot`` extra);
they are imported on first use, with a clear error naming the extra when
they are missing.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

import numpy as np

from ._plot import MissingExtraError, progress, require_plot_extra, save_field

__all__ = [
    "MissingExtraError",
    "check_output_path",
    "human_bytes",
    "progress",
    "report_check",
    "require_plot_extra",
    "rerun_on_simulator",
    "save_field",
]


def human_bytes(n: float) -> str:
    """A byte count in binary units.

    Parameters
    ----------
    n : float
        Bytes.

    Returns
    -------
    str
        ``"512 B"``, ``"256 MiB"``, ``"1.50 GiB"``.

    Examples
    --------
    >>> human_bytes(268435456)
    '256 MiB'
    """
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def check_output_path(path: str | os.PathLike, option: str = "--out") -> None:
    """Refuse an output file that could not be written, before any work is done.

    The examples write their picture at the end of a run; checking first
    turns a missing or read-only folder into an argument error at the start
    instead of a traceback after the whole simulation.

    Parameters
    ----------
    path : str or path-like
        The file to be written (it may exist: it is replaced).
    option : str
        The command-line option that gave it, named in the message.

    Raises
    ------
    ValueError
        The folder does not exist, is not a folder, or is not writable, or
        ``path`` is a folder; the message names the option and the path.

    Examples
    --------
    >>> check_output_path("/missing/dir/plate.png")
    Traceback (most recent call last):
    ...
    ValueError: --out /missing/dir/plate.png: folder /missing/dir does not exist
    """
    name = os.fspath(path)
    folder = os.path.dirname(name) or "."
    if os.path.isdir(name):
        raise ValueError(f"{option} {name}: is a folder; give a file name (e.g. {os.path.join(name, 'out.png')})")
    if not os.path.exists(folder):
        raise ValueError(f"{option} {name}: folder {folder} does not exist")
    if not os.path.isdir(folder):
        raise ValueError(f"{option} {name}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(name) and not os.access(name, os.W_OK)):
        raise ValueError(f"{option} {name}: cannot write there (permission denied)")


def report_check(result: Any, expected: Any, steps: int) -> int:
    """Print how far ``result`` is from a NumPy reference, and whether that is rounding.

    The error is the largest absolute difference relative to the largest
    absolute value of ``expected``; the tolerance is 1e-5 for float32 and
    1e-12 for float64 (the GPU may fuse multiply-adds, NumPy does not).

    Parameters
    ----------
    result : ndarray
        What the GPU computed.
    expected : ndarray
        The reference (:func:`heat2d_reference` ...), same shape.
    steps : int
        Steps both ran, for the message.

    Returns
    -------
    int
        0 within the tolerance, else 1 (an exit status).

    Raises
    ------
    ValueError
        The shapes differ.
    """
    result, expected = np.asarray(result), np.asarray(expected)
    if result.shape != expected.shape:
        raise ValueError(f"result has shape {result.shape}, the reference {expected.shape}")
    scale = max(float(np.max(np.abs(expected))) if expected.size else 0.0, 1e-30)
    error = float(np.max(np.abs(result - expected))) / scale if result.size else 0.0
    tolerance = 1e-5 if result.dtype == np.float32 else 1e-12
    verdict = "OK" if error < tolerance else "MISMATCH"
    print(
        f"check against NumPy ({steps} steps): max error {error:.2e} of the largest value "
        f"(tolerance {tolerance:.0e}): {verdict}"
    )
    return 0 if error < tolerance else 1


def rerun_on_simulator(script: str, argv: list[str], what: str) -> NoReturn:
    """No GPU: say so in one line and run ``script`` again under numba's CUDA simulator.

    The simulator must be chosen before ``numba.cuda`` is first imported, so a
    fresh interpreter runs the script (``NUMBA_ENABLE_CUDASIM=1``); this
    process is replaced and its exit status is the run's.

    Parameters
    ----------
    script : str
        The example's path (its ``__file__``).
    argv : list of str
        Its command-line arguments.
    what : str
        What will run, e.g. ``"a 64 x 64 plate for 60 steps"``.
    """
    name = os.path.splitext(os.path.basename(script))[0]
    print(
        f"{name}: no CUDA GPU here (`python -m umem_numba info` says why): running {what} "
        "on numba's CUDA simulator instead",
        flush=True,
    )
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    os.execve(sys.executable, [sys.executable, os.path.abspath(script), *argv], env)
