"""RankHeat's GPU path on MPI ranks under numba's CUDA simulator (a helper of tests/kernels/test_mpi.py).

    NUMBA_ENABLE_CUDASIM=1 mpirun -np N python tests/support/mpi_sim_worker.py ROWS COLS STEPS SEED \
        [3d] [ipc] [driver] [graphs]

The copies run at once, after all work queued before them (the simulated
driver runs kernels late, on their streams), so the order queued is kept: this
checks the data flow of the overlapped schedule on the GPU path (the real
kernels over the real band arrays, the row offsets of every copy, which
receive buffer feeds which halo), not its concurrency.  The driver calls that
the simulator lacks are replaced here: the asynchronous copies by
``memmove`` on the simulator's host-backed arrays, the pinned staging by
NumPy arrays, the priority stream by a simulator stream.  Rank 0 prints
``bitwise equal`` (or the count of differing cells) against the NumPy
reference, which the simulator matches bit for bit.

With ``driver`` (``halo="mpi"`` only) nothing is replaced: RankHeat runs
over the simulated driver (copies, pinned staging, priority stream), whose
streams run their work late and in a seeded order, so a missing event shows
up as a wrong cell too; ``graphs`` adds ``graphs=True`` (each step's slab
kernel and bands captured and replayed as CUDA graphs; implies ``driver``).

With ``ipc`` the same runs with ``halo="ipc"``: each rank's exported VMM
outbox is a shared memory file (``memfd_create``, mapped with ``mmap``) whose
descriptor really travels to the neighbours over the Unix sockets of
``kernels.mpi._fdpass`` (``SCM_RIGHTS``), and the neighbours really read it in
place from their own mappings (the device-to-device copies, as ``memmove``).
Copies run when queued here, so a slot read before the neighbour's token, or
from the wrong slot or parity, shows up as a wrong cell.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import numpy as np
from mpi4py import MPI
from numba import cuda
from numba.cuda.simulator import api as sim

import umem_numba as um
from umem_numba import _driver
from umem_numba.kernels import heat2d_reference, heat3d_reference
from umem_numba.kernels.decomp import Decomposition
from umem_numba.kernels.mpi import distributed
from umem_numba.kernels.stencil2d import TUNED_2D
from umem_numba.kernels.stencil3d import DEFAULT_VARIANT_3D, TUNED_3D, slab_align_3d

COPIES = {"cuMemcpyDtoDAsync", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync"}


def fake_call(name: str, *args: object, detail: str = "") -> None:
    if name not in COPIES:
        raise AssertionError(f"unexpected driver call under the simulator: {name}")
    dst, src, nbytes, _stream = args
    # The copy runs now, so the work queued before it (kernels are queued on the simulated
    # driver's streams and run late, as on a GPU) runs first: the order queued is kept.
    _driver.api().drv.cuCtxSynchronize()
    ctypes.memmove(int(dst), int(src), int(nbytes))


class FakePinned:
    def __init__(self, shape: tuple, dtype: np.dtype) -> None:
        self.host = np.full(shape, np.nan, dtype)

    @classmethod
    def empty(cls, shape: tuple, dtype: np.dtype) -> FakePinned:
        return cls(shape, dtype)

    def close(self) -> None:
        pass


class FakePriorityStream:
    def __init__(self, highest: bool = True) -> None:
        self.stream = cuda.stream()

    def close(self) -> None:
        pass


class FakeVMMBuffer:
    """An exportable VMM buffer as a shared memory file; imports map the received descriptor."""

    def __init__(self, fd: int, nbytes: int) -> None:
        self.fd = fd
        self.map = mmap.mmap(fd, nbytes)
        self.nbytes = nbytes
        self.ptr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))

    @classmethod
    def empty(cls, shape: tuple, dtype: np.dtype, *, device: int, capacity: int, exportable: bool) -> FakeVMMBuffer:
        assert exportable and device == 0 and capacity == shape[0]
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        fd = os.memfd_create("outbox")
        os.ftruncate(fd, nbytes)
        buf = cls(fd, nbytes)
        buf.map[:] = np.full(nbytes // 4, np.nan, np.float32).tobytes()  # never-written slots read as NaN
        return buf

    @classmethod
    def from_shareable_handle(cls, pairs: list, shape: tuple, dtype: np.dtype, *, device: int, access: object):
        assert access == um.AccessFlags.READ and len(pairs) == 1
        fd, nbytes = pairs[0]
        return cls(os.dup(fd), nbytes)  # the caller closes the received descriptor

    @property
    def _address(self) -> int:
        """The untracked address the stencils read (``kernels._common.raw_address``)."""
        return self.ptr

    def export_fds(self) -> list:
        return [(os.dup(self.fd), self.nbytes)]

    def close(self) -> None:
        if self.fd >= 0:
            self.ptr = 0
            os.close(self.fd)
            self.fd = -1  # the mmap is left to the garbage collector: a ctypes view may still refer to it


def fake_ipc() -> None:
    """The driver calls of halo='ipc' set-up, for one simulated device shared by the ranks."""
    um.VMMBuffer = FakeVMMBuffer
    _driver.ensure_context = lambda: 0
    _driver.device_attribute = lambda name, dev: 1
    distributed._simulating = lambda: False
    distributed._device_uuid = lambda dev: "simulated-gpu"
    distributed._device_of = lambda uuid: 0 if uuid == "simulated-gpu" else None


def main() -> int:
    rows, cols, steps, seed = (int(x) for x in sys.argv[1:5])
    flags = set(sys.argv[5:])
    three_d = "3d" in flags
    halo = "ipc" if "ipc" in flags else "mpi"
    graphs = "graphs" in flags
    if not (graphs or "driver" in flags):
        sim.stream.handle = 0  # the simulator's streams have no driver handle
        cuda.event = lambda timing=True: sim.Event()  # nor do its events take flags
        _driver.call = fake_call
        um.PinnedBuffer = FakePinned
        distributed.PriorityStream = FakePriorityStream
        distributed._dptr = lambda arr: int(arr.__array_interface__["data"][0])
        if halo == "ipc":
            fake_ipc()

    comm = MPI.COMM_WORLD
    shape = (rows, cols, 6) if three_d else (rows, cols)
    dtype = np.dtype(np.float32)
    align = slab_align_3d(DEFAULT_VARIANT_3D[dtype], TUNED_3D[dtype][0]) if three_d else TUNED_2D[dtype][0]
    u0 = np.random.default_rng(seed).random(shape).astype(dtype)
    alpha = 0.15 if three_d else 0.2
    d = Decomposition(shape, comm.Get_size(), align)
    s = d.slabs[comm.Get_rank()]
    run = distributed.RankHeat(comm, d, u0[s.start : s.stop], alpha, halo=halo, fd_timeout=30.0, graphs=graphs)
    run.step(steps)
    run.synchronize()
    plate = run.gather(0)
    run.close()
    if comm.Get_rank() != 0:
        return 0
    assert plate is not None
    expected = (heat3d_reference if three_d else heat2d_reference)(u0, steps, alpha)
    differ = int(np.count_nonzero(plate != expected))
    changed = not np.array_equal(expected, u0)
    print(
        f"simulated GPU path ({halo} halos{', graphs' if graphs else ''}), {comm.Get_size()} ranks: "
        + ("bitwise equal" if not differ else f"{differ} DIFFER")
    )
    return 0 if differ == 0 and changed else 1


if __name__ == "__main__":
    sys.exit(main())
