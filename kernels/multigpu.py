"""Heat steps on several GPUs of one process: one slab per GPU, halos moved device to device.

:class:`MultiGPUHeat` cuts the grid with :class:`~umem_numba.kernels.decomp.Decomposition`
(aligned to the tuned kernel's strips, so the result is bitwise equal to the
one-GPU run) and gives each slab a device, two streams (*main* and *edge*),
two fields and, per halo row it sends, a small *band* array.  One step of
slab ``k`` is:

1. main stream: wait for the halo rows its neighbours sent last step
   (``cuStreamWaitEvent`` on their events) and put them into the field's
   halo rows (a device-local copy, or nothing for ``halo="vmm"``: see
   below); record ``ready``; then the full slab step (the tuned kernel over
   the slab, the very launch :func:`heat2d_step` / :func:`heat3d_step` makes
   on one GPU);
2. edge stream (created with the greatest priority, so that the small band
   launches are not scheduled behind the full kernel's blocks), concurrently:
   wait for ``ready``; launch the same kernel over
   the band of ``2 R + 1`` rows around each owned edge row
   (:meth:`Decomposition.band`: the row comes out bitwise as in the full
   launch) into the band array; then, as soon as that small launch is done,
   move the row towards the neighbour while both GPUs compute their
   interiors:

   ``halo="copy"`` (default)
       into a *landing* row on the receiver: ``cuMemcpyPeerAsync`` between
       GPUs with peer access (enabled with ``cuCtxEnablePeerAccess``),
       ``cuMemcpyDtoDAsync`` between slabs on one GPU, and otherwise into a
       pinned host row (``transport="pinned"`` forces that); the receiver
       copies landing row -> halo row at the start of its next step;
   ``halo="vmm"``
       nothing: the band arrays are :class:`umem_numba.VMMBuffer` objects on the
       *receiving* GPU, to which the sending GPU is granted READ_WRITE access
       (``set_access``), so the band launch itself writes the row across
       through the peer mapping (no copy and no landing row); the receiver
       copies it, device-local, into its halo row at the start of its next
       step, as it does a landing row.  (Reading the row in place from a band
       array on the sender, as the first design did, put a 64 KiB read over
       the link on the receiver's main stream before every step's kernel:
       15 µs a step on two H200s.)  Needs ``cuDeviceCanAccessPeer`` between
       every pair of neighbouring GPUs; otherwise :class:`MultiGPUHeat` warns
       and falls back to ``"copy"``.

Nothing in a step waits on the host, so the host queues steps ahead of the GPUs.

With ``graphs=True`` (the default) each slab's step is one CUDA graph launch
(:func:`umem_numba.capture`, one graph per step parity, since the fields swap):
the rows in on main, then a fork into the edge stream (bands, rows out) joined
back into main.  Issuing the launches, copies and events of four GPUs' steps
from one Python thread took longer than an H200's step; a graph step costs
per slab two event waits, one launch and one event record.  The events inside
a step become the graph's edges, so the rows cross between graphs instead:
slab ``k``'s step ``t`` sends through *slot* ``t % 2`` (two landing rows, or
two VMM band arrays, per move), receives what its neighbours sent in step
``t - 1`` through slot ``(t - 1) % 2``, and waits (``cuStreamWaitEvent``) for
its neighbours' step ``t - 1`` to end (``step_end`` events, one per parity).
That wait covers both hazards: the rows it receives were written then, and the
slot it sends through was last read in the neighbour's step ``t - 1``.  Before
the first step, slot 1 holds each slab's initial halo rows (written from the
host), so the first step's receive changes nothing.

The same GPU may appear several times in ``devices``: ``devices=[0, 0, 0]``
runs a *simulated* decomposition into three slabs on GPU 0, with the same
exchange logic (the tests compare it bitwise with the one-slab run).

Ordering (every hazard, by the events that close it):

* the band of step ``t`` reads the field after the halos of step ``t`` are in
  (``ready``); the full kernel of step ``t`` overwrites the field the band of
  step ``t - 1`` read only after that band (``band_done``, waited on by main);
* a band array is rewritten by the next band only after the row moved out of
  it (same edge stream; for ``"vmm"``, whose band array the receiver copies
  from, the edge stream also waits for the receiver's ``ready``, which follows
  that copy);
* a landing row is rewritten only after the receiver consumed it (the copy
  waits for the receiver's ``ready`` of the same step);
* the receiver's halo row is written after its own full kernel of the
  previous step (same main stream) and before its band/full kernel read it.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from umem_numba import PriorityStream

from ._common import _as_float_dtype, raw_address, raw_view, require_free_memory, stencil_weights
from .decomp import Decomposition, HaloExchange

__all__ = ["HALOS", "TRANSPORTS", "MultiGPUHeat", "PeerExchange", "heat2d_multi", "heat3d_multi", "heat_multi"]

#: Halo transports: ``auto`` picks per pair (same GPU: device copy; peer access: peer copy;
#: otherwise pinned staging); ``pinned`` stages every halo through pinned host memory.
TRANSPORTS = ("auto", "pinned")

#: How a halo row reaches the neighbour: ``copy`` (into a landing row, then into the field) or
#: ``vmm`` (the sender's band launch writes into a VMM band array on the receiver, through the
#: peer mapping; the receiver copies the row from there into the field).
HALOS = ("copy", "vmm")


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
    edge: Any = None  # edge stream: bands and outgoing rows (greatest priority)
    edge_owner: Any = None  # the PriorityStream behind ``edge``
    ready: Any = None  # main: halos of this step are in the field
    band_done: Any = None  # edge: the bands of this step have read the field
    step_end: tuple = ()  # graphs=True: per step parity, the end of the slab's step (main)
    graphs: tuple = ()  # graphs=True: per step parity, the slab's step as a umem_numba.Graph


def _ptr(arr: Any) -> int:
    return int(arr.__cuda_array_interface__["data"][0])


@dataclass
class _Link:
    """One halo move with its band launch, buffers and event.

    ``scratch`` and ``landing`` hold one buffer per *slot*: one when steps are
    issued one by one, two for graph steps (step ``t`` sends through slot
    ``t % 2``, and the receiver reads it during step ``t + 1``, while the sender
    may already fill the other slot).
    """

    kind: str  # device | peer | pinned | vmm
    band: tuple[int, int]  # local rows of the sender's band launch
    band_row: int  # the sent row's index in the band array
    scratch: list  # band arrays: on the sender (one), or for vmm VMMBuffers on the receiver (one per slot)
    grid: tuple
    block: tuple
    #: What the band kernels write: the band arrays, or for vmm untracked views of them (every use
    #: is ordered by this module's events, and a tracked buffer is refused on a graph's branch).
    outputs: list = field(default_factory=list)
    landing: list = field(default_factory=list)  # per slot: device array on the receiver, or PinnedBuffer
    landing_ptr: list = field(default_factory=list)
    sent: Any = None  # event on the sender's edge stream: the row left (or, vmm: is ready)
    views: dict = field(default_factory=dict)  # band views of the sender's two fields


class PeerExchange(HaloExchange):
    """Halo moves between slab fields on GPUs of one process (see the module docstring).

    Parameters
    ----------
    decomp : Decomposition
    slabs : list of _SlabState
        Per slab: device, context, streams, fields and events.
    transport : {'auto', 'pinned'}
    halo : {'copy', 'vmm'}
    kernel, config : the slab kernel and its launch-configuration function (for the bands)
    block : the kernel's (x, y) block
    rows : the kernel's strip height
    slots : 1 (steps issued one by one) or 2 (graph steps: see :class:`_Link`)
    """

    def __init__(
        self,
        decomp: Decomposition,
        slabs: list[_SlabState],
        transport: str = "auto",
        halo: str = "copy",
        *,
        kernel: Any = None,
        config: Any = None,
        block: tuple = (),
        rows: int = 1,
        slots: int = 1,
    ) -> None:
        super().__init__(decomp)
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if halo not in HALOS:
            raise ValueError(f"halo must be one of {HALOS}, got {halo!r}")
        from numba import cuda

        import umem_numba as um

        self._slabs = slabs
        self._call = um.driver_call  # bound once: the step calls it per halo row
        self.kernel = kernel
        self.halo = halo
        self.fallback: str | None = None
        if halo == "vmm":
            why = _vmm_unavailable(decomp, slabs, transport)
            if why:
                self.fallback = f"halo='vmm' is not available ({why}); using halo='copy'"
                warnings.warn(self.fallback, RuntimeWarning, stacklevel=3)
                self.halo = halo = "copy"
        rest = decomp.shape[1:]
        dtype = slabs[0].src.dtype
        self.links: list[_Link] = []
        self.kinds: list[str] = []
        for m in self.moves:
            a, b = slabs[m.src], slabs[m.dst]
            if halo == "vmm":
                kind = "vmm"
            elif transport == "pinned":
                kind = "pinned"
            elif a.device == b.device:
                kind = "device"
            elif _enable_peer(a, b) and _enable_peer(b, a):
                kind = "peer"
            else:
                kind = "pinned"
            sa = decomp.slabs[m.src]
            b0, b1 = decomp.band(m.src, sa.start + m.src_row)
            with cuda.gpus[a.device]:
                scratch = []
                if kind == "vmm":
                    # On the receiver, written by the sender's band launch over the peer
                    # mapping, and read by the receiver a step later: one per slot.
                    for _ in range(slots):
                        band = um.VMMBuffer.empty((b1 - b0, *rest), dtype, device=b.device)
                        if b.device != a.device:
                            band.set_access(a.device, um.AccessFlags.READ_WRITE)
                        scratch.append(band)
                else:  # written and sent within one step on one stream: one is enough
                    scratch.append(cuda.device_array((b1 - b0, *rest), dtype))
                grid, blk3 = config((b1 - b0, *rest), rows, block)
                sent = cuda.event(timing=False)
            link = _Link(kind, (b0, b1), m.src_row - b0, scratch, grid, blk3, sent=sent)
            link.outputs = [raw_view(band) for band in scratch] if kind == "vmm" else list(scratch)
            for _ in range(slots if kind != "vmm" else 0):
                if kind == "pinned":
                    landing = um.PinnedBuffer.empty(rest, dtype, um.HostAllocFlags.PORTABLE)
                    link.landing_ptr.append(int(landing.host.ctypes.data))
                else:
                    with cuda.gpus[b.device]:
                        landing = cuda.device_array(rest, dtype)
                    link.landing_ptr.append(_ptr(landing))
                link.landing.append(landing)
            self.links.append(link)
            self.kinds.append(kind)

    def _scratch(self, link: _Link, slot: int) -> Any:
        return link.scratch[slot if link.kind == "vmm" else 0]

    def _scratch_row_ptr(self, link: _Link, slot: int) -> int:
        band = self._scratch(link, slot)
        base = raw_address(band) if link.kind == "vmm" else _ptr(band)
        return base + link.band_row * self._slabs[0].row_bytes

    def _incoming(self, k: int) -> list[tuple[Any, _Link]]:
        return [(m, link) for m, link in zip(self.moves, self.links, strict=True) if m.dst == k]

    def _outgoing(self, k: int) -> list[tuple[Any, _Link]]:
        return [(m, link) for m, link in zip(self.moves, self.links, strict=True) if m.src == k]

    def sends(self, k: int) -> bool:
        """Whether slab ``k`` sends rows (it has a neighbour)."""
        return bool(self._outgoing(k))

    def neighbours(self, k: int) -> list[int]:
        """The slabs slab ``k`` exchanges rows with."""
        near = {m.src for m, _ in self._incoming(k)} | {m.dst for m, _ in self._outgoing(k)}
        return sorted(near)

    def copy_in(self, k: int, field_: Any, slot: int, handle: int) -> None:
        """On ``handle``: put the rows sent to slab ``k`` through ``slot`` into ``field_``'s halo rows."""
        s = self._slabs[k]
        for m, link in self._incoming(k):
            dst = _ptr(field_) + m.dst_row * s.row_bytes
            if link.kind == "vmm":  # the band array is on this GPU: the sender's launch wrote it across
                self._call("cuMemcpyDtoDAsync", dst, self._scratch_row_ptr(link, slot), s.row_bytes, handle)
            elif link.kind == "pinned":
                self._call("cuMemcpyHtoDAsync", dst, link.landing_ptr[slot], s.row_bytes, handle)
            else:
                self._call("cuMemcpyDtoDAsync", dst, link.landing_ptr[slot], s.row_bytes, handle)

    def bands(self, k: int, field_: Any, slot: int, weights: tuple, stream: Any) -> None:
        """On ``stream``: the band launches of slab ``k`` over ``field_`` into the band arrays of ``slot``."""
        for _, link in self._outgoing(k):
            view = link.views.get(id(field_))
            if view is None:  # slicing a device array costs host time: once per field
                b0, b1 = link.band
                view = link.views[id(field_)] = field_[b0:b1]
            self.kernel[link.grid, link.block, stream](view, link.outputs[slot if link.kind == "vmm" else 0], *weights)

    def send_row(self, m: Any, link: _Link, slot: int, handle: int, *, captured: bool = False) -> None:
        """On ``handle``: move the row of ``link``'s band array towards the receiver (nothing for vmm).

        ``captured``: the copy goes into a graph, where the driver refuses ``cuMemcpyPeerAsync``
        (``CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED``); a unified-address copy between the GPUs,
        whose peer access is enabled, is captured as a copy node instead.
        """
        s, b = self._slabs[m.src], self._slabs[m.dst]
        src = self._scratch_row_ptr(link, slot)
        if link.kind == "peer" and captured:
            self._call("cuMemcpyAsync", link.landing_ptr[slot], src, s.row_bytes, handle)
        elif link.kind == "peer":
            self._call("cuMemcpyPeerAsync", link.landing_ptr[slot], b.ctx, src, s.ctx, s.row_bytes, handle)
        elif link.kind == "device":
            self._call("cuMemcpyDtoDAsync", link.landing_ptr[slot], src, s.row_bytes, handle)
        elif link.kind == "pinned":
            self._call("cuMemcpyDtoHAsync", link.landing_ptr[slot], src, s.row_bytes, handle)

    def prefill(self, parts: Sequence[np.ndarray]) -> None:
        """Put each slab's first halo rows where its first graph step receives them (slot 1).

        ``parts``: the slabs' initial fields on the host.  The first step then puts
        the rows each slab has back in place: bitwise the run without it.  Each row
        is written from the host by the receiving GPU, which owns the landing row
        or VMM band array.
        """
        from numba import cuda

        for m, link in zip(self.moves, self.links, strict=True):
            row = np.ascontiguousarray(parts[m.dst][m.dst_row])
            if link.kind == "pinned":
                link.landing[1].host[...] = row
                continue
            dst = self._scratch_row_ptr(link, 1) if link.kind == "vmm" else link.landing_ptr[1]
            with cuda.gpus[self._slabs[m.dst].device]:
                self._call("cuMemcpyHtoD", dst, row.ctypes.data, row.nbytes)
                cuda.synchronize()  # the copy from pageable memory may still be in flight when it returns

    def receive(self, k: int) -> None:
        """On slab ``k``'s main stream: put the rows sent to it last step into its ``src`` halo rows."""
        s = self._slabs[k]
        for _, link in self._incoming(k):
            link.sent.wait(s.stream)
        self.copy_in(k, s.src, 0, int(s.stream.handle))

    def send(self, k: int, weights: tuple) -> None:
        """On slab ``k``'s edge stream: the bands of this step, then the rows towards the neighbours."""
        s = self._slabs[k]
        s.ready.wait(s.edge)
        mine = self._outgoing(k)
        for m, link in mine:
            if link.kind == "vmm":
                # The receiver copies last step's row out of this band array: it must
                # have done so before the band kernel overwrites it.
                self._slabs[m.dst].ready.wait(s.edge)
        self.bands(k, s.src, 0, weights, s.edge)
        s.band_done.record(s.edge)
        h = int(s.edge.handle)
        for m, link in mine:
            self._slabs[m.dst].ready.wait(s.edge)  # the receiver consumed the previous row (landing or band array)
            self.send_row(m, link, 0, h)
            link.sent.record(s.edge)

    def exchange(self, fields: Sequence[Any] | None = None) -> None:
        """Not used: :class:`MultiGPUHeat` calls :meth:`receive` and :meth:`send` per slab."""
        raise NotImplementedError("PeerExchange moves halos inside MultiGPUHeat.step (receive/send per slab)")

    def close(self) -> None:
        """Free the band, landing and staging buffers."""
        for link in self.links:
            for buf in (*link.scratch, *link.landing):
                close = getattr(buf, "close", None)
                if close is not None:
                    close()
            link.scratch, link.outputs, link.landing, link.landing_ptr = [], [], [], []
            link.views.clear()
        self.links = []


def _vmm_unavailable(decomp: Decomposition, slabs: list[_SlabState], transport: str) -> str | None:
    """Why ``halo='vmm'`` cannot run here, or None."""
    from umem_numba import can_access_peer, device_attribute

    if transport == "pinned":
        return "transport='pinned' asks for staging through host memory"
    for m in decomp.moves():
        a, b = slabs[m.src], slabs[m.dst]
        if a.device != b.device and not can_access_peer(b.device, a.device):
            return f"GPU {b.device} cannot access GPU {a.device}'s memory (cuDeviceCanAccessPeer is 0)"
    for d in {s.device for s in slabs}:
        try:
            supported = device_attribute("VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", d)
        except Exception as exc:
            return f"cannot ask GPU {d} for VMM support: {exc}"
        if not supported:
            return f"GPU {d} does not support virtual memory management"
    return None


def _enable_peer(a: _SlabState, b: _SlabState) -> bool:
    """Let ``b``'s context access ``a``'s memory; False if the GPUs cannot."""
    from numba import cuda

    from umem_numba import CudaError, can_access_peer, driver_call

    if not can_access_peer(b.device, a.device):
        return False
    with cuda.gpus[b.device]:
        try:
            driver_call("cuCtxEnablePeerAccess", a.ctx, 0)
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
    halo : {'copy', 'vmm'}
        ``"vmm"``: each band launch writes its rows straight into a
        :class:`umem_numba.VMMBuffer` on the neighbour, through the peer
        mapping (see the module notes);
        falls back to ``"copy"`` with a :class:`RuntimeWarning` (and
        :attr:`fallback` says why) where the GPUs cannot access each other.
    rows_per_thread : int, optional
        The kernel's strip height (``rows_per_thread`` / ``planes_per_thread``);
        the tuned value for the dtype when omitted.  The decomposition aligns to it
        (3-D: to :func:`~umem_numba.kernels.stencil3d.slab_align_3d` of it).
    block : (int, int), optional
        Thread block; the tuned one when omitted.
    graphs : bool
        Issue each step as one CUDA graph launch per slab (default): the
        slab's step (halo rows in, the full kernel, and on the high-priority
        edge branch the bands and the rows out) is captured once per step
        parity with :func:`umem_numba.capture`, and a step is then, per slab,
        a wait for its neighbours' previous step, the graph launch and one
        event (see the module notes).  ``False`` issues every launch, copy
        and event of a step from the host.
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

    def __init__(
        self,
        u0: Any,
        devices: Sequence[int],
        alpha: float | None = None,
        *,
        transport: str = "auto",
        halo: str = "copy",
        rows_per_thread: int | None = None,
        block: tuple[int, int] | None = None,
        graphs: bool = True,
        allow_oversubscribe: bool = False,
    ) -> None:
        u0 = np.asarray(u0)
        if u0.ndim not in (2, 3):
            raise ValueError(f"u0 must be 2-D or 3-D, got shape {u0.shape}")
        dtype = _as_float_dtype(u0.dtype)
        devices = [int(d) for d in devices]
        if not devices:
            raise ValueError("devices must name at least one GPU")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if halo not in HALOS:
            raise ValueError(f"halo must be one of {HALOS}, got {halo!r}")
        ndim = u0.ndim
        alpha = (0.25 if ndim == 2 else 1.0 / 6.0) if alpha is None else float(alpha)
        self.weights = stencil_weights(alpha, ndim, dtype)
        self.alpha = alpha
        if ndim == 2:
            from .stencil2d import TUNED_2D as TUNED
            from .stencil2d import heat2d_kernel as make
            from .stencil2d import launch_config_2d as config
        else:
            from .stencil3d import TUNED_3D as TUNED
            from .stencil3d import heat3d_kernel as make
            from .stencil3d import launch_config_3d as config
        rows, blk = TUNED[dtype]
        rows = rows if rows_per_thread is None else int(rows_per_thread)
        blk = blk if block is None else tuple(block)
        if ndim == 2:
            align = rows
        else:
            from .stencil3d import DEFAULT_VARIANT_3D, slab_align_3d

            align = slab_align_3d(DEFAULT_VARIANT_3D[dtype], rows)
        self.decomp = Decomposition(u0.shape, len(devices), align=align)  # ValueError before any driver call

        from numba import cuda

        import umem_numba as um

        count = um.device_count()  # CudaUnavailableError without a GPU
        bad = [d for d in devices if not 0 <= d < count]
        if bad:
            raise ValueError(f"devices {bad} do not exist: this machine has {count} CUDA device(s)")
        need: dict[int, int] = {}
        for k, d in enumerate(devices):
            need[d] = need.get(d, 0) + 2 * int(np.prod(self.decomp.local_shape(k))) * dtype.itemsize
        for d, nbytes in need.items():
            free, total = um.mem_info(d)
            require_free_memory(
                nbytes, f"the slabs of GPU {d}", allow_oversubscribe=allow_oversubscribe, free=free, total=total
            )

        if ndim == 2:
            self.kernel = make(rows)
        else:
            from .stencil3d import DEFAULT_VARIANT_3D

            variant = DEFAULT_VARIANT_3D[dtype]
            self.kernel = make(rows, variant, blk)
            config = functools.partial(config, variant=variant)
        self.devices = devices
        self.dtype = dtype
        row_bytes = self.decomp.halo_cells() * dtype.itemsize
        parts = self.decomp.scatter(u0)
        self.slabs: list[_SlabState] = []
        for d, local in zip(devices, parts, strict=True):  # one slab per device
            with cuda.gpus[d]:
                ctx = um.driver_call("cuCtxGetCurrent")
                stream = cuda.stream()
                src = cuda.to_device(local, stream=stream)
                dst = cuda.to_device(local, stream=stream)  # alignment rows start defined
                grid, block3 = config(local.shape, rows, blk)
                edge = PriorityStream(highest=True)  # bands first, not behind the slab kernel's blocks
                self.slabs.append(
                    _SlabState(
                        d,
                        ctx,
                        stream,
                        src,
                        dst,
                        cuda.event(timing=False),
                        grid,
                        block3,
                        row_bytes,
                        edge=edge.stream,
                        edge_owner=edge,
                        ready=cuda.event(timing=False),
                        band_done=cuda.event(timing=False),
                        step_end=(cuda.event(timing=False), cuda.event(timing=False)),
                    )
                )
        self.exchanger = PeerExchange(
            self.decomp,
            self.slabs,
            transport,
            halo,
            kernel=self.kernel,
            config=config,
            block=blk,
            rows=rows,
            slots=2 if graphs else 1,
        )
        self._pending = False  # rows sent by the last step wait to be received
        self.steps_done = 0
        self.graphs = bool(graphs)
        if self.graphs:
            self._capture(parts)
        self.synchronize()

    def _capture(self, parts: list[np.ndarray]) -> None:
        """Capture each slab's step, once per step parity (the fields swap each step), as a graph.

        Step ``t`` of slab ``k`` (parity ``p = t % 2``) reads ``fields[p]``,
        writes ``fields[1 - p]``, receives the rows sent through slot ``1 - p``
        in step ``t - 1`` and sends its own through slot ``p``.  Its graph:
        the rows in (main stream), then a fork: the full kernel on main, and on
        the edge stream the bands and the rows out, joined back into main.
        """
        from numba import cuda

        import umem_numba as um

        ex = self.exchanger
        wc, wn = self.weights
        for k, s in enumerate(self.slabs):
            fields = (s.src, s.dst)
            with cuda.gpus[s.device]:
                # Load the kernel's module on this device outside the capture.  Harmless: the
                # first step writes the same interior of fields[1] from the same fields[0].
                self.kernel[s.grid, s.block, s.stream](fields[0], fields[1], wc, wn)
                graphs = []
                for p in (0, 1):
                    src, dst = fields[p], fields[1 - p]
                    with um.capture(s.stream, node_priorities=True) as graph:  # the edge branch goes first
                        ex.copy_in(k, src, 1 - p, int(s.stream.handle))
                        sends = ex.sends(k)
                        if sends:
                            s.ready.record(s.stream)  # the fork: the bands read the field with its halos in
                            s.ready.wait(s.edge)
                        self.kernel[s.grid, s.block, s.stream](src, dst, wc, wn)
                        if sends:
                            ex.bands(k, src, p, self.weights, s.edge)
                            for m, link in ex._outgoing(k):
                                ex.send_row(m, link, p, int(s.edge.handle), captured=True)
                            s.band_done.record(s.edge)  # the join
                            s.band_done.wait(s.stream)
                    graphs.append(graph)
                s.graphs = tuple(graphs)
        ex.prefill(parts)
        self._neighbours = [ex.neighbours(k) for k in range(len(self.slabs))]
        self._call = um.driver_call  # bound once: a graph step calls it per slab

    @property
    def transports(self) -> list[str]:
        """How each halo move travels (``device``, ``peer``, ``pinned`` or ``vmm``).

        In :meth:`Decomposition.moves` order.
        """
        return list(self.exchanger.kinds)

    @property
    def halo(self) -> str:
        """The halo mode in use (``"copy"`` after a fallback from ``"vmm"``)."""
        return self.exchanger.halo

    @property
    def fallback(self) -> str | None:
        """Why ``halo="vmm"`` fell back to ``"copy"``, or None."""
        return self.exchanger.fallback

    def step(self, n: int = 1, *, exchange: bool = True) -> None:
        """Queue ``n`` steps on every GPU (asynchronous: no host synchronize).

        ``exchange=False`` skips the halo moves (for timing the kernels alone;
        the field is then wrong at the slab edges).
        """
        if self.graphs:
            self._graph_steps(int(n), exchange)
            return
        from numba import cuda

        wc, wn = self.weights
        ex = self.exchanger
        for _ in range(int(n)):
            for k, s in enumerate(self.slabs):
                with cuda.gpus[s.device]:
                    if exchange and self._pending:
                        ex.receive(k)  # last step's rows into the halo rows
                    s.ready.record(s.stream)
                    s.band_done.wait(s.stream)  # the last bands have read what this kernel overwrites
                    self.kernel[s.grid, s.block, s.stream](s.src, s.dst, wc, wn)
                    s.done.record(s.stream)
            if exchange:
                for k, s in enumerate(self.slabs):
                    with cuda.gpus[s.device]:
                        ex.send(k, self.weights)  # bands, then rows out, while the kernels run
            self._pending = exchange
            for s in self.slabs:
                s.src, s.dst = s.dst, s.src
            self.steps_done += 1

    def _graph_steps(self, n: int, exchange: bool) -> None:
        """``n`` steps as graph launches (see :meth:`_capture`); ``exchange=False``: the kernels alone.

        Slab ``k``'s step ``t`` waits for its neighbours' step ``t - 1`` (their
        ``step_end`` of parity ``1 - p``): the rows it receives were sent then,
        and the slot it sends through was last read then.  Two events per slab,
        one per parity: a neighbour recording step ``t`` cannot be mistaken for
        its step ``t - 1``.
        """
        from numba import cuda

        call = self._call
        wc, wn = self.weights
        for _ in range(n):
            p = self.steps_done % 2
            for k, s in enumerate(self.slabs):
                h = int(s.stream.handle)
                for j in self._neighbours[k]:
                    call("cuStreamWaitEvent", h, int(self.slabs[j].step_end[1 - p].handle), 0)
                if exchange:
                    s.graphs[p].launch(s.stream)
                else:
                    with cuda.gpus[s.device]:
                        self.kernel[s.grid, s.block, s.stream](s.src, s.dst, wc, wn)
                call("cuEventRecord", int(s.step_end[p].handle), h)
            for s in self.slabs:
                s.src, s.dst = s.dst, s.src
            self.steps_done += 1

    def synchronize(self) -> None:
        """Wait for everything queued on every slab's streams."""
        for s in self.slabs:
            s.stream.synchronize()
            s.edge.synchronize()

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
        """Free the device arrays, staging buffers and edge streams now."""
        from numba import cuda

        self.synchronize()
        for s in self.slabs:
            for graph in s.graphs:
                graph.close()
            s.graphs = ()
        self.exchanger.close()
        for s in self.slabs:
            s.src = s.dst = None
            if s.edge_owner is not None:
                with cuda.gpus[s.device]:
                    s.edge_owner.close()
        self.slabs = []

    def __enter__(self) -> MultiGPUHeat:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def heat_multi(u0: Any, steps: int, devices: Sequence[int], alpha: float | None = None, **kwargs: Any) -> np.ndarray:
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


def heat3d_multi(u0: Any, steps: int, devices: Sequence[int], alpha: float = 1.0 / 6.0, **kwargs: Any) -> np.ndarray:
    """:func:`heat_multi` for a 3-D field (checks that it is 3-D)."""
    if np.ndim(u0) != 3:
        raise ValueError(f"heat3d_multi needs a 3-D field, got shape {np.shape(u0)}")
    return heat_multi(u0, steps, devices, alpha, **kwargs)
