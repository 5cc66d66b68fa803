"""Kernels of fp8kit's FP8 engine.

``ops`` registers the ``torch.library`` custom ops (``torch.ops.fp8kit.*``): CUDA runs the Triton
kernels of ``blockwise_triton``, every other device the PyTorch reference of :mod:`fp8kit.fp8.blockwise`.
Triton is imported only when a CUDA kernel first runs, so this package imports on a CPU-only install.
"""
