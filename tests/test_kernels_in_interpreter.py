"""The Triton kernels' logic on the CPU, in Triton's interpreter (tests/kernels_in_interpreter.py says what it
checks and what it cannot). Skipped where triton is not installed (CPU installs of torch do not bring it, so CI
skips it; ``pip install triton`` runs it)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernels_agree_in_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "kernels_in_interpreter.py")], env=env,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "moe token kernels" in proc.stdout and "moe rowwise fusions" in proc.stdout, proc.stdout
    assert "fp8 adamw step" in proc.stdout, proc.stdout
    assert "delayed swiglu backward" in proc.stdout, proc.stdout
