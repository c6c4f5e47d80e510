"""numba internals in one place: ``umem_numba._numba_compat`` is the only module that reaches them.

* No other module of umem_numba (nor of the kernels and examples) imports a
  private numba module or reaches one through ``numba.``/``cuda.`` attributes
  (import-linter cannot say it: its forbidden contracts take only whole external
  packages, ``numba``, not ``numba.cuda.cudadrv``).
* Each guard answers a missing internal with :class:`NumbaInternalsError` (an
  ``UnsupportedError``) naming the feature, what is missing and the numba-cuda
  versions that have it, instead of an ``AttributeError`` deep inside; optional
  fast paths fall back to numba's own launch.

docs/concepts/numba-internals.md maps each internal to numba-cuda-mlir.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from support.helpers import random_array

import umem_numba as um
from umem_numba import _numba_compat
from umem_numba._driver import _sim
from umem_numba._numba_compat import NumbaInternalsError

ROOT = Path(__file__).resolve().parents[2]
COMPAT = ROOT / "umem_numba" / "_numba_compat.py"

#: numba's public modules: what its documentation tells users to import.
PUBLIC = frozenset(
    {
        "numba",
        "numba.types",
        "numba.config",
        "numba.cuda",
        "numba.cuda.cg",
        "numba.cuda.fp16",
        "numba.cuda.bf16",
        "numba.cuda.libdevice",
        "numba.cuda.random",
        "numba.cuda.types",
        "numba.cuda.vector_types",
    }
)

#: The kernels' one use of numba's extension API: a device intrinsic's LLVM code generation
#: (kernels/stencil3d.py's vector loads). The kernels build on umem_numba's public API only, so
#: they cannot go through the compat module; docs/concepts/numba-internals.md lists it.
ALLOWED = frozenset(
    {
        ("kernels/stencil3d.py", "numba.cuda.cgutils"),
        ("kernels/stencil3d.py", "numba.cuda.extending"),
    }
)


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError, AttributeError):
        return False


def _private(name: str) -> bool:
    """Whether ``name`` is a numba module outside numba's public ones."""
    return (name == "numba" or name.startswith("numba.")) and name not in PUBLIC


def _violations(path: Path) -> list[str]:
    """Every private numba module ``path`` imports or reaches through an attribute of numba or numba.cuda."""
    rel = path.relative_to(ROOT).as_posix()
    tree = ast.parse(path.read_text(), str(path))
    aliases: dict[str, str] = {}  # local name -> "numba" / "numba.cuda"
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _private(a.name):
                    found.append((node.lineno, a.name))
                if a.name in ("numba", "numba.cuda"):
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "numba"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            module = node.module
            if _private(module):
                found.append((node.lineno, module))
            elif module in ("numba", "numba.cuda"):
                for a in node.names:
                    full = f"{module}.{a.name}"
                    if full in ("numba.cuda",):
                        aliases[a.asname or a.name] = full
                    elif _private(full) and _is_module(full):
                        found.append((node.lineno, full))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            full = f"{aliases[node.value.id]}.{node.attr}"
            if _private(full) and _is_module(full):
                found.append((node.lineno, full))
    return [f"{rel}:{line}: {name}" for line, name in sorted(set(found)) if (rel, name) not in ALLOWED]


def _sources() -> list[Path]:
    files = [p for folder in ("umem_numba", "kernels", "examples") for p in sorted((ROOT / folder).rglob("*.py"))]
    return [p for p in files if p != COMPAT]


def test_only_the_compat_module_reaches_numba_internals():
    found = [v for path in _sources() for v in _violations(path)]
    assert not found, "private numba modules outside umem_numba/_numba_compat.py:\n" + "\n".join(found)


def test_the_scan_sees_each_way_of_reaching_an_internal(tmp_path, monkeypatch):
    """The scan finds an import, a from-import of a submodule, and an attribute path, aliased or not."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    probe = tmp_path / "probe.py"
    probe.write_text(
        textwrap.dedent("""
        import numba.cuda.cudadrv.driver
        from numba.core import types
        from numba.cuda import cgutils, jit
        from numba import cuda as nbcuda, config, uint64
        import numba
        x = nbcuda.simulator
        y = numba.np
        z = nbcuda.libdevice
        """)
    )
    found = {v.split(": ", 1)[1] for v in _violations(probe)}
    assert found == {
        "numba.cuda.cudadrv.driver",
        "numba.core",
        "numba.cuda.cgutils",
        "numba.cuda.simulator",
        "numba.np",
    }


def test_the_compat_module_is_a_layer_of_its_own():
    """pyproject's layer contract names it (below _driver), and the kernels may not import it."""
    text = (ROOT / "pyproject.toml").read_text()
    assert '"_driver",\n    "_numba_compat",\n    "_errors | _checks",' in text
    assert '"umem_numba._numba_compat",' in text


# ---------------------------------------------------------------------------
# Guards: a missing internal gives the clear error


def _assert_names(err: pytest.ExceptionInfo[NumbaInternalsError], *parts: str) -> None:
    msg = str(err.value)
    assert isinstance(err.value, um.UnsupportedError)
    for part in (*parts, "numba-cuda", "docs/concepts/numba-internals.md"):
        assert part in msg, f"{part!r} not in {msg!r}"


def test_types_guard_names_the_missing_numba_type(monkeypatch):
    import numba.core.types as nbtypes

    assert _numba_compat.array_type(np.dtype(np.float32), 2, "C") == nbtypes.Array(nbtypes.float32, 2, "C")
    monkeypatch.setattr(_numba_compat, "_types", None)
    monkeypatch.delattr(nbtypes, "Array")
    with pytest.raises(NumbaInternalsError) as err:
        _numba_compat.array_type(np.dtype(np.float32), 2, "C")
    _assert_names(err, "numba.core.types.Array", "numba typing", ">= 0.60")
    assert _numba_compat.is_scalar_type(nbtypes.float32) is False  # a cast is not known: counts as a write


def test_direct_launch_guard_names_the_missing_kernel_attribute():
    kernel = SimpleNamespace(bind=lambda: None, debug=False, cooperative=False, launch_config_sensitive=False)
    with pytest.raises(NumbaInternalsError) as err:
        _numba_compat.kernel_function_handle(kernel)
    _assert_names(err, "numba's _Kernel._codelibrary", "direct kernel launch", ">= 0.22, < 0.31")
    dispatcher = SimpleNamespace(targetoptions={})
    assert not _numba_compat.direct_launch_allowed(dispatcher, kernel)  # numba launches it instead
    kernel._codelibrary = SimpleNamespace(get_cufunc=lambda: SimpleNamespace(handle=0x1234))
    assert _numba_compat.direct_launch_allowed(dispatcher, kernel)
    assert _numba_compat.kernel_function_handle(kernel) == 0x1234
    # numba-cuda below 0.30 cannot say whether a kernel is launch-configuration sensitive: numba launches
    del kernel.launch_config_sensitive
    assert not _numba_compat.direct_launch_allowed(dispatcher, kernel)


def test_launch_configuration_guards():
    with pytest.raises(NumbaInternalsError) as err:
        _numba_compat.launch_dims(SimpleNamespace(griddim=(1, 1, 1), blockdim=(32, 1, 1)))
    _assert_names(err, "_LaunchConfiguration.sharedmem")
    with pytest.raises(NumbaInternalsError) as err:
        _numba_compat.set_pre_launch_callbacks(SimpleNamespace(), [])
    _assert_names(err, "pre_launch_callbacks", ">= 0.30")
    assert _numba_compat.pre_launch_callbacks(SimpleNamespace()) is None


def test_kernel_parameter_layout_is_numba_cudas():
    """meminfo, parent, nitems, itemsize, data, shape, strides: 5 + 2 * ndim eight-byte parameters."""
    params = _numba_compat.kernel_array_params(0x7000, (3, 4), (32, 8), 8)
    assert params == (0, 0, 12, 8, 0x7000, 3, 4, 32, 8)
    assert _numba_compat.array_param_count(_numba_compat.array_type(np.dtype(np.float64), 2, "C")) == len(params)
    assert _numba_compat.kernel_array_params(0x7000, (0, 4), (32, 8), 8)[4] == 0  # empty: a null pointer


def test_emm_guard_names_the_missing_driver_attribute(monkeypatch):
    monkeypatch.setattr(_numba_compat, "_emm", None)
    if _sim.active():  # numba's simulator has no memory managers at all
        with pytest.raises(NumbaInternalsError) as err:
            _numba_compat.emm_api()
        assert "needs a GPU" in str(err.value) and "NUMBA_ENABLE_CUDASIM" in str(err.value)
        return
    from numba.cuda.cudadrv import driver

    assert _numba_compat.emm_api().HostOnlyCUDAMemoryManager is driver.HostOnlyCUDAMemoryManager
    monkeypatch.setattr(_numba_compat, "_emm", None)
    monkeypatch.delattr(driver, "_SizeNotSet")
    with pytest.raises(NumbaInternalsError) as err:
        _numba_compat.emm_api()
    _assert_names(err, "numba.cuda.cudadrv.driver._SizeNotSet", "memory-manager plugin", ">= 0.22, < 0.31")


def test_emm_plugin_on_the_simulator_says_it_needs_a_gpu():
    """Before: ``AttributeError: module 'numba.cuda.simulator.cudadrv.driver' has no attribute 'GetIpcHandleMixin'``."""
    code = textwrap.dedent("""
        import umem_numba
        try:
            umem_numba.UmemNumbaMemoryManager
        except umem_numba.UnsupportedError as exc:
            print("refused:", exc)
    """)
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("refused:"), proc.stdout + proc.stderr
    assert "needs a GPU" in proc.stdout and "simulator" in proc.stdout


def test_simulator_guard_names_the_missing_simulator_piece(monkeypatch):
    from numba.cuda.simulator import kernelapi

    monkeypatch.setattr(_numba_compat, "_simulator", None)
    monkeypatch.delattr(kernelapi, "swapped_cuda_module")
    with pytest.raises(NumbaInternalsError) as err:
        _numba_compat.simulator_api()
    _assert_names(err, "numba.cuda.simulator.kernelapi.swapped_cuda_module", "simulated driver")
    with pytest.raises(NumbaInternalsError) as err:
        _numba_compat.sim_kernel_debug(SimpleNamespace())
    _assert_names(err, "FakeCUDAKernel._debug")


def test_simulator_arg_hint_is_found_where_each_numba_cuda_has_it(monkeypatch):
    """``numba.cuda.simulator.args`` from numba-cuda 0.25, ``numba.cuda.args`` before."""
    from numba.cuda import args as old

    monkeypatch.setitem(sys.modules, "numba.cuda.simulator.args", None)  # as numba-cuda 0.22 to 0.24
    assert _numba_compat.simulator_arg_hint() == (old.ArgHint, old.InOut)
    monkeypatch.setitem(sys.modules, "numba.cuda.args", None)
    with pytest.raises(NumbaInternalsError) as err:
        _numba_compat.simulator_arg_hint()
    _assert_names(err, "ArgHint and InOut", "numba.cuda.simulator.args", "numba.cuda.args")


def test_stream_classes_without_numbas_driver_module_wrap_every_stream(monkeypatch):
    native, own = _numba_compat.stream_classes()
    from numba.cuda.cudadrv import driver

    assert own is driver.Stream and driver.Stream in native
    monkeypatch.setitem(sys.modules, "numba.cuda.cudadrv.driver", None)
    monkeypatch.delattr(sys.modules["numba.cuda.cudadrv"], "driver")
    assert _numba_compat.stream_classes() == ((), None)
    assert not _numba_compat.stream_owns_handle(object(), None)


# ---------------------------------------------------------------------------
# On a GPU: a numba-cuda that hides the compiled function still launches, through numba


@pytest.mark.gpu
@pytest.mark.real_gpu("the direct launch path: numba's simulator compiles nothing")
def test_launch_without_the_compiled_function_goes_through_numba(rng, monkeypatch):
    from numba import cuda

    def hidden(kernel):
        raise _numba_compat.missing("direct kernel launch", "numba's _Kernel._codelibrary")

    monkeypatch.setattr(_numba_compat, "kernel_function_handle", hidden)

    @um.jit
    def affine(out, x, a, n):
        i = cuda.grid(1)
        if i < n:
            out[i] = x[i] * a + 1.0

    n = int(rng.integers(1000, 5000))
    x_h = random_array(rng, n, np.float32)
    with um.ManagedBuffer.from_array(x_h) as x, um.ManagedBuffer.empty(n, np.float32) as out:
        for a in (2.0, 0.5, -4.0):  # exact products: one rounding on the GPU and in numpy
            affine[(n + 127) // 128, 128](out, x, np.float32(a), n)
            np.testing.assert_array_equal(out.host, x_h * np.float32(a) + np.float32(1.0))
    calls = [call for cfg in affine._configs.values() for _types, call in cfg._calls.values()]
    assert calls and all(call is None for call in calls), "a direct call was made without the function handle"
