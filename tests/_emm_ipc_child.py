"""Child side of test_emm's IPC test (importable by a spawned process)."""

from __future__ import annotations

import numpy as np


def read(handle) -> np.ndarray:
    """Open a numba IPC array handle (as numba's own IPC tests do) and copy it out."""
    with handle as arr:
        return arr.copy_to_host()
