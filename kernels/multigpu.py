"""Heat steps on several GPUs of one process: one slab per GPU, halos moved device to device.

:class:`MultiGPUHeat` cuts the grid with :class:`~umem_numba.kernels.decomp.Decomposition`
(aligned to the tuned kernel's strips, so the result is bitwise equal to the
one-GPU run) and gives each slab a device, a stream and two device arrays.
One step is:

1. on every slab's stream: the tuned kernel over the slab (``heat2d_kernel`` /
   ``heat3d_kernel``, the very launch :func:`heat2d_step` makes on one GPU),
   then an event;
2. for each halo row: the *receiving* slab's stream waits for the sending
   slab's event (``cuStreamWaitEvent``) and copies the row device to device:
   ``cuMemcpyPeerAsync`` between GPUs with peer access (enabled here with
   ``cuCtxEnablePeerAccess``), ``cuMemcpyDtoDAsync`` between slabs on one GPU,
   and otherwise through a portable :class:`umem_numba.PinnedBuffer` (a
   device-to-host copy on the sender's stream, a host-to-device copy on the
   receiver's; the buffer's coherence tracking orders the two).

Nothing in a step waits on the host, so the host queues steps ahead of the GPUs.

The same GPU may appear several times in ``devices``: ``devices=[0, 0, 0]``
runs a *simulated* decomposition into three slabs on GPU 0, with the same
exchange logic (the tests compare it bitwise with the one-slab run).

Ordering argument: slab ``k`` reads its neighbour's new field only after
waiting for the neighbour's kernel; the neighbour overwrites that field two
steps later, after its own stream has waited for slab ``k``'s next kernel,
which slab ``k``'s stream queued after the copy.  So every read of a
neighbour's memory is ordered between the write it needs and the next write.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ._common import _as_float_dtype, require_free_memory, stencil_weights
from .decomp import Decomposition, HaloExchange

__all__ = ["MultiGPUHeat", "PeerExchange", "heat_multi", "heat2d_multi", "heat3d_multi", "TRANSPORTS"]

#: Halo transports: ``auto`` picks per pair (same GPU: device copy; peer access: peer copy;
#: otherwise pinned staging); ``pinned`` stages every halo through pinned host memory.
TRANSPORTS = ("auto", "pinned")


@dataclass
class _SlabState:
    device: int
    ctx: Any
    stream: Any
    src: Any
    dst: Any
    done: Any
    grid: tuple
    block: tuple
    row_bytes: int
    ptrs: dict = field(default_factory=dict)


def _ptr(arr: Any) -> int:
    return int(arr.__cuda_array_interface__["data"][0])


class PeerExchange(HaloExchange):
    """Halo moves between slab fields on GPUs of one process (see the module docstring).

    Parameters
    ----------
    decomp : Decomposition
    slabs : list of _SlabState
        Per slab: device, context, stream, fields and the event its step records.
    transport : {'auto', 'pinned'}
    """

    def __init__(self, decomp: Decomposition, slabs: list[_SlabState], transport: str = "auto") -> None:
        super().__init__(decomp)
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        import umem_numba as um
        from umem_numba import _driver
        from numba import cuda

        self._slabs = slabs
        self.kinds: list[str] = []
        self._pinned: list[Any] = []
        for m in self.moves:
            a, b = slabs[m.src], slabs[m.dst]
            if transport == "pinned":
                kind = "pinned"
            elif a.device == b.device:
                kind = "device"
            elif _enable_peer(a, b) and _enable_peer(b, a):
                kind = "peer"
            else:
                kind = "pinned"
            self.kinds.append(kind)
            if kind == "pinned":
                with cuda.gpus[b.device]:
                    shape = decomp.shape[1:]
                    self._pinned.append(um.PinnedBuffer.empty(shape, a.src.dtype, um.HostAllocFlags.PORTABLE))
            else:
                self._pinned.append(None)
        self._drv = _driver

    def exchange(self, fields: Sequence[Any] | None = None) -> None:
        """Queue every halo move of the slabs' current ``dst`` fields (after their kernels; no host wait)."""
        from numba import cuda

        slabs = self._slabs
        for m, kind, pin in zip(self.moves, self.kinds, self._pinned):
            a, b = slabs[m.src], slabs[m.dst]
            if kind == "pinned":
                with cuda.gpus[a.device]:
                    pin.copy_from_device(a.dst[m.src_row], stream=a.stream)
                with cuda.gpus[b.device]:
                    pin.copy_to_device(b.dst[m.dst_row], stream=b.stream)
                continue
            src = _ptr(a.dst) + m.src_row * a.row_bytes
            dst = _ptr(b.dst) + m.dst_row * b.row_bytes
            with cuda.gpus[b.device]:
                a.done.wait(b.stream)
                h = int(b.stream.handle)
                if kind == "device":
                    self._drv.call("cuMemcpyDtoDAsync", dst, src, a.row_bytes, h)
                else:
                    self._drv.call("cuMemcpyPeerAsync", dst, b.ctx, src, a.ctx, a.row_bytes, h)

    def close(self) -> None:
        """Free the pinned staging buffers."""
        for p in self._pinned:
            if p is not None:
                p.close()
        self._pinned = [None] * len(self._pinned)


def _enable_peer(a: _SlabState, b: _SlabState) -> bool:
    """Let ``b``'s context access ``a``'s memory; False if the GPUs cannot."""
    from numba import cuda
    from umem_numba import CudaError, _driver

    if not int(_driver.call("cuDeviceCanAccessPeer", b.device, a.device)):
        return False
    with cuda.gpus[b.device]:
        try:
            _driver.call("cuCtxEnablePeerAccess", a.ctx, 0)
        except CudaError as exc:
            if exc.name != "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED":
                raise
    return True


class MultiGPUHeat:
    """The 2-D or 3-D heat step on slabs spread over GPUs of this process.

    Parameters
    ----------
    u0 : 2-D or 3-D float32/float64 array
        Initial field (host); its first and last rows/planes and columns are
        the fixed boundary.
    devices : sequence of int
        One GPU ordinal per slab, top to bottom; repeat an ordinal to put
        several slabs on one GPU (a simulated decomposition).
    alpha : float, optional
        Diffusion number; 0.25 (2-D) or 1/6 (3-D) when omitted.
    transport : {'auto', 'pinned'}
        How halos move (see :data:`TRANSPORTS`).
    rows_per_thread : int, optional
        The kernel's strip height (``rows_per_thread`` / ``planes_per_thread``);
        the tuned value for the dtype when omitted.  The decomposition aligns to it.
    block : (int, int), optional
        Thread block; the tuned one when omitted.
    allow_oversubscribe : bool
        Skip the free-memory check.

    Raises
    ------
    ValueError
        No devices, a device that does not exist, more slabs than rows, a bad alpha.
    TypeError
        A dtype other than float32/float64.
    MemoryBudgetError
        The slabs of a GPU do not fit in its free memory.
    CudaUnavailableError
        No usable GPU.
    """

    def __init__(self, u0: Any, devices: Sequence[int], alpha: float | None = None, *,
                 transport: str = "auto", rows_per_thread: int | None = None,
                 block: tuple[int, int] | None = None, allow_oversubscribe: bool = False) -> None:
        u0 = np.asarray(u0)
        if u0.ndim not in (2, 3):
            raise ValueError(f"u0 must be 2-D or 3-D, got shape {u0.shape}")
        dtype = _as_float_dtype(u0.dtype)
        devices = [int(d) for d in devices]
        if not devices:
            raise ValueError("devices must name at least one GPU")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        ndim = u0.ndim
        alpha = (0.25 if ndim == 2 else 1.0 / 6.0) if alpha is None else float(alpha)
        self.weights = stencil_weights(alpha, ndim, dtype)
        self.alpha = alpha
        if ndim == 2:
            from .stencil2d import TUNED_2D as tuned, heat2d_kernel as make, launch_config_2d as config
        else:
            from .stencil3d import TUNED_3D as tuned, heat3d_kernel as make, launch_config_3d as config
        rows, blk = tuned[dtype]
        rows = rows if rows_per_thread is None else int(rows_per_thread)
        blk = blk if block is None else tuple(block)
        self.decomp = Decomposition(u0.shape, len(devices), align=rows)  # ValueError before any driver call

        from numba import cuda
        from umem_numba import _driver

        count = _driver.device_count()  # CudaUnavailableError without a GPU
        bad = [d for d in devices if not 0 <= d < count]
        if bad:
            raise ValueError(f"devices {bad} do not exist: this machine has {count} CUDA device(s)")
        need: dict[int, int] = {}
        for k, d in enumerate(devices):
            need[d] = need.get(d, 0) + 2 * int(np.prod(self.decomp.local_shape(k))) * dtype.itemsize
        for d, nbytes in need.items():
            with cuda.gpus[d]:
                free, total = _driver.mem_get_info()
            require_free_memory(nbytes, f"the slabs of GPU {d}", allow_oversubscribe=allow_oversubscribe,
                                free=free, total=total)

        self.kernel = make(rows)
        self.devices = devices
        self.dtype = dtype
        row_bytes = self.decomp.halo_cells() * dtype.itemsize
        parts = self.decomp.scatter(u0)
        self.slabs: list[_SlabState] = []
        for k, (d, local) in enumerate(zip(devices, parts)):
            with cuda.gpus[d]:
                ctx = _driver.call("cuCtxGetCurrent")
                stream = cuda.stream()
                src = cuda.to_device(local, stream=stream)
                dst = cuda.to_device(local, stream=stream)  # alignment rows start defined
                grid, block3 = config(local.shape, rows, blk)
                self.slabs.append(_SlabState(d, ctx, stream, src, dst, cuda.event(timing=False),
                                             grid, block3, row_bytes))
        self.exchanger = PeerExchange(self.decomp, self.slabs, transport)
        self.steps_done = 0
        self.synchronize()

    @property
    def transports(self) -> list[str]:
        """How each halo move travels (``device``, ``peer`` or ``pinned``), in :meth:`Decomposition.moves` order."""
        return list(self.exchanger.kinds)

    def step(self, n: int = 1, *, exchange: bool = True) -> None:
        """Queue ``n`` steps on every GPU (asynchronous: no host synchronize).

        ``exchange=False`` skips the halo moves (for timing the kernels alone;
        the field is then wrong at the slab edges).
        """
        from numba import cuda

        wc, wn = self.weights
        for _ in range(int(n)):
            for s in self.slabs:
                with cuda.gpus[s.device]:
                    self.kernel[s.grid, s.block, s.stream](s.src, s.dst, wc, wn)
                    s.done.record(s.stream)
            if exchange:
                self.exchanger.exchange()
            for s in self.slabs:
                s.src, s.dst = s.dst, s.src
            self.steps_done += 1

    def synchronize(self) -> None:
        """Wait for everything queued on every slab's stream."""
        for s in self.slabs:
            s.stream.synchronize()

    def timed(self, n: int, *, exchange: bool = True) -> float:
        """Seconds for ``n`` steps, host clock between synchronizes of every GPU."""
        self.synchronize()
        t0 = time.perf_counter()
        self.step(n, exchange=exchange)
        self.synchronize()
        return time.perf_counter() - t0

    def result(self) -> np.ndarray:
        """The gathered field after the steps so far (waits for them)."""
        from numba import cuda

        fields = []
        for s in self.slabs:
            with cuda.gpus[s.device]:
                fields.append(s.src.copy_to_host(stream=s.stream))
        self.synchronize()
        return self.decomp.gather(fields)

    def close(self) -> None:
        """Free the device arrays and staging buffers now."""
        self.synchronize()
        self.exchanger.close()
        for s in self.slabs:
            s.src = s.dst = None
        self.slabs = []

    def __enter__(self) -> "MultiGPUHeat":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def heat_multi(u0: Any, steps: int, devices: Sequence[int], alpha: float | None = None,
               **kwargs: Any) -> np.ndarray:
    """``steps`` heat steps of ``u0`` on slabs over ``devices``; returns the gathered field.

    Bitwise equal to ``steps`` calls of :func:`heat2d_step` / :func:`heat3d_step`
    on one GPU with the same launch shape.  Keyword arguments go to
    :class:`MultiGPUHeat`.
    """
    with MultiGPUHeat(u0, devices, alpha, **kwargs) as run:
        run.step(int(steps))
        return run.result()


def heat2d_multi(u0: Any, steps: int, devices: Sequence[int], alpha: float = 0.25, **kwargs: Any) -> np.ndarray:
    """:func:`heat_multi` for a 2-D field (checks that it is 2-D)."""
    if np.ndim(u0) != 2:
        raise ValueError(f"heat2d_multi needs a 2-D field, got shape {np.shape(u0)}")
    return heat_multi(u0, steps, devices, alpha, **kwargs)


def heat3d_multi(u0: Any, steps: int, devices: Sequence[int], alpha: float = 1.0 / 6.0,
                 **kwargs: Any) -> np.ndarray:
    """:func:`heat_multi` for a 3-D field (checks that it is 3-D)."""
    if np.ndim(u0) != 3:
        raise ValueError(f"heat3d_multi needs a 3-D field, got shape {np.shape(u0)}")
    return heat_multi(u0, steps, devices, alpha, **kwargs)
