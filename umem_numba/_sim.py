"""Whether numba's CUDA simulator is on: read once, from the environment, never importing numba.cuda.

``NUMBA_ENABLE_CUDASIM=1`` must be set before ``numba.cuda`` is first
imported; numba reads it once.  :mod:`umem_numba` asks :func:`active` once, at
import, and then takes its buffers from :mod:`umem_numba._sim_memory` (host
memory, the simulator runs the kernels) instead of the CUDA driver's.
"""

from __future__ import annotations

import os

__all__ = ["NOTE", "active"]

#: What every simulated object says about itself (``info()``, hints, reprs).
NOTE = (
    "numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1): buffers are host memory, kernels run on the CPU "
    "one block at a time and synchronously, advice and prefetch are accepted and checked but nothing migrates"
)


def active() -> bool:
    """Whether ``NUMBA_ENABLE_CUDASIM`` switches numba's CUDA simulator on (numba's own test of it)."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")
