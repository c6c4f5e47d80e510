"""README's example runs as written (on a GPU)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_an_example():
    blocks = _python_blocks()
    assert blocks and "ManagedBuffer" in blocks[0]


@pytest.mark.gpu
def test_readme_example_runs(capsys):
    import numpy as np

    namespace: dict = {}
    exec(compile(_python_blocks()[0], str(README), "exec"), namespace)
    printed = capsys.readouterr().out
    assert "[" in printed  # it printed the first four values
    buf = namespace["buf"]
    assert buf.closed
    # scale doubled the interior (elements 1 .. n-2): element 0 is unchanged
    data = namespace["data"]
    values = np.array([float(v) for v in printed.strip().strip("[]").split()], dtype=np.float32)
    expected = np.concatenate([data[:1], 2 * data[1:4]])
    # numpy prints at most 8 decimals (floatmode "maxprec"): a value below 0.01 prints with fewer
    # significant digits than float32 holds (0.0012345679 prints 0.00123457, 1.7e-6 off), hence atol.
    np.testing.assert_allclose(values, expected, rtol=1e-6, atol=1e-8)
    assert not np.allclose(values[1:], data[1:4])  # the kernel did run
