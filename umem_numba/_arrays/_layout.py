"""Shapes, dtypes, strides and basic indexing, with no driver involved.

Validation here runs before any allocation, so bad sizes never reach the
driver.  Views are described by ``(offset, shape, strides)`` in bytes relative
to the start of their allocation, exactly like a numpy array over a buffer.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np

from .. import _numba_compat
from .._checks import as_int

#: No single buffer may claim more bytes than this (well past any GPU); it keeps
#: size arithmetic exact and turns absurd requests into a clear ValueError.
MAX_NBYTES = 1 << 60


def _unusable_by_kernels(dt: np.dtype) -> str:
    """Why kernels cannot use values of ``dt`` ('' when they can): text, raw bytes, in a field too."""
    if dt.kind in "US":
        return (
            f"dtype {dt} holds text (numpy {'str_' if dt.kind == 'U' else 'bytes_'}), which GPU kernels cannot "
            "use; store numbers (text as its bytes, e.g. np.frombuffer(text.encode(), np.uint8))"
        )
    if dt.kind == "V" and dt.names is None and dt.subdtype is None:
        return f"dtype {dt} is raw bytes with no fields, which GPU kernels cannot use; use uint8 and one more dimension"
    fields: Mapping[str, tuple[Any, ...]] = dt.fields or {}
    for name in dt.names or ():
        why = _unusable_by_kernels(fields[name][0])
        if why:
            return f"field {name!r} of dtype {dt}: {why}"
    return ""


def normalize_dtype(dtype: Any) -> np.dtype:
    """A fixed-size numpy dtype of values kernels can use, or ``TypeError`` naming what was wrong."""
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"not a numpy dtype: {dtype!r} ({exc})") from None
    if dt.hasobject:
        raise TypeError(f"dtype {dt} holds Python objects, which cannot live in GPU memory")
    why = _unusable_by_kernels(dt)
    if why:
        raise TypeError(why)
    if dt.itemsize == 0:
        raise TypeError(f"dtype {dt} has no fixed size")
    if dt.subdtype is not None:
        base, sub = dt.subdtype
        raise TypeError(
            f"subarray dtype {dt} is not supported: numpy expands it into extra dimensions; "
            f"use dtype {base} with {len(sub)} more trailing dimension(s) {sub} in the shape instead"
        )
    if not dt.isnative:
        raise TypeError(
            f"dtype {dt} is not in the machine's byte order; GPU kernels need native-endian data "
            f"(use {dt.newbyteorder('=')})"
        )
    return dt


def normalize_shape(shape: Any) -> tuple[int, ...]:
    """A tuple of non-negative ints from an int or a sequence of ints."""
    if isinstance(shape, (bool, np.bool_)):
        raise TypeError("shape must be an int or a sequence of ints, not a bool")
    try:
        dims: Sequence[Any] = (operator.index(shape),)
    except TypeError:
        if not isinstance(shape, (tuple, list)):
            raise TypeError(f"shape must be an int or a tuple of ints, not {type(shape).__name__}") from None
        dims = shape
    out = []
    for d in dims:
        n = as_int(d, f"shape entries (in {shape!r})", "ints")
        if n < 0:
            raise ValueError(f"negative dimension {n} in shape {tuple(dims)!r}")
        out.append(n)
    if len(out) > 32:
        raise ValueError(f"at most 32 dimensions are supported, got {len(out)}")
    return tuple(out)


def checked_nbytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    """Total bytes of a C-ordered array, refusing sizes that cannot exist."""
    n = dtype.itemsize
    for d in shape:
        n *= d
    if n > MAX_NBYTES:
        raise ValueError(f"shape {shape} of {dtype} needs {n} bytes, more than any device has")
    return n


def c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Row-major strides in bytes."""
    strides = []
    acc = itemsize
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def f_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Column-major (Fortran) strides in bytes: the first index varies fastest."""
    strides = []
    acc = itemsize
    for d in shape:
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(strides)


#: What ``order=`` takes: C (row-major) or F (column-major, Fortran).
ORDERS = ("C", "F")


def check_order(order: Any, what: str, *, allow_keep: bool = False) -> str:
    """Validate an ``order=`` argument: ``"C"`` or ``"F"`` (and ``"K"``, keep the source's, where allowed)."""
    allowed = ORDERS + (("K",) if allow_keep else ())
    if not isinstance(order, str) or order.upper() not in allowed:
        names = ", ".join(repr(o) for o in allowed)
        raise ValueError(f"{what}: order must be one of {names}, got {order!r}")
    return order.upper()


def strides_for(shape: tuple[int, ...], itemsize: int, order: str) -> tuple[int, ...]:
    """Dense strides in ``order`` (``"C"`` or ``"F"``)."""
    return f_strides(shape, itemsize) if order == "F" else c_strides(shape, itemsize)


def dense_order(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> str:
    """In which orders the elements are dense: ``"CF"`` (both: 1-d, or trivial dims), ``"C"``, ``"F"`` or ``""``."""
    return ("C" if is_c_contiguous(shape, strides, itemsize) else "") + (
        "F" if is_f_contiguous(shape, strides, itemsize) else ""
    )


def is_c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    if 0 in shape:
        return True
    expected = itemsize
    for d, s in zip(reversed(shape), reversed(strides), strict=True):
        if d != 1 and s != expected:
            return False
        expected *= d
    return True


def is_f_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    if 0 in shape:
        return True
    expected = itemsize
    for d, s in zip(shape, strides, strict=True):
        if d != 1 and s != expected:
            return False
        expected *= d
    return True


def as_axis(value: Any, ndim: int, what: str) -> int:
    """An axis number in ``[0, ndim)`` (negative counts from the end, like numpy)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what}: an axis cannot be a bool")
    try:
        axis = operator.index(value)
    except TypeError:
        raise TypeError(f"{what}: axes must be ints, got {type(value).__name__}") from None
    if not -ndim <= axis < ndim:
        raise ValueError(f"{what}: axis {axis} is out of bounds for {ndim} dimension(s)")
    return axis + ndim if axis < 0 else axis


def index_view(
    shape: tuple[int, ...], strides: tuple[int, ...], key: Any
) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """Apply a basic index to a strided layout.

    Supports integers, slices (any step) and one ``Ellipsis``, alone or in a
    tuple.  Returns ``(byte_offset, shape, strides)`` of the view.

    Raises
    ------
    IndexError
        Too many indices, or an integer out of range.
    TypeError
        Advanced (array, list, boolean) or other unsupported indices.
    """
    if not isinstance(key, tuple):
        key = (key,)
    n_ellipsis = sum(1 for k in key if k is Ellipsis)
    if n_ellipsis > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    explicit = len(key) - n_ellipsis
    if explicit > len(shape):
        raise IndexError(f"too many indices: {explicit} for an array of {len(shape)} dimension(s)")
    if n_ellipsis:
        pos = key.index(Ellipsis)
        key = key[:pos] + (slice(None),) * (len(shape) - explicit) + key[pos + 1 :]
    else:
        key = key + (slice(None),) * (len(shape) - explicit)

    offset = 0
    new_shape: list[int] = []
    new_strides: list[int] = []
    for axis, (k, dim, stride) in enumerate(zip(key, shape, strides, strict=True)):
        if isinstance(k, slice):
            start, stop, step = k.indices(dim)
            length = len(range(start, stop, step))
            if length:
                offset += start * stride
            new_shape.append(length)
            new_strides.append(stride * step)
            continue
        if isinstance(k, (bool, np.bool_)):
            raise TypeError("boolean indices are not supported: only ints, slices and '...'")
        try:
            i = operator.index(k)
        except TypeError:
            raise TypeError(
                f"unsupported index {k!r} ({type(k).__name__}): only ints, "
                "slices and '...' are supported (no advanced indexing)"
            ) from None
        if not -dim <= i < dim:
            raise IndexError(f"index {i} is out of bounds for axis {axis} with size {dim}")
        offset += (i + dim if i < 0 else i) * stride
    return offset, tuple(new_shape), tuple(new_strides)


def extent(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """``(lowest, highest+1)`` byte offsets a strided view touches, relative to its start."""
    if 0 in shape:
        return 0, 0
    lo = hi = 0
    for d, s in zip(shape, strides, strict=True):
        span = (d - 1) * s
        if span < 0:
            lo += span
        else:
            hi += span
    return lo, hi + itemsize


class DeviceArrayInfo(NamedTuple):
    """What a ``__cuda_array_interface__`` describes, validated."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def is_c_contiguous(self) -> bool:
        """Whether the elements are dense in row-major order."""
        return is_c_contiguous(self.shape, self.strides, self.dtype.itemsize)

    @property
    def order(self) -> str:
        """The orders the elements are dense in (see :func:`dense_order`)."""
        return dense_order(self.shape, self.strides, self.dtype.itemsize)


def cuda_array_info(obj: Any, what: str) -> DeviceArrayInfo:
    """Parse another library's ``__cuda_array_interface__`` (numba, CuPy, PyTorch ...).

    Raises
    ------
    TypeError
        ``obj`` has no CUDA Array Interface, or an unusable dtype.
    """
    iface = getattr(obj, "__cuda_array_interface__", None)
    if not isinstance(iface, dict):
        raise TypeError(
            f"{what}: expected a device array with __cuda_array_interface__ (numba, CuPy, "
            "PyTorch) or a umem_numba buffer (ManagedBuffer, PinnedBuffer, VMMBuffer), "
            f"got {type(obj).__name__}"
        )
    descr = iface.get("descr")
    dtype = normalize_dtype(descr if descr and len(descr) > 1 else iface["typestr"])
    shape = tuple(int(d) for d in iface["shape"])
    strides = iface.get("strides")
    strides = c_strides(shape, dtype.itemsize) if strides is None else tuple(int(s) for s in strides)
    return DeviceArrayInfo(int(iface["data"][0]), shape, strides, dtype)


def numba_type(dtype: np.dtype, shape: tuple[int, ...], strides: tuple[int, ...]) -> Any:
    """The numba ``types.Array`` a kernel sees for this layout (:func:`umem_numba._numba_compat.array_type`)."""
    ndim = len(shape)
    layout: Literal["C", "F", "A"]
    if is_c_contiguous(shape, strides, dtype.itemsize):
        layout = "C"
    elif is_f_contiguous(shape, strides, dtype.itemsize):
        layout = "F"
    else:
        layout = "A"
    return _numba_compat.array_type(dtype, ndim, layout)


class _StridedLayoutShim:
    """What numba-cuda's launch path reads from a device array's layout."""

    __slots__ = ("is_contiguous_any", "is_contiguous_c", "is_contiguous_f", "strides_in_bytes")

    def __init__(self, strides: tuple[int, ...], c: bool, f: bool) -> None:
        self.strides_in_bytes = strides
        self.is_contiguous_c = c
        self.is_contiguous_f = f
        self.is_contiguous_any = c or f


class StridedViewShim:
    """The attributes numba-cuda's kernel launch reads from device memory.

    numba-cuda (0.2x) marshals an argument that says ``__cuda_memory__`` through
    its ``_strided_memory_view_shim``: pointer, shape, dtype, size and the
    layout's strides.  Handing it this precomputed object skips parsing a
    ``__cuda_array_interface__`` dict on every launch.
    """

    __slots__ = ("_layout", "dtype", "ptr", "shape", "size")

    def __init__(self, ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: np.dtype) -> None:
        size = 1
        for d in shape:
            size *= d
        self.ptr = ptr
        self.shape = shape
        self.dtype = dtype
        self.size = size
        self._layout = _StridedLayoutShim(
            strides,
            is_c_contiguous(shape, strides, dtype.itemsize),
            is_f_contiguous(shape, strides, dtype.itemsize),
        )
