"""Kernel launches: coherent launches (ordering, read-only inference) and direct calls through cuLaunchKernel.

``_kernel_call`` (a compiled numba kernel called straight through ``cuLaunchKernel``), ``_write_inference``
(which arguments a kernel writes, from its source), ``_coherent`` (``launch``, ``coherent``, ``jit``: ordered
on the device, one event per launch) and ``_graphs`` (``capture`` and ``Graph``: CUDA graphs with coherence).
"""
