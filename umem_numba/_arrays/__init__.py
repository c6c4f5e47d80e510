"""The one ``Buffer``: layout (shapes, dtypes, interfaces), array behaviour, export protocols, copies.

``_layout`` (shapes, strides, the interfaces read and written), ``_dlpack`` (DLPack capsules),
``_copy`` (the one copy layer), ``_export`` (every export protocol: CUDA Array Interface, numba's,
DLPack, ``lend``) and ``_buffer`` (the array behaviour every buffer kind shares).
"""
