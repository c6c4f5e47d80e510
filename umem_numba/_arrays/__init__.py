"""The one ``Buffer``: layout (shapes, dtypes, interfaces), array behaviour, DLPack export, copies.

``_layout`` (shapes, strides, the interfaces read and written), ``_dlpack`` (DLPack capsules),
``_copy`` (the one copy layer) and ``_buffer`` (the array behaviour every buffer kind shares).
"""
