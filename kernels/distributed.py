"""The heat step on MPI ranks (mpi4py): one slab per rank, halos by non-blocking MPI.

Used by ``examples/heat2d_mpi.py``; importing this module imports neither
mpi4py nor numba's CUDA driver.  Every function takes the communicator.

* :func:`cuda_aware_mpi`: does the MPI library take device buffers?
* :func:`collective_errors`: every rank's error, known to every rank, before any exchange.
* :class:`RankHeat`: one rank's slab, stepped on the GPU (halos through
  :class:`umem_numba.PinnedBuffer` staging, or device buffers where MPI is
  CUDA-aware, while the slab's interior is computed on its own stream) or,
  with ``cpu=True``, with the NumPy reference kernels.

A GPU step on a rank: on the *comm* stream, the rows this rank sends are
computed first by a small launch of the same kernel over a band of
``2 * R + 1`` rows (:meth:`Decomposition.band`, bitwise the same values as
the full launch) and copied to pinned memory; on the *compute* stream the
full slab step runs meanwhile.  The host waits only for the comm stream,
then ``Irecv``/``Isend``/``Waitall``; the received rows go into the new
field's halo rows on the compute stream, and an event orders the next
step's band launch after them.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._common import _as_float_dtype, stencil_weights
from .decomp import Decomposition

__all__ = ["RankHeat", "collective_errors", "cuda_aware_mpi", "local_rank"]

_TAG_DOWN, _TAG_UP, _TAG_GATHER = 11, 12, 13


def cuda_aware_mpi(
    environ: Mapping[str, str] | None = None, libraries: Sequence[Any] | None = None
) -> tuple[bool, str]:
    """Whether the MPI library that mpi4py runs on accepts CUDA device buffers.

    Asks the library itself, after ``MPI_Init``: Open MPI's
    ``MPIX_Query_cuda_support()`` (also in MPICH 4), else MPICH's
    ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)``.  The environment
    variable ``UMEM_MPI_CUDA_AWARE=0`` or ``1`` overrides the answer.

    Parameters
    ----------
    environ : mapping, optional
        Environment to read the override from (``os.environ``).
    libraries : sequence, optional
        Objects to look the query functions up on (attributes, as on a
        ``ctypes.CDLL``); by default the library mpi4py loaded.

    Returns
    -------
    (aware, how) : (bool, str)
        The answer and how it was found, for logs.
    """
    env = os.environ if environ is None else environ
    forced = env.get("UMEM_MPI_CUDA_AWARE", "").strip()
    if forced in ("0", "1"):
        return forced == "1", f"UMEM_MPI_CUDA_AWARE={forced}"
    if libraries is None:
        libraries = _mpi_libraries()
    for lib in libraries:
        fn = _symbol(lib, "MPIX_Query_cuda_support")
        if fn is not None:
            value = int(fn())
            return value == 1, f"MPIX_Query_cuda_support() returned {value}"
        fn = _symbol(lib, "MPIX_GPU_query_support")
        if fn is not None:
            flag = ctypes.c_int(0)
            err = int(fn(0, ctypes.byref(flag)))  # 0 == MPIX_GPU_SUPPORT_CUDA
            if err == 0:
                return flag.value == 1, f"MPIX_GPU_query_support(CUDA) gave {flag.value}"
    return False, (
        "the MPI library has no CUDA-awareness query (MPIX_Query_cuda_support, "
        "MPIX_GPU_query_support): using pinned host buffers"
    )


def _symbol(lib: Any, name: str) -> Any:
    try:
        fn = getattr(lib, name)
    except AttributeError:
        return None
    try:
        fn.restype = ctypes.c_int
    except AttributeError:  # a plain Python callable (tests)
        pass
    return fn


def _mpi_libraries() -> list[Any]:
    """The mpi4py extension module as a ctypes library: dlsym searches libmpi behind it."""
    try:
        from mpi4py import MPI

        return [ctypes.CDLL(MPI.__file__, mode=ctypes.RTLD_GLOBAL)]
    except (ImportError, OSError):
        return []


def collective_errors(comm: Any, error: str | None) -> list[str]:
    """Every rank's error (``None`` if it has none), known to every rank: ``'rank R: message'`` lines.

    A collective: call it on every rank, before any halo exchange, so that a
    problem on one rank stops all of them instead of leaving the others
    waiting for a message that never comes.
    """
    errors = comm.allgather(error)
    by_message: dict[str, list[int]] = {}
    for r, e in enumerate(errors):
        if e:
            by_message.setdefault(str(e), []).append(r)
    return [
        f"{'all ranks' if len(rs) == len(errors) > 1 else 'rank ' + ', '.join(map(str, rs))}: {e}"
        for e, rs in by_message.items()
    ]


def mismatch(comm: Any, config: Mapping[str, Any]) -> str | None:
    """A message if ``config`` differs between ranks (collective), else None."""
    configs = comm.allgather(dict(config))
    differ = sorted({k for c in configs for k in c if any(c2.get(k) != configs[0].get(k) for c2 in configs)})
    if not differ:
        return None
    per = "; ".join(f"{k}: " + ", ".join(f"rank {r}={c.get(k)!r}" for r, c in enumerate(configs)) for k in differ)
    return f"the ranks were started with different settings ({per})"


def local_rank(comm: Any) -> int:
    """This rank's index among the ranks on its node (``MPI_COMM_TYPE_SHARED``)."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return int(node.Get_rank())
    finally:
        node.Free()


class RankHeat:
    """One rank's slab of a 2-D or 3-D heat run.

    Parameters
    ----------
    comm : mpi4py communicator
    decomp : Decomposition
        The whole grid's decomposition; this rank steps slab ``comm.rank``.
        For the GPU path its ``align`` must be the kernel's strip height.
    local : ndarray
        This slab's initial stored rows (``decomp.local_shape(rank)``).
    alpha : float
    cpu : bool
        NumPy reference kernels instead of the GPU.
    device_buffers : bool
        Pass device buffers to MPI (CUDA-aware MPI) instead of pinned staging.
    rows_per_thread : int, optional
        Strip height of the GPU kernel (must equal ``decomp.align``).
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
    ) -> None:
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
        s = self.slab
        # (neighbour rank, global row sent, local halo row received, tag sent, tag received)
        self.links = []
        if self.rank > 0:
            self.links.append((self.rank - 1, s.lo, s.local(s.lo - 1), _TAG_UP, _TAG_DOWN))
        if self.rank < decomp.parts - 1:
            self.links.append((self.rank + 1, s.hi - 1, s.local(s.hi), _TAG_DOWN, _TAG_UP))
        self.halo_seconds = 0.0
        if cpu:
            from .reference import heat2d_step_reference, heat3d_step_reference

            self._ref = heat2d_step_reference if decomp.ndim == 2 else heat3d_step_reference
            self.a = np.array(local, copy=True)
            self.b = np.array(local, copy=True)
            self._recv = [np.empty(decomp.shape[1:], dtype) for _ in self.links]
            return
        self._setup_gpu(local, rows_per_thread)

    # -- GPU --------------------------------------------------------------------------
    def _setup_gpu(self, local: np.ndarray, rows_per_thread: int | None) -> None:
        from numba import cuda

        import umem_numba as um

        d = self.decomp
        if d.ndim == 2:
            from .stencil2d import TUNED_2D as TUNED
            from .stencil2d import heat2d_kernel as make
            from .stencil2d import launch_config_2d as config
        else:
            from .stencil3d import TUNED_3D as TUNED
            from .stencil3d import heat3d_kernel as make
            from .stencil3d import launch_config_3d as config
        rows, blk = TUNED[self.dtype]
        rows = rows if rows_per_thread is None else int(rows_per_thread)
        if rows != d.align:
            raise ValueError(f"the decomposition is aligned to {d.align} rows but the kernel's strips are {rows}")
        self.kernel = make(rows)
        self.ks = cuda.stream()  # compute: the full slab
        self.cs = cuda.stream()  # comm: the bands whose rows are sent
        self.a = cuda.to_device(local, stream=self.ks)
        self.b = cuda.to_device(local, stream=self.ks)
        self.grid, self.block = config(local.shape, rows, blk)
        self.bands = []
        halo_shape = d.shape[1:]
        for _, row, _, _, _ in self.links:
            b0, b1 = d.band(self.rank, row)
            scratch = cuda.device_array((b1 - b0, *halo_shape), self.dtype, stream=self.ks)
            bgrid, bblock = config(scratch.shape, rows, blk)
            self.bands.append((b0, b1, self.slab.local(row) - b0, scratch, bgrid, bblock))
        if self.device_buffers:
            self._send = [None] * len(self.links)
            self._recv = [cuda.device_array(halo_shape, self.dtype, stream=self.ks) for _ in self.links]
        else:
            self._send = [um.PinnedBuffer.empty(halo_shape, self.dtype) for _ in self.links]
            self._recv = [um.PinnedBuffer.empty(halo_shape, self.dtype) for _ in self.links]
        self.halo_done = cuda.event(timing=False)
        self.halo_done.record(self.ks)
        self.ks.synchronize()

    def _gpu_step(self, exchange: bool) -> None:
        import time

        from mpi4py import MPI

        wc, wn = self.weights
        self.halo_done.wait(self.cs)  # the bands read the field the last exchange completed
        send_views = []
        if exchange:
            for (b0, b1, r, scratch, bgrid, bblock), buf in zip(self.bands, self._send, strict=True):
                self.kernel[bgrid, bblock, self.cs](self.a[b0:b1], scratch, wc, wn)
                if buf is None:
                    send_views.append(scratch[r])
                else:
                    buf.copy_from_device(scratch[r], stream=self.cs)
        self.kernel[self.grid, self.block, self.ks](self.a, self.b, wc, wn)  # overlaps the messages below
        if exchange and self.links:
            t0 = time.perf_counter()
            self.cs.synchronize()
            reqs = []
            for (peer, _, _, _, tag_in), buf in zip(self.links, self._recv, strict=True):
                reqs.append(self.comm.Irecv(buf if self.device_buffers else buf.host, source=peer, tag=tag_in))
            for i, ((peer, _, _, tag_out, _), buf) in enumerate(zip(self.links, self._send, strict=True)):
                reqs.append(self.comm.Isend(send_views[i] if buf is None else buf.host, dest=peer, tag=tag_out))
            MPI.Request.Waitall(reqs)
            self.halo_seconds += time.perf_counter() - t0
            for (_, _, halo, _, _), buf in zip(self.links, self._recv, strict=True):
                if self.device_buffers:
                    self.b[halo].copy_to_device(buf, stream=self.ks)
                else:
                    buf.copy_to_device(self.b[halo], stream=self.ks)
        self.halo_done.record(self.ks)

    # -- both -------------------------------------------------------------------------
    def step(self, n: int = 1, *, exchange: bool = True) -> None:
        """Advance ``n`` steps (collective: every rank must call it with the same ``n``)."""
        for _ in range(int(n)):
            if self.cpu:
                self._cpu_step(exchange)
            else:
                self._gpu_step(exchange)
            self.a, self.b = self.b, self.a

    def _cpu_step(self, exchange: bool) -> None:
        import time

        from mpi4py import MPI

        self._ref(self.a, self.alpha, out=self.b)
        if not (exchange and self.links):
            return
        t0 = time.perf_counter()
        reqs = [
            self.comm.Irecv(buf, source=peer, tag=tag_in)
            for (peer, _, _, _, tag_in), buf in zip(self.links, self._recv, strict=True)
        ]
        sends = [np.ascontiguousarray(self.b[self.slab.local(row)]) for _, row, _, _, _ in self.links]
        reqs += [
            self.comm.Isend(buf, dest=peer, tag=tag_out)
            for (peer, _, _, tag_out, _), buf in zip(self.links, sends, strict=True)
        ]
        MPI.Request.Waitall(reqs)
        for (_, _, halo, _, _), buf in zip(self.links, self._recv, strict=True):
            self.b[halo] = buf
        self.halo_seconds += time.perf_counter() - t0

    def synchronize(self) -> None:
        """Wait for this rank's queued GPU work (nothing on the CPU path)."""
        if not self.cpu:
            self.ks.synchronize()
            self.cs.synchronize()

    def local_field(self) -> np.ndarray:
        """This rank's stored rows after the steps so far (host copy)."""
        if self.cpu:
            return np.array(self.a, copy=True)
        out = self.a.copy_to_host(stream=self.ks)
        self.ks.synchronize()
        return out

    def gather(self, root: int = 0) -> np.ndarray | None:
        """The global field on ``root`` (collective; other ranks get None)."""
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
        """Free the staging buffers (GPU path)."""
        if not self.cpu:
            self.synchronize()
            for buf in [*self._send, *self._recv]:
                if buf is not None and hasattr(buf, "close"):
                    buf.close()
