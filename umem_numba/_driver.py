"""The checked driver layer: every CUDA driver call of umem_numba goes through here.

``cuda.bindings.driver`` returns ``(CUresult, *values)`` tuples; :func:`check`
turns a failure into a :class:`~umem_numba.CudaError` that names the call.
Loading is lazy: importing umem_numba never touches the driver, and the first
call that needs it raises one :class:`~umem_numba.CudaUnavailableError` on a
machine with no driver, no GPU, or with numba's CUDA simulator switched on.

cuda-bindings 12.9 exposes the location forms of ``cuMemAdvise`` and
``cuMemPrefetchAsync`` as ``*_v2``; 13.x has them under the plain names.  The
:class:`_Api` object resolves those differences once.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator

from ._errors import CudaError, CudaUnavailableError, OutOfMemoryError

_OOM_NAMES = frozenset({"CUDA_ERROR_OUT_OF_MEMORY"})


class _Api:
    """The loaded binding plus the version-dependent entry points."""

    def __init__(self, drv: Any, version: str) -> None:
        self.drv = drv
        self.version = version
        self.mem_advise = getattr(drv, "cuMemAdvise_v2", None) or drv.cuMemAdvise
        self.mem_prefetch = getattr(drv, "cuMemPrefetchAsync_v2", None) or drv.cuMemPrefetchAsync
        # cuda-bindings 13 only: one driver call for a whole prefetch plan.
        self.mem_prefetch_batch = getattr(drv, "cuMemPrefetchBatchAsync", None)
        self.success = drv.CUresult.CUDA_SUCCESS


_lock = threading.Lock()
_api: _Api | None = None
_unavailable: str | None = None


def _load() -> _Api:
    global _api, _unavailable
    with _lock:
        if _api is not None:
            return _api
        if _unavailable is None:
            _unavailable = _probe()
        if _unavailable:
            raise CudaUnavailableError(_unavailable)
        assert _api is not None
        return _api


def _probe() -> str:
    """Load the binding and initialise the driver; return '' or why not."""
    global _api
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        return ("numba's CUDA simulator is enabled (NUMBA_ENABLE_CUDASIM); "
                "umem_numba allocates real CUDA memory and needs a real GPU")
    try:
        from cuda.bindings import driver as drv
        import cuda.bindings as bindings
    except ImportError as exc:  # pragma: no cover - cuda-bindings is a dependency
        return f"cuda-bindings is not importable ({exc}); install numba-cuda[cu12] or [cu13]"
    try:
        (err,) = drv.cuInit(0)
    except Exception as exc:  # libcuda.so missing: pathfinder raises its own types
        return f"the NVIDIA driver library (libcuda) could not be loaded: {exc}"
    if err != drv.CUresult.CUDA_SUCCESS:
        return f"cuInit failed with {_result_name(drv, err)}: no usable CUDA GPU or driver"
    err, count = drv.cuDeviceGetCount()
    if err != drv.CUresult.CUDA_SUCCESS or count == 0:
        return "the CUDA driver reports no GPU"
    _api = _Api(drv, getattr(bindings, "__version__", "unknown"))
    return ""


def _result_name(drv: Any, err: Any) -> str:
    try:
        return drv.CUresult(err).name
    except Exception:
        return f"CUresult {int(err)}"


def api() -> _Api:
    """Return the loaded driver API, loading it on first use.

    Raises
    ------
    CudaUnavailableError
        No driver, no GPU, or numba's simulator is enabled.
    """
    return _api if _api is not None else _load()


def available() -> bool:
    """Whether a CUDA driver and at least one GPU can be used."""
    try:
        api()
    except CudaUnavailableError:
        return False
    return True


def unavailable_reason() -> str:
    """Why the GPU cannot be used ('' when it can)."""
    try:
        api()
    except CudaUnavailableError as exc:
        return str(exc)
    return ""


def raise_for(result: Any, call: str, detail: str = "") -> None:
    """Raise the :class:`CudaError` subclass for a failed ``CUresult``."""
    drv = api().drv
    name = _result_name(drv, result)
    cls = OutOfMemoryError if name in _OOM_NAMES else CudaError
    raise cls(call, int(result), name, detail)


def check(result: tuple, call: str, detail: str = "") -> Any:
    """Unpack a binding's ``(CUresult, *values)`` tuple or raise.

    Returns
    -------
    None, the single value, or a tuple of values.
    """
    err = result[0]
    if err != 0:
        raise_for(err, call, detail)
    n = len(result)
    if n == 1:
        return None
    if n == 2:
        return result[1]
    return result[1:]


def call(name: str, *args: Any, detail: str = "") -> Any:
    """Call ``cuda.bindings.driver.<name>(*args)`` and :func:`check` it."""
    return check(getattr(api().drv, name)(*args), name, detail)


# --------------------------------------------------------------------------
# Contexts.  umem_numba shares numba's primary contexts, so that memory it
# allocates is valid in every kernel numba launches.

def _numba_cuda() -> Any:
    from numba import cuda as nbcuda
    return nbcuda


def ensure_context() -> int:
    """Make numba's context for the current device current; return its ordinal."""
    api()
    nbcuda = _numba_cuda()
    try:
        ctx = nbcuda.current_context()
    except Exception as exc:  # CudaSupportError and friends
        raise CudaUnavailableError(f"numba could not create a CUDA context: {exc}") from exc
    return int(ctx.device.id)


@contextlib.contextmanager
def device_context(device_id: int | None) -> Iterator[int]:
    """Run the block with numba's context of ``device_id`` current.

    ``None`` means the current device.  The previous context is restored.
    """
    current = ensure_context()
    if device_id is None or device_id == current:
        yield current
        return
    with _numba_cuda().gpus[device_id]:
        yield device_id


def device_count() -> int:
    """Number of CUDA devices visible to the driver."""
    return int(call("cuDeviceGetCount"))


_attr_cache: dict[tuple[int, str], int] = {}


def device_attribute(name: str, device_id: int) -> int:
    """Read ``CU_DEVICE_ATTRIBUTE_<name>`` of a device (cached: they do not change)."""
    key = (device_id, name)
    value = _attr_cache.get(key)
    if value is None:
        drv = api().drv
        attr = getattr(drv.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + name)
        value = int(call("cuDeviceGetAttribute", attr, device_id))
        _attr_cache[key] = value
    return value


def mem_get_info() -> tuple[int, int]:
    """``(free, total)`` bytes of the current device."""
    ensure_context()
    free, total = call("cuMemGetInfo")
    return int(free), int(total)
