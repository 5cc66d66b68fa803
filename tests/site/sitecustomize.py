"""Run by Python at the start of every process the test suite launches (``tests/conftest.py`` puts this folder
first on ``PYTHONPATH``): installs the suite's CPU bf16 GEMM (``cpu_bf16_gemm.py``, which says why)."""

import cpu_bf16_gemm

cpu_bf16_gemm.install()
