"""Slabs on GPUs: the simulated decomposition on one GPU and the two-GPU run, bitwise against one GPU.

The one-GPU reference is ``heat2d_step`` / ``heat3d_step`` over the whole field
(the same tuned kernel); the slab runs must match it bit for bit, and the
result must have moved away from the start (and agree with NumPy to rounding).

On numba's simulator (``NUMBA_ENABLE_CUDASIM=1``) the plates are small (:func:`_size`): every
simulated CUDA thread is Python code, and the GPU sizes took over a minute per test there.  They
still cut into several aligned strips per slab, with the same steps, transports and checks.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.helpers import random_array

from umem_numba import _sim, kernels
from umem_numba.kernels import multigpu


def _size(gpu, sim):
    """``gpu`` on a GPU, the small ``sim`` under numba's simulator (a shape, or a (low, high) range)."""
    return sim if _sim.active() else gpu


def _one_gpu(u0: np.ndarray, steps: int, alpha: float) -> np.ndarray:
    from numba import cuda

    step = kernels.heat2d_step if u0.ndim == 2 else kernels.heat3d_step
    a, b = cuda.to_device(u0), cuda.device_array_like(u0)
    for _ in range(steps):
        step(a, b, alpha)
        a, b = b, a
    cuda.synchronize()
    return a.copy_to_host()


def _check(got: np.ndarray, u0: np.ndarray, steps: int, alpha: float) -> None:
    expected = _one_gpu(u0, steps, alpha)
    assert not np.array_equal(expected, u0)
    mism = np.argwhere(got != expected)
    assert mism.size == 0, f"{len(mism)} cells differ from the one-GPU run, first at {mism[:5].tolist()}"
    ref = (kernels.heat2d_reference if u0.ndim == 2 else kernels.heat3d_reference)(u0, steps, alpha)
    tol = 1e-5 if u0.dtype == np.float32 else 1e-12
    assert np.max(np.abs(got - ref)) <= tol * np.max(np.abs(ref))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "launches"])
def test_simulated_slabs_2d_bitwise(rng, dtype, parts: int, graphs: bool) -> None:
    rows, cols = _size(((300, 700), (200, 600)), ((70, 130), (24, 60)))
    u0 = random_array(rng, (rng.integers(*rows), rng.integers(*cols)), dtype)
    alpha = float(rng.uniform(0.1, 0.25))
    got = multigpu.heat2d_multi(u0, 25, [0] * parts, alpha, graphs=graphs)
    _check(got, u0, 25, alpha)


@pytest.mark.gpu
@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "launches"])
def test_simulated_slabs_pinned_staging_bitwise(rng, parts: int, graphs: bool) -> None:
    u0 = random_array(rng, _size((513, 257), (97, 41)), np.float32)
    with multigpu.MultiGPUHeat(u0, [0] * parts, 0.2, transport="pinned", graphs=graphs) as run:
        assert run.transports == ["pinned"] * (2 * (parts - 1))
        run.step(17)
        got = run.result()
    _check(got, u0, 17, 0.2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_simulated_slabs_3d_bitwise(rng, dtype, parts: int) -> None:
    planes, rest = _size(((60, 90), (37, 70)), ((34, 50), (9, 22)))
    u0 = random_array(rng, (int(rng.integers(*planes)), *rest), dtype)
    got = multigpu.heat3d_multi(u0, 9, [0] * parts)
    _check(got, u0, 9, 1.0 / 6.0)


@pytest.mark.gpu
@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "launches"])
def test_simulated_slabs_vmm_halo_bitwise(rng, ndim: int, parts: int, graphs: bool) -> None:
    """halo='vmm' on one GPU: band arrays are VMMBuffers the band launches write and the neighbour copies from."""
    import umem_numba as um

    rows, rest = (
        _size(((200, 400), (211,)), ((70, 130), (45,)))
        if ndim == 2
        else _size(((50, 80), (29, 67)), ((34, 50), (9, 19)))
    )
    shape = (int(rng.integers(*rows)), *rest)
    u0 = random_array(rng, shape, np.float32)
    alpha = 0.22 if ndim == 2 else 0.15
    with multigpu.MultiGPUHeat(u0, [0] * parts, alpha, halo="vmm", graphs=graphs) as run:
        assert run.halo == "vmm" and run.fallback is None
        assert run.transports == ["vmm"] * (2 * (parts - 1))
        for link in run.exchanger.links:  # one band array per slot: two for graph steps
            assert len(link.scratch) == (2 if graphs else 1)
            assert all(isinstance(band, um.VMMBuffer) for band in link.scratch)
        run.step(13)
        got = run.result()
    _check(got, u0, 13, alpha)


@pytest.mark.gpu
def test_overlapped_steps_queue_ahead_of_the_gpu(rng) -> None:
    """Many steps queued without a host wait, then one result: still bitwise the one-GPU run."""
    u0 = random_array(rng, _size((1500, 700), (96, 40)), np.float32)
    with multigpu.MultiGPUHeat(u0, [0, 0], 0.25) as run:
        for _ in range(6):
            run.step(7)  # no synchronize between the calls
        got = run.result()
    _check(got, u0, 42, 0.25)


@pytest.mark.gpu
def test_simulated_slabs_odd_strip_height(rng) -> None:
    """A non-tuned strip height: the decomposition follows it and equality holds against that launch."""
    from numba import cuda

    u0 = random_array(rng, _size((301, 150), (61, 40)), np.float32)
    got = multigpu.heat2d_multi(u0, 12, [0, 0, 0], 0.25, rows_per_thread=5)
    a, b = cuda.to_device(u0), cuda.device_array_like(u0)
    for _ in range(12):
        kernels.heat2d_step(a, b, 0.25, rows_per_thread=5)
        a, b = b, a
    assert np.array_equal(got, a.copy_to_host())


@pytest.mark.gpu
def test_bad_devices_named() -> None:
    u0 = np.zeros((64, 64), np.float32)
    with pytest.raises(ValueError, match="do not exist"):
        multigpu.MultiGPUHeat(u0, [0, 99])
    with pytest.raises(ValueError, match="at least one GPU"):
        multigpu.MultiGPUHeat(u0, [])
    with pytest.raises(ValueError, match="cannot be cut into 3 slabs"):
        multigpu.MultiGPUHeat(np.zeros((2, 64), np.float32), [0, 0, 0])
    with pytest.raises(ValueError, match="halo must be one of"):
        multigpu.MultiGPUHeat(u0, [0], halo="ipc")


@pytest.mark.gpu
def test_vmm_halo_with_pinned_transport_falls_back_with_reason(rng) -> None:
    u0 = random_array(rng, _size((300, 100), (70, 40)), np.float32)
    with pytest.warns(RuntimeWarning, match="halo='vmm' is not available .*pinned"):
        run = multigpu.MultiGPUHeat(u0, [0, 0], 0.25, halo="vmm", transport="pinned")
    with run:
        assert run.halo == "copy" and "pinned" in run.fallback and run.transports == ["pinned", "pinned"]
        run.step(9)
        got = run.result()
    _check(got, u0, 9, 0.25)


@pytest.mark.multigpu
@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("transport", ["auto", "pinned"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "launches"])
def test_two_gpus_bitwise(rng, ndim: int, transport: str, graphs: bool) -> None:
    from umem_numba import _driver

    shape = _size((1031, 777), (103, 77)) if ndim == 2 else _size((97, 65, 80), (41, 13, 20))
    u0 = random_array(rng, shape, np.float32)
    alpha = 0.25 if ndim == 2 else 1.0 / 6.0
    with multigpu.MultiGPUHeat(u0, [0, 1], alpha, transport=transport, graphs=graphs) as run:
        peer = int(_driver.call("cuDeviceCanAccessPeer", 0, 1))
        expected_kind = "pinned" if transport == "pinned" or not peer else "peer"
        assert run.transports == [expected_kind, expected_kind]
        run.step(21)
        got = run.result()
    _check(got, u0, 21, alpha)


@pytest.mark.multigpu
@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "launches"])
def test_two_gpus_vmm_halo_bitwise(rng, ndim: int, graphs: bool) -> None:
    """Band arrays on the receiving GPU, READ_WRITE granted to the sender, whose band launch writes them."""
    import umem_numba as um
    from umem_numba import _driver

    if not int(_driver.call("cuDeviceCanAccessPeer", 0, 1)):
        pytest.skip("GPUs 0 and 1 have no peer access: halo='vmm' falls back (tested above)")
    shape = _size((1029, 801), (101, 81)) if ndim == 2 else _size((95, 66, 81), (39, 14, 21))
    u0 = random_array(rng, shape, np.float32)
    alpha = 0.25 if ndim == 2 else 1.0 / 6.0
    with multigpu.MultiGPUHeat(u0, [0, 1], alpha, halo="vmm", graphs=graphs) as run:
        assert run.halo == "vmm" and run.transports == ["vmm", "vmm"]
        for m, link in zip(run.exchanger.moves, run.exchanger.links, strict=True):
            for band in link.scratch:  # the driver's own answers
                assert band.device_id == run.slabs[m.dst].device
                assert band.get_access(run.slabs[m.src].device) == um.AccessFlags.READ_WRITE
        run.step(19)
        got = run.result()
    _check(got, u0, 19, alpha)


@pytest.mark.multigpu
def test_process_with_live_peer_and_vmm_state_exits_cleanly(rng):
    """Slabs, VMM halos and peer mappings still alive at exit: the process ends with status 0, no crash."""
    import subprocess
    import sys
    import textwrap

    seed = int(rng.integers(1 << 30))
    shape = _size((512, 384), (64, 48))
    code = textwrap.dedent(
        f"""
        import numpy as np
        import umem_numba as um
        from umem_numba.kernels import multigpu

        u0 = np.random.default_rng({seed}).random({shape}, dtype=np.float32)
        heat = multigpu.MultiGPUHeat(u0, [0, 1], halo="vmm")
        heat.step(20)
        field = heat.result()
        keep = [um.VMMBuffer.empty((1024,), np.float32, device=d) for d in (0, 1)]
        keep[0].set_access(1, um.AccessFlags.READ)
        managed = um.ManagedBuffer.from_array(field)
        print("OK", float(field.sum()) > 0)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, f"exit status {out.returncode}: {out.stderr[-2000:]}"
    assert out.stdout.split() == ["OK", "True"]
