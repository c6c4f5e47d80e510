"""The simulated driver: :class:`SimDriver`, composed of one mixin per concept."""

from __future__ import annotations

from typing import Any

from ._common import (
    _CONTEXT,
    _INVALID_VALUE,
    _SUCCESS,
    TOTAL_MEM,
    _device_attributes_by_value,
    _int,
    _refuse,
    seed,
)
from ._graphs import GraphCapture, guard_capture
from ._kernels import Kernels
from ._managed import ManagedHints
from ._pools import Pools
from ._vmm import VirtualMemory


class SimDriver(GraphCapture, Pools, ManagedHints, VirtualMemory, Kernels):
    """The simulated driver: the subset of ``cuda.bindings.driver`` that umem_numba uses.

    One mixin per concept: :class:`~._scheduling.Scheduling` (streams, events, the seeded order
    their work runs in), :class:`~._memory.Allocations` (allocations, pointer attributes, copies,
    memsets), :class:`~._pools.Pools`, :class:`~._managed.ManagedHints` (advice, prefetches, range
    attributes, discards), :class:`~._vmm.VirtualMemory`, :class:`~._kernels.Kernels` and
    :class:`~._graphs.GraphCapture`; this class adds the device and context entry points.
    """

    #: How :mod:`umem_numba._driver` recognises it.
    SIMULATED = True

    def __init__(self, seed_value: int | None = None) -> None:
        self._init_scheduling(seed() if seed_value is None else seed_value)
        self._init_memory()
        self._init_pools()
        self._init_vmm()
        self._init_managed()
        self._init_capture()

    # -- the binding's enums and structs -------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name.startswith("cu") and name[2:3].isupper():
            if name.endswith("_v2") or name == "cuMemPrefetchBatchAsync":
                raise AttributeError(name)  # optional entry points: umem_numba falls back
            return _refuse(name)
        return getattr(self._real, name)

    # Entry points (each mixin holds those of its concept).  Each returns (CUresult, *values).

    # -- initialisation, devices, contexts -----------------------------------------------
    def cuInit(self, flags: int) -> tuple[Any, ...]:
        return (self._real.CUresult.CUDA_SUCCESS,)

    def cuDriverGetVersion(self) -> tuple[Any, ...]:
        return (_SUCCESS, 13000)

    def cuDeviceGetCount(self) -> tuple[Any, ...]:
        return (_SUCCESS, 1)

    def cuDeviceGet(self, ordinal: int) -> tuple[Any, ...]:
        return (_SUCCESS, 0) if _int(ordinal) == 0 else (_INVALID_VALUE, None)

    def cuDeviceGetName(self, length: int, device: Any) -> tuple[Any, ...]:
        return (_SUCCESS, b"umem_numba simulated device (numba CUDA simulator)")

    def cuDeviceGetUuid(self, device: Any) -> tuple[Any, ...]:
        uuid = self._real.CUuuid()
        return (_SUCCESS, uuid)

    def cuDeviceTotalMem(self, device: Any) -> tuple[Any, ...]:
        return (_SUCCESS, TOTAL_MEM)

    def cuDeviceGetAttribute(self, attr: Any, device: Any) -> tuple[Any, ...]:
        if _int(device) != 0:
            return (_INVALID_VALUE, None)
        return (_SUCCESS, _device_attributes_by_value().get(_int(attr), 0))

    def cuDeviceCanAccessPeer(self, dev: Any, peer: Any) -> tuple[Any, ...]:
        return (_SUCCESS, 0)

    def cuDevicePrimaryCtxGetState(self, device: Any) -> tuple[Any, ...]:
        return (_SUCCESS, 0, 1)

    def cuCtxGetCurrent(self) -> tuple[Any, ...]:
        return (_SUCCESS, _CONTEXT)

    def cuCtxSetCurrent(self, ctx: Any) -> tuple[Any, ...]:
        return (_SUCCESS,)

    def cuCtxPushCurrent(self, ctx: Any) -> tuple[Any, ...]:
        return (_SUCCESS,)

    def cuCtxPopCurrent(self) -> tuple[Any, ...]:
        return (_SUCCESS, _CONTEXT)

    def cuCtxGetDevice(self) -> tuple[Any, ...]:
        return (_SUCCESS, 0)

    def cuCtxGetStreamPriorityRange(self) -> tuple[Any, ...]:
        return (_SUCCESS, 0, -5)


guard_capture(SimDriver)
