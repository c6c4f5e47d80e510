"""A validated byte range of managed memory: what advice and prefetch act on.

Every range in umem_numba's advice, prefetch and discard API is ``[start,
stop)`` in *elements* of the buffer seen as a flat array in memory order:
element ``i`` is the bytes ``[i * itemsize, (i + 1) * itemsize)`` after the
buffer's first element.  For a C-ordered buffer that is the row-major flat
index (``buf.host.ravel(order="C")[i]``); for an F-ordered one (``order="F"``,
or the ``.T`` of a C-ordered buffer) the column-major flat index
(``buf.host.ravel(order="F")[i]``): a range of an F-ordered matrix is a run of
whole or partial *columns*.
Bounds work like a Python slice without the wrap-around: ``0 <= start < stop
<= size``; a negative bound is an :class:`IndexError`, never "from the end",
and an empty range is a :class:`ValueError` (there is nothing to advise or
prefetch), except the whole of a zero-size buffer, which a prefetch or a
discard leaves alone (as every operation on a zero-size buffer does nothing).
Views must be contiguous (C or F); a view's range counts from the view's
first element.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import _driver
from .._arrays import _layout
from .._arrays._buffer import Buffer
from .._checks import as_int
from .._errors import BufferClosedError, CudaError, UnsupportedError
from .._memory._lifetime import Memory
from .._memory._tracker import Tracker

__all__ = ["ManagedSpan", "check_range", "element_count", "managed_span", "unsupported_from"]


@dataclass(frozen=True)
class ManagedSpan:
    """A validated byte range of managed memory, valid until the buffer is closed."""

    ptr: int
    nbytes: int
    device_id: int
    tracker: Tracker | None
    label: str
    #: The allocation's memory (``None`` for a foreign array): told when advice is given on it.
    memory: Memory | None = None


def _index(value: Any, name: str, what: str) -> int:
    return as_int(value, f"{what}: {name}", "an integer element index")


def check_range(start: Any, stop: Any, size: int, what: str, *, whole_may_be_empty: bool = False) -> tuple[int, int]:
    """Validate ``[start, stop)`` against ``size`` elements (``None`` = that end).

    ``whole_may_be_empty``: the whole of a zero-size buffer (no bound given)
    is ``(0, 0)``, for the operations that do nothing on one (prefetch,
    discard); a range the caller named must not be empty.
    """
    if whole_may_be_empty and start is None and stop is None and size == 0:
        return 0, 0
    lo = 0 if start is None else _index(start, "start", what)
    hi = size if stop is None else _index(stop, "stop", what)
    if lo < 0 or hi < 0:
        raise IndexError(
            f"{what}: range [{lo}, {hi}) has a negative bound; element ranges "
            "count from the start of the buffer (no wrap-around)"
        )
    if hi > size:
        raise IndexError(f"{what}: range [{lo}, {hi}) is out of bounds for {size} element(s)")
    if lo >= hi:
        if lo > hi:
            raise ValueError(f"{what}: range [{lo}, {hi}) has start > stop")
        raise ValueError(f"{what}: range [{lo}, {hi}) is empty: nothing to advise or prefetch")
    return lo, hi


def element_count(obj: Any, what: str) -> int:
    """Elements of a supported object, checking everything that needs no driver."""
    if isinstance(obj, Buffer):
        if obj.closed:
            raise BufferClosedError(f"{what}: this {type(obj).__name__} is closed")
        alloc = obj._live()
        if not alloc.resource.migrates:
            raise UnsupportedError(
                f"{what}: {type(obj).__name__} memory is {alloc.kind} memory, not managed "
                "memory; advice and prefetch need a ManagedBuffer"
            )
        if not (obj.is_c_contiguous or obj.is_f_contiguous):
            raise ValueError(
                f"{what}: the buffer view is strided; advice and prefetch need a C-contiguous "
                "(or F-contiguous) buffer or view"
            )
        return obj.size
    info = _layout.cuda_array_info(obj, what)
    if not info.order:
        raise ValueError(f"{what}: the array is not C-contiguous (nor F-contiguous)")
    return info.size


def managed_span(obj: Any, lo: int, hi: int, what: str) -> ManagedSpan:
    """The live byte range of elements ``[lo, hi)`` of ``obj`` (bounds already checked)."""
    label = f"{type(obj).__name__} elements [{lo}, {hi})"
    if isinstance(obj, Buffer):
        alloc = obj._live()
        itemsize = obj.itemsize
        return ManagedSpan(
            obj._address + lo * itemsize, (hi - lo) * itemsize, alloc.device_id, alloc.tracker, label, alloc.memory
        )
    info = _layout.cuda_array_info(obj, what)
    itemsize = info.dtype.itemsize
    device_id = _driver.ensure_context()
    _require_managed(info.ptr, what)
    return ManagedSpan(info.ptr + lo * itemsize, (hi - lo) * itemsize, device_id, None, label)


def _require_managed(ptr: int, what: str) -> None:
    api = _driver.api()
    # cuPointerGetAttributes, not cuPointerGetAttribute: for an address the driver does not know
    # (plain host memory) it answers "not managed" with success, where the singular call fails with
    # CUDA_ERROR_INVALID_VALUE, which compute-sanitizer reports as an error of the user's program.
    # Any failure (a sticky launch error, say) is reported as what it is.
    err, values = api.drv.cuPointerGetAttributes(1, [api.c.pointer_is_managed], ptr)
    if int(err):
        _driver.raise_for(err, "cuPointerGetAttributes", f"{what}: asking whether {ptr:#x} is managed memory")
    if not int(values[0] or 0):
        raise UnsupportedError(
            f"{what}: the memory at {ptr:#x} is not managed memory "
            "(cuPointerGetAttributes IS_MANAGED); advice and prefetch need "
            "cuMemAllocManaged memory"
        )


def unsupported_from(exc: CudaError, what: str) -> UnsupportedError | None:
    """The :class:`UnsupportedError` a ``CUDA_ERROR_NOT_SUPPORTED`` means; ``None`` for other errors."""
    if exc.name == "CUDA_ERROR_NOT_SUPPORTED":
        return UnsupportedError(f"{what}: the driver does not support this here ({exc})")
    return None
