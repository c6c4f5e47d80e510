"""The one release path: wait, free, count, report a failed free, stay quiet at exit (no GPU needed)."""

from __future__ import annotations

import gc
import warnings

import pytest

import umem_numba as um
from umem_numba import _driver
from umem_numba._errors import CudaError
from umem_numba._memory import _lifetime, _stats
from umem_numba._memory._lifetime import Allocation, Memory, Transaction
from umem_numba._memory._tracker import Tracker


class _FailingMemory(Memory):
    kind = "managed"

    def __init__(self, exc: BaseException, nbytes: int = 4096) -> None:
        self.exc = exc
        self.nbytes = nbytes
        self.freed = 0

    def free(self, tracker: Tracker) -> None:
        self.freed += 1
        raise self.exc


def _allocation(memory: Memory) -> Allocation:
    return Allocation("managed", memory, 0x1000, 0, Tracker(0))


def test_a_failed_free_warns_at_the_callers_line_and_still_counts():
    before = _stats.stats()["managed"].live_count
    memory = _FailingMemory(CudaError("cuMemFree", 1, "CUDA_ERROR_INVALID_VALUE"))
    alloc = _allocation(memory)
    assert _stats.stats()["managed"].live_count == before + 1
    with pytest.warns(RuntimeWarning, match="releasing managed memory.*CUDA_ERROR_INVALID_VALUE") as record:
        alloc.close()
    assert memory.freed == 1 and alloc.released
    assert record[0].filename == __file__, record[0].filename  # not weakref.py
    assert _stats.stats()["managed"].live_count == before


def test_a_non_cuda_exception_from_free_does_not_escape_the_finalizer():
    memory = _FailingMemory(ValueError("binding refused the handle"))
    alloc = _allocation(memory)
    with pytest.warns(RuntimeWarning, match="binding refused the handle") as record:
        del alloc
        gc.collect()
    assert memory.freed == 1
    assert not record[0].filename.endswith("weakref.py")
    assert record[0].filename in (__file__, _lifetime.__file__)


def test_quiet_when_the_context_is_gone_or_the_interpreter_exits(monkeypatch):
    gone = _FailingMemory(CudaError("cuMemFree", 4, "CUDA_ERROR_DEINITIALIZED"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _allocation(gone).close()
        monkeypatch.setattr(_driver, "shutting_down", lambda: True)
        late = _FailingMemory(CudaError("cuMemFree", 1, "CUDA_ERROR_INVALID_VALUE"))
        _allocation(late).close()
    assert gone.freed == 1 and late.freed == 1


def test_host_export_is_refused_after_close():
    memory = _FailingMemory(CudaError("cuMemFree", 4, "CUDA_ERROR_DEINITIALIZED"))
    alloc = _allocation(memory)
    alloc.close()
    with pytest.raises(um.BufferClosedError):
        alloc.add_export()


def test_transaction_undoes_in_reverse_unless_committed():
    done: list[str] = []
    with pytest.raises(RuntimeError), Transaction() as tx:
        tx.append(done.append, "free a")
        tx.append(done.append, "unmap b")
        raise RuntimeError("third step failed")
    assert done == ["unmap b", "free a"]
    done.clear()
    with Transaction() as tx:
        tx.append(done.append, "free a")
        tx.commit()
    assert done == []


@pytest.mark.parametrize("cls", [um.ManagedBuffer, um.PinnedBuffer, um.VMMBuffer])
def test_buffers_are_not_called_directly(cls):
    with pytest.raises(TypeError, match=rf"{cls.__name__}\(\) cannot be called directly; use {cls.__name__}.empty"):
        cls((4,), "f4")


def test_finalizers_stay_silent_at_interpreter_exit():
    """Memory still alive at exit is left to the driver: no free runs during shutdown."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        from umem_numba._memory._lifetime import finalizer

        class Held:
            pass

        held = Held()
        f = finalizer(held, print, "FREED")
        assert f.alive and not f.atexit
        gone = Held()
        finalizer(gone, print, "COLLECTED")
        del gone  # collected before exit: its finalizer runs as usual
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["COLLECTED"]


def test_allocations_alive_at_exit_are_left_to_the_driver():
    """An Allocation released by collection frees once; one still alive at exit frees nothing."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        from umem_numba._memory._lifetime import Allocation, Memory
        from umem_numba._memory._tracker import Tracker

        class Loud(Memory):
            kind = "managed"
            nbytes = 4096

            def __init__(self, name):
                self.name = name

            def free(self, tracker):
                print("FREED", self.name)

        held = Allocation("managed", Loud("held"), 0x1000, 0, Tracker(0))
        gone = Allocation("managed", Loud("gone"), 0x2000, 0, Tracker(0))
        del gone  # collected before exit: released as usual
        closed = Allocation("managed", Loud("closed"), 0x3000, 0, Tracker(0))
        closed.close()
        closed.close()  # once only
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["FREED gone", "FREED closed"]
    assert out.stderr == ""
