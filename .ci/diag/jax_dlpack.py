"""Why JAX refuses a umem_numba DLPack capsule (diagnostic)."""
import traceback
import numpy as np
import jax, jax.numpy as jnp
import cupy
import umem_numba as um

print("jax", jax.__version__, jax.devices())
c = cupy.arange(8, dtype=cupy.float32)
print("cupy ->", jax.dlpack.from_dlpack(c))
from numba import cuda

@um.jit
def twice(a):
    i = cuda.grid(1)
    if i < a.shape[0]:
        a[i] = 2 * a[i]

for make in (lambda: um.DeviceBuffer.from_array(np.arange(8, dtype=np.float32)),
             lambda: um.managed_from(np.arange(8, dtype=np.float32))):
    b = make()
    twice[1, 32](b)  # pending toolkit work: __dlpack__ must order JAX's stream after it
    print(type(b).__name__, b.__dlpack_device__())
    for kw in ({}, {"stream": None}):
        try:
            cap = b.__dlpack__(**kw)
            print("  capsule ok", kw)
        except Exception as e:
            print("  __dlpack__ failed", kw, repr(e))
    try:
        print("  jax ->", jax.dlpack.from_dlpack(b))
    except Exception:
        traceback.print_exc(limit=3)
    try:
        print("  jax(capsule) ->", jax.dlpack.from_dlpack(b.__dlpack__(stream=None)))
    except Exception as e:
        print("  capsule path:", repr(e)[:300])
