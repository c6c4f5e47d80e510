"""``python -m umem_numba bench e2e``: its options, and its timing code on real kernels.

The benchmark itself needs a GPU (under the simulator it is skipped with the shared reason: see
``test_bench_report.py``); the function it times with, ``time_example``, runs here on numba's
documented examples at small sizes through the same memories (``cases()``: numba's idiom,
managed, device, and a new pool per run), so that what the GPU run executes is executed in CI too.
"""

from __future__ import annotations

import functools
import math
import re

import numpy as np
import pytest

from umem_numba.__main__ import main
from umem_numba._bench import _numba_examples as ex
from umem_numba._bench import e2e

pytestmark = [
    # numba's RNG initialiser on its simulator: object-mode fallbacks and numpy's uint64 wrap-around warnings
    pytest.mark.filterwarnings("ignore::numba.core.errors.NumbaWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered in scalar:RuntimeWarning"),
]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--runs", "4"], "--runs must be >= 5"),
        (["--only", "vecadd,nbody"], "unknown example(s) nbody"),
        (["--only", ","], "unknown example(s) (none given)"),
    ],
)
def test_bad_options_are_refused_before_any_work(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "e2e", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_every_example_the_issue_names_is_timed():
    timed = {function for function, _, _ in e2e.SIZES.values()}
    assert timed >= {"vecadd", "matmul", "laplace", "montecarlo", "random_3d"}
    assert all(function in ex.EXAMPLES for function in timed)


# Small sizes for the simulator (a Python thread per CUDA thread); laplace needs a grid-wide
# sync the simulator does not have (test_numba_doc_examples.py says so).
_SMALL = {
    "vecadd": {"N": 300},
    "matmul": {"n": 4, "nonsquare": (3, 5, 2)},
    "montecarlo": {"nsamps": 64},
    "random_3d": {"shape": (5, 6, 7), "block": (2, 2, 2), "grid": (2, 2, 2)},
}


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(_SMALL))
def test_time_example_times_every_memory_after_checking_it(name):
    memories, missing = e2e.cases()
    assert next(iter(memories)) == e2e.NUMBA_IDIOM
    assert set(memories) | set(missing) == set(e2e.CASE_NAMES)
    runs = 2
    times = e2e.time_example(name, functools.partial(ex.EXAMPLES[name], **_SMALL[name]), memories, runs)
    assert list(times) == list(memories)
    for memory, ms in times.items():
        assert len(ms) == runs and all(math.isfinite(t) and t > 0 for t in ms), (memory, ms)


@pytest.mark.gpu
def test_time_example_stops_on_a_result_that_differs_from_numbas(rng):
    memories, _ = e2e.cases()
    wrong_at = int(rng.integers(0, 300))

    def vecadd_wrong_off_numba(mem):
        results = ex.vecadd(mem, N=300)
        if mem is not ex.NUMBA:
            results["launch"][wrong_at] += 1.0
        return results

    where = rf"bench e2e, vecadd on {re.escape(e2e.DEFAULT)}, launch: .* element {wrong_at} "
    with pytest.raises(AssertionError, match=where):
        e2e.time_example("vecadd", vecadd_wrong_off_numba, memories, 1)


@pytest.mark.gpu
def test_a_pool_case_gives_a_new_pool_per_run_and_closes_it():
    memories, missing = e2e.cases()
    if "umem device pool=" in missing:
        pytest.skip(missing["umem device pool="])
    seen = []
    for _ in range(2):
        with memories["umem device pool="]() as mem:
            buf = mem.device_array(16, dtype=np.float32)
            pool = mem.device_array.keywords["pool"]
            assert not pool.closed
            seen.append(pool)
            del buf
    assert seen[0] is not seen[1]
    assert all(pool.closed for pool in seen)


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_rounds_rotate_which_memory_runs_first_and_short_examples_run_more_rounds():
    cases, _ = e2e.cases()
    calls = []

    def noting(name, case):
        def run_case():
            calls.append(name)
            return case()

        return run_case

    memories = {name: noting(name, case) for name, case in cases.items()}
    names, n = list(memories), len(memories)
    example = functools.partial(ex.vecadd, N=300)
    # min_timed_ms out of reach: max_runs rounds, after the warm-up's one run each in the table's order
    times = e2e.time_example("vecadd", example, memories, 2, min_timed_ms=1e9, max_runs=n + 1)
    assert [len(ms) for ms in times.values()] == [n + 1] * n
    assert calls[:n] == names
    rounds = [calls[n + r * n : n + (r + 1) * n] for r in range(n + 1)]
    assert rounds == [names[r % n :] + names[: r % n] for r in range(n + 1)]

    calls.clear()  # reached at once: the fewest rounds
    times = e2e.time_example("vecadd", example, memories, 2, min_timed_ms=0.0, max_runs=40)
    assert [len(ms) for ms in times.values()] == [2] * n
    assert len(calls) == 3 * n
