"""What every part of the simulated driver shares: sizes, result codes, the seed, device facts, errors."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..._errors import UnsupportedError

#: The seed used when ``UMEM_SIM_SEED`` is not set.
DEFAULT_SEED = 0
#: Bytes of the simulated device.
TOTAL_MEM = 4 << 30
#: Page size of advice and prefetch bookkeeping (the driver's is the OS page).
PAGE = 4096
#: VMM granularity (the driver's minimum on current GPUs).
GRANULARITY = 2 << 20

_SUCCESS = 0
_NOT_READY = 600
_INVALID_VALUE = 1
_INVALID_HANDLE = 400
_ILLEGAL_ADDRESS = 700
_OUT_OF_MEMORY = 2
_NOT_SUPPORTED = 801

_DEVICE_ATTRIBUTES = {
    "CONCURRENT_MANAGED_ACCESS": 1,
    "MANAGED_MEMORY": 1,
    "MEMORY_POOLS_SUPPORTED": 1,
    "HOST_MEMORY_POOLS_SUPPORTED": 1,
    "HOST_NUMA_MEMORY_POOLS_SUPPORTED": 1,
    "MEMPOOL_SUPPORTED_HANDLE_TYPES": 0,
    "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED": 1,
    "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED": 1,
    "MULTIPROCESSOR_COUNT": 4,
    "HOST_NUMA_ID": -1,
    "PAGEABLE_MEMORY_ACCESS": 0,
    "CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM": 1,
    "UNIFIED_ADDRESSING": 1,
    "CAN_MAP_HOST_MEMORY": 1,
    "COMPUTE_CAPABILITY_MAJOR": 5,
    "COMPUTE_CAPABILITY_MINOR": 2,
    "WARP_SIZE": 32,
    "MAX_THREADS_PER_BLOCK": 1024,
    "INTEGRATED": 0,
    "DIRECT_MANAGED_MEM_ACCESS_FROM_HOST": 0,
    "CONCURRENT_KERNELS": 1,
    "ASYNC_ENGINE_COUNT": 2,
}


_BY_VALUE: dict[int, int] = {}


def _device_attributes_by_value() -> dict[int, int]:
    """:data:`_DEVICE_ATTRIBUTES` by enum value: the binding names some attributes twice.

    ``CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`` is an alias of
    ``..._VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED`` (102), and the member's ``name`` is the latter.
    """
    if not _BY_VALUE:
        from cuda.bindings import driver

        for name, value in _DEVICE_ATTRIBUTES.items():
            member = getattr(driver.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + name, None)
            if member is not None:
                _BY_VALUE[int(member)] = value
    return _BY_VALUE


def seed() -> int:
    """The seed of this process's simulation: ``UMEM_SIM_SEED``, else :data:`DEFAULT_SEED`."""
    env = os.environ.get("UMEM_SIM_SEED", "").strip()
    return int(env) if env else DEFAULT_SEED


class _Context:
    """What ``cuCtxGetCurrent`` gives: the one context of the one device."""

    def __int__(self) -> int:
        return 0x5100

    def __repr__(self) -> str:
        return "<simulated CUDA context>"


_CONTEXT = _Context()


def _int(value: Any) -> int:
    """A handle or pointer argument as an int (the binding's wrapper types too)."""
    if isinstance(value, int):
        return value
    if value is None:
        return 0
    try:
        return int(value)
    except TypeError:
        v = getattr(value, "value", None)
        return int(v or 0)


class _Error(Exception):
    """A driver error code raised inside the simulation, returned as the call's result."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class SimulatedFault(RuntimeError):  # noqa: N818  (a fault, as a GPU's)
    """Device work of the simulation touched memory that is not allocated (a GPU would fault)."""


def _refuse(name: str) -> Callable[..., Any]:
    """An entry point ``name`` that the simulation does not offer: it raises UnsupportedError naming it."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise UnsupportedError(
            f"{name}: not supported under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1); it needs a real GPU"
        )

    refuse.__name__ = name
    return refuse
