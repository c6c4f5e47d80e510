"""Launch overhead: what a kernel argument costs per launch, and what coherence adds.

Measured in one process, interleaved round by round (the machine is shared
and noisy), best of several batches of synchronous-free launches of a trivial
one-block kernel:

* numba ``DeviceNDArray`` (the reference), numba ``managed_array``,
  a plain ``__cuda_array_interface__`` object (what a naive wrapper costs);
* ``ManagedBuffer`` launched as is (numba sees it as device memory);
* ``ManagedBuffer`` through ``umem_numba.coherent`` (orders the stream after
  conflicting work on other streams, records one CUDA event);

each with 1, 2 and 5 buffer arguments.  Then the host-side coherence check
with nothing pending, and ``buf.host``.

Goals: a coherent launch <= 1.10x a bare DeviceNDArray launch of the same
kernel with 1, 2 and 5 arguments; coherence adds < 0.3 µs per extra argument
with nothing pending on other streams; the check with nothing pending < 2 µs;
a bare ManagedBuffer launch <= 1.25x DeviceNDArray.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from ._common import goal_text, print_table, wall_timer_us, write_json


class _PlainCAI:
    """A bare ``__cuda_array_interface__`` holder: the naive way to wrap memory."""

    def __init__(self, arr: Any) -> None:
        self._arr = arr
        self.__cuda_array_interface__ = dict(arr.__cuda_array_interface__, stream=None)


def main(argv: list[str] | None = None) -> int:
    """Run the launch benchmark; see the module docstring."""
    ap = argparse.ArgumentParser(prog="python -m umem_numba bench launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=2000, help="launches per batch (default 2000)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; best is kept (default 5)")
    ap.add_argument("--json", metavar="PATH", help="write results as JSON")
    args = ap.parse_args(argv)
    if args.launches < 1 or args.rounds < 1:
        ap.error("--launches and --rounds must be >= 1")

    from numba import cuda

    import umem_numba as um

    @cuda.jit
    def bump1(a):
        if cuda.grid(1) == 0:
            a[0] += 1.0

    @cuda.jit
    def bump2(a, b):
        if cuda.grid(1) == 0:
            a[0] += b[0]

    @cuda.jit
    def bump5(a, b, c, d, e):
        if cuda.grid(1) == 0:
            a[0] += b[0] + c[0] + d[0] + e[0]

    kernels = {1: bump1, 2: bump2, 5: bump5}
    n = 1024
    devs = [cuda.to_device(np.ones(n, np.float32)) for _ in range(5)]
    bufs = [um.ManagedBuffer.from_array(np.ones(n, np.float32)) for _ in range(5)]
    nb_managed = cuda.managed_array(n, np.float32)
    nb_managed[:] = 1.0
    plain = _PlainCAI(devs[0])
    stream = cuda.stream()

    cases: dict[str, Any] = {
        "numba managed_array (1 arg)": lambda: bump1[1, 32, stream](nb_managed),
        "plain CAI object (1 arg)": lambda: bump1[1, 32, stream](plain),
        "ManagedBuffer, um.launch (1 arg)": lambda: um.launch(bump1, 1, 32, bufs[0], stream=stream),
    }
    for k, kern in kernels.items():
        coh = um.coherent(kern)
        cases[f"DeviceNDArray ({k} args)"] = (lambda kern=kern, k=k: kern[1, 32, stream](*devs[:k]))
        cases[f"ManagedBuffer ({k} args)"] = (lambda kern=kern, k=k: kern[1, 32, stream](*bufs[:k]))
        cases[f"ManagedBuffer, coherent ({k} args)"] = (lambda coh=coh, k=k: coh[1, 32, stream](*bufs[:k]))
    best = {name: float("inf") for name in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            best[name] = min(best[name], wall_timer_us(fn, args.launches, repeat=1))
            for b in bufs:
                b.synchronize()  # a bare launch marks the buffers: settle before the next case

    # Host-side check with nothing pending: the fast path every host access takes.
    buf = bufs[0]
    tracker = buf._coherence_tracker
    assert tracker is not None
    reps = 200_000
    t0 = time.perf_counter()
    for _ in range(reps):
        tracker.before_host_access("bench")
    check_us = (time.perf_counter() - t0) / reps * 1e6
    reps = 20_000
    t0 = time.perf_counter()
    for _ in range(reps):
        buf.host
    host_us = (time.perf_counter() - t0) / reps * 1e6

    rows = []
    for name, us in best.items():
        k = 5 if "5 args" in name else 2 if "2 args" in name else 1
        rows.append((name, f"{us:.2f}", f"{us / best[f'DeviceNDArray ({k} args)']:.2f}x"))
    print(f"launch overhead, {args.launches} launches x {args.rounds} rounds, best batch")
    print_table(rows, ["argument(s)", "µs/launch", "vs DeviceNDArray, same args"])

    def per_arg(kind: str) -> float:
        return (best[f"{kind} (5 args)"] - best[f"{kind} (1 args)"]) / 4

    ordering_per_arg = per_arg("ManagedBuffer, coherent") - per_arg("ManagedBuffer")
    goals = [(f"coherent ManagedBuffer / DeviceNDArray, {k} arg(s)",
              best[f"ManagedBuffer, coherent ({k} args)"] / best[f"DeviceNDArray ({k} args)"], "<= 1.10")
             for k in kernels]
    goals += [
        ("ManagedBuffer / DeviceNDArray, 1 arg", best["ManagedBuffer (1 args)"] / best["DeviceNDArray (1 args)"],
         "<= 1.25"),
        ("coherence per extra argument, µs", ordering_per_arg, "< 0.3"),
        ("host check, nothing pending, µs", check_us, "< 2"),
    ]
    print()
    print_table([(g, f"{v:.2f}", goal, goal_text(v, float(goal.split()[-1]), higher_is_better=False))
                 for g, v, goal in goals], ["figure", "value", "goal", ""])
    print(f"\n`buf.host` (check + numpy view creation): {host_us:.2f} µs")
    write_json(args.json, {"benchmark": "launch", "us_per_launch": best, "host_check_us": check_us,
                           "host_view_us": host_us, "ratios": {g: v for g, v, _ in goals}})
    for b in bufs:
        b.close()
    return 0
