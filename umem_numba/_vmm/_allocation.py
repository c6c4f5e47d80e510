"""The memory behind a VMMBuffer: chunks of physical memory mapped back to back in one range.

:class:`VMMChunks` is the buffer's :class:`~umem_numba._memory._lifetime.Memory`: it
owns the reservation and the chunks and always undoes them in order (unmap
before release, every chunk before the range is freed).  Because that order
lives in one place, the chunks need no finalizer or refcount of their own,
and growing costs three driver calls per chunk plus one access grant for the
whole step (``grow`` is the hot path the benchmark measures).

The driver maps physical allocations only whole, and sets access only on
whole mappings: chunk boundaries are therefore where a buffer can later be
shrunk and where access can be set on part of it.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from .. import _driver
from .._memory import _stats
from .._memory._lifetime import Allocation, Memory, Transaction, report_failed_free
from .._memory._tracker import Tracker
from ._access import AccessFlags, alloc_prop, set_access
from ._mapping import AddressRange

__all__ = ["VMMAllocation", "VMMChunks"]


class _Chunk:
    """One physical allocation, mapped at ``offset`` bytes into the buffer's range."""

    __slots__ = ("handle", "offset", "size")

    def __init__(self, handle: Any, offset: int, size: int) -> None:
        self.handle = handle
        self.offset = offset
        self.size = size


class VMMChunks(Memory):
    """A buffer's reservation and chunks; never refers to the buffer (its finalizer holds this).

    Parameters
    ----------
    address_range : AddressRange or None
        The reservation (``None`` when the buffer never needs memory).
    device_id : int
        The device the memory is on.
    exportable : bool
        Create chunks that can be exported as POSIX file descriptors.
    """

    kind = "vmm"

    __slots__ = ("chunks", "device_id", "exportable", "nbytes", "range")

    def __init__(self, address_range: AddressRange | None, device_id: int, exportable: bool) -> None:
        self.range = address_range
        self.chunks: list[_Chunk] = []
        self.nbytes = 0  # mapped bytes
        self.device_id = device_id
        self.exportable = exportable

    @property
    def base(self) -> int:
        """Start address of the reservation (0 when there is none)."""
        return self.range.ptr if self.range is not None else 0

    def describe(self) -> str:
        return f"VMM memory at {self.base:#x} ({self.nbytes} bytes in {len(self.chunks)} chunk(s))"

    # -- growing --------------------------------------------------------------
    def map_tail(self, size: int, chunk_bytes: int | None, grants: dict[int, AccessFlags]) -> None:
        """Map ``size`` more bytes after the last chunk, in chunks of at most ``chunk_bytes``.

        All or nothing: on any failure (out of memory included) what this call
        mapped is undone and the state is exactly as before.
        """
        rng = self.range
        if rng is None or self.nbytes + size > rng.size:
            raise ValueError(
                f"mapping {size} bytes after {self.nbytes} would pass the "
                f"{0 if rng is None else rng.size} reserved bytes"
            )
        drv = _driver.api().drv
        prop = alloc_prop(self.device_id, self.exportable)
        start, end = self.nbytes, self.nbytes + size
        new: list[_Chunk] = []
        with _driver.device_context(self.device_id), Transaction() as tx:
            tx.append(self._drop, new)
            offset = start
            while offset < end:
                n = min(chunk_bytes or size, end - offset)
                handle = _driver.check(
                    drv.cuMemCreate(n, prop, 0),
                    "cuMemCreate",
                    f"creating {n} bytes of physical memory on device {self.device_id}",
                )
                self._map(_Chunk(handle, offset, n), new)
                offset += n
            live: dict[int, AccessFlags] = {d: f for d, f in grants.items() if f != AccessFlags.NONE}
            set_access(rng.ptr + start, size, live, f"granting access to {size} newly mapped bytes")
            tx.commit()
        self.chunks.extend(new)
        self.nbytes = end

    def _map(self, chunk: _Chunk, done: list[_Chunk]) -> None:
        """Map one chunk (releasing its handle if that fails) and file it in ``done``."""
        rng = self.range
        assert rng is not None
        ptr = rng.ptr + chunk.offset
        with Transaction() as tx:
            tx.append(self._release_handle, chunk)
            rng._mappings.claim(chunk.offset, chunk.size)
            tx.append(rng._mappings.unclaim, chunk.offset)
            _driver.call(
                "cuMemMap", ptr, chunk.size, 0, chunk.handle, 0, detail=f"mapping {chunk.size} bytes at {ptr:#x}"
            )
            tx.commit()
        done.append(chunk)

    def import_chunks(self, pieces: list[tuple[int, int]], access: AccessFlags = AccessFlags.READ_WRITE) -> None:
        """Map exported allocations (``(fd, nbytes)`` in order) back to back, ``access`` for this device.

        All or nothing.  The import, the mapping and the grant run in this
        device's context: the memory may sit on another device (a peer),
        which is then reached over the peer link.
        """
        drv = _driver.api().drv
        kind = _driver.consts().vmm_posix_fd
        new: list[_Chunk] = []
        with _driver.device_context(self.device_id), Transaction() as tx:
            tx.append(self._drop, new)
            offset = 0
            for fd, n in pieces:
                handle = _driver.check(
                    drv.cuMemImportFromShareableHandle(fd, kind),
                    "cuMemImportFromShareableHandle",
                    f"importing VMM memory from file descriptor {fd}",
                )
                self._map(_Chunk(handle, offset, n), new)
                offset += n
            set_access(
                self.base,
                offset,
                {self.device_id: access},
                f"granting device {self.device_id} {access.name} access to imported memory",
            )
            tx.commit()
        self.chunks.extend(new)
        self.nbytes = offset

    # -- sharing --------------------------------------------------------------
    def export_fds(self) -> list[tuple[int, int]]:
        """One new POSIX file descriptor per chunk, with its size (the caller closes them)."""
        drv = _driver.api().drv
        kind = _driver.consts().vmm_posix_fd
        out: list[tuple[int, int]] = []
        with _driver.device_context(self.device_id), Transaction() as tx:
            for chunk in self.chunks:
                fd = _driver.check(
                    drv.cuMemExportToShareableHandle(chunk.handle, kind, 0),
                    "cuMemExportToShareableHandle",
                    "exporting VMM memory as a POSIX file descriptor",
                )
                tx.append(os.close, int(fd))
                out.append((int(fd), chunk.size))
            tx.commit()
        return out

    # -- releasing --------------------------------------------------------------
    def release_tail(self, keep: int) -> int:
        """Unmap and release every chunk that starts at or past byte ``keep``; return bytes freed."""
        gone = []
        while self.chunks and self.chunks[-1].offset >= keep:
            gone.append(self.chunks.pop())
        self._drop(gone[::-1])
        freed = sum(c.size for c in gone)
        self.nbytes -= freed
        return freed

    def free(self, tracker: Tracker) -> None:
        """Unmap and release every chunk, then free the range (the release path waited already)."""
        try:
            self._drop(self.chunks)
        finally:
            if self.range is not None:
                self.range.close()

    def _drop(self, chunks: list[_Chunk]) -> None:
        """Unmap then release ``chunks`` (last first); failures are reported, not raised."""
        if not chunks:
            return
        try:
            with _driver.device_context(self.device_id):
                for chunk in reversed(chunks):
                    self._unmap(chunk)
                    self._release_handle(chunk)
        except Exception as exc:  # no context to enter any more (interpreter exit)
            report_failed_free("entering the device context to free VMM memory", exc)

    def _unmap(self, chunk: _Chunk) -> None:
        rng = self.range
        assert rng is not None
        ptr = rng.ptr + chunk.offset
        try:
            _driver.call("cuMemUnmap", ptr, chunk.size, detail=f"unmapping {chunk.size} bytes at {ptr:#x}")
        except Exception as exc:
            report_failed_free(f"unmapping VMM memory at {ptr:#x}", exc)
        finally:
            rng._mappings.unclaim(chunk.offset)

    def _release_handle(self, chunk: _Chunk) -> None:
        try:
            _driver.call("cuMemRelease", chunk.handle, detail=f"releasing {chunk.size} bytes of VMM memory")
        except Exception as exc:
            report_failed_free("releasing VMM memory", exc)


class VMMAllocation(Allocation):
    """The allocation that a VMMBuffer and all its views share, with its growable state.

    Parameters
    ----------
    chunks : VMMChunks
        The memory (initially unmapped).
    granularity : int
        The allocation granularity of the device.
    chunk_bytes : int or None
        Largest chunk new memory is created in (``None``: one per growth step).
    """

    __slots__ = ("chunk_bytes", "chunks", "grants", "granularity", "length_nbytes", "resize_lock", "shrinks")

    def __init__(self, chunks: VMMChunks, granularity: int, chunk_bytes: int | None) -> None:
        super().__init__("vmm", chunks, chunks.base, chunks.device_id, Tracker(chunks.device_id))
        self.chunks = chunks
        self.granularity = granularity
        self.chunk_bytes = chunk_bytes
        self.length_nbytes = 0
        # Access given to every chunk mapped from now on (set_access on the whole buffer).
        self.grants: dict[int, AccessFlags] = {chunks.device_id: AccessFlags.READ_WRITE}
        # Logical byte length after each shrink: views made before a shrink check against it.
        self.shrinks: list[int] = []
        self.resize_lock = threading.RLock()

    def map_more(self, size: int) -> None:
        """Map ``size`` more bytes (all or nothing) and count them."""
        self.chunks.map_tail(size, self.chunk_bytes, self.grants)
        _stats.record_resize("vmm", size)

    def release_past(self, keep: int) -> None:
        """Release the chunks that start at or past byte ``keep`` and count them."""
        _stats.record_resize("vmm", -self.chunks.release_tail(keep))
