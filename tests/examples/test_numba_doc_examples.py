"""numba-cuda's documented examples on umem_numba buffers, bitwise equal to numba's own results (issue #30, item 3).

The examples are numba-cuda's (0.30.4: ``numba/cuda/tests/doc_examples/test_*.py``, the source of
its documentation), with their kernels, launches and reads as numba documents them.  Only the
allocation lines change: ``cuda.to_device(x)`` becomes ``mem.to_device(x)``,
``cuda.device_array(...)`` ``mem.device_array(...)``, ``cuda.device_array_like(a)``
``mem.device_array_like(a)`` and ``create_xoroshiro128p_states(n, seed)``
``mem.create_xoroshiro128p_states(n, seed)``, where ``mem`` is one buffer kind (the examples and
the kinds live in ``umem_numba/_bench/_numba_examples.py``, which ``python -m umem_numba bench e2e``
times too):

=================  ===============================  ==================================  =====================
kind               ``to_device``                    ``device_array``                    ``device_array_like``
=================  ===============================  ==================================  =====================
numba (reference)  ``cuda.to_device``               ``cuda.device_array``               ``cuda.device_array_like``
managed            ``um.managed_from``              ``um.managed_empty``                ``um.managed_like``
device             ``um.device_from``               ``um.device_empty``                 ``um.device_like``
pinned-mapped      ``PinnedBuffer.from_array(x,     ``PinnedBuffer.empty(shape, dtype,  the same, of ``a``'s
                   HostAllocFlags.DEVICEMAP)``      HostAllocFlags.DEVICEMAP)``         shape and dtype
vmm                ``VMMBuffer.from_array``         ``VMMBuffer.empty``                 the same, of ``a``
=================  ===============================  ==================================  =====================

and ``mem.create_xoroshiro128p_states(n, seed)`` is ``mem.device_array(n, xoroshiro128p_dtype)``
then numba's ``init_xoroshiro128p_states(states, seed)`` (what numba's own
``create_xoroshiro128p_states`` does with ``cuda.device_array``).  Each example runs once as
numba documents it and once per kind; every result the example reads must be bitwise equal.

On numba's simulator (CI) the sizes are small (``SIM_SIZES``: the simulator runs a Python thread
per CUDA thread), and three examples run on a GPU only: laplace needs a grid-wide sync across
blocks, which the simulator does not have (its ``forall`` makes one-thread blocks); the simulator
compiles nothing, so it captures no globals as constants; and a global device or VMM buffer
read inside a simulated kernel would be a DMA copy inside device work.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest

from umem_numba._bench import _numba_examples as ex
from umem_numba._driver import _sim

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),
    # numba's RNG initialiser on its simulator: object-mode fallbacks and numpy's uint64 wrap-around warnings
    pytest.mark.filterwarnings("ignore::numba.core.errors.NumbaWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered in scalar:RuntimeWarning"),
]

SIM = _sim.active()
KINDS = ("managed", "device", "pinned-mapped", "vmm")

#: The examples' sizes on the simulator (keyword arguments); on a GPU, numba's documented ones.
SIM_SIZES: dict[str, dict[str, Any]] = {
    "vecadd": {"N": 2_000},
    "reduction": {"n": 256},
    "montecarlo": {"nsamps": 500},
    "random_3d": {"shape": (7, 9, 5), "block": (2, 2, 2), "grid": (2, 2, 2)},
}


def _run(example: Callable[..., dict[str, Any]], mem: ex.Mem) -> dict[str, Any]:
    return example(mem, **(SIM_SIZES.get(example.__name__, {}) if SIM else {}))


def _check(example: Callable[..., dict[str, Any]], kind: str) -> None:
    ex.compare_results(_run(example, ex.MEMS[kind]), _reference(example), f"{example.__name__} on {kind} memory")


@functools.cache
def _reference(example: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """The example as numba documents it (numba's own arrays), once per process."""
    return _run(example, ex.NUMBA)


@pytest.mark.parametrize("kind", KINDS)
def test_vecadd(kind):
    _check(ex.vecadd, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_matmul(kind):
    _check(ex.matmul, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_reduction(kind):
    _check(ex.reduction, kind)


@pytest.mark.real_gpu(
    "a grid-wide sync across blocks (cuda.cg.this_grid().sync()): numba's simulator syncs one block only, and "
    "its forall launches one-thread blocks"
)
@pytest.mark.parametrize("kind", KINDS)
def test_laplace(kind):
    _check(ex.laplace, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_montecarlo(kind):
    _check(ex.montecarlo, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_random_3d(kind):
    _check(ex.random_3d, kind)


@pytest.mark.real_gpu(
    "globals captured as constants when the kernel compiles: numba's simulator compiles nothing (its kernels read "
    "the Python globals when they run, and the simulated driver runs them late)"
)
@pytest.mark.parametrize("kind", KINDS)
def test_globals_constant_capture(kind):
    _check(ex.globals_constant_capture, kind)


_ELEMENT_READ_IN_A_KERNEL = pytest.mark.real_gpu(
    "a global device array read in a kernel by its captured address: numba's simulator runs the kernel in Python, "
    "where the global is the buffer itself, and an element read of device or VMM memory is a DMA copy, which the "
    "simulated driver cannot wait for inside device work"
)


@pytest.mark.parametrize(
    "kind",
    [k if k in ("managed", "pinned-mapped") else pytest.param(k, marks=_ELEMENT_READ_IN_A_KERNEL) for k in KINDS],
)
def test_globals_device_array_capture(kind):
    _check(ex.globals_device_array_capture, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_cpu_gpu_compat(kind):
    _check(ex.cpu_gpu_compat, kind)
