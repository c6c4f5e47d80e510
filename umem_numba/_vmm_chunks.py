"""The physical side of a VMMBuffer: chunks mapped back to back in one reserved range.

One :class:`_State` owns a buffer's chunks and always undoes them in order:
unmap before release, every chunk before the range is freed.  Because that
order lives in one place, the chunks need no finalizer or refcount of their
own, and growing costs three driver calls per chunk plus one access grant
for the whole step (``grow`` is the hot path the benchmark measures).

The driver maps physical allocations only whole, and sets access only on
whole mappings: chunk boundaries are therefore where a buffer can later be
shrunk and where access can be set on part of it.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from . import _driver, _stats
from ._buffer import _GONE
from ._coherence import Tracker
from ._errors import CudaError
from ._vmm import AccessFlags, AddressRange, _alloc_prop, _c, _on_device, _set_access


class _Chunk:
    """One physical allocation, mapped at ``offset`` bytes into the buffer's range."""

    __slots__ = ("handle", "offset", "size")

    def __init__(self, handle: Any, offset: int, size: int) -> None:
        self.handle = handle
        self.offset = offset
        self.size = size


def _warn_failed_free(what: str, exc: BaseException) -> None:
    gone = isinstance(exc, CudaError) and exc.name in _GONE
    if not gone and not sys.is_finalizing():
        # A failed free is reported, never hidden (the memory may be lost).
        warnings.warn(f"umem_numba: {what} failed: {exc}", RuntimeWarning, stacklevel=3)


class _State:
    """A buffer's reservation and chunks; never refers to the buffer (its finalizer holds this).

    Parameters
    ----------
    address_range : AddressRange or None
        The reservation (``None`` when the buffer never needs memory).
    device_id : int
        The device the memory is on.
    tracker : Tracker
        Device work on the buffer, waited for before memory is released.
    exportable : bool
        Create chunks that can be exported as POSIX file descriptors.
    """

    __slots__ = ("range", "chunks", "mapped", "device_id", "tracker", "exportable", "counted", "released")

    def __init__(self, address_range: AddressRange | None, device_id: int, tracker: Tracker,
                 exportable: bool) -> None:
        self.range = address_range
        self.chunks: list[_Chunk] = []
        self.mapped = 0
        self.device_id = device_id
        self.tracker = tracker
        self.exportable = exportable
        self.counted = False  # set once stats counted the buffer
        self.released = False

    @property
    def base(self) -> int:
        return self.range.ptr if self.range is not None else 0

    # -- growing --------------------------------------------------------------
    def map_tail(self, size: int, chunk_bytes: int | None, grants: dict[int, AccessFlags]) -> None:
        """Map ``size`` more bytes after the last chunk, in chunks of at most ``chunk_bytes``.

        All or nothing: on any failure (out of memory included) what this call
        mapped is undone and the state is exactly as before.
        """
        rng = self.range
        if rng is None or self.mapped + size > rng.size:
            raise ValueError(f"mapping {size} bytes after {self.mapped} would pass the "
                             f"{0 if rng is None else rng.size} reserved bytes")
        drv = _driver.api().drv
        prop = _alloc_prop(self.device_id, self.exportable)
        base, start, end = rng.ptr, self.mapped, self.mapped + size
        new: list[_Chunk] = []
        try:
            with _on_device(self.device_id):
                offset = start
                while offset < end:
                    n = min(chunk_bytes or size, end - offset)
                    handle = _driver.check(drv.cuMemCreate(n, prop, 0), "cuMemCreate",
                                           f"creating {n} bytes of physical memory on device {self.device_id}")
                    self._map(_Chunk(handle, offset, n), new)
                    offset += n
                grants = {d: f for d, f in grants.items() if f != AccessFlags.NONE}
                _set_access(base + start, size, grants, f"granting access to {size} newly mapped bytes")
        except BaseException:
            self._drop(new)
            raise
        self.chunks.extend(new)
        self.mapped = end

    def _map(self, chunk: _Chunk, done: list[_Chunk]) -> None:
        """Map one chunk (releasing its handle if that fails) and file it in ``done``."""
        ptr = self.base + chunk.offset
        try:
            _driver.call("cuMemMap", ptr, chunk.size, 0, chunk.handle, 0,
                         detail=f"mapping {chunk.size} bytes at {ptr:#x}")
        except BaseException:
            try:
                _driver.call("cuMemRelease", chunk.handle, detail="releasing a chunk that could not be mapped")
            except CudaError as exc:
                _warn_failed_free("releasing VMM memory", exc)
            raise
        self.range._res.retain()  # type: ignore[union-attr]  # the range outlives its mappings
        done.append(chunk)

    def import_chunks(self, pieces: list[tuple[int, int]]) -> None:
        """Map exported allocations (``(fd, nbytes)`` in order) back to back; all or nothing."""
        drv = _driver.api().drv
        kind = _c().posix_fd
        new: list[_Chunk] = []
        try:
            with _on_device(self.device_id):
                offset = 0
                for fd, n in pieces:
                    handle = _driver.check(drv.cuMemImportFromShareableHandle(fd, kind),
                                           "cuMemImportFromShareableHandle",
                                           f"importing VMM memory from file descriptor {fd}")
                    self._map(_Chunk(handle, offset, n), new)
                    offset += n
                _set_access(self.base, offset, {self.device_id: AccessFlags.READ_WRITE},
                            f"granting device {self.device_id} READ_WRITE access to imported memory")
        except BaseException:
            self._drop(new)
            raise
        self.chunks.extend(new)
        self.mapped = offset

    # -- sharing --------------------------------------------------------------
    def export_fds(self) -> list[tuple[int, int]]:
        """One new POSIX file descriptor per chunk, with its size (the caller closes them)."""
        import os

        drv = _driver.api().drv
        kind = _c().posix_fd
        out: list[tuple[int, int]] = []
        try:
            with _on_device(self.device_id):
                for chunk in self.chunks:
                    fd = _driver.check(drv.cuMemExportToShareableHandle(chunk.handle, kind, 0),
                                       "cuMemExportToShareableHandle",
                                       "exporting VMM memory as a POSIX file descriptor")
                    out.append((int(fd), chunk.size))
        except BaseException:
            for fd, _ in out:
                os.close(fd)
            raise
        return out

    # -- releasing --------------------------------------------------------------
    def release_tail(self, keep: int) -> int:
        """Unmap and release every chunk that starts at or past byte ``keep``; return bytes freed."""
        gone = []
        while self.chunks and self.chunks[-1].offset >= keep:
            gone.append(self.chunks.pop())
        self._drop(gone[::-1])
        freed = sum(c.size for c in gone)
        self.mapped -= freed
        return freed

    def release(self) -> None:
        """Wait for device work, unmap and release every chunk, free the range (once)."""
        if self.released:
            return
        self.released = True
        t = self.tracker
        try:
            if t.pending or t.unknown:
                t.wait(extra="context" if t.unknown else None)
        except Exception as exc:  # the frees below still run; each reports its own failure
            _warn_failed_free("waiting for device work before freeing a VMMBuffer", exc)
        finally:
            self._drop(self.chunks)
            self.chunks = []
            if self.range is not None:
                self.range.close()
            if self.counted:
                _stats.record_free("vmm", self.mapped)

    def _drop(self, chunks: list[_Chunk]) -> None:
        """Unmap then release ``chunks`` (last first); failures are warned about, not raised."""
        if not chunks:
            return
        try:
            with _on_device(self.device_id):
                for chunk in reversed(chunks):
                    self._unmap_release(chunk)
        except Exception as exc:  # no context to enter any more (interpreter exit)
            _warn_failed_free("entering the device context to free VMM memory", exc)

    def _unmap_release(self, chunk: _Chunk) -> None:
        ptr = self.base + chunk.offset
        try:
            _driver.call("cuMemUnmap", ptr, chunk.size, detail=f"unmapping {chunk.size} bytes at {ptr:#x}")
        except Exception as exc:
            _warn_failed_free(f"unmapping VMM memory at {ptr:#x}", exc)
        finally:
            try:
                _driver.call("cuMemRelease", chunk.handle, detail=f"releasing {chunk.size} bytes of VMM memory")
            except Exception as exc:
                _warn_failed_free("releasing VMM memory", exc)
            finally:
                self.range._res.unretain()  # type: ignore[union-attr]
