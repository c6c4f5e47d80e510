import numpy as np
from numba import cuda
@cuda.jit
def k(a, s):
    i, j = cuda.grid(2)
    if i < a.shape[0] and j < a.shape[1]:
        a[i, j] *= s
t = cuda.managed_array((32, 32), np.float32)
try:
    k[(4, 4), (16, 16)](t[:, 1:-1], 2.0); cuda.synchronize(); print("DIAG no error")
except Exception as e:
    print("DIAG", type(e).__module__, type(e).__name__, str(e)[:300])
