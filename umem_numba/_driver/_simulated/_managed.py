"""Managed memory hints: advice, prefetches, range attributes, attaching, discards.

Mixed into :class:`~umem_numba._driver._simulated.SimDriver` as :class:`ManagedHints`.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
from typing import Any

import numpy as np

from ..._errors import UnsupportedError
from ._common import (
    _INVALID_VALUE,
    _NOT_SUPPORTED,
    _SUCCESS,
    PAGE,
    _Error,
    _int,
    _refuse,
)
from ._locations import _legacy_codes, location_code, typed_location
from ._memory import Allocations, _Memory


class ManagedHints(Allocations):
    """Advice, prefetches and discards of managed memory, and the range attributes that read them back."""

    def _init_managed(self) -> None:
        self._range_get_attribute: Any = None  # the ctypes callback cuGetProcAddress hands out, made once

    def _managed_pages(self, ptr: int, nbytes: int) -> tuple[_Memory, slice] | None:
        mem = self._find(ptr)
        if mem is None or mem.kind != "managed" or ptr + nbytes > mem.base + mem.size:
            return None
        lo = (ptr - mem.base) // PAGE
        hi = -(-(ptr - mem.base + nbytes) // PAGE)
        return mem, slice(lo, max(hi, lo + 1))

    def cuMemAdvise(self, ptr: Any, nbytes: Any, advice: Any, location: Any) -> tuple[Any, ...]:
        p, n = _int(ptr), _int(nbytes)
        name = getattr(advice, "name", str(advice)).replace("CU_MEM_ADVISE_", "")
        with self._lock:
            found = self._managed_pages(p, n)
            if found is None:
                return (_INVALID_VALUE,)
            mem, pages = found
            if mem.pool:
                # Managed-pool memory takes no advice: driver 580 refused read-mostly, accessed-by and
                # a preferred location there, and unsetting the pool's preferred location.
                return (_NOT_SUPPORTED,)
            try:
                loc = location_code(location)
            except _Error as e:
                return (e.code,)
            col = 0 if loc == 0 else 1
            if name == "SET_READ_MOSTLY":
                mem.read_mostly[pages] = True
            elif name == "UNSET_READ_MOSTLY":
                mem.read_mostly[pages] = False
            elif name == "SET_PREFERRED_LOCATION":
                mem.preferred[pages] = loc
            elif name == "UNSET_PREFERRED_LOCATION":
                mem.preferred[pages] = -2
            elif name == "SET_ACCESSED_BY":
                mem.accessed_by[pages, col] = True
            elif name == "UNSET_ACCESSED_BY":
                mem.accessed_by[pages, col] = False
            else:
                return (_INVALID_VALUE,)
        return (_SUCCESS,)

    def cuMemPrefetchAsync(self, ptr: Any, nbytes: Any, location: Any, flags: Any, handle: Any) -> tuple[Any, ...]:
        p, n = _int(ptr), _int(nbytes)
        with self._lock:
            found = self._managed_pages(p, n)
            if found is None:
                return (_INVALID_VALUE,)
            mem, pages = found
            try:
                loc = location_code(location)
            except _Error as e:
                return (e.code,)

            # The driver reports the last location asked for, done or not.
            mem.last_prefetch[pages] = loc

            def run() -> None:
                self._check_live(p, n, "cuMemPrefetchAsync")

            try:
                self._enqueue(handle, run, "cuMemPrefetchAsync")
            except _Error as e:
                return (e.code,)
        return (_SUCCESS,)

    def cuMemRangeGetAttribute(self, size: Any, attr: Any, ptr: Any, nbytes: Any) -> tuple[Any, ...]:
        name = getattr(attr, "name", str(attr)).replace("CU_MEM_RANGE_ATTRIBUTE_", "")
        p, n, size = _int(ptr), _int(nbytes), _int(size)
        with self._lock:
            found = self._managed_pages(p, n)
            if found is None:
                return (_INVALID_VALUE, None)
            mem, pages = found

            def same(values: np.ndarray) -> int:
                return int(values[0]) if (values == values[0]).all() else -2

            if name == "READ_MOSTLY":
                return (_SUCCESS, int(bool(mem.read_mostly[pages].all())))
            if name == "PREFERRED_LOCATION":
                return (_SUCCESS, same(_legacy_codes(mem.preferred[pages])))
            if name == "LAST_PREFETCH_LOCATION":
                return (_SUCCESS, same(_legacy_codes(mem.last_prefetch[pages])))
            if name.endswith(("_LOCATION_TYPE", "_LOCATION_ID")):
                code = same(mem.preferred[pages] if name.startswith("PREFERRED") else mem.last_prefetch[pages])
                loc_type, loc_id = typed_location(self._real, code)
                return (_SUCCESS, loc_id if name.endswith("_ID") else loc_type)
            if name == "ACCESSED_BY":
                ids = [loc for col, loc in ((0, 0), (1, -1)) if mem.accessed_by[pages, col].all()]
                slots = max(size // 4, 1)
                return (_SUCCESS, (ids + [-2] * slots)[:slots])
        raise UnsupportedError(
            f"cuMemRangeGetAttribute({name}): not supported under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)"
        )

    def cuStreamAttachMemAsync(self, handle: Any, ptr: Any, length: Any, flags: Any) -> tuple[Any, ...]:
        with self._lock:
            mem = self._find(_int(ptr))
            if mem is None or mem.kind != "managed":
                return (_INVALID_VALUE,)
            f = _int(flags)

            def run() -> None:
                mem.attach = f

            try:
                self._enqueue(handle, run, "attach memory")
            except _Error as e:
                return (e.code,)
        return (_SUCCESS,)

    def _discard_batch(
        self, call: str, dptrs: Any, sizes: Any, count: Any, locations: list[Any] | None, flags: Any, handle: Any
    ) -> tuple[Any, ...]:
        n = _int(count)
        ptrs, lengths = [_int(p) for p in list(dptrs)[:n]], [_int(z) for z in list(sizes)[:n]]
        if not n or len(ptrs) != n or len(lengths) != n or _int(flags):
            return (_INVALID_VALUE,)
        with self._lock:
            try:
                s = self._stream(handle)
            except _Error as e:
                return (e.code,)
            if s.kind == "legacy":
                return (_INVALID_VALUE,)  # "Must not be legacy NULL stream"
            spans = []
            for p, z in zip(ptrs, lengths, strict=True):
                found = self._managed_pages(p, z) if z > 0 else None
                if found is None:
                    return (_INVALID_VALUE,)  # managed memory only
                spans.append((p, z, found))
            codes: list[int] = []
            if locations is not None:
                try:
                    codes = [location_code(loc) for loc in locations]
                except _Error as e:
                    return (e.code,)
                for (_, _, (mem, pages)), code in zip(spans, codes, strict=True):
                    mem.last_prefetch[pages] = code  # the driver reports the last location asked for
            # Discarded contents are indeterminate: garbage, drawn from the seed, when the discard runs.
            salt = self._rng.getrandbits(32)
            ranges = [(p, p + z) for p, z, _ in spans]
            # A GPU does not hold a discard back for work of other streams on its pages that is still
            # unfinished when it is issued, even behind a stream wait for that work: an H100 lost the
            # write queued after such a discard (issue #27).  Its garbage then lands again once that work
            # has run, at the end of the synchronisation that ran it, after what ran meanwhile.
            racing = self._unfinished_work_on(ranges, s)

            def garble() -> None:
                for i, (p, z, _) in enumerate(spans):
                    self._check_live(p, z, call)
                    garbage = np.random.default_rng((salt, i)).integers(0, 256, z, dtype=np.uint8)
                    ctypes.memmove(p, garbage.ctypes.data, z)

            def land_late() -> None:
                if all(self._find(p) is not None for p, _, _ in spans):  # not freed meanwhile
                    garble()

            op = self._enqueue(s, garble, call)
            op.spans = tuple(ranges)
            if racing:
                self._late_effects.append(([*racing, op], land_late))
        return (_SUCCESS,)

    def cuMemDiscardBatchAsync(self, dptrs: Any, sizes: Any, count: Any, flags: Any, handle: Any) -> tuple[Any, ...]:
        return self._discard_batch("cuMemDiscardBatchAsync", dptrs, sizes, count, None, flags, handle)

    def cuMemDiscardAndPrefetchBatchAsync(
        self,
        dptrs: Any,
        sizes: Any,
        count: Any,
        locations: Any,
        first: Any,
        nlocations: Any,
        flags: Any,
        handle: Any,
    ) -> tuple[Any, ...]:
        n, runs = _int(count), _int(nlocations)
        locs, starts = list(locations)[:runs], [_int(i) for i in list(first)[:runs]]
        if (
            not runs
            or runs > n
            or starts[0] != 0
            or any(b <= a for a, b in itertools.pairwise(starts))
            or starts[-1] >= n
        ):
            return (_INVALID_VALUE,)
        per_range = [locs[bisect.bisect_right(starts, i) - 1] for i in range(n)]
        return self._discard_batch("cuMemDiscardAndPrefetchBatchAsync", dptrs, sizes, count, per_range, flags, handle)

    def cuGetProcAddress(self, symbol: Any, version: Any, flags: Any) -> tuple[Any, ...]:
        """The driver's own ``cuMemRangeGetAttribute`` (umem_numba calls it through ctypes); nothing else."""
        name = symbol.decode() if isinstance(symbol, bytes) else str(symbol)
        if name != "cuMemRangeGetAttribute":
            return _refuse(f"cuGetProcAddress({name})")()
        if self._range_get_attribute is None:
            proto = ctypes.CFUNCTYPE(
                ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64, ctypes.c_size_t
            )
            self._range_get_attribute = proto(self._raw_range_get_attribute)
        pfn = ctypes.cast(self._range_get_attribute, ctypes.c_void_p).value
        return (_SUCCESS, pfn, self._real.CUdriverProcAddressQueryResult.CU_GET_PROC_ADDRESS_SUCCESS)

    def _raw_range_get_attribute(self, out: int, size: int, attr: int, ptr: int, nbytes: int) -> int:
        """``CUresult cuMemRangeGetAttribute(void *data, size_t dataSize, attribute, devPtr, count)``."""
        try:
            res = self.cuMemRangeGetAttribute(size, self._real.CUmem_range_attribute(attr), ptr, nbytes)
        except Exception:  # an attribute the simulation does not answer: the driver's "invalid value"
            return _INVALID_VALUE
        if res[0] != _SUCCESS:
            return int(res[0])
        values = res[1] if isinstance(res[1], list) else [int(res[1])]
        slots = max(int(size) // 4, 1)
        (ctypes.c_int32 * slots).from_address(out)[:] = [int(v) for v in values[:slots]]
        return _SUCCESS
