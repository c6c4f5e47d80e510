"""The memory kinds as buffers: managed, pinned and device memory (``VMMBuffer`` is in ``_vmm``).

``_managed`` (``ManagedBuffer`` and its constructors), ``_pinned`` (``PinnedBuffer``) and ``_device``
(``DeviceBuffer``).
"""
