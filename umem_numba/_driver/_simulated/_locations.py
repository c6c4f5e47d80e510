"""Memory locations as the simulated driver keeps them: one int32 code per page (device, host, host NUMA node)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._errors import UnsupportedError
from ._common import (
    _INVALID_VALUE,
    _Error,
)

#: Host NUMA node k is kept as the location code _NUMA_BASE - k (see location_code).
_NUMA_BASE = -3


# Locations are kept per page as one int32 code: a device ordinal (>= 0), -1 the host,
# -2 none, and host NUMA node k as -3 - k (the legacy attributes say CU_DEVICE_CPU for it).
def location_code(location: Any) -> int:
    """The code of a ``CUmemLocation`` (raises :class:`_Error` with the driver's error for a bad one)."""
    kind = getattr(location.type, "name", "")
    if kind.endswith("HOST_NUMA"):
        node = int(location.id)
        if node not in _host_numa_nodes():
            raise _Error(_INVALID_VALUE)  # no such node on this host
        return _NUMA_BASE - node
    if kind.endswith("HOST_NUMA_CURRENT"):
        raise UnsupportedError(
            "CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT: not simulated under numba's CUDA simulator "
            "(NUMBA_ENABLE_CUDASIM=1); name the host NUMA node instead"
        )
    return _legacy_id(location)


def _legacy_id(location: Any) -> int:
    kind = getattr(location.type, "name", "")
    if kind.endswith(("HOST", "HOST_NUMA", "HOST_NUMA_CURRENT")):
        return -1
    if kind.endswith("DEVICE"):
        if int(location.id) != 0:
            raise _Error(101)  # CUDA_ERROR_INVALID_DEVICE
        return 0
    raise _Error(_INVALID_VALUE)


def host_pool_location(props: Any) -> dict[str, int] | int | None:
    """A pinned pool's location attributes (``None``: not a host pool; an int: the driver's error)."""
    kind = getattr(props.location.type, "name", "")
    if not kind.endswith(("HOST", "HOST_NUMA")):
        return None
    node = int(props.location.id)
    if kind.endswith("HOST_NUMA") and node not in _host_numa_nodes():
        return _INVALID_VALUE
    return {
        "LOCATION_TYPE": int(props.location.type),
        "LOCATION_ID": node if kind.endswith("HOST_NUMA") else 0,
        "ALLOCATION_TYPE": int(props.allocType),
    }


def typed_location(real: Any, code: int) -> tuple[int, int]:
    """``(CUmemLocationType, id)`` of a location code (the driver's typed range attributes; ``real``: the binding)."""
    lt = real.CUmemLocationType
    if code <= _NUMA_BASE:
        return int(lt.CU_MEM_LOCATION_TYPE_HOST_NUMA), _NUMA_BASE - code
    if code == -1:
        return int(lt.CU_MEM_LOCATION_TYPE_HOST), 0
    if code == -2:
        return int(lt.CU_MEM_LOCATION_TYPE_INVALID), 0
    return int(lt.CU_MEM_LOCATION_TYPE_DEVICE), code


def _legacy_codes(codes: np.ndarray) -> np.ndarray:
    """Location codes as the legacy range attributes say them (a host NUMA node is CU_DEVICE_CPU, -1)."""
    return np.where(codes <= _NUMA_BASE, -1, codes)


_NUMA_NODES: tuple[int, ...] | None = None


def _host_numa_nodes() -> tuple[int, ...]:
    """This host's online NUMA nodes (the kernel's list; node 0 where it has none)."""
    global _NUMA_NODES
    if _NUMA_NODES is None:
        nodes: list[int] = []
        try:
            with open("/sys/devices/system/node/online") as f:
                for part in f.read().strip().split(","):
                    if part:
                        lo, _, hi = part.partition("-")
                        nodes.extend(range(int(lo), int(hi or lo) + 1))
        except (OSError, ValueError):
            pass
        _NUMA_NODES = tuple(nodes) or (0,)
    return _NUMA_NODES
