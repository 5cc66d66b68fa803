"""The Triton kernels' logic on the CPU, in Triton's interpreter (tests/kernels_in_interpreter.py says what it
checks and what it cannot). Skipped where triton is not installed (CPU installs of torch do not bring it, so CI
skips it; ``pip install triton`` runs it), and where NumPy refuses ``int()`` of a one-element array: Triton 3.6's
interpreter turns a kernel's runtime loop bound into a Python int that way (``_scatter_rows_kernel``'s
``range(0, K, BLOCK_K)``), which NumPy 2.2 only deprecates and NumPy 2.4 refuses. To run it there: ``pip install
--target /tmp/np22 numpy==2.2.6`` and ``PYTHONPATH=/tmp/np22`` (session 42: passed so, in 111 s, with triton 3.6.0)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _why_not() -> str | None:
    """Why the interpreter cannot run the kernels here (module docstring), or None."""
    import warnings

    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    import numpy as np

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            int(np.array([1]))
    except TypeError:
        return (f"NumPy {np.__version__} refuses int() of a one-element array, which Triton's interpreter needs for "
                "runtime loop bounds: put numpy 2.2 first on PYTHONPATH (module docstring)")
    return None


@pytest.mark.slow
@pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")
def test_kernels_agree_in_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "kernels_in_interpreter.py")], env=env,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "moe token kernels" in proc.stdout and "moe rowwise fusions" in proc.stdout, proc.stdout
    assert "fp8 adamw step" in proc.stdout, proc.stdout
    assert "delayed swiglu backward" in proc.stdout, proc.stdout
