"""Whether numba's CUDA simulator is on: read once, from the environment, never importing numba.cuda.

``NUMBA_ENABLE_CUDASIM=1`` must be set before ``numba.cuda`` is first
imported; numba reads it once.  This is the one test of it in umem_numba:
:mod:`umem_numba._driver` then loads the simulated driver
(:mod:`umem_numba._driver._simulated`) instead of the CUDA binding, and every buffer,
pool, copy and launch runs over it unchanged.
"""

from __future__ import annotations

import os

__all__ = ["HINT", "NOTE", "active"]

#: What umem_numba says about the simulation (``info()``, skip reasons).
NOTE = (
    "numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1): umem_numba runs over a simulated driver whose memory "
    "is host memory; kernels run on the CPU, late, when a synchronisation needs them, with streams in a "
    "seeded adversarial order (UMEM_SIM_SEED)"
)


#: How to run without a GPU: said by CudaUnavailableError, ``python -m umem_numba info`` and the test run.
HINT = (
    "without a GPU, run on numba's CUDA simulator: set NUMBA_ENABLE_CUDASIM=1 before Python starts "
    "(NUMBA_ENABLE_CUDASIM=1 python your_script.py); umem_numba then runs over a simulated driver, "
    "in host memory"
)


_active: bool | None = None


def active() -> bool:
    """Whether ``NUMBA_ENABLE_CUDASIM`` switches numba's CUDA simulator on (numba's own test of it).

    Read at the first call and kept, as numba keeps it: every launch asks.
    """
    global _active
    on = _active
    if on is None:
        on = _active = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")
    return on
