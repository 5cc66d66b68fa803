"""bf16 matmuls on a CPU without AVX-512: ``aten::mm`` of bf16 as a float32 GEMM rounded once to bf16.

Why: on x86 CPUs without AVX-512 (this project's development and CI machines: AMD EPYC, AVX2) torch has no fast
bf16 GEMM. oneDNN's bf16 path needs AVX-512, so ``torch.mm`` falls back to ATen's reference loops
(``aten/src/ATen/native/cpu/BlasKernel.cpp``), and how slow they are depends on the layout: measured on torch
2.13.0+cpu, one thread, ``[256, 1024] @ [1024, 256]``: 166 ms with both operands row-major (every linear's dgrad,
``grad_out @ W``), 9-15 ms transposed, 2.0 ms in float32 (pytorch/pytorch#146508 reports 44-500x on AVX2
machines). The tiny preset's bf16 training step (2 layers, the test suite's) spends 80% of its time there (1066 ms
against 205 ms with this module; FP8 runs 430 -> 292 ms: their output head stays bf16).

What: :func:`install` re-registers ``aten::mm``'s CPU kernel for the rest of the process. bf16 x bf16 computes
``addmm(0, a.float(), b.float(), beta=0)`` rounded to bf16: float32 accumulation and one rounding, as torch's bf16
kernels and a GPU's tensor cores do (the sum's order differs, so about 1 element in 10^4 differs by one bf16 ulp
from the reference loops; ``tests/test_cpu_bf16_gemm.py``). Every other dtype computes ``addmm(0, a, b, beta=0)``,
which is what ATen's CPU ``mm`` itself calls (``addmm_impl_cpu_`` with beta 0): the same bits. Only the CPU
dispatch key is touched (CUDA, meta and fake tensors are not), and only where the CPU has no AVX-512 (:func:`needed`).

Who: the ``fp8kit train`` command installs it at start (its run prints a note and records ``cpu_bf16_gemm`` in
``run_info.json``); importing fp8kit does not (a library caller's process keeps torch's kernels unless it calls
:func:`install`). The test suite installs it in the pytest process (``tests/conftest.py``) and, through
``tests/site/sitecustomize.py``, in every Python process the tests launch.
"""

from __future__ import annotations

import platform
import warnings

import torch

_LIB = None


def needed() -> bool:
    """True on an x86 CPU without AVX-512 (torch's CPU capability ``AVX2`` or ``DEFAULT``), where ``torch.mm``
    of bf16 runs ATen's reference loops."""
    return platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in (
        "AVX2", "DEFAULT")


def _mm(a, b):
    if a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16:
        return torch.addmm(a.new_zeros((), dtype=torch.float32), a.float(), b.float(), beta=0).to(torch.bfloat16)
    return torch.addmm(a.new_zeros(()), a, b, beta=0)


def installed() -> bool:
    """Whether :func:`install` registered the kernel in this process."""
    return _LIB is not None


def install() -> bool:
    """Register the kernel once per process when :func:`needed`; returns whether it is installed."""
    global _LIB
    if _LIB is not None:
        return True
    if not needed():
        return False
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": the point of this module
        warnings.simplefilter("ignore", UserWarning)
        lib.impl("mm", _mm, "CPU")
    _LIB = lib
    return True


def state() -> str | None:
    """What bf16 matmuls on this CPU run, for ``run_info.json``: ``"float32 GEMM"`` (installed), ``"torch reference
    loops"`` (needed, not installed) or None (the CPU has torch's fast bf16 path)."""
    if installed():
        return "float32 GEMM"
    return "torch reference loops" if needed() else None


def describe() -> str | None:
    """The note a CPU run prints about its bf16 matmuls (None where there is nothing to say)."""
    s = state()
    if s == "float32 GEMM":
        return ("CPU: bf16 matmuls run as float32 GEMMs rounded to bf16 (this CPU has no AVX-512, where torch's "
                "bf16 GEMM runs reference loops 10-80x slower, pytorch/pytorch#146508; fp8kit.base.cpu_bf16_gemm)")
    if s == "torch reference loops":
        return ("CPU: bf16 matmuls run torch's reference loops on this CPU (no AVX-512), 10-80x slower than float32 "
                "(pytorch/pytorch#146508); fp8kit.base.cpu_bf16_gemm.install() computes them as float32 GEMMs "
                "rounded to bf16, as the fp8kit train command does")
    return None
