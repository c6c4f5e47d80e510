"""The heat step on MPI ranks: communication (:mod:`.comm`), the ranks' slabs (:mod:`.distributed`), fd passing.

``comm``: CUDA-aware MPI, errors known to every rank, ranks per node;
``distributed``: :class:`~umem_numba.kernels.mpi.distributed.RankHeat`, one rank's slab stepped on the
GPU or with NumPy; ``_fdpass``: exported GPU memory's file descriptors passed between the ranks of one
node (``halo="ipc"``).  Importing imports neither mpi4py nor numba's CUDA driver.
"""
