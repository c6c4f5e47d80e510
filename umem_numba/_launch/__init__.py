"""Kernel launches: coherent launches (ordering, read-only inference) and direct calls through cuLaunchKernel.

``_kernel_call`` (a compiled numba kernel called straight through ``cuLaunchKernel``) and ``_coherent``
(``launch``, ``coherent``, ``jit``: ordered on the device, one event per launch).
"""
