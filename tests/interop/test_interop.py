"""Interop recipes, on the GPU: umem_numba buffers shared with numba, CuPy, PyTorch and JAX.

Each test runs both directions on fresh random data, for every memory kind a
kernel can use (managed, VMM, mapped pinned):

1. a kernel launched through umem_numba writes ``src * a + b`` into the
   buffer, and the other library reads it back through its own array type,
   without a copy (the addresses are checked);
2. the other library writes random values into the same memory, and a
   kernel launched through umem_numba reads them into a second buffer.

The hand-offs follow docs/interop.md: ``buf.synchronize()`` before the other
library touches memory a umem_numba launch wrote, and the other library's own
synchronize before umem_numba reads what it wrote.  A library that is not
installed is skipped, with the reason.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from numba import cuda

import umem_numba as um

pytestmark = pytest.mark.gpu

KINDS = ["managed", "vmm", "pinned-mapped"]


def _shape(rng: np.random.Generator) -> tuple[int, int]:
    # At least 128 blocks of 32 x 8 threads: a realistic launch, no low-occupancy warning.
    return int(rng.integers(300, 700)), int(rng.integers(300, 900))


def _buffer(kind: str, array: np.ndarray) -> Any:
    if kind == "managed":
        return um.ManagedBuffer.from_array(array)
    if kind == "vmm":
        return um.VMMBuffer.from_array(array)
    return um.PinnedBuffer.from_array(array, flags=um.HostAllocFlags.DEVICEMAP)


_KERNEL = None


def _affine():
    """``dst = src * a + b`` over a 2-D grid, launched through umem_numba."""
    global _KERNEL
    if _KERNEL is None:

        @um.jit
        def affine(src, dst, a, b):
            i, j = cuda.grid(2)
            if i < dst.shape[0] and j < dst.shape[1]:
                dst[i, j] = src[i, j] * a + b

        _KERNEL = affine
    return _KERNEL


def _launch_affine(src: Any, dst: Any, a: float, b: float) -> None:
    n, m = dst.shape
    _affine()[((n + 31) // 32, (m + 7) // 8), (32, 8)](src, dst, np.float32(a), np.float32(b))


def _pair(kind: str, rng: np.random.Generator) -> tuple[np.ndarray, Any, Any]:
    host = (rng.random(_shape(rng)) + 0.5).astype(np.float32)
    return host, _buffer(kind, host), _buffer(kind, np.zeros_like(host))


def _close(*bufs: Any) -> None:
    for b in bufs:
        b.close()


def _assert_close(got: np.ndarray, expected: np.ndarray) -> None:
    # The GPU may fuse the multiply-add: one rounding apart from NumPy's two.
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def _expected(host: np.ndarray, a: float, b: float) -> np.ndarray:
    return host * np.float32(a) + np.float32(b)


@pytest.mark.parametrize("kind", KINDS)
def test_numba_device_array(rng, kind):

    host, src, dst = _pair(kind, rng)
    a, b = float(rng.uniform(1, 3)), float(rng.uniform(-1, 1))
    try:
        # umem_numba writes, numba reads (a DeviceNDArray over the same memory).
        _launch_affine(src, dst, a, b)
        dst.synchronize()
        view = cuda.as_cuda_array(dst)
        assert view.device_ctypes_pointer.value == dst.ptr and view.shape == dst.shape
        _assert_close(view.copy_to_host(), _expected(host, a, b))

        # numba writes (a plain numba copy into the view), umem_numba reads.
        fresh = (rng.random(host.shape) - 0.5).astype(np.float32)
        cuda.as_cuda_array(src).copy_to_device(fresh)
        cuda.synchronize()
        _launch_affine(src, dst, 2.0, 1.0)
        _assert_close(dst.copy_to_host(), _expected(fresh, 2.0, 1.0))
    finally:
        _close(src, dst)


@pytest.mark.parametrize("kind", KINDS)
def test_cupy(rng, kind):
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    host, src, dst = _pair(kind, rng)
    a, b = float(rng.uniform(1, 3)), float(rng.uniform(-1, 1))
    try:
        _launch_affine(src, dst, a, b)
        dst.synchronize()
        c = cupy.asarray(dst)  # zero-copy through __cuda_array_interface__
        assert c.data.ptr == dst.ptr and c.shape == dst.shape and c.dtype == np.float32
        _assert_close(cupy.asnumpy(c), _expected(host, a, b))

        fresh = (rng.random(host.shape) - 0.5).astype(np.float32)
        cs = cupy.asarray(src)
        cs[...] = cupy.asarray(fresh)  # CuPy writes
        cs *= 3  # and runs a kernel of its own on it
        cupy.cuda.get_current_stream().synchronize()
        _launch_affine(src, dst, 1.0, 0.5)
        _assert_close(dst.copy_to_host(), _expected(fresh * np.float32(3), 1.0, 0.5))
    finally:
        _close(src, dst)


@pytest.mark.parametrize("kind", KINDS)
def test_pytorch(rng, kind):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch build has no CUDA support")
    host, src, dst = _pair(kind, rng)
    a, b = float(rng.uniform(1, 3)), float(rng.uniform(-1, 1))
    try:
        _launch_affine(src, dst, a, b)
        dst.synchronize()
        t = torch.as_tensor(dst, device="cuda")  # zero-copy through __cuda_array_interface__
        assert t.data_ptr() == dst.ptr and tuple(t.shape) == dst.shape and t.dtype == torch.float32
        _assert_close(t.cpu().numpy(), _expected(host, a, b))

        fresh = (rng.random(host.shape) - 0.5).astype(np.float32)
        ts = torch.as_tensor(src, device="cuda")
        ts.copy_(torch.from_numpy(fresh).cuda())  # PyTorch writes
        ts.mul_(-2.0)
        torch.cuda.synchronize()
        _launch_affine(src, dst, 1.0, 0.25)
        _assert_close(dst.copy_to_host(), _expected(fresh * np.float32(-2), 1.0, 0.25))
    finally:
        _close(src, dst)


def _jax_cuda_plugin_installed() -> bool:
    """Whether JAX's CUDA plugin is installed (``jax[cuda12]`` / ``jax[cuda13]``)."""
    import importlib.util
    import pkgutil

    if any(importlib.util.find_spec(f"jax_cuda{v}_plugin") is not None for v in (12, 13)):
        return True
    try:
        import jax_plugins
    except ImportError:
        return False
    return any(m.name.startswith("xla_cuda") for m in pkgutil.iter_modules(jax_plugins.__path__))


def _jax_gpus():
    """``(jax, its GPUs)``; skips only where JAX or its CUDA plugin is not installed: a JAX error fails."""
    jax = pytest.importorskip("jax", reason="JAX is not installed")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as exc:
        if _jax_cuda_plugin_installed():
            raise  # the plugin is there and JAX cannot use the GPU: a failure, not a skip
        pytest.skip(f"JAX is installed without its CUDA plugin: {exc}")
    assert gpus, "JAX's GPU backend lists no device"
    return jax, gpus


# JAX imports only kDLCUDA memory (docs/interop.md): a mapped pinned buffer is kDLCUDAHost, so
# the import runs for the kinds JAX takes, and the mapped pinned buffer is tested the other way
# (test_jax_array_into_a_mapped_pinned_buffer) instead of a test that would skip everywhere.
@pytest.mark.parametrize("kind", ["managed", "vmm"])
def test_jax_through_dlpack(rng, kind):
    jax, gpus = _jax_gpus()
    import jax.numpy as jnp

    host, src, dst = _pair(kind, rng)
    a, b = float(rng.uniform(1, 3)), float(rng.uniform(-1, 1))
    try:
        assert dst.__dlpack_device__() == (2, dst.device_id)  # kDLCUDA: what JAX imports
        # umem_numba writes, JAX reads through DLPack.
        _launch_affine(src, dst, a, b)
        x = jax.dlpack.from_dlpack(dst)
        assert x.shape == dst.shape and x.dtype == jnp.float32
        _assert_close(np.asarray(x), _expected(host, a, b))
        _assert_close(np.asarray(x * 2 + 1), _expected(host, a, b) * 2 + 1)

        # JAX computes an array, umem_numba reads it through __cuda_array_interface__.
        fresh = (rng.random(host.shape) - 0.5).astype(np.float32)
        y = jax.device_put(jnp.asarray(fresh), gpus[0]) * 4
        y.block_until_ready()
        _launch_affine(cuda.as_cuda_array(y), dst, 1.0, -1.0)  # through JAX's CUDA Array Interface
        _assert_close(dst.copy_to_host(), _expected(fresh * np.float32(4), 1.0, -1.0))
        del x, y  # JAX's views of the memory go before the buffers are closed
    finally:
        _close(src, dst)


def test_jax_array_into_a_mapped_pinned_buffer(rng):
    """A mapped pinned buffer is DLPack kDLCUDAHost (which JAX does not import); a kernel launched
    through umem_numba reads a JAX array (CUDA Array Interface) into it, and the host reads the result."""
    jax, gpus = _jax_gpus()
    import jax.numpy as jnp

    host, src, dst = _pair("pinned-mapped", rng)
    try:
        assert dst.__dlpack_device__() == (3, 0)  # kDLCUDAHost
        fresh = (rng.random(host.shape) - 0.5).astype(np.float32)
        y = jax.device_put(jnp.asarray(fresh), gpus[0]) * 4
        y.block_until_ready()
        _launch_affine(cuda.as_cuda_array(y), dst, 1.0, -1.0)
        _assert_close(dst.host, _expected(fresh * np.float32(4), 1.0, -1.0))  # .host waits for the kernel
        del y
    finally:
        _close(src, dst)
