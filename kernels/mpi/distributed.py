"""The heat step on MPI ranks (mpi4py): one slab per rank, halos by non-blocking MPI.

Used by ``examples/heat2d_mpi.py``; importing this module imports neither
mpi4py nor numba's CUDA driver.  Every function takes the communicator.

* :func:`~.comm.cuda_aware_mpi`: does the MPI library take device buffers?
* :func:`~.comm.collective_errors`: every rank's error, known to every rank, before any exchange.
* :func:`~.comm.ipc_unavailable`: why ``halo="ipc"`` cannot run on these ranks (collective).
* :class:`RankHeat`: one rank's slab, stepped on the GPU (halos through
  :class:`umem_numba.PinnedBuffer` staging, or device buffers where MPI is
  CUDA-aware, or, with ``halo="ipc"``, read in place from the neighbours'
  exported VMM memory, while the slab's interior is computed on its own
  stream) or, with ``cpu=True``, with the NumPy reference kernels.

A step on a rank follows the overlapped schedule of
:mod:`umem_numba.kernels.decomp` (edge bands), on the GPU with two streams:

* *compute* stream ``ks``: the slab kernel over the whole slab (its halo rows
  stale: they are never written), and the *fix-ups*: the band's edge rows
  copied over the slab kernel's (wrong) edge rows of the new field;
* *comm* stream ``cs``, created with the greatest priority
  (:class:`umem_numba.PriorityStream`) so that its small
  launches take the next free SM slots instead of queueing behind the slab
  kernel's blocks: after the previous step's slab kernel is done, each
  :class:`~umem_numba.kernels.decomp.EdgeBand`'s input gets the edge row and
  its owned neighbour (device copy) and the row last received from the
  neighbour (host-to-device from pinned memory), the same kernel runs over
  the band (``2 R + 1`` rows), and the edge row goes to pinned memory.

Graph steps (``graphs=True``, the default)
------------------------------------------
The host issues a step ``n`` as:

1. ``cs`` waits for ``field_done`` (recorded after the previous step's work
   on ``ks``: the bands read the field it wrote);
2. on ``ks``, one graph: the fix-ups of the previous step (from its bands'
   outputs), then the slab kernel of step ``n``; ``field_done`` is recorded;
3. ``Waitall`` on the messages of step ``n - 1``;
4. on ``cs``, one graph: the band inputs, the bands and the rows out of step
   ``n``; ``band_done`` is recorded and the host synchronises with it;
5. one ``Startall`` of the step's persistent requests (``Recv_init`` /
   ``Send_init``, made once per band slot): the receives and sends of step ``n``.

So the slab kernel of step ``n + 1`` is queued while that of step ``n`` runs,
and the messages travel during the next slab kernel.  The fix-ups of step
``n`` wait for the next step's graph on ``ks``, which comes after the host's
``band_done`` synchronisation: no stream waits for the bands.  Meanwhile the
bands of step ``n + 1`` read the field's edge rows from the band outputs of
step ``n`` (their fix-ups may not have run), the other rows from the field.
The band outputs come in two *slots*: exchange ``e`` writes slot ``e % 2``
while the fix-ups beside it copy slot ``(e - 1) % 2``; exchange ``e + 1``
writes that slot again only after ``field_done`` of the step that copied it.
Before the field is read (:meth:`RankHeat.synchronize`, :meth:`RankHeat.local_field`)
the pending fix-ups are queued on ``ks``.  A step after an exchange-free step
takes every band row from the field (the slab kernel's edge rows, as the
schedule below does).

The graphs (:func:`umem_numba.capture`) are keyed by the field's parity and
the band slot (and, for the bands, whether rows were received and where the
edge rows come from); those of a run whose every step exchanges (six, or two
without neighbours) are captured at set-up, others when they first come.  Per
step a rank with two neighbours makes two graph launches, four event calls and
two MPI calls, where the schedule below makes a numba launch per kernel
(three), a driver call per copy (eight), five event calls and five MPI calls.
On four ranks (16384² float32, 0.15 ms of GPU work per rank and step) the host time per step
went from 185–302 µs to 39–65 µs, and the strong speed-up to 3.11x (pinned) and 3.13x (ipc) on
H100s, 2.92x and 3.06x on H200s, weak efficiency 0.99 (docs/scaling.md).  The graphs run at
their launch stream's priority (:func:`umem_numba.capture`'s default): with node priorities the
band graph's copies ran at the default priority, behind the slab kernel (2.26x).

Inside the band graph each band, and each copy filling a band's input, is a branch of its own
(forked onto side streams during the capture and joined back), so the graph is at most three
nodes deep (copies, band kernel, row out) instead of one chain of all of them: with the slab
kernel filling the GPU every node of the chain waited its turn, and on four H200 ranks the chain
took 115-130 µs of a 150 µs step on a rank with two neighbours (CUDA events around the graph
launches); the next slab kernel waits for it (its fix-ups read the bands' rows).  The fix-ups
are two branches likewise.  Four ranks on four H200s (``bench scale --gpus 4 --no-peer``):
3.55x strong speed-up with pinned and with ipc halos (from 2.68x and 3.40x), the exchange adding
4-7 µs to a 0.146 ms step; four ranks sharing two H200s: 581 µs per step, from 1,142-1,202 µs.

Steps issued one by one (``graphs=False``)
------------------------------------------
The host queues the slab kernel of step ``n`` first, then waits for the
messages of step ``n - 1`` (``Waitall``), queues the bands of step ``n`` on
``cs`` after ``field_done``, records ``band_done``, queues the fix-ups on
``ks`` after it and records ``field_done``, waits for the bands (the event),
and posts ``Irecv``/``Isend`` of step ``n``.  One band slot serves, since the
fix-ups follow the bands of their own step.  On four H200 ranks (16384²,
where a step is 0.148 ms of GPU work) a rank's host took 185-212 µs per step
issuing this, so the step followed the host (docs/scaling.md).

Same-node zero copy (``halo="ipc"``)
------------------------------------
Ranks on one node need not move halo rows through host memory.  Each rank
keeps an *outbox*: an exportable :class:`umem_numba.VMMBuffer` of four rows
(two per neighbour side, alternating by exchange step).  At set-up it
exports the outbox as POSIX file descriptors, passes them to its neighbours
with ``SCM_RIGHTS`` over Unix sockets (:mod:`._fdpass`, which says why not
``pidfd_getfd``), and maps each neighbour's outbox with
:meth:`umem_numba.VMMBuffer.from_shareable_handle` in its own context, READ
access for its own GPU only (the neighbour's GPU, or the same GPU when ranks
share one; a different GPU needs peer access).  Per step, on the comm stream,
the band's edge row goes into the outbox slot of this step's parity (a device
copy instead of the device-to-host copy), and the band input's halo row is
read in place from the neighbour's slot of the last step's parity (a device
copy over the mapping instead of MPI plus host-to-device).

Ordering between the processes uses the schedule's existing host handshake,
with 8-byte MPI *tokens* instead of the rows: a rank posts its token of step
``n`` only after ``band_done.synchronize()``, i.e. after its slot of step
``n`` is written and its reads of the neighbours' slots of step ``n - 1``
are done; the neighbour waits for that token (``Waitall`` at the start of its
step ``n + 1``) before it queues the read of that slot.  The two parities make
the write of step ``n + 1`` (the other slot) safe while the neighbour may be
reading slot ``n``; the write of step ``n + 2`` into slot ``n``'s parity comes
after the neighbour's token of step ``n + 1``, which follows its read.
CUDA IPC events (``cuIpcGetEventHandle``) would let the reader's stream wait
on the GPU instead, but ``cuStreamWaitEvent`` waits only for the last record
made *before* it is called, so the reader would still need a host message
per step saying that the owner has recorded; the host synchronisation they
would save is the one the schedule already hides behind the next slab
kernel, so the tokens cost no more and need no cross-process event state.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import numpy as np

from umem_numba import PriorityStream

from .._common import _as_float_dtype, raw_address, stencil_weights
from ..decomp import Decomposition, EdgeBand
from .comm import collective_errors

__all__ = ["HALOS", "HaloSetupError", "RankHeat"]

_TAG_DOWN, _TAG_UP, _TAG_GATHER = 11, 12, 13

#: How GPU ranks move halo rows: ``"mpi"`` (MPI messages from pinned staging or, with
#: CUDA-aware MPI, device buffers) or ``"ipc"`` (ranks of one node read the rows in place from
#: their neighbours' exported VMM memory; see the module notes).
HALOS = ("mpi", "ipc")


class HaloSetupError(RuntimeError):
    """Setting up a rank's halo exchange failed on at least one rank; raised on every rank."""


class RankHeat:
    """One rank's slab of a 2-D or 3-D heat run (collective: every rank makes one).

    Parameters
    ----------
    comm : mpi4py communicator
    decomp : Decomposition
        The whole grid's decomposition; this rank steps slab ``comm.rank``.
        For the GPU path its ``align`` must be the kernel's strip height (3-D:
        :func:`~umem_numba.kernels.stencil3d.slab_align_3d` of it).
    local : ndarray
        This slab's initial stored rows (``decomp.local_shape(rank)``).
    alpha : float
    cpu : bool
        NumPy reference kernels instead of the GPU (the same schedule).
    device_buffers : bool
        Pass device buffers to MPI (CUDA-aware MPI) instead of pinned staging.
    rows_per_thread : int, optional
        Strip height of the GPU kernel (``decomp.align`` must suit it, see ``decomp``).
    halo : {'mpi', 'ipc'}
        ``"mpi"``: rows travel in MPI messages (pinned staging or
        ``device_buffers``).  ``"ipc"``: GPU path only, every rank on one
        node; each rank reads its neighbours' rows in place from their
        exported VMM memory, and 8-byte MPI tokens order the ranks (module
        notes).  Set-up failures raise :class:`HaloSetupError` on every rank.
    fd_timeout : float
        ``"ipc"``: seconds any socket operation of the descriptor exchange may take.
    graphs : bool
        GPU path (default): a step is two CUDA graph launches, the last
        exchange's edge-row fix-ups and the slab kernel on the compute stream
        and the edge bands with their inputs and rows out on the comm stream
        (:func:`umem_numba.capture`; the graphs of a run whose every step
        exchanges are captured here, others at first use: each capture
        collects garbage once), and the messages are persistent requests
        started together (module notes: graph steps).  ``False`` issues every
        launch, copy and event of a step from the host and posts each step's
        messages anew (the schedule before graph steps).

    Raises
    ------
    ValueError
        An unknown ``halo``, or ``halo="ipc"`` with ``cpu=True``.
    HaloSetupError
        ``halo="ipc"``: any rank failed to set up (on every rank).

    Attributes
    ----------
    halo_seconds : float
        Host time spent waiting for messages (``Waitall``) so far; with the
        exchange hidden, most of it overlaps the next slab kernel.
    band_seconds : float
        Host time spent waiting for the edge bands (and the rows they send)
        before posting the messages, so far.  The rest of a step's host time
        is the host issuing work: when it nears the GPU's step, the host is
        what limits the run.
    """

    def __init__(
        self,
        comm: Any,
        decomp: Decomposition,
        local: np.ndarray,
        alpha: float,
        *,
        cpu: bool = False,
        device_buffers: bool = False,
        rows_per_thread: int | None = None,
        halo: str = "mpi",
        fd_timeout: float = 60.0,
        graphs: bool = True,
    ) -> None:
        if halo not in HALOS:
            raise ValueError(f"halo must be one of {HALOS}, got {halo!r}")
        if halo == "ipc" and cpu:
            raise ValueError("halo='ipc' maps GPU memory between the ranks: it needs the GPU path, not cpu=True")
        self.halo = halo
        self.graphs = bool(graphs) and not cpu
        self._graph_cache: dict[tuple, Any] = {}  # ("slab" | "bands", field parity, ...) -> umem_numba.Graph
        self.comm = comm
        self.decomp = decomp
        self.rank = comm.Get_rank()
        self.slab = decomp.slabs[self.rank]
        self.cpu = cpu
        self.device_buffers = device_buffers
        dtype = _as_float_dtype(local.dtype)
        self.dtype = dtype
        self.alpha = alpha
        self.weights = stencil_weights(alpha, decomp.ndim, dtype)
        # One edge band per neighbour: the row sent to it, the halo row it fills.
        self.bands: tuple[EdgeBand, ...] = decomp.edge_bands(self.rank)
        self._tags = [(_TAG_UP, _TAG_DOWN) if e.peer < self.rank else (_TAG_DOWN, _TAG_UP) for e in self.bands]
        self._recv_of = {e.halo: j for j, e in enumerate(self.bands)}  # the receive buffer of each halo row
        self._pending: list[Any] = []  # the MPI requests of the last step
        self._received = False  # the receive buffers hold rows from the neighbours
        self._exchanges = 0  # exchange steps done: the band slot (and ipc outbox parity) of the next one
        # graphs: the band slot whose rows the current field's edge rows still wait for (their fix-ups
        # are queued with the next slab kernel), and whether that slot holds the field's edge rows.
        self._fix: int | None = None
        self._edges_in_scratch = False
        self._preqs: list[list[Any]] = []  # graphs: per band slot, the persistent requests of a step
        self._sides: list[Any] = []  # graphs: side streams of the parallel branches (_parallel)
        self._sides_taken = 0
        self._fork_events: dict[int, Any] = {}  # stream handle -> the event of its forks and joins
        self.halo_seconds = 0.0
        self.band_seconds = 0.0
        halo_shape = decomp.shape[1:]
        if cpu:
            from ..reference import heat2d_step_reference, heat3d_step_reference

            self._ref = heat2d_step_reference if decomp.ndim == 2 else heat3d_step_reference
            self.a = np.array(local, copy=True)
            self.b = np.array(local, copy=True)
            self._band_in = [self.a[e.start : e.stop].copy() for e in self.bands]  # the first step's halos
            self._send = [np.empty(halo_shape, dtype) for _ in self.bands]
            self._recv = [np.empty(halo_shape, dtype) for _ in self.bands]
            return
        if halo == "mpi":
            self._setup_gpu(local, rows_per_thread)
            self._setup_graphs()
            return
        # halo="ipc": every step of the set-up ends in a collective check, so that a failure on
        # one rank raises on all of them before any rank waits for a neighbour.
        self._ipc_in: dict[int, Any] = {}  # neighbour rank -> its outbox, mapped READ here
        self._outbox: Any = None
        error = None
        try:
            if _simulating():
                raise RuntimeError(
                    "halo='ipc' maps exported VMM memory, which needs the CUDA driver: numba's simulator has none"
                )
            self._setup_gpu(local, rows_per_thread)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        self._check_collective(error, "GPU set-up")
        self._setup_ipc(float(fd_timeout))
        error = None
        try:
            self._setup_graphs()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        self._check_collective(error, "graph capture")

    # -- GPU --------------------------------------------------------------------------
    def _setup_gpu(self, local: np.ndarray, rows_per_thread: int | None) -> None:
        from numba import cuda

        import umem_numba as um

        d = self.decomp
        if d.ndim == 2:
            from ..stencil2d import TUNED_2D as TUNED
            from ..stencil2d import heat2d_kernel as make
            from ..stencil2d import launch_config_2d as config
        else:
            from ..stencil3d import TUNED_3D as TUNED
            from ..stencil3d import heat3d_kernel as make
            from ..stencil3d import launch_config_3d as config
        rows, blk = TUNED[self.dtype]
        rows = rows if rows_per_thread is None else int(rows_per_thread)
        if d.ndim == 2:
            align, variant = rows, None
        else:
            from ..stencil3d import DEFAULT_VARIANT_3D, slab_align_3d

            variant = DEFAULT_VARIANT_3D[self.dtype]
            align = slab_align_3d(variant, rows)
            make = functools.partial(make, variant=variant, block=blk)
            config = functools.partial(config, variant=variant)
        if align != d.align:
            raise ValueError(
                f"the decomposition is aligned to {d.align} rows but the kernel needs {align} ({rows} rows per thread)"
            )
        self._call = um.driver_call  # bound once: the step calls it per halo row
        self.kernel = make(rows)
        self.ks = cuda.stream()  # compute: the whole slab, then the edge-row fix-ups
        self._comm_stream = PriorityStream(highest=True)
        self.cs = self._comm_stream.stream  # comm: band inputs, bands, rows out (greatest priority)
        self._ksh, self._csh = int(self.ks.handle), int(self.cs.handle)
        self.a = cuda.to_device(local, stream=self.ks)
        self.b = cuda.to_device(local, stream=self.ks)
        self._ptr = {id(f): _dptr(f) for f in (self.a, self.b)}
        self.grid, self.block = config(local.shape, rows, blk)
        self.row_bytes = int(np.prod(d.shape[1:])) * self.dtype.itemsize
        halo_shape = d.shape[1:]
        self._band_in, self._band_launch = [], []
        for e in self.bands:
            band_in = cuda.to_device(np.ascontiguousarray(local[e.start : e.stop]), stream=self.ks)  # first halos
            self._band_in.append(band_in)
            self._band_launch.append(config(band_in.shape, rows, blk))
        # The band outputs, per slot.  Graph steps use two: the bands of exchange e write slot e % 2
        # while the slab step queued beside them still copies slot (e - 1) % 2 into the field (the
        # deferred fix-ups, module notes); steps issued one by one use one.
        self._scratch_slots = [
            [cuda.device_array(b.shape, self.dtype, stream=self.ks) for b in self._band_in]
            for _ in range(2 if self.graphs else 1)
        ]
        self._scratch = self._scratch_slots[0]
        self._band_in_ptr = [_dptr(x) for x in self._band_in]
        self._scratch_ptr_slots = [[_dptr(x) for x in slot] for slot in self._scratch_slots]
        self._scratch_ptr = self._scratch_ptr_slots[0]
        if self.halo == "ipc":  # rows through the outboxes (_setup_ipc); 8-byte tokens in the messages
            self._send = [np.zeros(1, np.int64) for _ in self.bands]
            self._recv = [np.zeros(1, np.int64) for _ in self.bands]
            self._send_ptr, self._recv_ptr = [], []
        elif self.device_buffers:  # CUDA-aware MPI: send the band's row in place, receive into device rows
            self._send = [s[e.band_row] for s, e in zip(self._scratch, self.bands, strict=True)]
            self._send_slots = [
                [s[e.band_row] for s, e in zip(slot, self.bands, strict=True)] for slot in self._scratch_slots
            ]
            self._recv = [cuda.device_array(halo_shape, self.dtype, stream=self.ks) for _ in self.bands]
            self._recv_ptr = [_dptr(r) for r in self._recv]
            self._send_ptr = []
        else:
            self._pinned = [um.PinnedBuffer.empty(halo_shape, self.dtype) for _ in range(2 * len(self.bands))]
            host = [p.host for p in self._pinned]  # taken once: the copies below are plain driver calls
            self._send, self._recv = host[: len(self.bands)], host[len(self.bands) :]
            self._send_ptr = [int(h.ctypes.data) for h in self._send]
            self._recv_ptr = [int(h.ctypes.data) for h in self._recv]
        if not self.device_buffers or self.halo == "ipc":  # one set of send buffers, whatever the slot
            self._send_slots = [self._send] * len(self._scratch_slots)
        self.band_done = cuda.event(timing=False)  # cs: this step's bands and rows to send
        self.field_done = cuda.event(timing=False)  # ks: this step's slab kernel and fix-ups
        if self.graphs:  # graph steps record, wait for and synchronise them through the driver directly
            self._band_done_h, self._field_done_h = int(self.band_done.handle), int(self.field_done.handle)
        self._fields = (self.a, self.b)  # graph keys: which one is the step's input
        if self.graphs:
            # Load the kernel's module outside any capture.  Harmless: the first step writes the
            # same interior of b from the same a.
            wc, wn = self.weights
            self.kernel[self.grid, self.block, self.ks](self.a, self.b, wc, wn)
        self.field_done.record(self.ks)
        self.ks.synchronize()

    def _check_collective(self, error: str | None, what: str) -> None:
        """Every rank's set-up error known to every rank; :class:`HaloSetupError` on all of them if any."""
        errors = collective_errors(self.comm, error)
        if errors:
            self._close_ipc()
            raise HaloSetupError(f"halo='ipc' {what} failed: " + "; ".join(errors))

    def _setup_ipc(self, timeout: float) -> None:
        """Export this rank's outbox, pass it to the neighbours, map theirs (collective)."""
        import umem_numba as um

        from ._fdpass import FdPassError, exchange_fds

        peers = [e.peer for e in self.bands]
        fds: list[tuple[int, int]] = []
        payload: dict[str, Any] = {}
        error = None
        try:
            dev = um.ensure_context()
            self._device = dev
            for attr, what in (
                ("VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", "virtual memory management (VMM)"),
                ("HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED", "exporting VMM memory as POSIX file descriptors"),
            ):
                if not um.device_attribute(attr, dev):
                    raise um.UnsupportedError(f"GPU {dev} does not support {what} (CU_DEVICE_ATTRIBUTE_{attr} is 0)")
            # [parity][side]: side 0 is the row sent up (to rank - 1), side 1 the row sent down.
            shape = (2, 2, *self.decomp.shape[1:])
            self._outbox = um.VMMBuffer.empty(shape, self.dtype, device=dev, capacity=2, exportable=True)
            fds = self._outbox.export_fds()
            payload = {
                "uuid": _device_uuid(dev),
                "sizes": [n for _, n in fds],
                "shape": list(shape),
                "dtype": self.dtype.str,
            }
        except Exception as exc:
            error = f"exporting the outbox: {type(exc).__name__}: {exc}"
        try:
            self._check_collective(error, "set-up")
            try:
                got = exchange_fds(self.comm, peers, [fd for fd, _ in fds], payload, timeout=timeout)
            except FdPassError as exc:  # raised on every rank alike
                self._close_ipc()
                raise HaloSetupError(f"halo='ipc' descriptor exchange failed: {exc}") from exc
        finally:
            for fd, _ in fds:
                os.close(fd)
        error = None
        try:
            for peer, (their_fds, theirs) in sorted(got.items()):
                self._ipc_in[peer] = self._map_neighbour(peer, their_fds, theirs)
        except Exception as exc:
            error = f"mapping a neighbour's outbox: {type(exc).__name__}: {exc}"
        finally:
            # Every peer's descriptors, mapped or not: a failure on one peer must not leak the later ones'.
            # (A mapping holds its own reference to the memory; the descriptors are not needed after it.)
            for their_fds, _ in got.values():
                for fd in their_fds:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
        self._check_collective(error, "mapping")
        rb = self.row_bytes
        out = raw_address(self._outbox)
        # Where each band's edge row goes, per parity; where each halo row comes from, per parity.
        self._out_ptr = [[out + (p * 2 + (0 if e.peer < self.rank else 1)) * rb for e in self.bands] for p in range(2)]
        self._in_ptr: list[dict[int, int]] = [{}, {}]
        for e in self.bands:
            theirs_base = raw_address(self._ipc_in[e.peer])
            side = 1 if e.peer < self.rank else 0  # the neighbour above sends down, the one below up
            for p in range(2):
                self._in_ptr[p][e.halo] = theirs_base + (p * 2 + side) * rb

    def _map_neighbour(self, peer: int, fds: list[int], theirs: dict[str, Any]) -> Any:
        """Map ``peer``'s exported outbox READ-only for this rank's GPU."""
        import umem_numba as um

        dev = self._device
        owner = _device_of(theirs["uuid"])
        if owner is None:
            raise RuntimeError(
                f"rank {peer}'s GPU (UUID {theirs['uuid']}) is not visible to this rank: the ranks see "
                "different GPUs (CUDA_VISIBLE_DEVICES?)"
            )
        if owner != dev and not um.can_access_peer(dev, owner):
            raise RuntimeError(
                f"GPU {dev} cannot read GPU {owner}'s memory (cuDeviceCanAccessPeer is 0): rank {peer}'s rows "
                "cannot be read in place; use the MPI halos"
            )
        shape = tuple(int(x) for x in theirs["shape"])
        if shape != (2, 2, *self.decomp.shape[1:]) or np.dtype(theirs["dtype"]) != self.dtype:
            raise RuntimeError(f"rank {peer} exported {shape} {theirs['dtype']}, not this run's outbox")
        pairs = list(zip(fds, (int(n) for n in theirs["sizes"]), strict=True))
        return um.VMMBuffer.from_shareable_handle(pairs, shape, self.dtype, device=dev, access=um.AccessFlags.READ)

    def _close_ipc(self) -> None:
        for buf in [*getattr(self, "_ipc_in", {}).values(), getattr(self, "_outbox", None)]:
            if buf is not None:
                buf.close()
        self._ipc_in = {}
        self._outbox = None

    # -- graph steps (graphs=True) ------------------------------------------------------
    def _setup_graphs(self) -> None:
        """Persistent requests per band slot, and the graphs of the first three steps, captured now.

        A capture collects garbage and instantiates a graph (milliseconds): done here, none
        falls into a timed step of a run whose every step exchanges.  Other cases (a step after
        ``exchange=False`` steps) are captured when they first come.
        """
        if not self.graphs:
            return
        if self.bands:
            from mpi4py import MPI

            self._startall = MPI.Prequest.Startall
            for send in self._send_slots:
                reqs = [
                    self.comm.Recv_init(buf, source=e.peer, tag=tag_in)
                    for e, buf, (_, tag_in) in zip(self.bands, self._recv, self._tags, strict=True)
                ]
                reqs += [
                    self.comm.Send_init(buf, dest=e.peer, tag=tag_out)
                    for e, buf, (tag_out, _) in zip(self.bands, send, self._tags, strict=True)
                ]
                self._preqs.append(reqs)
            # Step 0 (parity 0, slot 0, nothing received), then the two that repeat.
            keys = [("slab", 0, None), ("bands", 0, 0, "first"), ("slab", 1, 0), ("bands", 1, 1, "scratch")]
            keys += [("slab", 0, 1), ("bands", 0, 0, "scratch")]
        else:
            keys = [("slab", 0, None), ("slab", 1, None)]
        for key in keys:
            self._graph(key)

    def _graph(self, key: tuple) -> Any:
        """The graph of ``key``: ``("slab", parity, fix)`` on ks or ``("bands", parity, slot, mode)`` on cs.

        Captured (:func:`umem_numba.capture`) the first time ``key`` comes.
        """
        graph = self._graph_cache.get(key)
        if graph is None:
            import umem_numba as um

            stream = self.ks if key[0] == "slab" else self.cs
            with um.capture(stream) as graph:
                if key[0] == "slab":
                    self._slab_body(key[1], key[2])
                else:
                    self._band_body(key[1], key[2], key[3])
            self._graph_cache[key] = graph
        return graph

    def _slab_body(self, p: int, fix: int | None) -> None:
        """On ks: the fix-ups of the last exchange (from band slot ``fix``), then the slab kernel.

        The fix-ups write the edge rows of ``fields[p]`` that the slab kernel of the last step
        wrote wrong; this step's slab kernel reads them.
        """
        src, dst = self._fields[p], self._fields[1 - p]
        self._sides_taken = 0
        if fix is not None:
            self._parallel(self.ks, self._fixups(src, fix))
        wc, wn = self.weights
        self.kernel[self.grid, self.block, self.ks](src, dst, wc, wn)  # stale halos

    def _band_body(self, p: int, slot: int, mode: str) -> None:
        """On cs: the bands of an exchange that writes band slot ``slot``, over ``fields[p]``.

        ``mode``: ``"first"`` (nothing received yet: the band inputs keep their first halos),
        ``"field"`` (every input row from the field and the receive buffers) or ``"scratch"``
        (the last step exchanged: its fix-ups are queued on ks beside these bands, so the field's
        edge rows are taken from that step's bands, slot ``1 - slot``, instead of the field).

        The bands are independent branches of the graph, and so are the copies that fill one
        band's input (:meth:`_parallel`; the module notes say why).
        """
        wc, wn = self.weights
        call, rb = self._call, self.row_bytes
        self._sides_taken = 0
        field = self._ptr[id(self._fields[p])]
        prev = self._scratch_ptr_slots[1 - slot] if len(self._scratch_ptr_slots) > 1 else []
        edge_of: dict[int, tuple[int, int]] = {}  # edge row -> (band, its index in that band's output)
        for j, e in enumerate(self.bands):
            edge_of.setdefault(e.row, (j, e.band_row))
        ipc = self.halo == "ipc"

        def band(j: int, e: EdgeBand) -> Any:
            bptr, sptr = self._band_in_ptr[j], self._scratch_ptr_slots[slot][j] + e.band_row * rb
            fills: list[tuple[str, int, int, int]] = []  # (driver call, destination, source, bytes)
            r = e.copy_start
            while r < e.copy_stop:  # the field rows, in runs; with mode "scratch" edge rows from the bands
                if mode == "scratch" and r in edge_of:
                    jj, brow = edge_of[r]
                    fills.append(("cuMemcpyDtoDAsync", bptr + e.band_index(r) * rb, prev[jj] + brow * rb, rb))
                    r += 1
                    continue
                stop = r + 1
                while stop < e.copy_stop and not (mode == "scratch" and stop in edge_of):
                    stop += 1
                fills.append(("cuMemcpyDtoDAsync", bptr + e.band_index(r) * rb, field + r * rb, (stop - r) * rb))
                r = stop
            if mode != "first":
                for h in e.halos:
                    if ipc:  # the neighbour's outbox slot of the last exchange (its token said it is there)
                        fills.append(("cuMemcpyDtoDAsync", bptr + e.band_index(h) * rb, self._in_ptr[1 - slot][h], rb))
                    else:
                        name = "cuMemcpyDtoDAsync" if self.device_buffers else "cuMemcpyHtoDAsync"
                        fills.append((name, bptr + e.band_index(h) * rb, self._recv_ptr[self._recv_of[h]], rb))

            def run(stream: Any, handle: int) -> None:
                self._parallel(stream, [functools.partial(_copy, call, *fill) for fill in fills])
                grid, block = self._band_launch[j]
                self.kernel[grid, block, stream](self._band_in[j], self._scratch_slots[slot][j], wc, wn)
                if ipc:
                    call("cuMemcpyDtoDAsync", self._out_ptr[slot][j], sptr, rb, handle)
                elif not self.device_buffers:
                    call("cuMemcpyDtoHAsync", self._send_ptr[j], sptr, rb, handle)

            return run

        self._parallel(self.cs, [band(j, e) for j, e in enumerate(self.bands)])

    def _parallel(self, stream: Any, branches: list[Any]) -> None:
        """Inside a capture on ``stream``: each ``branch(stream, handle)`` as a parallel branch of the graph.

        The first branch goes on ``stream`` itself, each other one on a side stream of this
        rank that waits for ``stream`` (an event) and is waited for by it at the end.  Only
        for captures: there a branch not joined back fails the capture
        (``CUDA_ERROR_STREAM_CAPTURE_UNJOINED``), so no work can be left unordered.
        """
        if len(branches) < 2:
            for branch in branches:
                branch(stream, int(stream.handle))
            return
        call = self._call
        sides = self._side_streams(len(branches) - 1)
        handle = int(stream.handle)
        call("cuEventRecord", self._event_of(handle), handle)
        for side in sides:
            call("cuStreamWaitEvent", int(side.handle), self._event_of(handle), 0)
        branches[0](stream, handle)
        for branch, side in zip(branches[1:], sides, strict=True):
            branch(side, int(side.handle))
        for side in sides:
            h = int(side.handle)
            call("cuEventRecord", self._event_of(h), h)
            call("cuStreamWaitEvent", handle, self._event_of(h), 0)

    def _side_streams(self, n: int) -> list[Any]:
        """The next ``n`` side streams of this rank for :meth:`_parallel` (made at first need, kept).

        Branches nest (a band's branch forks its input copies), so within one graph's body each
        fork takes streams no other fork of it holds; the body starts over (``_sides_taken = 0``).
        """
        from numba import cuda

        taken = self._sides_taken
        while len(self._sides) < taken + n:
            self._sides.append(cuda.stream())
        self._sides_taken = taken + n
        return self._sides[taken : taken + n]

    def _event_of(self, handle: int) -> int:
        """The event (handle) this rank records on the stream of ``handle`` for a fork or a join."""
        ev = self._fork_events.get(handle)
        if ev is None:
            from numba import cuda

            ev = self._fork_events[handle] = cuda.event(timing=False)
        return int(ev.handle)

    def _graph_step(self, exchange: bool) -> None:
        """One step as two graph launches (module notes: graph steps)."""
        p = 0 if self.a is self._fields[0] else 1
        call = self._call
        bands = exchange and bool(self.bands)
        if bands:  # before field_done is recorded again: the bands read the last step's field
            call("cuStreamWaitEvent", self._csh, self._field_done_h, 0)
        # The last exchange's fix-ups and this slab kernel, queued first.  No wait for the last
        # bands: the host synchronised with them before it posted the last messages.
        graph = self._graph_cache.get(("slab", p, self._fix)) or self._graph(("slab", p, self._fix))
        graph.launch(self._ksh)
        call("cuEventRecord", self._field_done_h, self._ksh)
        self._fix = None
        if not bands:
            self._edges_in_scratch = False
            self._drain()
            return
        self._wait_pending()  # the rows (ipc: tokens) of the last exchange are in
        slot = self._exchanges % 2
        mode = ("scratch" if self._edges_in_scratch else "field") if self._received else "first"
        key = ("bands", p, slot, mode)
        graph = self._graph_cache.get(key) or self._graph(key)
        graph.launch(self._csh)
        call("cuEventRecord", self._band_done_h, self._csh)
        # The rows to send are out (ipc: in the outbox); the receive buffers (ipc: the neighbours'
        # outboxes) were read.  Only then may the neighbours learn it from this step's messages.
        t0 = time.perf_counter()
        call("cuEventSynchronize", self._band_done_h)
        self.band_seconds += time.perf_counter() - t0
        self._exchanges += 1
        if self.halo == "ipc":
            for t in self._send:
                t[0] = self._exchanges
        self._fix, self._edges_in_scratch = slot, True
        reqs = self._preqs[slot]
        self._startall(reqs)
        self._pending = reqs
        self._received = True

    def _flush(self) -> None:
        """Graph steps: queue the last exchange's fix-ups on ks now (before the field is read)."""
        if self._fix is None:
            return
        for copy in self._fixups(self.a, self._fix):  # rare (before the field is read): no branches
            copy(self.ks, self._ksh)
        self._call("cuEventRecord", self._field_done_h, self._ksh)
        self._fix = None

    def _fixups(self, field: Any, slot: int) -> list[Any]:
        """The copies of ``field``'s edge rows from the bands' rows of band slot ``slot``.

        Each is a ``copy(stream, handle)``: the slab graph queues them side by side
        (:meth:`_parallel`), :meth:`_flush` one after another on ks.
        """
        call, rb = self._call, self.row_bytes
        dst, rows = self._ptr[id(field)], self._scratch_ptr_slots[slot]
        return [
            functools.partial(_copy, call, "cuMemcpyDtoDAsync", dst + e.row * rb, rows[j] + e.band_row * rb, rb)
            for j, e in enumerate(self.bands)
        ]

    # -- steps issued one by one (graphs=False) -------------------------------------------
    def _slab_kernel(self) -> None:
        wc, wn = self.weights
        self.kernel[self.grid, self.block, self.ks](self.a, self.b, wc, wn)  # stale halos

    def _bands(self, ipc: bool, k: int) -> None:
        """On the comm stream: each band's input (field rows, received halos), the band, its row out."""
        wc, wn = self.weights
        call, rb, csh = self._call, self.row_bytes, self._csh
        a = self._ptr[id(self.a)]
        if ipc:  # this step writes the outbox slots of parity k % 2 and reads the neighbours' of (k - 1) % 2
            out_ptr, in_ptr = self._out_ptr[k % 2], self._in_ptr[(k - 1) % 2]
        for j, e in enumerate(self.bands):
            bptr, sptr = self._band_in_ptr[j], self._scratch_ptr[j]
            n = e.copy_stop - e.copy_start
            call("cuMemcpyDtoDAsync", bptr + e.band_index(e.copy_start) * rb, a + e.copy_start * rb, n * rb, csh)
            if self._received:
                if ipc:  # in place from the neighbour's mapped outbox (its token said the row is there)
                    for h in e.halos:
                        call("cuMemcpyDtoDAsync", bptr + e.band_index(h) * rb, in_ptr[h], rb, csh)
                else:
                    name = "cuMemcpyDtoDAsync" if self.device_buffers else "cuMemcpyHtoDAsync"
                    for h in e.halos:
                        call(name, bptr + e.band_index(h) * rb, self._recv_ptr[self._recv_of[h]], rb, csh)
            grid, block = self._band_launch[j]
            self.kernel[grid, block, self.cs](self._band_in[j], self._scratch[j], wc, wn)
            if ipc:
                call("cuMemcpyDtoDAsync", out_ptr[j], sptr + e.band_row * rb, rb, csh)
            elif not self.device_buffers:
                call("cuMemcpyDtoHAsync", self._send_ptr[j], sptr + e.band_row * rb, rb, csh)

    def _gpu_step(self, exchange: bool) -> None:
        if self.graphs:
            self._graph_step(exchange)
            return
        self._slab_kernel()  # queued first
        if not (exchange and self.bands):
            self.field_done.record(self.ks)  # a later step's bands read this field
            self._drain()
            return
        self._wait_pending()  # the rows of the last step are in the receive buffers
        call, rb = self._call, self.row_bytes
        b = self._ptr[id(self.b)]
        self.field_done.wait(self.cs)  # the last step's field is complete
        ipc = self.halo == "ipc"
        self._bands(ipc, self._exchanges)
        self.band_done.record(self.cs)
        self.band_done.wait(self.ks)
        for j, e in enumerate(self.bands):  # the fix-ups: after the slab kernel wrote these rows wrong
            call("cuMemcpyDtoDAsync", b + e.row * rb, self._scratch_ptr[j] + e.band_row * rb, rb, self._ksh)
        self.field_done.record(self.ks)
        # The rows to send are out (ipc: in the outbox); the receive buffers (ipc: the neighbours'
        # outboxes) were read.  Only then may the neighbours learn it from this step's messages.
        t0 = time.perf_counter()
        self.band_done.synchronize()
        self.band_seconds += time.perf_counter() - t0
        self._exchanges += 1
        if ipc:
            for t in self._send:
                t[0] = self._exchanges
        self._post()

    # -- both -------------------------------------------------------------------------
    def _post(self) -> None:
        """Post this step's receives and sends (completed by the next step, or :meth:`synchronize`)."""
        reqs = []
        for e, buf, (_, tag_in) in zip(self.bands, self._recv, self._tags, strict=True):
            reqs.append(self.comm.Irecv(buf, source=e.peer, tag=tag_in))
        for e, buf, (tag_out, _) in zip(self.bands, self._send, self._tags, strict=True):
            reqs.append(self.comm.Isend(buf, dest=e.peer, tag=tag_out))
        self._pending = reqs
        self._received = True

    def _wait_pending(self) -> None:
        if self._pending:
            from mpi4py import MPI

            t0 = time.perf_counter()
            MPI.Request.Waitall(self._pending)
            self.halo_seconds += time.perf_counter() - t0
            self._pending = []

    def _drain(self) -> None:
        self._wait_pending()

    def step(self, n: int = 1, *, exchange: bool = True) -> None:
        """Advance ``n`` steps (collective: every rank must call it with the same ``n`` and ``exchange``).

        ``exchange=False`` skips the edge bands and messages (to time the slab
        kernels alone); the field is then wrong near the slab edges.
        """
        for _ in range(int(n)):
            if self.cpu:
                self._cpu_step(exchange)
            else:
                self._gpu_step(exchange)
            self.a, self.b = self.b, self.a

    def _cpu_step(self, exchange: bool) -> None:
        self._ref(self.a, self.alpha, out=self.b)  # stale halos
        if not (exchange and self.bands):
            self._drain()
            return
        self._wait_pending()
        for j, e in enumerate(self.bands):
            bi = self._band_in[j]
            bi[e.band_index(e.copy_start) : e.band_index(e.copy_stop - 1) + 1] = self.a[e.copy_start : e.copy_stop]
            if self._received:
                for h in e.halos:
                    bi[e.band_index(h)] = self._recv[self._recv_of[h]]
            row = self._ref(bi, self.alpha)[e.band_row]
            self._send[j][...] = row
            self.b[e.row] = row  # the fix-up
        self._post()

    def synchronize(self) -> None:
        """Complete this step's messages and wait for this rank's queued GPU work (collective)."""
        self._drain()
        if not self.cpu:
            self._flush()
            self.ks.synchronize()
            self.cs.synchronize()

    def timed(self, n: int, *, exchange: bool = True) -> float:
        """Seconds for ``n`` steps, host clock from a barrier to :meth:`synchronize` (collective)."""
        self.synchronize()
        self.comm.Barrier()
        t0 = time.perf_counter()
        self.step(n, exchange=exchange)
        self.synchronize()
        return time.perf_counter() - t0

    def local_field(self) -> np.ndarray:
        """This rank's stored rows after the steps so far (host copy; the halo rows are stale)."""
        if self.cpu:
            return np.array(self.a, copy=True)
        self._flush()
        out = self.a.copy_to_host(stream=self.ks)
        self.ks.synchronize()
        return out

    def gather(self, root: int = 0) -> np.ndarray | None:
        """The global field on ``root`` (collective; other ranks get None)."""
        self._drain()
        owned = np.ascontiguousarray(self.local_field()[self.slab.owned])
        if self.rank != root:
            self.comm.Send(owned, dest=root, tag=_TAG_GATHER)
            return None
        out = np.empty(self.decomp.shape, self.dtype)
        for s in self.decomp.slabs:
            if s.index == root:
                out[s.lo : s.hi] = owned
            else:
                self.comm.Recv(out[s.lo : s.hi], source=s.index, tag=_TAG_GATHER)
        return out

    def close(self) -> None:
        """Complete the messages; free the staging buffers, the outboxes and the comm stream (GPU path).

        With ``halo="ipc"`` no neighbour reads this rank's outbox any more once
        the last messages are complete (their tokens follow their reads), and
        each process's mapping keeps the memory alive until it unmaps, so no
        further synchronisation between the ranks is needed.
        """
        self._drain()
        if not self.cpu:
            self.synchronize()
            for reqs in self._preqs:  # inactive (the last messages are complete); before their buffers go
                for req in reqs:
                    req.Free()
            self._preqs = []
            for buf in getattr(self, "_pinned", []):
                buf.close()
            self._pinned = []
            self._send = self._recv = []
            for graph in self._graph_cache.values():
                graph.close()
            self._graph_cache = {}
            if self.halo == "ipc":
                self._close_ipc()
            self._comm_stream.close()


def _copy(call: Any, name: str, dst: int, src: int, nbytes: int, stream: Any, handle: int) -> None:
    """One driver copy on ``handle`` (a branch of :meth:`RankHeat._parallel`)."""
    call(name, dst, src, nbytes, handle)


def _dptr(arr: Any) -> int:
    """The device address of a numba device array."""
    return int(arr.__cuda_array_interface__["data"][0])


def _simulating() -> bool:
    from .._common import simulating

    return simulating()


def _device_uuid(device_id: int) -> str:
    """The GPU's UUID (hex): the same GPU has the same UUID in every process, whatever its ordinal there."""
    from umem_numba import driver_call

    raw = driver_call("cuDeviceGetUuid", device_id).bytes
    return (raw.encode("latin-1") if isinstance(raw, str) else bytes(raw)).hex()


def _device_of(uuid: str) -> int | None:
    """This process's ordinal of the GPU with ``uuid`` (None if it is not visible here)."""
    from umem_numba import device_count

    for d in range(device_count()):
        if _device_uuid(d) == uuid:
            return d
    return None
