"""Pool benchmark: ``python -m umem_numba bench pool [--json PATH] [--iterations N] [--quick]``.

Allocate and free 1 MiB in a loop, per cycle, best of five batches (host time,
synchronised after each batch), same run for every row; the batches of every row
alternate, round after round, so that a slow spell of a shared machine falls on
all of them alike:

* umem_numba pools as buffers (``ManagedBuffer.empty(pool=...)`` /
  ``DeviceBuffer.empty`` then ``close``), managed and device: goal <= 2 µs per
  cycle (what a program pays; the memory comes back from the pool's free
  lists, see :mod:`umem_numba._memory._pool`);
* the raw interface (``MemoryPool.allocate`` / ``free``: addresses, no
  coherence record, free lists per size and stream like CuPy's pool): goal
  <= 2 µs per cycle, the figure to set beside CuPy's;
* ``cuMemAllocManaged`` + ``cuMemFree`` (the driver, no Python layer above the
  binding), ``ManagedBuffer.empty`` without a pool, numba's ``managed_array``;
* CuPy's managed-memory pool, ``cupy.empty`` and ``torch.empty`` where they
  are importable; the defaults (no ``pool=``) against ``cupy.empty``: goal
  <= 1.2x, a pool buffer <= 1.0x (issue #28).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _driver
from .._errors import CudaUnavailableError, UnsupportedError
from ._common import (
    BenchSkipped,
    command_line,
    device_name,
    goal_row,
    goal_text,
    print_table,
    require_gpu,
    wall_timer_us,
)

_SIZE = 1 << 20
_GOAL_US = 2.0
_CUPY_EMPTY = "cupy.empty (device, CuPy's default pool)"
#: Issue #28: the defaults within 1.2x of cupy.empty, a pool buffer at most cupy.empty's cost.
_RATIO_GOALS = (
    ("ManagedBuffer.empty + close (no pool)", 1.2),
    ("DeviceBuffer.empty + close (no pool)", 1.2),
    ("umem managed pool (ManagedBuffer.empty + close)", 1.0),
    ("umem device pool (DeviceBuffer.empty + close)", 1.0),
)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m umem_numba bench pool",
        description="Allocate+free 1 MiB: umem pools vs cuMemAllocManaged vs CuPy's pool.",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--iterations", type=int, default=20_000, help="cycles per batch (default 20000)")
    p.add_argument("--quick", action="store_true", help="2000 cycles per batch")
    args = p.parse_args(argv)
    if args.iterations < 1:
        p.error("--iterations must be >= 1")
    if args.quick:
        args.iterations = 2000
    return args


#: Rounds of :func:`_interleaved`: each case's figure is its best batch over these.
_ROUNDS = 5


def _interleaved(cases: dict[str, Callable[[], Any]], n: int) -> dict[str, float]:
    """Best host µs per cycle of each case: :data:`_ROUNDS` rounds, each running one batch of ``n`` cycles
    of every case in turn (synchronised after each batch), so that a slow spell of a shared machine
    falls on every case alike rather than on whichever ran then."""
    best = {name: float("inf") for name in cases}
    for _ in range(_ROUNDS):
        for name, fn in cases.items():
            best[name] = min(best[name], wall_timer_us(fn, n, repeat=1))
    return best


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """The benchmark protocol's ``run`` (see :mod:`umem_numba._bench._common`)."""
    return _run(_parse(argv))


def main(argv: list[str] | None = None) -> int:
    """The benchmark protocol's ``main``: ``python -m umem_numba bench NAME``."""
    return command_line("pool", _parse, _run, argv)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    require_gpu()
    try:
        _driver.api()
    except CudaUnavailableError as exc:
        raise BenchSkipped(f"no usable GPU: {exc}") from exc
    from numba import cuda

    import umem_numba as um

    _driver.ensure_context()
    s = cuda.stream()
    drv = _driver.api().drv
    n = args.iterations
    cases: list[tuple[str, Callable[[], Any] | str, bool]] = []

    pools: dict[str, Any] = {}
    for kind in ("managed", "device"):
        try:
            pools[kind] = um.MemoryPool(kind)
        except UnsupportedError as exc:
            pools[kind] = str(exc)

    def raw(pool: Any) -> Callable[[], None]:
        alloc, free = pool.allocate, pool.free

        def cycle() -> None:
            free(alloc(_SIZE, s), s)  # the stream object: its id is known while it lives

        return cycle

    def managed_buf(pool: Any) -> Callable[[], None]:
        return lambda: um.ManagedBuffer.empty(_SIZE, np.uint8, pool=pool, stream=s).close()

    def device_buf(pool: Any) -> Callable[[], None]:
        return lambda: um.DeviceBuffer.empty(_SIZE, np.uint8, pool=pool, stream=s).close()

    for kind, make_buf in (("managed", managed_buf), ("device", device_buf)):
        pool = pools[kind]
        if isinstance(pool, str):
            cases.append((f"umem {kind} pool (addresses)", pool, True))
            cases.append((f"umem {kind} pool (buffer)", pool, True))
        else:
            cases.append((f"umem {kind} pool (allocate + free: addresses)", raw(pool), True))
            cases.append(
                (
                    f"umem {kind} pool ({'ManagedBuffer' if kind == 'managed' else 'DeviceBuffer'}.empty + close)",
                    make_buf(pool),
                    True,
                )
            )

    def driver_managed() -> None:
        _err, ptr = drv.cuMemAllocManaged(_SIZE, 1)
        drv.cuMemFree(ptr)

    cases.append(("cuMemAllocManaged + cuMemFree", driver_managed, False))
    cases.append(
        ("ManagedBuffer.empty + close (no pool)", lambda: um.ManagedBuffer.empty(_SIZE, np.uint8).close(), False)
    )
    cases.append(
        ("DeviceBuffer.empty + close (no pool)", lambda: um.DeviceBuffer.empty(_SIZE, np.uint8).close(), False)
    )
    cases.append(("numba cuda.managed_array", lambda: cuda.managed_array(_SIZE, np.uint8), False))
    try:
        import cupy

        cases.append((_CUPY_EMPTY, lambda: cupy.empty(_SIZE, np.uint8), False))  # freed when dropped
    except Exception as exc:  # not installed, or no CUDA for it
        cases.append((_CUPY_EMPTY, f"not importable: {type(exc).__name__}: {exc}", False))
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
        cases.append(("torch.empty (cuda)", lambda: torch.empty(_SIZE, dtype=torch.uint8, device="cuda"), False))
    except Exception as exc:
        cases.append(("torch.empty (cuda)", f"not importable: {type(exc).__name__}: {exc}", False))
    try:
        import cupy

        cp_pool = cupy.cuda.MemoryPool(cupy.cuda.malloc_managed)

        def cupy_cycle() -> None:
            cp_pool.malloc(_SIZE)  # back to the pool when the pointer is dropped

        cases.append(("CuPy managed MemoryPool", cupy_cycle, False))
    except Exception as exc:  # not installed, or no CUDA for it
        cases.append(("CuPy managed MemoryPool", f"not importable: {type(exc).__name__}: {exc}", False))

    rows, results = [], {"device": device_name(), "bytes": _SIZE, "iterations": n, "goal_us": _GOAL_US, "cases": {}}
    timed = _interleaved({name: fn for name, fn, _ in cases if not isinstance(fn, str)}, n)
    for name, fn, has_goal in cases:
        if isinstance(fn, str):
            rows.append([name, "-", fn])
            results["cases"][name] = {"skipped": fn}
            continue
        us = timed[name]
        verdict = goal_text(us, _GOAL_US, higher_is_better=False) if has_goal else ""
        rows.append([name, f"{us:.2f}", verdict])
        results["cases"][name] = {"us_per_cycle": us, "goal": has_goal, "met": verdict == "met" if has_goal else None}
    s.synchronize()
    for pool in pools.values():
        if not isinstance(pool, str):
            st = pool.statistics()
            results["cases"].setdefault("pool_stats", {})[pool.kind] = st.__dict__
            pool.close()
    print(
        f"bench pool on {results['device']}: allocate + free {_SIZE >> 20} MiB, "
        f"best of {_ROUNDS} interleaved batches of {n}"
    )
    print_table(rows, ["allocator", "µs per cycle", f"goal <= {_GOAL_US} µs"])
    results["figures"] = [
        goal_row(
            f"allocate + free 1 MiB: {name}",
            c["us_per_cycle"],
            _GOAL_US if c["goal"] else None,
            higher_is_better=False,
            unit="µs",
        )
        for name, c in results["cases"].items()
        if isinstance(c, dict) and "us_per_cycle" in c
    ]
    cupy_us = results["cases"].get(_CUPY_EMPTY, {}).get("us_per_cycle")
    if cupy_us:
        for name, goal in _RATIO_GOALS:
            us = results["cases"].get(name, {}).get("us_per_cycle")
            if us:
                results["figures"].append(goal_row(f"{name} / cupy.empty", us / cupy_us, goal, higher_is_better=False))
        print_table(
            [
                [f["name"], f"{f['value']:.3g}x", goal_text(f["value"], f["goal"], higher_is_better=False)]
                for f in results["figures"]
                if f["name"].endswith("/ cupy.empty")
            ],
            ["same run, against cupy.empty + del", "ratio", "goal"],
        )
    return results
