"""Bandwidth-tuned ``@cuda.jit`` stencil kernels, installed as ``umem_numba.kernels``.

* :func:`heat2d_step` / :func:`heat2d_kernel`: 2-D five-point heat (Jacobi) step.
* :func:`heat3d_step` / :func:`heat3d_kernel`: 3-D seven-point step.
* :func:`max_abs_diff`: ``max |a - b|`` on the device, for convergence checks.
* :mod:`.reference`: NumPy versions of each, for tests and checks.
* :mod:`.decomp`: slab decomposition with halos (several GPUs or MPI ranks);
  :mod:`.multigpu`: the heat steps on several GPUs of one process.
* :func:`human_bytes`, :func:`report_check`, :func:`rerun_on_simulator`, :func:`save_field`,
  :func:`progress`: what the examples share (the last two need the ``plot``
  extra: matplotlib and tqdm).

The kernels take numba device arrays and umem_numba buffers alike (managed,
VMM, mapped pinned), float32 or float64, and copy the boundary through
unchanged.  The ``*_step`` launchers go through :func:`umem_numba.launch`, so
host access to a buffer afterwards waits for exactly the launches that used it.

Importing this package compiles nothing and touches no GPU.
"""

from __future__ import annotations

from ._common import MIN_BLOCKS, SUPPORTED_DTYPES, MemoryBudgetError, require_free_memory, stencil_weights
from ._report import (
    MissingExtraError,
    check_output_path,
    human_bytes,
    progress,
    report_check,
    require_plot_extra,
    rerun_on_simulator,
    save_field,
)
from .decomp import (
    Decomposition,
    EdgeBand,
    HaloExchange,
    LocalExchange,
    heat_slabs_overlapped,
    heat_slabs_reference,
    split_rows,
)
from .reference import (
    heat2d_reference,
    heat2d_step_reference,
    heat3d_reference,
    heat3d_step_reference,
    max_abs_diff_reference,
)
from .residual import max_abs_diff, max_abs_diff_kernel
from .stencil2d import TUNED_2D, heat2d_compile, heat2d_kernel, heat2d_launch, heat2d_step, launch_config_2d
from .stencil3d import (
    DEFAULT_VARIANT_3D,
    TUNED_3D,
    VARIANTS_3D,
    heat3d_compile,
    heat3d_kernel,
    heat3d_launch,
    heat3d_step,
    launch_config_3d,
    slab_align_3d,
)

__all__ = [
    "SUPPORTED_DTYPES",
    "stencil_weights",
    "require_free_memory",
    "MemoryBudgetError",
    "MIN_BLOCKS",
    # 2-D
    "heat2d_kernel",
    "heat2d_step",
    "launch_config_2d",
    "TUNED_2D",
    "heat2d_launch",
    "heat2d_compile",
    # 3-D
    "heat3d_kernel",
    "heat3d_step",
    "launch_config_3d",
    "slab_align_3d",
    "TUNED_3D",
    "VARIANTS_3D",
    "DEFAULT_VARIANT_3D",
    "heat3d_launch",
    "heat3d_compile",
    # residual
    "max_abs_diff",
    "max_abs_diff_kernel",
    # decomposition (kernels.decomp; kernels.multigpu for several GPUs)
    "Decomposition",
    "HaloExchange",
    "LocalExchange",
    "split_rows",
    "heat_slabs_reference",
    "EdgeBand",
    "heat_slabs_overlapped",
    # references
    "heat2d_step_reference",
    "heat2d_reference",
    "heat3d_step_reference",
    "heat3d_reference",
    "max_abs_diff_reference",
    # for the examples
    "human_bytes",
    "report_check",
    "rerun_on_simulator",
    "save_field",
    "check_output_path",
    "progress",
    "require_plot_extra",
    "MissingExtraError",
]
