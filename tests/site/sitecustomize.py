"""Run by Python at the start of every process the test suite launches (``tests/conftest.py`` puts this folder
first on ``PYTHONPATH``): installs the suite's CPU bf16 GEMM (``cpu_bf16_gemm.py``, which says why). An interpreter
without torch (a system ``python3`` a test or a user's shell starts with this PYTHONPATH) is left alone."""

import importlib.util

if importlib.util.find_spec("torch") is not None:
    import cpu_bf16_gemm

    cpu_bf16_gemm.install()
