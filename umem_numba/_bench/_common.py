"""Small helpers the benchmarks share: timing with CUDA events, tables, JSON."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable, Iterable


def cuda_timer_ms(fn: Callable[[], Any], repeat: int = 5, warmup: int = 1, stream: Any = 0) -> float:
    """Best wall time of ``fn`` in ms between CUDA events recorded on ``stream``.

    Warms up first; events bracket each call and the elapsed time is read
    after the end event completes, so host-side queuing is included only as
    far as it delays the GPU.
    """
    from numba import cuda

    for _ in range(warmup):
        fn()
    cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        start, end = cuda.event(), cuda.event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        best = min(best, cuda.event_elapsed_time(start, end))
    return best


def wall_timer_us(fn: Callable[[], Any], n: int, repeat: int = 3) -> float:
    """Best host time per call in µs over ``repeat`` batches of ``n`` calls (synchronised after each batch)."""
    from numba import cuda

    fn()
    cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        cuda.synchronize()
        best = min(best, (t1 - t0) / n * 1e6)
    return best


def print_table(rows: Iterable[Iterable[Any]], header: Iterable[str], file: Any = None) -> None:
    """Print rows as an aligned text table."""
    file = file or sys.stdout
    rows = [[str(c) for c in r] for r in rows]
    header = [str(h) for h in header]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)), file=file)


def goal_text(value: float, goal: float, higher_is_better: bool = True) -> str:
    """'met' or 'MISSED' for a ratio against its goal."""
    ok = value >= goal if higher_is_better else value <= goal
    return "met" if ok else "MISSED"


def write_json(path: str | None, data: dict) -> None:
    """Write results as JSON when a path was given."""
    if path:
        with open(path, "w") as fh:
            json.dump(data, fh, indent=2, default=str)
        print(f"wrote {path}")


def device_name() -> str:
    from numba import cuda
    return cuda.get_current_device().name.decode() if isinstance(cuda.get_current_device().name, bytes) \
        else str(cuda.get_current_device().name)
