"""Small helpers for the examples: a progress bar on stderr (no dependency) and byte counts."""

from __future__ import annotations

import sys
import time
from typing import TextIO


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
