"""Small helpers for the examples: a progress bar on stderr (no dependency) and byte counts."""

from __future__ import annotations

import sys
import time
from typing import TextIO

import numpy as np


class ProgressBar:
    """``[#####-----]  52%  260/500 steps  1.2 s`` redrawn in place on a terminal.

    When stderr is not a terminal (a log file, a test), it prints nothing
    until :meth:`close`, which writes a single final line.

    Parameters
    ----------
    total : int
        The count that means 100%.
    label : str
        The unit shown after the counts.
    width : int
        Characters in the bar.
    stream : file, optional
        Where to draw (default ``sys.stderr``).
    """

    def __init__(self, total: int, label: str = "steps", width: int = 30, stream: TextIO | None = None) -> None:
        self.total = max(int(total), 1)
        self.label = label
        self.width = width
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self.start = time.perf_counter()
        self.done = 0

    def update(self, done: int) -> None:
        """Show ``done`` out of ``total``."""
        self.done = min(int(done), self.total)
        if self.live:
            self.stream.write("\r" + self._line())
            self.stream.flush()

    def close(self) -> None:
        """Finish the line."""
        self.stream.write(("\r" if self.live else "") + self._line() + "\n")
        self.stream.flush()

    def _line(self) -> str:
        filled = self.width * self.done // self.total
        return (f"[{'#' * filled}{'-' * (self.width - filled)}] {100 * self.done // self.total:3d}%  "
                f"{self.done}/{self.total} {self.label}  {time.perf_counter() - self.start:.1f} s")

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def human_bytes(n: float) -> str:
    """``268435456`` -> ``"256 MiB"``."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def report_check(result: np.ndarray, expected: np.ndarray, steps: int) -> int:
    """Print how far ``result`` is from the NumPy reference; 0 if within rounding, else 1.

    The error is the largest absolute difference relative to the largest
    value; the tolerance is 1e-5 for float32 and 1e-12 for float64.
    """
    error = float(np.max(np.abs(result - expected)) / max(float(np.max(np.abs(expected))), 1e-30))
    tolerance = 1e-5 if result.dtype == np.float32 else 1e-12
    verdict = "OK" if error < tolerance else "MISMATCH"
    print(f"check against NumPy ({steps} steps): max error {error:.2e} of the largest value "
          f"(tolerance {tolerance:.0e}): {verdict}")
    return 0 if error < tolerance else 1
