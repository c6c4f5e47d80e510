"""Helpers the tests share (imported as ``from support.helpers import ...``; fixtures live in conftest)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable

import numpy as np

__all__ = [
    "ORDERING_TRIALS",
    "TESTS_DIR",
    "random_array",
    "run_with_plugin",
    "sleeping",
    "test_seed",
    "while_threads_run",
    "worker_thread",
]

#: The tests/ folder: a child interpreter puts it on sys.path to import ``support.helpers``.
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_seed() -> int:
    """``UMEM_TEST_SEED`` if set, else a fresh random seed."""
    env = os.environ.get("UMEM_TEST_SEED")
    return int(env) if env else int.from_bytes(os.urandom(4), "little")


test_seed.__test__ = False  # type: ignore[attr-defined]  # not a test, despite its name


def random_array(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Random, never-zero data of any numeric dtype."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return (rng.random(shape) + 0.5).astype(dtype)
    if dtype.kind in "iu":
        return rng.integers(1, 100, size=shape).astype(dtype)
    if dtype.kind == "c":
        return (rng.random(shape) + 0.5 + 1j * rng.random(shape)).astype(dtype)
    raise TypeError(dtype)


def run_with_plugin(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter with umem_numba as numba's memory manager.

    numba reads ``NUMBA_CUDA_MEMORY_MANAGER`` once, at import, so the plugin needs a process of
    its own.  ``UMEM_TESTS_DIR`` names this folder (``sys.path.insert(0, ...)`` there reaches
    these helpers); ``env`` adds or overrides variables.  The child must exit 0 and print a JSON
    object on its last line, which is returned.
    """
    full = dict(os.environ, NUMBA_CUDA_MEMORY_MANAGER="umem_numba", UMEM_TESTS_DIR=TESTS_DIR)
    full.update(env)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        check=False,
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


_workers: dict[str, concurrent.futures.ThreadPoolExecutor] = {}


def worker_thread(name: str) -> concurrent.futures.ThreadPoolExecutor:
    """A named worker thread that lives until the interpreter exits.

    Its per-thread default stream (handle 2) therefore stays the same stream from one call to
    the next; a thread that ends while its stream has queued work is a trap of its own (see the
    device README's known traps).
    """
    ex = _workers.get(name)
    if ex is None:
        ex = _workers[name] = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"umem-{name}")
    return ex


def while_threads_run(workers: list[Callable[[], None]], background: Callable[[], None]) -> None:
    """Run each of ``workers`` in a thread of its own, and ``background()`` over and over in one more
    thread until they have all returned (a reader, a drain: what races the workers)."""
    stop = threading.Event()

    def repeat() -> None:
        while not stop.is_set():
            background()

    side = threading.Thread(target=repeat)
    side.start()
    threads = [threading.Thread(target=w) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    side.join()


#: Trials of every ordering test: a missing wait shows in some of them, not necessarily all.
ORDERING_TRIALS = 20


class _SleepKernels:
    """Kernels that sleep on the device first, so that a missing wait shows as a wrong value.

    ``cuda.nanosleep(1_000_000)`` sleeps about a millisecond of device time per call; ``ms``
    is the number of calls.  Compiled on first use (importing this module compiles nothing).
    """

    def __init__(self) -> None:
        self._compiled: dict[str, object] = {}

    def _get(self, name: str):
        k = self._compiled.get(name)
        if k is None:
            from numba import cuda

            if name == "read":

                def sleep_then_copy(src, out, ms):
                    for _ in range(ms):
                        cuda.nanosleep(1_000_000)
                    i = cuda.grid(1)
                    if i < src.size:
                        out[i] = src[i]

                k = cuda.jit(sleep_then_copy)
            elif name == "fill":

                def sleep_then_fill(a, value, ms):
                    for _ in range(ms):
                        cuda.nanosleep(1_000_000)
                    i = cuda.grid(1)
                    if i < a.size:
                        a[i] = value

                k = cuda.jit(sleep_then_fill)
            else:
                raise KeyError(name)
            self._compiled[name] = k
        return k

    @property
    def copy(self):
        """``copy[grid, block, stream](src, out, ms)``: sleep ``ms`` ms, then ``out[i] = src[i]`` (flat arrays)."""
        return self._get("read")

    @property
    def fill(self):
        """``fill[grid, block, stream](a, value, ms)``: sleep ``ms`` ms, then ``a[i] = value`` (a flat array)."""
        return self._get("fill")


#: Shared by the ordering tests: ``sleeping.copy`` and ``sleeping.fill`` (plain numba kernels;
#: wrap them in ``umem_numba.coherent`` for tracked launches).
sleeping = _SleepKernels()
