"""What matters about this machine for unified memory: ``umem_numba.info()``."""

from __future__ import annotations

from typing import Any

from .. import _driver
from .._driver import _sim
from .._driver._location import numa_nodes
from .._errors import CudaError
from .._memory import _cache


def _versions() -> dict[str, str]:
    out: dict[str, str] = {}
    from importlib import metadata

    for dist in ("numba", "numba-cuda", "cuda-bindings", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _device_info(ordinal: int) -> dict[str, Any]:
    drv = _driver.api().drv
    attr = _driver.device_attribute
    name = _driver.call("cuDeviceGetName", 256, ordinal)
    name = name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name)
    info: dict[str, Any] = {
        "ordinal": ordinal,
        "name": name,
        "compute_capability": (attr("COMPUTE_CAPABILITY_MAJOR", ordinal), attr("COMPUTE_CAPABILITY_MINOR", ordinal)),
        "multiprocessors": attr("MULTIPROCESSOR_COUNT", ordinal),
        "managed_memory": bool(attr("MANAGED_MEMORY", ordinal)),
        "concurrent_managed_access": bool(attr("CONCURRENT_MANAGED_ACCESS", ordinal)),
        "pageable_memory_access": bool(attr("PAGEABLE_MEMORY_ACCESS", ordinal)),
        "can_map_host_memory": bool(attr("CAN_MAP_HOST_MEMORY", ordinal)),
        "vmm_supported": bool(attr("VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", ordinal)),
        "vmm_posix_fd_export": bool(attr("HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED", ordinal)),
    }
    try:
        # The host NUMA node nearest the device (-1: none, e.g. no NUMA); a CUDA 12.2+ attribute.
        info["host_numa_id"] = attr("HOST_NUMA_ID", ordinal)
    except (AttributeError, CudaError):
        info["host_numa_id"] = -1
    if info["vmm_supported"]:
        from .._vmm._access import allocation_granularity

        info["vmm_granularity"] = allocation_granularity(ordinal)
    with _driver.device_context(ordinal):
        free, total = _driver.mem_get_info()
    info["memory_free"] = free
    info["memory_total"] = total
    del drv
    return info


def info() -> dict[str, Any]:
    """Describe the CUDA setup: driver, library versions, and each device's memory features.

    Returns
    -------
    dict
        ``{"available": bool, "reason": str, "driver_version": int,
        "versions": {...}, "numa_nodes": [...], "devices": [ {...}, ... ]}``.
        ``numa_nodes`` are the host's online NUMA nodes (the ``N`` of a
        ``"cpu:N"`` / ``Host(numa=N)`` location; ``[]`` where the system
        does not say), and each device's ``host_numa_id`` is the node nearest
        to it as the driver reports it (``-1``: none).  On a machine with no
        GPU, ``available`` is False, ``reason`` says why, and ``devices`` is
        empty; nothing raises.  ``"simulator"`` is True under numba's CUDA
        simulator (``NUMBA_ENABLE_CUDASIM=1``): ``reason`` then says that
        buffers are host memory and nothing migrates.  ``allocation_cache``
        (with a GPU) says whether buffers made without ``pool=`` reuse cached
        allocations (:func:`umem_numba.set_allocation_cache`) and how many
        bytes are cached.
    """
    out: dict[str, Any] = {"versions": _versions(), "simulator": _sim.active(), "numa_nodes": numa_nodes() or []}
    if out["simulator"]:
        out.update(available=False, reason=_sim.NOTE, devices=[])
        return out
    reason = _driver.unavailable_reason()
    out["available"] = not reason
    out["reason"] = reason
    out["devices"] = []
    if reason:
        return out
    out["allocation_cache"] = {"enabled": _cache.get_allocation_cache(), "cached_bytes": _cache.cached_bytes()}
    out["driver_version"] = int(_driver.call("cuDriverGetVersion"))
    out["cuda_bindings"] = _driver.api().version
    out["devices"] = [_device_info(i) for i in range(_driver.device_count())]
    return out


def format_info(data: dict[str, Any]) -> str:
    """Render :func:`info` as aligned text for the command line."""
    lines = []
    v = data["versions"]
    lines.append("versions: " + ", ".join(f"{k} {val}" for k, val in v.items()))
    if data.get("numa_nodes"):
        lines.append("host NUMA nodes: " + ", ".join(map(str, data["numa_nodes"])) + " (targets 'cpu:N')")
    if data.get("simulator"):
        lines.append(f"CUDA: no GPU in use, {data['reason']}")
        return "\n".join(lines)
    if not data["available"]:
        lines.append(f"CUDA: not available ({data['reason']})")
        lines.append(
            "without a GPU: numba's CUDA simulator runs your kernels and umem_numba's buffers in host memory; "
            "set NUMBA_ENABLE_CUDASIM=1 before Python starts (NUMBA_ENABLE_CUDASIM=1 python -m umem_numba info)"
        )
        return "\n".join(lines)
    dv = data["driver_version"]
    lines.append(f"CUDA driver: {dv // 1000}.{dv % 1000 // 10}")
    cache = data.get("allocation_cache")
    if cache is not None:
        state = "on" if cache["enabled"] else "off (set_allocation_cache)"
        lines.append(f"allocation cache for buffers without pool=: {state}, {cache['cached_bytes']} bytes cached")
    gib = float(1 << 30)
    for d in data["devices"]:
        lines.append(
            f"device {d['ordinal']}: {d['name']} (compute capability "
            f"{d['compute_capability'][0]}.{d['compute_capability'][1]}, {d['multiprocessors']} SMs)"
        )
        lines.append(f"  memory: {d['memory_free'] / gib:.1f} GiB free of {d['memory_total'] / gib:.1f} GiB")
        for key in (
            "managed_memory",
            "concurrent_managed_access",
            "pageable_memory_access",
            "can_map_host_memory",
            "vmm_supported",
            "vmm_posix_fd_export",
        ):
            lines.append(f"  {key}: {'yes' if d[key] else 'no'}")
        if d.get("host_numa_id", -1) >= 0:
            lines.append(f"  host_numa_id: {d['host_numa_id']} (the nearest host NUMA node)")
        if "vmm_granularity" in d:
            lines.append(f"  vmm_granularity: {d['vmm_granularity'] // 1024} KiB")
    return "\n".join(lines)
