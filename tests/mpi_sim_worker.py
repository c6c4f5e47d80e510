"""RankHeat's GPU path on MPI ranks under numba's CUDA simulator (a helper of tests/test_mpi.py).

    NUMBA_ENABLE_CUDASIM=1 mpirun -np N python tests/mpi_sim_worker.py ROWS COLS STEPS SEED [3d]

The simulator runs every launch and copy at once, in the order queued, so this
checks the data flow of the overlapped schedule on the GPU path (the real
kernels over the real band arrays, the row offsets of every copy, which
receive buffer feeds which halo), not its concurrency.  The driver calls that
the simulator lacks are replaced here: the asynchronous copies by
``memmove`` on the simulator's host-backed arrays, the pinned staging by
NumPy arrays, the priority stream by a simulator stream.  Rank 0 prints
``bitwise equal`` (or the count of differing cells) against the NumPy
reference, which the simulator matches bit for bit.
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np
from mpi4py import MPI
from numba import cuda
from numba.cuda.simulator import api as sim

import umem_numba as um
from umem_numba import _driver
from umem_numba.kernels import distributed, heat2d_reference, heat3d_reference
from umem_numba.kernels.decomp import Decomposition
from umem_numba.kernels.stencil2d import TUNED_2D
from umem_numba.kernels.stencil3d import TUNED_3D

COPIES = {"cuMemcpyDtoDAsync", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync"}


def fake_call(name: str, *args: object, detail: str = "") -> None:
    if name not in COPIES:
        raise AssertionError(f"unexpected driver call under the simulator: {name}")
    dst, src, nbytes, _stream = args
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


def main() -> int:
    rows, cols, steps, seed = (int(x) for x in sys.argv[1:5])
    three_d = len(sys.argv) > 5 and sys.argv[5] == "3d"
    sim.stream.handle = 0  # the simulator's streams have no driver handle
    cuda.event = lambda timing=True: sim.Event()  # nor do its events take flags
    _driver.call = fake_call
    um.PinnedBuffer = FakePinned
    distributed.PriorityStream = FakePriorityStream
    distributed._dptr = lambda arr: int(arr.__array_interface__["data"][0])

    comm = MPI.COMM_WORLD
    shape = (rows, cols, 6) if three_d else (rows, cols)
    dtype = np.dtype(np.float32)
    align = (TUNED_3D if three_d else TUNED_2D)[dtype][0]
    u0 = np.random.default_rng(seed).random(shape).astype(dtype)
    alpha = 0.15 if three_d else 0.2
    d = Decomposition(shape, comm.Get_size(), align)
    s = d.slabs[comm.Get_rank()]
    run = distributed.RankHeat(comm, d, u0[s.start : s.stop], alpha)
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
    print(f"simulated GPU path, {comm.Get_size()} ranks: " + ("bitwise equal" if not differ else f"{differ} DIFFER"))
    return 0 if differ == 0 and changed else 1


if __name__ == "__main__":
    sys.exit(main())
