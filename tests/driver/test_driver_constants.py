"""Every driver constant that umem_numba needs before the driver loads matches cuda.bindings."""

from __future__ import annotations

import pytest

import umem_numba as um
from umem_numba import _driver
from umem_numba._driver import _location

drv = pytest.importorskip("cuda.bindings.driver")


def test_public_enums_carry_the_drivers_values():
    assert int(um.HostAllocFlags.PORTABLE) == int(drv.CU_MEMHOSTALLOC_PORTABLE)
    assert int(um.HostAllocFlags.DEVICEMAP) == int(drv.CU_MEMHOSTALLOC_DEVICEMAP)
    assert int(um.HostAllocFlags.WRITECOMBINED) == int(drv.CU_MEMHOSTALLOC_WRITECOMBINED)
    for ours, theirs in (("NONE", "NONE"), ("READ", "READ"), ("READ_WRITE", "READWRITE")):
        assert int(getattr(um.AccessFlags, ours)) == int(
            getattr(drv.CUmemAccess_flags, f"CU_MEM_ACCESS_FLAGS_PROT_{theirs}")
        )
    for advice in um.MemAdvice:
        assert int(advice) == int(getattr(drv.CUmem_advise, f"CU_MEM_ADVISE_{advice.name}"))
    assert int(drv.CU_DEVICE_CPU) == _location._CU_DEVICE_CPU


def test_constants_resolve_from_the_binding_without_a_gpu():
    c = _driver._constants(drv)
    assert c.attach_global == int(drv.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL)
    assert c.attach_host == int(drv.CUmemAttach_flags.CU_MEM_ATTACH_HOST)
    assert c.attach_single == int(drv.CUmemAttach_flags.CU_MEM_ATTACH_SINGLE)
    assert {c.stream_legacy, c.stream_per_thread} == {int(drv.CU_STREAM_LEGACY), int(drv.CU_STREAM_PER_THREAD)}
    assert c.not_ready == int(drv.CUresult.CUDA_ERROR_NOT_READY)
