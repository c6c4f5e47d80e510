"""Where a coherent launch spends its time (diagnostic, not a benchmark)."""
import cProfile, pstats, threading, time
import numpy as np
from numba import cuda
from numba.cuda.core import config as nbconfig
import umem_numba as um
from umem_numba import _driver, _events

nbconfig.CUDA_LOW_OCCUPANCY_WARNINGS = False
drv = _driver.api().drv
s = cuda.stream()
h = int(s.handle)

def per_call(fn, n=100_000):
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6

ev = drv.cuEventCreate(2)[1]
lock = threading.Lock()
print("cuStreamIsCapturing  %.3f us" % per_call(lambda: drv.cuStreamIsCapturing(h)))
print("cuStreamGetId        %.3f us" % per_call(lambda: drv.cuStreamGetId(h)))
print("cuEventRecord        %.3f us" % per_call(lambda: drv.cuEventRecord(ev, h)))
print("cuEventQuery         %.3f us" % per_call(lambda: drv.cuEventQuery(ev)))
print("cuCtxGetDevice       %.3f us" % per_call(lambda: drv.cuCtxGetDevice()))
print("events.record        %.3f us" % per_call(lambda: _events.record(h, 0, 7)))
print("lock acquire+release %.3f us" % per_call(lambda: (lock.acquire(), lock.release())))

@cuda.jit
def bump(a):
    if cuda.grid(1) == 0:
        a[0] += 1.0

buf = um.ManagedBuffer.from_array(np.ones(1024, np.float32))
dev = cuda.to_device(np.ones(1024, np.float32))
kc = um.coherent(bump)
for _ in range(100):
    kc[1, 32, s](buf); bump[1, 32, s](dev)
cuda.synchronize()
print("bare DeviceNDArray   %.3f us" % per_call(lambda: bump[1, 32, s](dev), 20000))
cuda.synchronize()
buf.synchronize()
print("bare ManagedBuffer   %.3f us" % per_call(lambda: bump[1, 32, s](buf), 20000))
cuda.synchronize(); buf.synchronize()
print("coherent launch      %.3f us" % per_call(lambda: kc[1, 32, s](buf), 20000))
cfg = kc[1, 32, s]
print("coherent, cached cfg %.3f us" % per_call(lambda: cfg(buf), 20000))
nb_cfg = bump[1, 32, s]
print("numba cached cfg dev %.3f us" % per_call(lambda: nb_cfg(dev), 20000))
cuda.synchronize()
pr = cProfile.Profile()
pr.enable()
for _ in range(20000):
    cfg(buf)
pr.disable()
cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(18)

# Step by step, the same work as _ConfiguredLaunch.__call__, timed without a profiler.
from umem_numba import _launch, _tracker
pc = time.perf_counter_ns
acc = [0] * 7
info, configured = cfg._info, cfg._configured
for _ in range(20000):
    t0 = pc()
    uses = _launch._uses(info, (buf,))
    t1 = pc()
    _driver.is_capturing(h)
    t2 = pc()
    key = cfg._key
    begun = [(t, w, t.begin_use(key, w, "launch")[1]) for t, w in uses]
    t3 = pc()
    _tracker._launching.current = tuple(t for t, _ in uses)
    configured(buf)
    _tracker._launching.current = ()
    t4 = pc()
    rec = _events.record(h, _driver.current_device(), key)
    t5 = pc()
    for t, w, covered in begun:
        t.end_use(key, rec, w, covered)
    t6 = pc()
    for i, (a, b) in enumerate(((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t5, t6), (t0, t6))):
        acc[i] += b - a
names = ["_uses", "is_capturing", "begin_use", "numba launch", "record", "end_use", "total"]
for n_, v in zip(names, acc):
    print(f"{n_:14s} {v / 20000 / 1000:.3f} us")
cuda.synchronize(); buf.synchronize()
print("bare ManagedBuffer again %.3f us" % per_call(lambda: nb_cfg(buf), 20000))
