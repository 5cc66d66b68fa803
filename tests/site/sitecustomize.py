"""Run by Python at the start of every process the test suite launches (``tests/conftest.py`` puts this folder
first on ``PYTHONPATH``): installs fp8kit's CPU bf16 GEMM (``fp8kit/base/cpu_bf16_gemm.py``, which says why), as
the ``fp8kit train`` command does. An interpreter without fp8kit (a system ``python3`` started with this
PYTHONPATH) is left alone."""

import importlib.util

if importlib.util.find_spec("fp8kit") is not None:
    from fp8kit.base import cpu_bf16_gemm

    cpu_bf16_gemm.install()
