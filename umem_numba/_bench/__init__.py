"""Benchmarks behind ``python -m umem_numba bench NAME``; each module has ``main(argv)``."""

#: Registered benchmarks: name -> one-line description.  Each is the module
#: ``umem_numba._bench.NAME`` with ``run(argv) -> dict`` and ``main(argv) -> int``
#: (see ``umem_numba._bench._common``); ``bench all`` runs them in this order.
_BENCHES: dict[str, str] = {
    "launch": "Per-launch cost: ManagedBuffer vs DeviceNDArray vs numba managed_array, coherent launch overhead",
    "prefetch": "Prefetch bandwidth vs pinned copies, fault-driven first touch, batched plans",
    "vmm": "VMM grow in place vs reallocate+copy, append strategies, kernel bandwidth",
    "stencil": "Heat-equation stencil on every memory kind vs device_array and the copy bandwidth",
    "scale": "Heat stencil on 1 and N GPUs: weak/strong scaling, peer path and MPI path, halo time per step",
    "copy": "Copy paths (1 GiB): managed -> pinned / new numpy, numpy -> managed + kernel vs numba; HOST_MAPPED",
    "pool": "Allocate+free 1 MiB: umem pools (raw and buffers) vs cuMemAllocManaged vs CuPy's managed pool",
    "e2e": "numba-cuda's documented examples end to end: numba's idiom vs umem's default buffers, device, pool=",
}
