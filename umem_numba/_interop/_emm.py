"""numba's own allocations through umem_numba: an External Memory Management plugin.

Select it with numba's switches, before numba creates a CUDA context::

    NUMBA_CUDA_MEMORY_MANAGER=umem_numba python script.py
    # or, in code, before the first CUDA call:
    from numba import cuda; import umem_numba
    cuda.set_memory_manager(umem_numba.UmemNumbaMemoryManager)

What it reaches
---------------
``memalloc``
    Every device allocation numba makes: ``cuda.device_array``,
    ``to_device``, ``device_array_like``, the temporaries of reductions,
    ``copy_to_host``'s staging, IPC-opened staging copies.  They come from
    one umem_numba :class:`~umem_numba.MemoryPool` per context: device
    memory by default, managed memory with ``UMEM_NUMBA_EMM_POOL=managed``
    (or :attr:`UmemNumbaMemoryManager.pool_kind` set before the context
    exists).  Counted in ``umem_numba.stats()["emm"]``; the pool's driver
    counters appear in ``stats()["pool"]``.
``memallocmanaged``
    ``cuda.managed_array`` (global attachment) comes from a managed pool of
    the same context where the machine supports managed pools; host-attached
    requests, and machines without managed pools, keep numba's own
    ``cuMemAllocManaged``.
``memhostalloc`` / ``mempin``
    Pinned and mapped host memory (``cuda.pinned_array``,
    ``mapped_array``, ``cuda.pinned``) stay numba's own: the driver has no
    stream-ordered pool for page-locked host memory that numba's interface
    could use, so they are not counted in ``stats()``.

Frees are ordered after *every* stream of the device, non-blocking ones
included, as numba's own ``cuMemFree`` (which synchronises) is: numba does not
tell an allocator on which streams its kernels used an array, so a freed
array's memory is *held* by the pool and handed out again only after a
device synchronise that began after the free (``MemoryPool.free(ptr,
unordered=True)``; see :mod:`umem_numba._memory._pool`).  The pool synchronises once
it holds 32 blocks or 256 MiB and an allocation finds no settled memory of
its size (numba's own allocator synchronises about as often), and otherwise
takes new memory from the driver: no free ever costs a host wait.  Work of a
kernel on *another* device that used the array (peer access) must be
synchronised before the array is dropped, as with numba's own allocator.
Inside ``numba.cuda.defer_cleanup()`` frees are queued and run when the block
ends.

IPC
---
Off by default: every numba array of the process lives in the plugin's one
pool, and a handle gives the receiving process the whole pool (read-write).
Turn it on with ``UMEM_NUMBA_EMM_IPC=1`` (or
:attr:`UmemNumbaMemoryManager.exportable` set to ``True``) before numba
creates the context; ``get_ipc_handle()`` otherwise raises
:class:`~umem_numba.UnsupportedError` naming the setting.  With it on,
``DeviceNDArray.get_ipc_handle()`` works for memory of the (default) device
pool: the pool is created exportable (POSIX file descriptors, where the
device supports them), and the handle carries the pool's descriptor and the
allocation's 64-byte export data (``cuMemPoolExportToShareableHandle``,
``cuMemPoolExportPointer``).  It pickles through :mod:`multiprocessing`
(the descriptor travels over a Unix socket with ``SCM_RIGHTS``, by
``multiprocessing.reduction.DupFd``), as numba's own handles do, and the
receiving process opens it with ``handle.open()`` / ``with handle as arr``
(``cuMemPoolImportFromShareableHandle``, ``cuMemPoolSetAccess`` where its
device has no access yet, ``cuMemPoolImportPointer``), whatever memory
manager that process uses.  As with any CUDA IPC, close the handle in the
receiving process before the array is freed in the exporting one.  A
managed pool cannot be exported (the driver shares device pools only):
``get_ipc_handle()`` then raises :class:`~umem_numba.UnsupportedError`
saying so, as it does on a device that cannot export pools.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import os
import weakref
from collections.abc import Iterator
from typing import Any

from .. import _driver, _numba_compat
from .._errors import OutOfMemoryError, UnsupportedError
from .._memory import _resources, _stats

__all__ = ["UmemNumbaMemoryManager"]

#: numba-cuda's memory-manager classes and driver state (checked at import: a clear error if one lacks).
_nb = _numba_compat.emm_api()
_CudaAPIError: Any = _nb.CudaAPIError
_GetIpcHandleMixin: Any = _nb.GetIpcHandleMixin
_HostOnlyCUDAMemoryManager: Any = _nb.HostOnlyCUDAMemoryManager
_IpcHandle: Any = _nb.IpcHandle

_ENV = "UMEM_NUMBA_EMM_POOL"
_ENV_IPC = "UMEM_NUMBA_EMM_IPC"


def _env_pool_kind() -> str:
    kind = os.environ.get(_ENV, "device").strip().lower() or "device"
    return _resources.check_kind(kind, _resources.SHARED_KINDS, _ENV).name


def _env_ipc() -> bool:
    """``UMEM_NUMBA_EMM_IPC``: whether the plugin's device pool is made exportable (default: no)."""
    value = os.environ.get(_ENV_IPC, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{_ENV_IPC} must be 1 or 0 (also true/false, yes/no, on/off), got {value!r}")


def _existing_context() -> int | None:
    """A device on which numba already has a context (None if none)."""
    return _nb.context_device()


class _NumbaOutOfMemoryError(OutOfMemoryError, _CudaAPIError):
    """Out of memory in the pool: umem_numba's OutOfMemoryError and numba's CudaAPIError at once."""

    def __init__(self, err: OutOfMemoryError) -> None:
        self.call, self.code, self.name, self.detail = err.call, err.code, err.name, err.detail
        self.msg = str(err)
        Exception.__init__(self, str(err))

    def __reduce__(self) -> tuple[Any, ...]:  # pragma: no cover - pickled as the plain umem_numba error
        return (OutOfMemoryError, (self.call, self.code, self.name, self.detail))


class _CtxGuard:
    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.pushed = False

    def __enter__(self) -> None:
        drv = _driver.api().drv
        err, cur = drv.cuCtxGetCurrent()
        if not (err == 0 and int(cur) == int(self.handle)):
            drv.cuCtxPushCurrent(self.handle)
            self.pushed = True

    def __exit__(self, *exc: Any) -> None:
        if self.pushed:
            _driver.api().drv.cuCtxPopCurrent()


def _pool_free(pool: Any, ctx_handle: Any, ptr: int, size: int) -> None:
    with _CtxGuard(ctx_handle):
        pool.free(ptr, unordered=True)  # numba's kernels may still use it on any stream
    _stats.record_free("emm", size)


def _free_dtor(pool: Any, ctx_handle: Any, size: int) -> Any:
    def free_pool_memory(ptr: int, _quiet: Any = _driver.shutting_down) -> None:  # the name shows in numba's log
        if _quiet():  # exit: the driver reclaims the pool (see _finalizer)
            return
        _pool_free(pool, ctx_handle, ptr, size)

    return free_pool_memory


def _finalizer(mgr: UmemNumbaMemoryManager, pool: Any, ptr: int, size: int) -> Any:
    allocations = mgr.allocations
    deallocations = mgr.deallocations
    ctx_handle = mgr._ctx_handle

    def core(_quiet: Any = _driver.shutting_down) -> None:
        # numba registers this with weakref.finalize(atexit=True): it also runs at exit, when
        # contexts may be going (numba's, PyTorch's, CuPy's teardown).  Then nothing is freed:
        # the driver reclaims the pool with the process.  (Bound early: module globals may be None.)
        if _quiet():
            return
        allocations.pop(ptr, None)
        if deallocations.is_disabled:  # inside defer_cleanup(): run when it ends
            deallocations.add_item(_free_dtor(pool, ctx_handle, size), ptr, size)
        else:
            try:
                _pool_free(pool, ctx_handle, ptr, size)
            except Exception:
                if not _shutting_down():
                    raise

    return core


def _shutting_down() -> bool:
    return bool(_nb.shutting_down())


class UmemNumbaMemoryManager(_GetIpcHandleMixin, _HostOnlyCUDAMemoryManager):
    """numba-cuda EMM plugin that allocates numba's device memory from umem_numba pools.

    Parameters
    ----------
    context : numba Context or None
        What numba passes (keyword only): the context whose allocations the
        instance serves (``None`` for numba's interface check in
        ``cuda.set_memory_manager``); it goes on to numba's base class.

    Attributes
    ----------
    pool_kind : {"device", "managed"}
        Class attribute: the pool kind of contexts created from now on
        (default from ``UMEM_NUMBA_EMM_POOL``, else ``"device"``).
    exportable : bool
        Class attribute: whether contexts created from now on get an
        exportable device pool, which numba IPC (``get_ipc_handle()``) needs
        (default from ``UMEM_NUMBA_EMM_IPC``, else ``False``).  Every numba
        array of the process lives in that pool, and a handle shares the whole
        pool with the receiving process: turn it on only for IPC.

    Raises
    ------
    RuntimeError
        When selected (``cuda.set_memory_manager``) after numba already
        created a context: that context would keep numba's own allocator.
    """

    pool_kind: str = _env_pool_kind()
    exportable: bool = _env_ipc()
    # What numba calls it with (its base classes take *args, **kwargs): the signature help() and the docs show.
    __signature__ = inspect.Signature([inspect.Parameter("context", inspect.Parameter.KEYWORD_ONLY)])

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        context = kwargs.get("context")
        if context is None:  # numba's interface check in set_memory_manager()
            dev = _existing_context()
            if dev is not None:
                raise RuntimeError(
                    f"umem_numba's memory manager must be selected before numba creates a CUDA context, "
                    f"but device {dev} already has one (it keeps numba's own allocator): set "
                    f"NUMBA_CUDA_MEMORY_MANAGER=umem_numba, or call cuda.set_memory_manager() before the "
                    f"first CUDA call (or after cuda.close())"
                )
        super().__init__(*args, **kwargs)
        self._pool: Any = None
        self._managed_pool: Any = None
        self._managed_tried = False
        self._resource = _resources.check_kind(
            type(self).pool_kind, _resources.SHARED_KINDS, "UmemNumbaMemoryManager.pool_kind"
        )
        self._ipc = bool(type(self).exportable)
        self._ctx_handle = None if context is None else context.handle

    # -- setup ---------------------------------------------------------------------
    def initialize(self) -> None:
        """Create this context's pool (once) and size numba's deferred-free queue."""
        if self._pool is None:
            from .._memory._pool import MemoryPool

            device = self.context.device
            dev = int(getattr(device, "id", device))  # numba's Device, or the binding's CUdevice
            exportable = False
            if self._resource.pool_exportable and self._ipc:  # only when asked: see the module notes
                fd = int(_driver.consts().vmm_posix_fd)
                exportable = bool(_driver.device_attribute("MEMPOOL_SUPPORTED_HANDLE_TYPES", dev) & fd)
            self._pool = MemoryPool(self._resource.name, device=dev, exportable=exportable)
        if _nb.capacity_unset(self.deallocations):
            self.deallocations.memory_capacity = self.get_memory_info().total

    @property
    def pool(self) -> Any:
        """This context's :class:`~umem_numba.MemoryPool` (``None`` before initialisation)."""
        return self._pool

    # -- allocation ------------------------------------------------------------------
    def _wrap(self, pool: Any, ptr: int, size: int, cls: type) -> Any:
        _stats.record_alloc("emm", size)
        finalizer = _finalizer(self, pool, ptr, size)
        mem = cls(weakref.proxy(self.context), _nb.device_pointer(ptr), size, finalizer=finalizer)
        self.allocations[ptr] = mem
        return mem.own()

    def _allocate(self, pool: Any, size: int) -> int:
        try:
            return pool.allocate(size, 0)
        except OutOfMemoryError:
            # numba's own behaviour: run the pending frees, then try once more
            self.deallocations.clear()
            _driver.call("cuStreamSynchronize", 0, detail="letting queued frees complete before retrying")
            try:
                return pool.allocate(size, 0)
            except OutOfMemoryError as exc:
                raise _NumbaOutOfMemoryError(exc) from None

    def memalloc(self, size: int) -> Any:
        """Device (or managed, per :attr:`pool_kind`) memory for numba, from the pool."""
        if self._pool is None:
            self.initialize()
        if size == 0:
            return _nb.MemoryPointer(weakref.proxy(self.context), _nb.device_pointer(0), 0)
        ptr = self._allocate(self._pool, size)
        return self._wrap(self._pool, ptr, size, _nb.AutoFreePointer)

    def memallocmanaged(self, size: int, attach_global: bool) -> Any:
        """``cuda.managed_array``: from a managed pool where possible, else numba's own."""
        pool = self._managed_pool_or_none() if attach_global and size else None
        if pool is None:
            return super().memallocmanaged(size, attach_global)
        ptr = self._allocate(pool, size)
        return self._wrap(pool, ptr, size, _nb.ManagedMemory)

    def _managed_pool_or_none(self) -> Any:
        if self._resource is _resources.MANAGED:  # the pool numba's arrays come from is managed already
            if self._pool is None:
                self.initialize()
            return self._pool
        if not self._managed_tried:
            self._managed_tried = True
            from .._memory._pool import MemoryPool

            if not _resources.managed_pool_support():
                device = self.context.device
                self._managed_pool = MemoryPool("managed", device=int(getattr(device, "id", device)))
        return self._managed_pool

    @contextlib.contextmanager
    def _context_current(self) -> Iterator[None]:
        """This manager's context current for a driver call (numba may call in while it sets it up)."""
        err, current = _driver.api().drv.cuCtxGetCurrent()
        handle = self.context.handle
        if err == 0 and current is not None and int(current) == int(handle):
            yield
            return
        _driver.call("cuCtxPushCurrent", handle, detail="making numba's context current")
        try:
            yield
        finally:
            _driver.call("cuCtxPopCurrent", detail="restoring the previous context")

    # -- information ---------------------------------------------------------------------
    def get_memory_info(self) -> Any:
        """``(free, total)`` of the device; free includes what the pools hold unused."""
        with self._context_current():
            free, total = _driver.call("cuMemGetInfo", detail="memory info for numba")
        idle = 0
        for pool in (self._pool, self._managed_pool):
            if pool is not None and pool.resource.occupies_device and not pool.closed:
                s = pool.statistics()
                idle += s.reserved_current - s.used_current + s.cached  # the free lists are free for numba
        return _nb.MemoryInfo(free=min(int(free) + idle, int(total)), total=int(total))

    def get_ipc_handle(self, memory: Any) -> Any:
        """A numba IPC handle of device-pool memory (the pool's descriptor and the allocation's export data).

        Raises
        ------
        UnsupportedError
            IPC is off (``UMEM_NUMBA_EMM_IPC``), the memory comes from a
            managed pool, or the device cannot export pools (the message says
            which).
        """
        pool = self._pool
        owner = memory.owner
        base = int(owner.handle)
        if base not in self.allocations:  # not ours (numba cannot hand us another's memory, but be sure)
            base, _end = _nb.device_extents(memory)
        if pool is None or not pool.resource.pool_exportable:
            raise UnsupportedError(
                "numba IPC handles need device memory, but umem_numba's memory manager allocates from a "
                "managed pool here (UMEM_NUMBA_EMM_POOL=managed), which the driver cannot export; use "
                "UMEM_NUMBA_EMM_POOL=device for IPC"
            )
        if not getattr(self, "_ipc", False):
            raise UnsupportedError(
                "numba IPC through umem_numba's memory manager is off: its pool holds every numba array of "
                "the process and a handle would share all of it, so it is exportable only on request; set "
                f"{_ENV_IPC}=1 (or UmemNumbaMemoryManager.exportable = True) before numba creates the context"
            )
        if not pool.exportable:
            raise UnsupportedError(
                f"device {pool.device_id} cannot export memory pools as file descriptors, so numba IPC "
                "handles are unavailable through umem_numba's memory manager"
            )
        with self._context_current():
            # The pool first: the driver exports allocations of an already shared pool only.
            fd = int(
                _driver.call(
                    "cuMemPoolExportToShareableHandle",
                    pool.handle,
                    _driver.consts().vmm_posix_fd,
                    0,
                    detail="exporting a memory pool for IPC",
                )
            )
            try:
                data = _driver.call(
                    "cuMemPoolExportPointer", base, detail=f"exporting the pool allocation at {base:#x} for IPC"
                )
                raw = bytes(ctypes.string_at(data.getPtr(), _EXPORT_BYTES))
                offset = int(memory.handle) - base
                source_info = self.context.device.get_device_identity()
                # The handle owns the descriptor from here (its finalizer closes it), but only
                # once constructed: registering the finalizer is the last thing its __init__ does.
                return PoolIpcHandle(memory, _ExportData(raw), memory.size, source_info, offset=offset, pool_fd=fd)
            except BaseException:
                os.close(fd)
                raise

    # -- lifetime --------------------------------------------------------------------------
    def reset(self) -> None:
        """Free everything numba allocated in this context (numba's ``reset``)."""
        super().reset()

    @contextlib.contextmanager
    def defer_cleanup(self) -> Iterator[None]:
        """Queue frees (device and host) while active; run them when the outermost block ends."""
        with super().defer_cleanup():
            yield
        if not self.deallocations.is_disabled:
            self.deallocations.clear()

    @property
    def interface_version(self) -> int:
        """numba's EMM interface version implemented (1)."""
        return 1


_EXPORT_BYTES = 64  # sizeof(CUmemPoolPtrExportData)


class _ExportData:
    """The 64 opaque bytes of ``CUmemPoolPtrExportData`` (as ``.reserved``, like numba's handle)."""

    __slots__ = ("reserved",)

    def __init__(self, reserved: bytes) -> None:
        self.reserved = bytes(reserved)

    def __reduce__(self) -> Any:
        return (_ExportData, (self.reserved,))


class PoolIpcHandle(_IpcHandle):
    """A numba IPC handle of memory from an exportable device pool.

    Pickles the pool's file descriptor with :mod:`multiprocessing`'s
    descriptor passing and the allocation's export data; :meth:`open` imports
    both.  Open it in one process at a time; close it there before the
    exporting process frees the array.

    Parameters
    ----------
    base : numba MemoryPointer or None
        The exported memory (``None`` in a receiving process).
    handle : _ExportData
        The allocation's export data.
    size : int
        Bytes of the exported view.
    source_info : dict, optional
        The exporting device's identity (numba's ``get_device_identity``).
    offset : int
        Bytes from the allocation's start to the view.
    pool_fd : int or multiprocessing.reduction.DupFd
        The pool's descriptor (owned by this handle).
    """

    def __init__(
        self,
        base: Any,
        handle: _ExportData,
        size: int,
        source_info: Any = None,
        offset: int = 0,
        pool_fd: Any = None,
    ) -> None:
        super().__init__(base, handle, size, source_info, offset)
        self._pool_fd = pool_fd
        self._imported: tuple[Any, int] | None = None
        self._opened_mem: Any = None
        if isinstance(pool_fd, int):
            weakref.finalize(self, _close_fd, pool_fd)

    def __reduce__(self) -> Any:
        from multiprocessing.reduction import DupFd

        fd = self._pool_fd
        if isinstance(fd, int):
            fd = DupFd(fd)  # sent over a Unix socket (SCM_RIGHTS) when the receiver unpickles it
        return (_rebuild_pool_handle, (self.handle, fd, self.size, self.source_info, self.offset))

    def _descriptor(self) -> int:
        fd = self._pool_fd
        if not isinstance(fd, int):
            if fd is None:
                raise ValueError("this IPC handle has no pool descriptor (was it closed?)")
            fd = self._pool_fd = fd.detach()
            weakref.finalize(self, _close_fd, fd)
        return fd

    def open(self, context: Any) -> Any:
        """Import the memory into numba's ``context``; returns a numba memory pointer to the view."""
        if self.base is not None:
            raise ValueError("opening IpcHandle from original process")
        if self._imported is not None:
            raise ValueError("IpcHandle is already opened")
        drv = _driver.api().drv
        fd_type = _driver.consts().vmm_posix_fd
        dev = int(context.device.id)
        with _driver.device_context(dev):
            pool = _driver.call(
                "cuMemPoolImportFromShareableHandle",
                self._descriptor(),
                fd_type,
                0,
                detail="importing a memory pool from another process",
            )
            try:
                _grant_access(pool, dev)
                data = drv.CUmemPoolPtrExportData()
                ctypes.memmove(data.getPtr(), bytes(self.handle.reserved), _EXPORT_BYTES)
                ptr = int(
                    _driver.call(
                        "cuMemPoolImportPointer", pool, data, detail="importing a pool allocation from another process"
                    )
                )
            except BaseException:
                drv.cuMemPoolDestroy(pool)
                raise
        self._imported = (pool, ptr)
        mem = _nb.MemoryPointer(context, _nb.device_pointer(ptr), self.offset + self.size)
        self._opened_mem = mem
        return mem.own().view(self.offset)

    open_direct = open

    def open_staged(self, context: Any) -> Any:
        """As :meth:`open`: an imported pool is mapped for the receiving device itself (no staging needed)."""
        return self.open(context)

    def close(self) -> None:
        """Free the imported allocation and pool in this process."""
        if self._imported is None:
            raise ValueError("IpcHandle not opened")
        pool, ptr = self._imported
        drv = _driver.api().drv
        self._imported = None
        self._opened_mem = None
        try:
            _driver.check(drv.cuMemFree(ptr), "cuMemFree", "freeing an imported IPC allocation")
        finally:
            drv.cuMemPoolDestroy(pool)


def _grant_access(pool: Any, device_id: int) -> None:
    """Read/write access to an imported pool for ``device_id``, unless it has it (``cuMemPoolGetAccess``)."""
    drv = _driver.api().drv
    loc = drv.CUmemLocation()
    loc.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = device_id
    rw = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    flags = _driver.call("cuMemPoolGetAccess", pool, loc, detail="reading an imported pool's access")
    if int(flags) == int(rw):
        return
    desc = drv.CUmemAccessDesc()
    desc.location = loc
    desc.flags = rw
    _driver.call("cuMemPoolSetAccess", pool, [desc], 1, detail=f"granting device {device_id} an imported pool")


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _rebuild_pool_handle(handle: _ExportData, fd: Any, size: int, source_info: Any, offset: int) -> PoolIpcHandle:
    return PoolIpcHandle(None, handle, size, source_info, offset, pool_fd=fd)


#: What ``NUMBA_CUDA_MEMORY_MANAGER=umem_numba`` (or ``=umem_numba._interop._emm``) loads.
_numba_memory_manager = UmemNumbaMemoryManager
