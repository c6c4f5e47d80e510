"""CUDA virtual memory management: address ranges, physical memory, mappings, access, and ``VMMBuffer``.

``_access`` (access flags, granularity, allocation properties), ``_mapping`` (``AddressRange``,
``PhysicalMemory``, ``Mapping``), ``_allocation`` (VMM chunks behind a buffer) and ``_buffer``
(``VMMBuffer``: grow, shrink, set_access).
"""
