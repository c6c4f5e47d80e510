"""Child side of test_emm's IPC test (importable by a spawned process)."""

from __future__ import annotations

import numpy as np
from numba import cuda


@cuda.jit
def _double(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] *= 2.0


def read(handle) -> np.ndarray:
    """Open a numba IPC array handle (as numba's own IPC tests do) and copy it out."""
    with handle as arr:
        return arr.copy_to_host()


def read_then_double(handle) -> tuple[np.ndarray, str]:
    """Copy the shared array out, then double it in place on the device; also name this process's manager."""
    with handle as arr:
        before = arr.copy_to_host()
        _double[(arr.size + 255) // 256, 256](arr)
        cuda.synchronize()
    return before, type(cuda.current_context().memory_manager).__name__
